"""Grouped-query attention over the static KV cache, reading only the cache prefix that the mask can reach.

A cache is sized for the longest row and the whole generation budget, so early in a generation most slots
are empty and masked. Attending over all S slots anyway reads (and, for XLA's dot layout, transposes) the
whole cache in every layer of every step: with 8 rows over 1024 slots that was two thirds of a SmolLM2 decode
step. So the cache is cut into a few static prefix windows (S, S/2, S/4, ... down to ~256 slots, rounded to
multiples of 64) and each forward attends over the smallest window that holds every slot the mask allows
for any row and token: one `lax.switch`, no dynamic shapes. Masked slots contribute exactly zero to the
softmax, so the result is the full attention's (up to float summation order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30
_WINDOW_ALIGN = 64
_SMALLEST_SPLIT = 256  # caches up to this many slots are always read whole


def attention_windows(cache_size: int) -> tuple[int, ...]:
    """The static prefix windows for a cache of `cache_size` slots, ascending; the last is the whole cache."""
    windows = [cache_size]
    while windows[-1] > _SMALLEST_SPLIT:
        half = -(-(windows[-1] // 2) // _WINDOW_ALIGN) * _WINDOW_ALIGN
        if half >= windows[-1]:
            break
        windows.append(half)
    return tuple(reversed(windows))


def window_index(mask_bts: jax.Array, windows: tuple[int, ...]) -> jax.Array:
    """Index of the smallest window that contains every allowed slot of the mask [B, T, S] (int32 scalar)."""
    slot_s = jnp.arange(mask_bts.shape[-1], dtype=jnp.int32)
    reach = jnp.max(jnp.where(mask_bts, slot_s + 1, 0))  # one past the last allowed slot, over all rows
    return jnp.sum(jnp.asarray(windows[:-1], jnp.int32) < reach).astype(jnp.int32)


def grouped_attention(q_btkgd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(d), masked) v over the given slots; q heads grouped per KV head. Softmax in fp32."""
    d = q_btkgd.shape[-1]
    scores_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd.astype(q_btkgd.dtype))
    scores_bkgts = scores_bkgts.astype(jnp.float32) * (d ** -0.5)
    scores_bkgts = jnp.where(mask_bts[:, None, None, :, :], scores_bkgts, _NEG_INF)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(q_btkgd.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs_bkgts, v_bskd.astype(q_btkgd.dtype))


def cached_attention(q_btkgd: jax.Array, k_lbshd: jax.Array, v_lbshd: jax.Array, layer: int, mask_bts: jax.Array,
                     index: jax.Array | None) -> jax.Array:
    """Attention of q over layer `layer` of the stacked cache, reading only window `index` of
    `attention_windows(S)` (None: the whole cache)."""
    windows = attention_windows(k_lbshd.shape[2])

    def over(width: int):
        def attend(q, k_all, v_all, mask):
            return grouped_attention(q, k_all[layer, :, :width], v_all[layer, :, :width], mask[:, :, :width])
        return attend

    if index is None or len(windows) == 1:
        return over(windows[-1])(q_btkgd, k_lbshd, v_lbshd, mask_bts)
    return jax.lax.switch(index, [over(w) for w in windows], q_btkgd, k_lbshd, v_lbshd, mask_bts)
