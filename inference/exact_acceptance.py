"""Lossless ("exact") sampling over a Medusa tree: the emitted tokens have exactly the plain sampler's law. The
walk, why its law is exact, distinct siblings and the vectorised form are in docs/modules.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import RowTree
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.inference.sampling import SamplingConfig, target_logits


def children_table(tree: TreeBuffers) -> np.ndarray:
    """[T, J] int32: the children of each node in rank order (node order = rank order among siblings, as
    paths are sorted by (length, ranks)), padded with -1; J >= 1."""
    kids = [[] for _ in range(tree.num_tokens)]
    for t in range(1, tree.num_tokens):
        kids[int(tree.parent_t[t])].append(t)
    table_tj = np.full((tree.num_tokens, max(1, max(len(k) for k in kids))), -1, np.int32)
    for u, k in enumerate(kids):
        table_tj[u, : len(k)] = k
    return table_tj


def earlier_siblings(tree: TreeBuffers) -> np.ndarray:
    """[T, T] bool: [t, s] is True when s is a sibling of t tried before it (same parent, lower rank)."""
    t_idx = np.arange(tree.num_tokens)
    same_parent_tt = tree.parent_t[:, None] == tree.parent_t[None, :]
    return same_parent_tt & (t_idx[None, :] < t_idx[:, None]) & (t_idx[None, :] > 0) & (t_idx[:, None] > 0)


def trial_outcomes(tokens_bt: jax.Array, node_prob_bt: jax.Array, uniform_bt: jax.Array,
                   tree: TreeBuffers | RowTree) -> jax.Array:
    """[B, T] bool: would node t be accepted when tried? node_prob_bt: q_parent(token_t); uniform_bt: one
    fresh U[0, 1) coin per node. A token repeating an earlier sibling's has probability 0 (docs/modules.md)."""
    per_row = isinstance(tree, RowTree)
    earlier = tree.earlier_btt if per_row else jnp.asarray(earlier_siblings(tree))  # [b, t, s] or [t, s]
    repeat_bt = jnp.any(earlier & (tokens_bt[:, :, None] == tokens_bt[:, None, :]), axis=-1)
    prob_bt = jnp.where(repeat_bt, 0.0, node_prob_bt)
    mass_before_bt = jnp.einsum("bs,bts->bt" if per_row else "bs,ts->bt", prob_bt, earlier.astype(prob_bt.dtype))
    left_bt = jnp.maximum(1.0 - mass_before_bt, 0.0)  # the current q's normaliser when t is tried
    return uniform_bt * left_bt < prob_bt  # strict: a token with q = 0 is never accepted


def _children_of(tree: TreeBuffers | RowTree, node_b: jax.Array) -> jax.Array:
    """[B, J] the children of each row's node node_b[b], in rank order, -1-padded."""
    if isinstance(tree, RowTree):
        return tree.children_btj[jnp.arange(node_b.shape[0]), node_b]
    return jnp.asarray(children_table(tree))[node_b]


def exact_accept(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, key: jax.Array,
                 sampling: SamplingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens_bt / logits_btv: the T tree tokens and the base logits at each. Returns (accept length [B],
    accepted nodes [B, E + 1] root first (past the accept length: the last accepted node repeated), bonus
    token [B]) with the plain sampler's law (docs/modules.md)."""
    coin_key, bonus_key = jax.random.split(key)
    length_b, nodes_be, residual_bv = exact_walk(tree, tokens_bt, target_logits(logits_btv, sampling),
                                                 jax.random.uniform(coin_key, tokens_bt.shape))
    return length_b, nodes_be, jax.random.categorical(bonus_key, residual_bv, axis=-1).astype(jnp.int32)


def exact_walk(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, target_btv: jax.Array,
               uniform_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The walk (docs/modules.md) with the target logits at every node (target_btv: `target_logits` of
    the base logits, each row's own settings allowed) and one fresh U[0, 1) coin per node. Returns (accept
    length [B], accepted nodes [B, E + 1], the logits [B, V] the bonus token is drawn from)."""
    b = tokens_bt.shape[0]
    rows_b = jnp.arange(b)
    log_q_btv = jax.nn.log_softmax(target_btv, axis=-1)
    parent_bt = tree.parent_bt if isinstance(tree, RowTree) else jnp.asarray(tree.parent_t)[None, :]
    node_prob_bt = jnp.exp(log_q_btv[rows_b[:, None], parent_bt, tokens_bt])  # q_parent(token_t)
    accept_bt = trial_outcomes(tokens_bt, node_prob_bt, uniform_bt, tree)

    node_b = jnp.zeros((b,), jnp.int32)
    alive_b = jnp.ones((b,), bool)
    visited = [node_b]
    for _ in range(tree.depth):  # one round per depth: move to the first accepted child, or stop
        kids_bj = _children_of(tree, node_b)
        ok_bj = (kids_bj >= 0) & jnp.take_along_axis(accept_bt, jnp.maximum(kids_bj, 0), axis=1)
        move_b = alive_b & jnp.any(ok_bj, axis=1)
        first_b = jnp.argmax(ok_bj, axis=1)
        node_b = jnp.where(move_b, kids_bj[rows_b, first_b], node_b)
        alive_b = move_b
        visited.append(node_b)
    nodes_be = jnp.stack(visited, axis=1)
    length_b = jnp.sum(nodes_be[:, 1:] != nodes_be[:, :-1], axis=1).astype(jnp.int32)

    # bonus: the last accepted node's q without its (all rejected) children's tokens; a leaf keeps all of q
    kids_bj = _children_of(tree, node_b)
    kid_tokens_bj = jnp.where(kids_bj >= 0, jnp.take_along_axis(tokens_bt, jnp.maximum(kids_bj, 0), axis=1),
                              target_btv.shape[-1])  # out of range: dropped by the scatter
    last_bv = target_btv[rows_b, node_b]
    residual_bv = last_bv.at[rows_b[:, None], kid_tokens_bj].set(-jnp.inf, mode="drop")
    # rounding can leave no mass outside children that were all rejected; then fall back to the full q
    return length_b, nodes_be, jnp.where(jnp.any(residual_bv > -jnp.inf, axis=1, keepdims=True), residual_bv,
                                         last_bv)
