"""Grouped-query attention over the static KV cache, reading only the cache prefix that the mask can reach.

A cache is sized for the longest row and the whole generation budget, so early in a generation most slots
are empty and masked. Attending over all S slots anyway reads (and, for XLA's dot layout, transposes) the
whole cache in every layer of every step: with 8 rows over 1024 slots that was two thirds of a SmolLM2 decode
step. So the cache is cut into a few static prefix windows (S, S/2, S/4, ... down to ~256 slots, rounded to
multiples of 64) and each forward attends over the smallest window that holds every slot the mask allows
for any row and token: one `lax.switch`, no dynamic shapes. Masked slots contribute exactly zero to the
softmax, so the result is the full attention's (up to float summation order).

Rows of a batch have different lengths (a batch of MT-Bench prompts runs from 47 to 402 tokens), and one
window for the whole batch makes every row read as far as the longest one. So the rows are cut into a few
contiguous row groups (`row_groups`), each with its own window: attention reads about the slots each group
actually needs, and the batch engine sorts rows by length so that neighbours need similar windows. On XLA:CPU
the attention dots run at a few GB/s of cache (a batched matmul with 3-row operands per KV head), so slots
not read are the main saving at large batch. Under a mesh the batch is one group (a row slice of a sharded
batch would cross devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30
_WINDOW_ALIGN = 64
_SMALLEST_SPLIT = 256  # caches up to this many slots are always read whole
_MIN_GROUP_ROWS = 8  # rows per window group, at least
_MAX_GROUPS = 4  # window groups per batch, at most (each group x window is one compiled attention per layer)


def attention_windows(cache_size: int) -> tuple[int, ...]:
    """The static prefix windows for a cache of `cache_size` slots, ascending; the last is the whole cache."""
    windows = [cache_size]
    while windows[-1] > _SMALLEST_SPLIT:
        half = -(-(windows[-1] // 2) // _WINDOW_ALIGN) * _WINDOW_ALIGN
        if half >= windows[-1]:
            break
        windows.append(half)
    return tuple(reversed(windows))


def row_groups(batch_size: int) -> tuple[tuple[int, int], ...]:
    """Contiguous (start, stop) row ranges that get a window each: at most _MAX_GROUPS groups of at least
    _MIN_GROUP_ROWS rows (one group for small batches and under a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    groups = min(_MAX_GROUPS, batch_size // _MIN_GROUP_ROWS)
    if groups <= 1 or not mesh.empty:
        return ((0, batch_size),)
    bounds = [round(i * batch_size / groups) for i in range(groups + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def window_index(mask_bts: jax.Array, windows: tuple[int, ...],
                 groups: tuple[tuple[int, int], ...] | None = None) -> jax.Array:
    """Index of the smallest window that contains every allowed slot of the mask [B, T, S]: an int32 scalar
    over all rows, or an int32 vector with one index per row group of `groups`."""
    slot_s = jnp.arange(mask_bts.shape[-1], dtype=jnp.int32)
    reach_b = jnp.max(jnp.where(mask_bts, slot_s + 1, 0), axis=(1, 2))  # one past the last allowed slot, per row
    bounds = jnp.asarray(windows[:-1], jnp.int32)
    if groups is None:
        return jnp.sum(bounds < jnp.max(reach_b)).astype(jnp.int32)
    group_reach = jnp.stack([jnp.max(reach_b[start:stop]) for start, stop in groups])
    return jnp.sum(bounds[None, :] < group_reach[:, None], axis=1).astype(jnp.int32)


def grouped_attention(q_btkgh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(h), masked) v over the given slots; q heads grouped per KV head. Softmax in fp32."""
    h = q_btkgh.shape[-1]
    scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh.astype(q_btkgh.dtype))
    scores_bkgts = scores_bkgts.astype(jnp.float32) * (h ** -0.5)
    scores_bkgts = jnp.where(mask_bts[:, None, None, :, :], scores_bkgts, _NEG_INF)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(q_btkgh.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh.astype(q_btkgh.dtype))


def cached_attention(q_btkgh: jax.Array, k_lbskh: jax.Array, v_lbskh: jax.Array, layer: int, mask_bts: jax.Array,
                     index: jax.Array | None, groups: tuple[tuple[int, int], ...] | None = None) -> jax.Array:
    """Attention of q over layer `layer` of the stacked cache, reading only window `index` of
    `attention_windows(S)` (None: the whole cache). With `groups` (see `row_groups`), `index` holds one window
    per row group and rows [start, stop) of group i read window index[i]."""
    windows = attention_windows(k_lbskh.shape[2])
    b = q_btkgh.shape[0]
    if index is None or len(windows) == 1:
        index, groups = None, ((0, b),)
    elif groups is None:
        index, groups = index[None], ((0, b),)

    def over(width: int, start: int, stop: int):
        def attend(q, k_all, v_all, mask):
            return grouped_attention(q[start:stop], k_all[layer, start:stop, :width],
                                     v_all[layer, start:stop, :width], mask[start:stop, :, :width])
        return attend

    outs = []
    for i, (start, stop) in enumerate(groups):
        if index is None:
            outs.append(over(windows[-1], start, stop)(q_btkgh, k_lbskh, v_lbskh, mask_bts))
        else:
            outs.append(jax.lax.switch(index[i], [over(w, start, stop) for w in windows],
                                       q_btkgh, k_lbskh, v_lbskh, mask_bts))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
