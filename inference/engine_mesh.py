"""The generation engine's device side placed on a device mesh (or on one device), with the project's sharding
rules (`medusa_jax.model.sharding`, as inference/sharded.py uses them for batch generation):

    parameters      PARAM_RULES (attention heads, MLP width and vocabulary over `tensor`; hidden over `fsdp`)
    KV caches       rows over (data, fsdp), KV heads over `tensor` (the drafter's cache too, where it keeps one)
    row arrays      [b, ...] (tokens, budgets, sampling settings, outputs): rows over (data, fsdp)
    shared state    a drafter state shared by all rows (Token Recycling's table): replicated
    the rest        scalars and PRNG keys: replicated

The decode rows must split evenly over data x fsdp. The jitted calls (row_decode, drafted_rows) take no explicit
shardings: XLA propagates these layouts from their inputs, and the calls run under `jax.set_mesh` so the
row-local steps (`sharding.map_cache_rows`, `constrain_rows`) run shard by shard, as in inference/sharded.py.
Without a mesh everything is committed to the first device. Under several processes (jax.distributed) the mesh
spans every process's devices: each process places the same host values (`device_put` keeps its own shards) and
`fetch` reads every row back on every process.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from medusa_jax.model.kv_cache import KVCache
from medusa_jax.model.sharding import (MeshError, batch_sharding, cache_shardings, param_shardings, replicated,
                                       validate_model_mesh)


def fetch(tree: Any) -> Any:
    """Arrays -> host NumPy values, the whole of each on every process (rows held by other processes' devices
    are gathered from them)."""
    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _put(x, sharding):
    """`jax.device_put`; a PRNG key goes as its key data (device_put cannot send keys to other processes)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(x), sharding))
    return jax.device_put(x, sharding)


class Placement:
    """Where the engine's arrays live: `mesh` None is the first device."""

    def __init__(self, mesh: Mesh | None, rows: int, model_config=None):
        self.mesh, self.rows = mesh, rows
        if mesh is None:
            return
        if model_config is not None:
            validate_model_mesh(model_config, mesh)
        split = mesh.shape["data"] * mesh.shape["fsdp"]
        if rows % split:
            raise MeshError(f"{rows} decode rows do not split over the mesh's data x fsdp = {split}: use a "
                            f"multiple of {split}")

    def params(self, params: Any) -> Any:
        """An NNX state placed by PARAM_RULES (the first device without a mesh)."""
        if self.mesh is None:
            return jax.device_put(params, jax.devices()[0])
        return jax.device_put(params, param_shardings(params, self.mesh))

    def state(self, tree: Any) -> Any:
        """A pytree of the engine's row state placed: KV caches, [rows, ...] arrays and the rest (docstring)."""
        if self.mesh is None:
            return jax.device_put(tree, jax.devices()[0])

        def place(x):
            if isinstance(x, KVCache):
                return jax.device_put(x, cache_shardings(self.mesh, x))
            if getattr(x, "ndim", 0) >= 1 and x.shape[0] == self.rows:
                return jax.device_put(x, batch_sharding(self.mesh, x.ndim))
            return _put(x, replicated(self.mesh))

        return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, KVCache))

    def draft(self, draft: Any, shared: Any) -> Any:
        """A drafter state placed: the parts `shared` marks (one state for all rows, `row_drafts.shared_fields`)
        replicated, the others as `state` places row state."""
        if self.mesh is None:
            return jax.device_put(draft, jax.devices()[0])
        return jax.tree.map(lambda is_shared, part: jax.device_put(part, replicated(self.mesh)) if is_shared
                            else self.state(part), shared, draft)

    def active(self):
        """The context the engine's calls run in: `jax.set_mesh(mesh)`, or nothing without a mesh."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)
