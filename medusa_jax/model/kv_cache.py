"""The static KV cache and the attention masks over it. The buffers' layout (one K [b, k, h, s] and one V
[b, k, s, h] per layer, or their [L, ...] stacks for a stacked model), why it is this one, and how a forward
writes slots that its caller then commits: docs/design.md, "The KV cache"."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.model.config import ModelConfig

K_SLOT_AXIS = 3  # the slot axis of a K buffer [b, k, h, s]
V_SLOT_AXIS = 2  # the slot axis of a V buffer [b, k, s, h]
# the smallest attention window (`KVCache.window`); each larger one is WINDOW_FRACTION times it. XLA:CPU copies a
# window's slots out of the buffers before its dots, so a window of W slots costs about 3 W slot reads against the
# S of the whole cache: a window is at most 1 / WINDOW_FRACTION of the cache (SmolLM2 plain steps, 1,024 slots,
# docs/design.md: a 256-slot window took 0.67x / 0.82x the time at 64 / 4 rows, a 512-slot one 1.11x / 0.92x). The
# windows grow by the same factor to keep the chunk executables few: each holds thousands of memory mappings on a
# CPU (`compile_cache.MappingGuard`)
SMALLEST_WINDOW = 256
WINDOW_FRACTION = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k_bkhs: tuple[jax.Array, ...] | jax.Array  # one [B, K, H, S] buffer per layer, or them stacked [L, B, K, H, S]
    v_bksh: tuple[jax.Array, ...] | jax.Array  # one [B, K, S, H] buffer per layer, or them stacked [L, B, K, S, H]
    lengths_b: jax.Array
    # the slots a forward attends over: [0, window) (None: all of them). Static: a jit specialises on it. Only a
    # caller that knows every row that counts stays inside it sets one (the generation engine's chunks:
    # `attention_window`); writes still go to the whole buffers, and a row past it reads garbage
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def stacked(self) -> bool:
        """The layers' buffers are one [L, ...] array each (a stacked model's scan reads them: backbone.py)."""
        return not isinstance(self.k_bkhs, tuple)

    @property
    def batch_size(self) -> int:
        return self.lengths_b.shape[0]

    @property
    def cache_size(self) -> int:
        return (self.k_bkhs if self.stacked else self.k_bkhs[0]).shape[-1]

    @property
    def num_layers(self) -> int:
        return self.k_bkhs.shape[0] if self.stacked else len(self.k_bkhs)

    @property
    def dtype(self):
        return (self.k_bkhs if self.stacked else self.k_bkhs[0]).dtype

    @classmethod
    def zeros(cls, config: ModelConfig, batch_size: int, cache_size: int, dtype=None,
              stacked: bool | None = None) -> "KVCache":
        """An empty cache; stacked None: stacked when the model's layers are (config.execution.scan)."""
        dtype = dtype or config.jnp_dtype
        b, k, h, s, n = batch_size, config.num_kv_heads, config.head_dim, cache_size, config.num_layers
        lengths_b = jnp.zeros((batch_size,), jnp.int32)
        if config.execution.scan if stacked is None else stacked:
            return cls(jnp.zeros((n, b, k, h, s), dtype), jnp.zeros((n, b, k, s, h), dtype), lengths_b)
        return cls(tuple(jnp.zeros((b, k, h, s), dtype) for _ in range(n)),
                   tuple(jnp.zeros((b, k, s, h), dtype) for _ in range(n)), lengths_b)

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)

    def put_rows(self, rows_n: jax.Array, fresh: "KVCache") -> "KVCache":
        """This cache with rows rows_n[i] (index >= batch: dropped) holding fresh's row i in slots
        [0, fresh.cache_size) and its length; one in-place scatter per layer buffer (per stack)."""
        w = fresh.cache_size
        if self.stacked:
            k = self.k_bkhs.at[:, rows_n, :, :, :w].set(_stack(fresh.k_bkhs).astype(self.dtype), mode="drop")
            v = self.v_bksh.at[:, rows_n, :, :w].set(_stack(fresh.v_bksh).astype(self.dtype), mode="drop")
        else:
            k = tuple(buf.at[rows_n, :, :, :w].set(new.astype(buf.dtype), mode="drop")
                      for buf, new in zip(self.k_bkhs, _layers(fresh.k_bkhs)))
            v = tuple(buf.at[rows_n, :, :w].set(new.astype(buf.dtype), mode="drop")
                      for buf, new in zip(self.v_bksh, _layers(fresh.v_bksh)))
        lengths_b = self.lengths_b.at[rows_n].set(fresh.lengths_b, mode="drop")
        return self.replace(k_bkhs=k, v_bksh=v, lengths_b=lengths_b)

    def map_layers(self, k_fn, v_fn) -> "KVCache":
        """A cache with k_fn applied to every K buffer and v_fn to every V buffer (lengths unchanged); on a
        stacked cache, vectorised over the layers."""
        if self.stacked:
            return self.replace(k_bkhs=jax.vmap(k_fn)(self.k_bkhs), v_bksh=jax.vmap(v_fn)(self.v_bksh))
        return self.replace(k_bkhs=tuple(k_fn(x) for x in self.k_bkhs), v_bksh=tuple(v_fn(x) for x in self.v_bksh))


def _stack(buffers) -> jax.Array:
    return buffers if not isinstance(buffers, tuple) else jnp.stack(buffers)


def _layers(buffers) -> tuple[jax.Array, ...]:
    return buffers if isinstance(buffers, tuple) else tuple(buffers)


