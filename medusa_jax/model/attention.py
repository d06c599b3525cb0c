"""Grouped-query attention over one layer of the static KV cache (layout in `kv_cache.py`), and over a call's own
tokens (training); how each kind ("chunked", "xla", "cudnn") reads K and V, and why, is in docs/modules.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30
QUERY_CHUNK = 512  # query tokens per block of chunked attention (training's rows)
# query tokens per block over a cache (prefill): larger, because each block loop holds its own blocked queries and
# mask; 8B decode plans at 1024-token prompts grew by 0.30-0.46 GiB per device with blocks of 512 (docs/planning.md)
PREFILL_QUERY_CHUNK = 2048


def grouped_attention(q_btkgh: jax.Array, k_bkhs: jax.Array, v_bksh: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(h), masked) v for one layer, q heads grouped per KV head: q [B, T, K, G, H], K
    [B, K, H, S], V [B, K, S, H], mask [B, T, S] -> [B, T, K, G, H]. Softmax in fp32."""
    b, t, k, g, h = q_btkgh.shape
    s = k_bkhs.shape[-1]
    q_bkxh = q_btkgh.transpose(0, 2, 1, 3, 4).reshape(b, k, t * g, h)  # x = (t, g): one operand per KV head
    scores_bkxs = jnp.einsum("bkxh,bkhs->bkxs", q_bkxh, k_bkhs.astype(q_btkgh.dtype))
    scores_bktgs = scores_bkxs.reshape(b, k, t, g, s).astype(jnp.float32) * (h ** -0.5)
    scores_bktgs = jnp.where(mask_bts[:, None, :, None, :], scores_bktgs, _NEG_INF)
    probs_bkxs = jax.nn.softmax(scores_bktgs, axis=-1).astype(q_btkgh.dtype).reshape(b, k, t * g, s)
    out_bkxh = jnp.einsum("bkxs,bksh->bkxh", probs_bkxs, v_bksh.astype(q_btkgh.dtype))
    return out_bkxh.reshape(b, k, t, g, h).transpose(0, 2, 1, 3, 4)


def chunked_attention(q_btkgh: jax.Array, k_bkhs: jax.Array, v_bksh: jax.Array, mask_bts: jax.Array,
                      chunk: int = QUERY_CHUNK, recompute: bool = True) -> jax.Array:
    """`grouped_attention` over blocks of `chunk` query tokens (one `lax.map` step each), every block under
    `jax.checkpoint` when `recompute`: the backward pass keeps the inputs and recomputes a block's scores when it
    needs them."""
    attend = jax.checkpoint(grouped_attention) if recompute else grouped_attention
    b, t, k, g, h = q_btkgh.shape
    if t <= chunk:
        return attend(q_btkgh, k_bkhs, v_bksh, mask_bts)
    blocks = -(-t // chunk)
    pad = blocks * chunk - t  # padded query rows see no slot: a uniform softmax, cut off below
    q_ibtkgh = jnp.pad(q_btkgh, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0))).reshape(
        b, blocks, chunk, k, g, h).swapaxes(0, 1)
    mask_ibts = jnp.pad(mask_bts, ((0, 0), (0, pad), (0, 0))).reshape(b, blocks, chunk, -1).swapaxes(0, 1)
    out_ibtkgh = jax.lax.map(lambda qm: attend(qm[0], k_bkhs, v_bksh, qm[1]), (q_ibtkgh, mask_ibts))
    return out_ibtkgh.swapaxes(0, 1).reshape(b, blocks * chunk, k, g, h)[:, :t]


def self_attention(q_btkgh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, mask_bts: jax.Array,
                   kind: str) -> jax.Array:
    """Attention of T tokens over their own K/V (S = T slots): q [B, T, K, G, H], K and V [B, T, K, H], mask
    [B, T, T] -> [B, T, K, G, H]. kind: "chunked" | "xla" | "cudnn" (docs/modules.md)."""
    if kind == "chunked":
        return chunked_attention(q_btkgh, k_btkh.transpose(0, 2, 3, 1), v_btkh.transpose(0, 2, 1, 3), mask_bts)
    return _fused_attention(q_btkgh, k_btkh, v_btkh, mask_bts, kind)


def cache_attention(q_btkgh: jax.Array, k_bkhs: jax.Array, v_bksh: jax.Array, mask_bts: jax.Array,
                    kind: str) -> jax.Array:
    """Attention of T new tokens over one layer's cache (prefill, decode, tree verify): q [B, T, K, G, H], K
    [B, K, H, S], V [B, K, S, H] (the stored layout), mask [B, T, S] -> [B, T, K, G, H]. kind: as
    `self_attention` (docs/modules.md)."""
    if kind == "chunked":
        return chunked_attention(q_btkgh, k_bkhs, v_bksh, mask_bts, PREFILL_QUERY_CHUNK, recompute=False)
    return _fused_attention(q_btkgh, k_bkhs.transpose(0, 3, 1, 2), v_bksh.transpose(0, 2, 1, 3), mask_bts, kind)


def _fused_attention(q_btkgh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array,
                     kind: str) -> jax.Array:
    """`jax.nn.dot_product_attention` (implementation `kind`: "xla" or "cudnn") of q [B, T, K, G, H] over K and V
    [B, S, K, H] under mask [B, T, S] -> [B, T, K, G, H]; the K query heads' groups are its GQA heads."""
    b, t, k, g, h = q_btkgh.shape
    out_btnh = jax.nn.dot_product_attention(q_btkgh.reshape(b, t, k * g, h), k_bskh.astype(q_btkgh.dtype),
                                            v_bskh.astype(q_btkgh.dtype), mask=mask_bts[:, None],
                                            implementation=kind)
    return out_btnh.reshape(b, t, k, g, h)
