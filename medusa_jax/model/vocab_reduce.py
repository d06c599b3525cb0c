"""The argmax and top-k over a vocabulary axis, in two stages over blocks of `BLOCK` ids, with exactly the results
of the one-stage forms: XLA:CPU reduces a [n, V] array to an index (argmax) or runs its TopK over it one row at a
time, which costs the most where the decode loops call them on many rows (a tree step's nodes, Token Recycling's
table updates, the heads' proposals). Each ids' block is reduced to its maximum first (a plain max, vectorised),
the best blocks are found among those, and only they are searched. Where V is not a multiple of BLOCK (or the
blocks would not save work) the one-stage forms run. Measured: bench/vocab_reduce/README.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # ids per block: divides the vocabularies of Llama, Mistral, Qwen2 and SmolLM2


def _first_max(x: jax.Array) -> jax.Array:
    """[..., m] -> [...] int32: the first index of the maximum (m - 1 where no element equals it: a NaN row). Two
    plain reductions, which XLA:CPU vectorises, instead of argmax's (value, index) reduce."""
    max_x1 = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == max_x1, iota, x.shape[-1] - 1), axis=-1)


def _blocks(x: jax.Array, min_blocks: int) -> jax.Array | None:
    """x [..., V] as [..., V / BLOCK, BLOCK], or None where V is no multiple of BLOCK or has fewer blocks than
    min_blocks."""
    v = x.shape[-1]
    if v % BLOCK or v // BLOCK < min_blocks:
        return None
    return x.reshape(*x.shape[:-1], v // BLOCK, BLOCK)


def first_argmax(x_xv: jax.Array) -> jax.Array:
    """[..., V] -> [...] int32: the first index of the maximum over the last axis (= jnp.argmax for finite values):
    the first block holding the maximum, then the first index of it inside that block."""
    blocks = _blocks(x_xv, 2)
    if blocks is None:
        return _first_max(x_xv)
    block_x = _first_max(jnp.max(blocks, axis=-1))
    inside_xb = jnp.take_along_axis(blocks, block_x[..., None, None], axis=-2)[..., 0, :]
    return block_x * BLOCK + _first_max(inside_xb)


def top_k(x_xv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x_xv, k)`, the same values and indices (equal values: the lower index first). The k blocks
    with the largest maxima (equal maxima: the lower block first) hold the k largest values: any other block's
    elements each come after all k of those maxima. Those blocks, in index order, are searched by one top_k of
    k * BLOCK values."""
    blocks = _blocks(x_xv, 4 * k)
    if blocks is None:
        return jax.lax.top_k(x_xv, k)
    _, best_xk = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    best_xk = jnp.sort(best_xk, axis=-1)  # index order: equal values then keep lax.top_k's lower-index-first
    found_xkb = jnp.take_along_axis(blocks, best_xk[..., None], axis=-2)
    values_xk, at_xk = jax.lax.top_k(found_xkb.reshape(*found_xkb.shape[:-2], k * BLOCK), k)
    index_xk = jnp.take_along_axis(best_xk, at_xk // BLOCK, axis=-1) * BLOCK + at_xk % BLOCK
    return values_xk, index_xk.astype(jnp.int32)
