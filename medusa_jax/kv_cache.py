"""The static KV cache and the attention masks over it.

Layout (one buffer per K and V, all layers stacked):
    k_lbshd, v_lbshd : [num_layers, batch, cache_size, num_kv_heads, head_dim]
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
    k_lbshd: jax.Array
    v_lbshd: jax.Array
    lengths_b: jax.Array

    @property
    def batch_size(self) -> int:
        return self.k_lbshd.shape[1]

    @property
    def cache_size(self) -> int:
        return self.k_lbshd.shape[2]

    @classmethod
    def zeros(cls, config: ModelConfig, batch_size: int, cache_size: int, dtype=None) -> "KVCache":
        shape = (config.num_layers, batch_size, cache_size, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.jnp_dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32))

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)


def write_rows(cache_bshd: jax.Array, new_bthd: jax.Array, offsets_b: jax.Array) -> jax.Array:
    """Writes new_bthd[b] into cache_bshd[b, offsets_b[b] : offsets_b[b] + T] (in place under jit)."""
    def one_row(cache_shd, new_thd, offset):
        return jax.lax.dynamic_update_slice(cache_shd, new_thd.astype(cache_shd.dtype), (offset, 0, 0))

    return jax.vmap(one_row)(cache_bshd, new_bthd, offsets_b)


def write_layer_rows(cache_lbshd: jax.Array, layer: int, new_bthd: jax.Array, offsets_b: jax.Array) -> jax.Array:
    """Writes new_bthd[b] into cache_lbshd[layer, b, offsets_b[b] : offsets_b[b] + T] of the stacked buffer.

    Same result as `write_rows` on layer `layer`, but as one update of the stacked buffer: XLA does it in
    place, where slicing a layer out, updating it and setting it back copied the whole cache every layer."""
    def one_row(cache_lshd, new_thd, offset):
        start = (jnp.asarray(layer, jnp.int32), offset.astype(jnp.int32), jnp.int32(0), jnp.int32(0))
        return jax.lax.dynamic_update_slice(cache_lshd, new_thd[None].astype(cache_lshd.dtype), start)

    return jax.vmap(one_row, in_axes=(1, 0, 0), out_axes=1)(cache_lbshd, new_bthd, offsets_b)


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
