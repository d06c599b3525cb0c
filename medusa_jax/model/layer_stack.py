"""The decoder layers stored one by one (an nnx.List, the default) or stacked (one DecoderLayer whose parameters
carry a leading layer axis [L, ...], `LayerExecution.scan`), and the forward over them; how each form runs, and
which is the default where, in docs/modules.md."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.config import LayerExecution
from medusa_jax.model.sharding import constrain_rows, gathered_over_fsdp

# jax.checkpoint policies by LayerExecution.remat (None: no checkpoint, every intermediate is saved)
REMAT = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
         "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def stacked(layers: list[nnx.Module]) -> nnx.Module:
    """One module of the layers' structure whose every parameter is the layers' parameters stacked [L, ...]
    (abstract layers give abstract stacks)."""
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]
    return nnx.merge(graphdef, jax.tree.map(lambda *leaves: _stack(leaves), *states))


def _stack(leaves):
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves),) + leaves[0].shape, leaves[0].dtype)
    return jnp.stack(leaves)


def layer_slices(layers: nnx.Module, count: int) -> list[nnx.Module]:
    """The stacked layers as `count` modules of one layer each (slices of the stacked parameters)."""
    graphdef, state = nnx.split(layers)
    return [nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state)) for i in range(count)]


def _layer_step(layer_def, positions_bt, mask_bts, inv_freq, remat: str, dtype) -> Callable:
    """(one layer's state, x_btd) -> x_btd of that decoder layer, its weights cast to `dtype` (the trainer's
    float32 master weights reach the layer as they are stored), checkpointed by `remat`."""
    def layer_step(state, x_btd, positions_bt, mask_bts, inv_freq):
        # the barrier keeps what XLA does to the weights (the cast, re-layouts, the CPU compiler's float32 copies
        # of bf16 weights) inside the layer: hoisted out of the scan they were copies of every layer at once
        state = jax.tree.map(lambda w: w.astype(dtype), jax.lax.optimization_barrier(state))
        layer = nnx.merge(layer_def, gathered_over_fsdp(state))
        x_btd, _, _ = layer(x_btd, positions_bt, mask_bts, None, None, None, inv_freq)
        return constrain_rows(x_btd)

    if remat == "full":
        layer_step = _recomputed(layer_step, dtype)
    elif REMAT[remat] is not None:
        layer_step = jax.checkpoint(layer_step, policy=REMAT[remat])
    return lambda state, x_btd: layer_step(state, x_btd, positions_bt, mask_bts, inv_freq)


def _recomputed(layer_step: Callable, dtype) -> Callable:
    """`layer_step` saving nothing for the backward pass but its input, from which the backward recomputes the
    layer (as `jax.checkpoint` with nothing_saveable), a 16-bit input saved as its bit pattern: XLA's CPU compiler
    widens a saved bf16 stack of layer inputs to a float32 copy (it computes bf16 dynamic slices and updates in
    float32), a copy of the whole stack per device in a 70B Medusa-2 plan; an integer stack stays as it is."""
    bits = jnp.dtype(dtype).itemsize == 2

    @jax.custom_vjp
    def recomputed(state, x_btd, *consts):
        return layer_step(state, x_btd, *consts)

    def forward(state, x_btd, *consts):
        saved_x = jax.lax.bitcast_convert_type(x_btd, jnp.uint16) if bits else x_btd
        return layer_step(state, x_btd, *consts), (state, saved_x, consts)

    def backward(saved, dy_btd):
        state, saved_x, consts = saved
        x_btd = jax.lax.bitcast_convert_type(saved_x, dtype) if bits else saved_x
        d_state, d_x = jax.vjp(lambda s, x: layer_step(s, x, *consts), state, x_btd)[1](dy_btd)
        return (d_state, d_x) + tuple(_zero_cotangent(c) for c in consts)

    recomputed.defvjp(forward, backward)
    return recomputed


def _zero_cotangent(x):
    """The cotangent of an input nothing is differentiated by (float0 for integers and booleans)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def run_layers(layers, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array, inv_freq,
               execution: LayerExecution) -> jax.Array:
    """x_btd through every layer, cache-free (the tokens attend to each other under mask_bts [B, T, T]): `layers`
    is the nnx.List of the per-layer form, or the stacked module (execution.scan)."""
    if not execution.scan:
        step = _layer_step(nnx.graphdef(layers[0]), positions_bt, mask_bts, inv_freq, execution.remat,
                           x_btd.dtype)
        for layer in layers:
            x_btd = step(nnx.state(layer), x_btd)
        return x_btd
    layer_def, state = nnx.split(layers)
    step = _layer_step(layer_def, positions_bt, mask_bts, inv_freq, execution.remat, x_btd.dtype)
    x_btd, _ = jax.lax.scan(lambda x, layer_state: (step(layer_state, x), None), x_btd, state)
    return x_btd


def run_cached_layers(layers, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array, k_lbkhs: jax.Array,
                      v_lbksh: jax.Array, lengths_b: jax.Array, inv_freq,
                      keep_inputs: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """x_btd through the stacked layers over a stacked KV cache (prefill, decode and tree verify of a stacked
    model, `kv_cache.KVCache.stacked`), one `jax.lax.scan`: each iteration writes its layer's new K/V into the
    stacks (the loop's carry, updated in place) and attends over them. Returns (x_btd, k_lbkhs, v_lbksh, the
    residual stream entering each layer [L, B, T, D] when keep_inputs, else None)."""
    layer_def, state = nnx.split(layers)

    def step(carry, xs):
        x_btd, k_lbkhs, v_lbksh = carry
        layer_state, i = xs
        # as in `_layer_step`: what XLA does to the weights stays inside the layer (hoisted out of the scan, the
        # CPU compiler's float32 copies of bf16 weights were copies of every layer at once: 2x a 70B stack)
        layer = nnx.merge(layer_def, jax.lax.optimization_barrier(layer_state))
        y_btd, k_bkhs, v_bksh = layer(x_btd, positions_bt, mask_bts, k_lbkhs[i], v_lbksh[i], lengths_b, inv_freq)
        k_lbkhs = jax.lax.dynamic_update_index_in_dim(k_lbkhs, k_bkhs, i, 0)
        v_lbksh = jax.lax.dynamic_update_index_in_dim(v_lbksh, v_bksh, i, 0)
        return (constrain_rows(y_btd), k_lbkhs, v_lbksh), (x_btd if keep_inputs else None)

    count = k_lbkhs.shape[0]
    (x_btd, k_lbkhs, v_lbksh), inputs_lbtd = jax.lax.scan(
        step, (x_btd, k_lbkhs, v_lbksh), (state, jnp.arange(count, dtype=jnp.int32)))
    # the scan's output pinned to rows too: unpinned, the partitioner let a use after the loop (the heads' products,
    # split over `tensor`) choose the loop's carry layout, split over the hidden axis, and paid an all-gather and
    # a norm all-reduce per layer on a tensor mesh (scripts/plan.py --job decode --scan-layers showed them)
    return constrain_rows(x_btd), k_lbkhs, v_lbksh, inputs_lbtd
