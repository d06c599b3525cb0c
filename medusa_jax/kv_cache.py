"""The static KV cache and the attention masks over it.

Layout (one buffer per K and V, all layers stacked):
    k_lbskh, v_lbskh : [num_layers, batch, cache_size, num_kv_heads, head_dim] (l, b, s, k, h)
    lengths_b        : [batch] int32 — slots [0, lengths[b]) of row b hold its committed tokens, slot == position.
A forward over T new tokens writes their K/V to slots [lengths[b], lengths[b] + T) of each row and does NOT
advance `lengths`: the caller commits what it keeps (plain decode: +1; Medusa: the accepted path, after
moving its K/V into consecutive slots). Slots at or past `lengths[b]` are scratch and are always masked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k_lbskh: jax.Array
    v_lbskh: jax.Array
    lengths_b: jax.Array

    @property
    def batch_size(self) -> int:
        return self.k_lbskh.shape[1]

    @property
    def cache_size(self) -> int:
        return self.k_lbskh.shape[2]

    @classmethod
    def zeros(cls, config: ModelConfig, batch_size: int, cache_size: int, dtype=None) -> "KVCache":
        shape = (config.num_layers, batch_size, cache_size, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.jnp_dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32))

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)


def write_rows(cache_bskh: jax.Array, new_btkh: jax.Array, offsets_b: jax.Array) -> jax.Array:
    """Writes new_btkh[b] into cache_bskh[b, offsets_b[b] : offsets_b[b] + T] (in place under jit)."""
    def one_row(cache_skh, new_tkh, offset):
        return jax.lax.dynamic_update_slice(cache_skh, new_tkh.astype(cache_skh.dtype), (offset, 0, 0))

    return jax.vmap(one_row)(cache_bskh, new_btkh, offsets_b)


def write_layer_rows(cache_lbskh: jax.Array, layer: int, new_btkh: jax.Array, offsets_b: jax.Array) -> jax.Array:
    """Writes new_btkh[b] into cache_lbskh[layer, b, offsets_b[b] : offsets_b[b] + T] of the stacked buffer.

    One scatter with the batch as an explicit batching dimension: XLA updates the stacked buffer in place
    (slicing a layer out, updating it and setting it back copied the whole cache on every layer) and GSPMD
    keeps a batch-sharded cache local. Slots past the cache end are dropped, never clamped onto earlier slots;
    callers size the cache so that this does not happen (`engine.check_fits`)."""
    b, t = new_btkh.shape[:2]
    slots_bt = offsets_b[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    index_bt2 = jnp.stack([jnp.full((b, t), layer, jnp.int32), slots_bt], axis=-1)  # (layer, slot) per update
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2, 3), inserted_window_dims=(0, 2), scatter_dims_to_operand_dims=(0, 2),
        operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))
    return jax.lax.scatter(cache_lbskh, index_bt2, new_btkh.astype(cache_lbskh.dtype), dims,
                           indices_are_sorted=True, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def attention_mask(lengths_b: jax.Array, block_mask_tt: jax.Array, cache_size: int) -> jax.Array:
    """[B, T, S] bool: new token t of row b sees every committed slot (< lengths[b]) and, inside its own
    block of T slots starting at lengths[b], the slots that block_mask_tt[t] allows (causal or tree)."""
    num_new = block_mask_tt.shape[0]
    slot_s = jnp.arange(cache_size, dtype=jnp.int32)
    rel_bs = slot_s[None, :] - lengths_b[:, None]  # slot index relative to the row's block start
    committed_bs = rel_bs < 0
    in_block_bs = (rel_bs >= 0) & (rel_bs < num_new)
    block_bts = jnp.take(block_mask_tt, jnp.clip(rel_bs, 0, num_new - 1), axis=1).transpose(1, 0, 2)
    return committed_bs[:, None, :] | (in_block_bs[:, None, :] & block_bts)


def causal_block(num_new: int) -> np.ndarray:
    return np.tril(np.ones((num_new, num_new), dtype=bool))
