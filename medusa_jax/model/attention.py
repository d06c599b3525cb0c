"""Grouped-query attention over one layer of the static KV cache (layout in `kv_cache.py`).

Each KV head's K and V are read once per call, by two batched matrix products per (row, KV head): the g query
heads that share a KV head and the t query tokens are one [t*g, h] operand, K is read as its [h, s] panel and V
as its [s, h] panel, both in the order they are stored. No per-group copy of K/V is made (a GQA broadcast would
read them g times) and no transposed copy either: tests/test_decode_hlo.py checks both in the compiled decode
loops.

Every slot is read, also the masked ones past a row's length. Reading only a prefix window of the cache (the
previous design) needs a slice, and XLA:CPU materialises a slice of a cache buffer before a dot: the copy
cost more than the slots it saved (measured in docs/design.md, "Why per layer"). Masked slots contribute exactly
zero to the softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


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