def write_slots(buf: jax.Array, slot_axis: int, new_btkh: jax.Array, slots_bt: jax.Array) -> jax.Array:
    """Writes new_btkh[b, t] (one token's [K, H]) into slot slots_bt[b, t] of row b of a K ([b, k, h, s],
    slot_axis 3) or V ([b, k, s, h], slot_axis 2) buffer.

    One scatter with the batch as an explicit batching dimension: XLA updates the buffer in place and GSPMD keeps
    a batch-sharded cache local. Slots past the cache end are dropped, never clamped onto earlier slots; callers
    size the cache so that this does not happen (`engine.check_fits`)."""
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2, 3), inserted_window_dims=(slot_axis,), scatter_dims_to_operand_dims=(slot_axis,),
        operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
    new_btkh = new_btkh.astype(buf.dtype)
    if slots_bt.shape[1] == 1:
        # XLA rewrites a scatter of a single update (one row, one token) into a dynamic update slice guarded by
        # a select, and then copied the layer's whole K/V buffer 4 times per decode step (no copy with two or
        # more updates). A second update, always past the end and so dropped, keeps it a scatter.
        slots_bt = jnp.concatenate([slots_bt, jnp.full_like(slots_bt, buf.shape[slot_axis])], axis=1)
        new_btkh = jnp.concatenate([new_btkh, new_btkh], axis=1)
    return jax.lax.scatter(buf, slots_bt[..., None].astype(jnp.int32), new_btkh, dims,
                           indices_are_sorted=True, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def read_slots(buf: jax.Array, slot_axis: int, slots_bt: jax.Array) -> jax.Array:
    """The [b, t, K, H] entries at slots slots_bt[b, t] of each row of a K or V buffer (see `write_slots`)."""
    index = [slice(None)] * 4
    index[0] = jnp.arange(buf.shape[0])[:, None]
    index[slot_axis] = slots_bt
    return buf[tuple(index)]  # advanced indices split by a slice: their [b, t] axes come first


def write_layer(k_bkhs: jax.Array, v_bksh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                offsets_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes the K/V of T new tokens per row into slots [offsets_b[b], offsets_b[b] + T) of one layer."""
    t = k_btkh.shape[1]
    slots_bt = offsets_b[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    return write_slots(k_bkhs, K_SLOT_AXIS, k_btkh, slots_bt), write_slots(v_bksh, V_SLOT_AXIS, v_btkh, slots_bt)


def move_slots(cache: KVCache, src_bt: jax.Array, dst_bt: jax.Array) -> KVCache:
    """Copies slot src_bt[b, t] to slot dst_bt[b, t] of row b in every layer's K and V (all reads happen before
    the writes). Only these slots are read and written; lengths are unchanged."""
    return cache.map_layers(
        lambda k: write_slots(k, K_SLOT_AXIS, read_slots(k, K_SLOT_AXIS, src_bt), dst_bt),
        lambda v: write_slots(v, V_SLOT_AXIS, read_slots(v, V_SLOT_AXIS, src_bt), dst_bt))


def attention_mask(lengths_b: jax.Array, block_mask_tt: jax.Array, cache_size: int) -> jax.Array:
    """[B, T, S] bool: new token t of row b sees every committed slot (< lengths[b]) and, inside its own
    block of T slots starting at lengths[b], the slots that block_mask_tt[t] allows (causal or tree).
    block_mask_tt is one [T, T] mask for every row, or per row [B, T, T] (a dynamic tree's)."""
    num_new = block_mask_tt.shape[-1]
    slot_s = jnp.arange(cache_size, dtype=jnp.int32)
    rel_bs = slot_s[None, :] - lengths_b[:, None]  # slot index relative to the row's block start
    committed_bs = rel_bs < 0
    in_block_bs = (rel_bs >= 0) & (rel_bs < num_new)
    if block_mask_tt.ndim == 3:  # per row: [b, t, s] = block_mask_btt[b, t, rel_bs[b, s]]
        index_bts = jnp.broadcast_to(jnp.clip(rel_bs, 0, num_new - 1)[:, None, :],
                                     (rel_bs.shape[0], num_new, cache_size))
        block_bts = jnp.take_along_axis(block_mask_tt, index_bts, axis=2)
        return committed_bs[:, None, :] | (in_block_bs[:, None, :] & block_bts)
    block_bts = jnp.take(block_mask_tt, jnp.clip(rel_bs, 0, num_new - 1), axis=1).transpose(1, 0, 2)
    return committed_bs[:, None, :] | (in_block_bs[:, None, :] & block_bts)


def attention_windows(cache_size: int) -> tuple[int, ...]:
    """The windows a cache of `cache_size` slots may attend over (`KVCache.window`): SMALLEST_WINDOW, WINDOW_FRACTION
    times that, ... up to a WINDOW_FRACTION of cache_size, then cache_size itself (one executable each)."""
    windows, w = [], SMALLEST_WINDOW
    while w * WINDOW_FRACTION <= cache_size:
        windows.append(w)
        w *= WINDOW_FRACTION
    return tuple(windows) + (cache_size,)


def attention_window(reach: int, cache_size: int) -> int | None:
    """The smallest of `attention_windows(cache_size)` that holds slots [0, reach), or None when that is the whole
    cache (`KVCache.window`)."""
    window = next(w for w in attention_windows(cache_size) if w >= min(reach, cache_size))
    return None if window == cache_size else window


def causal_block(num_new: int) -> np.ndarray:
    return np.tril(np.ones((num_new, num_new), dtype=bool))
