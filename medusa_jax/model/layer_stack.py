"""The decoder layers of a cache-free forward (training's packed rows), run as `LayerExecution` says: unrolled or
under one `jax.lax.scan`, each layer under a rematerialisation policy.

The parameters stay stored per layer (`CausalLM.layers`, an nnx.List): loading, saving, the sharding rules, the
EAGLE drafter's single layer and the per-layer KV cache are the same for both forms. The scan stacks the layers'
parameters inside the traced step ([L, ...] leaves, sharded like one layer's: stacking moves no data between
devices) and runs one layer per iteration, so under FSDP each iteration all-gathers one layer's weights and the
backward pass keeps one layer's saved values per layer. The stacked copy is made in the compute dtype: with
float32 master weights and bfloat16 compute it takes the place of the cast copy the unrolled form makes anyway;
with weights stored in the compute dtype it is one extra copy of the layer weights per device.

Measured (bench/scan/): on this 2-core CPU a SmolLM2 training step runs about as fast either way, so the
unrolled form stays the default; pods use the scan (docs/planning.md).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.config import LayerExecution
from medusa_jax.model.sharding import constrain_rows, gathered_over_fsdp

# jax.checkpoint policies by LayerExecution.remat (None: no checkpoint, every intermediate is saved)
REMAT = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
         "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _layer_step(layer_def, positions_bt, mask_bts, inv_freq, remat: str) -> Callable:
    """(layer state, x_btd) -> x_btd of one decoder layer, checkpointed by `remat`."""
    def step(state, x_btd):
        layer = nnx.merge(layer_def, gathered_over_fsdp(state))
        x_btd, _, _ = layer(x_btd, positions_bt, mask_bts, None, None, None, inv_freq)
        return constrain_rows(x_btd)

    return step if REMAT[remat] is None else jax.checkpoint(step, policy=REMAT[remat])


def run_layers(layers: nnx.List, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array, inv_freq,
               execution: LayerExecution) -> jax.Array:
    """x_btd through every layer (cache-free: the tokens attend to each other under mask_bts [B, T, T])."""
    layer_def = nnx.graphdef(layers[0])
    step = _layer_step(layer_def, positions_bt, mask_bts, inv_freq, execution.remat)
    states = [nnx.state(layer) for layer in layers]
    if not execution.scan:
        for state in states:
            x_btd = step(state, x_btd)
        return x_btd
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)  # leaves [L, ...]
    x_btd, _ = jax.lax.scan(lambda x, state: (step(state, x), None), x_btd, stacked)
    return x_btd
