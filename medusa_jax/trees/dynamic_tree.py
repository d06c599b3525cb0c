"""Dynamic draft trees (EAGLE-2, Li et al., 2024): each step grows each row's tree from the drafter's own
probabilities, inside the jitted tree step, on the static sizes of a `tree.DynamicTree(nodes=N, top_k=K, depth=D)`.
The growth rule (`grow_tree`), the proposal (`TreeProposal`) and what verification derives from it (`row_tree`)
are in docs/design.md, "Dynamic trees"; axes as in the package legend (w frontier, a candidates)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.model import vocab_reduce
from medusa_jax.trees.tree import DynamicTree, TreeBuffers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeProposal:
    """A dynamic tree proposed for one step, per row; nodes sorted so that parents come before children."""

    tokens_bt: jax.Array  # [b, T] int32 draft tokens (node 0: the root, set by the tree step)
    parent_bt: jax.Array  # [b, T] int32 parent node (the root is its own parent)
    depth_bt: jax.Array  # [b, T] int32 depth (0 for the root); position = row length + depth
    score_bt: jax.Array  # [b, T] float32 cumulative draft log-probability (0 for the root)


@dataclasses.dataclass(frozen=True)
class Frontier:
    """The W nodes of one depth that `grow_tree` expands (W = 1 at depth 0: the root)."""

    path_bwe: jax.Array  # [b, W, depth + 1] tokens along each node's path, root first
    slots_bwe: jax.Array  # [b, W, depth] each ancestor's (itself last) slot in its depth's frontier, depths 1..depth
    parent_slot_bw: jax.Array  # [b, W] the node's parent's slot in the previous frontier
    score_bw: jax.Array  # [b, W] cumulative draft log-probability

    @property
    def depth(self) -> int:
        return self.path_bwe.shape[2] - 1


# expand(depth d, frontier of depth d - 1, carry) -> (ids_bwr, logp_bwr, carry): each frontier node's K most
# likely children (full-vocabulary ids, best first) and their draft log-probabilities given the node's path.
Expand = Callable[[int, Frontier, Any], tuple[jax.Array, jax.Array, Any]]


def top_k_log_probs(logits_xv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """[..., V] logits -> the k most likely ids [..., k] int32 (ties: the lower id first) and their log-probs
    (the top-k of the logits themselves, as `sharded.sharded_top_k` takes it shard by shard)."""
    logits_xv = logits_xv.astype(jnp.float32)
    values_xr, ids_xr = vocab_reduce.top_k(logits_xv, k)
    return ids_xr.astype(jnp.int32), values_xr - jax.nn.logsumexp(logits_xv, axis=-1, keepdims=True)


def _take(x_bw, index_bw):
    """x_bw[b, index_bw[b, i], ...] for an array with two or more leading axes [b, w, ...]."""
    index = index_bw.reshape(index_bw.shape + (1,) * (x_bw.ndim - 2))
    return jnp.take_along_axis(x_bw, index, axis=1)


def frontier_width(spec: DynamicTree, depth: int) -> int:
    """How many of the best depth-`depth` nodes the next round expands: K, or N - depth when fewer can matter.
    The N kept nodes are the N best of all candidates (ties: the lower index, so a node before its children and
    a shallower node before a deeper one). A child kept under the depth-d node ranked m + 1 at its depth keeps
    that node, the m ranked above it and one ancestor per depth 1..d - 1: N >= d + m + 1 nodes. So only the
    N - d best of depth d can have kept children, and expanding them alone keeps the same N nodes (at 4 nodes,
    depth 4, K = 4: 7 frontier rows drafted in place of 13; each round's rows are one pass of the drafter's
    vocabulary projection)."""
    return max(1, min(spec.top_k, spec.nodes - depth))


def grow_tree(spec: DynamicTree, root_b: jax.Array, expand: Expand, carry: Any = None) -> tuple[TreeProposal, Any]:
    """The kept tree of every row (docs/design.md, "Dynamic trees") and expand's final carry. D static rounds, each
    one expand call over the frontier (`frontier_width` nodes; one, the root, in round 1)."""
    b, k = root_b.shape[0], spec.top_k
    frontier = Frontier(root_b.astype(jnp.int32)[:, None, None], jnp.zeros((b, 1, 0), jnp.int32),
                        jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.float32))
    frontier_node_bw = jnp.full((b, 1), -1, jnp.int32)  # candidate index of each frontier node (-1: the root)
    tokens, scores, parents, depths = [], [], [], []
    offset = 0
    for depth in range(1, spec.depth + 1):
        ids_bwr, logp_bwr, carry = expand(depth, frontier, carry)
        w = ids_bwr.shape[1]
        score_ba = (frontier.score_bw[:, :, None] + jnp.minimum(logp_bwr, 0.0)).reshape(b, w * k)
        ids_ba = ids_bwr.reshape(b, w * k).astype(jnp.int32)
        tokens.append(ids_ba)
        scores.append(score_ba)
        parents.append(jnp.repeat(frontier_node_bw, k, axis=1))
        depths.append(np.full(w * k, depth, np.int32))
        if depth < spec.depth:  # the next frontier: this depth's best (ties: the lower index first)
            score_bw, best_bw = jax.lax.top_k(score_ba, frontier_width(spec, depth))
            parent_slot_bw = best_bw // k
            new_slot_bw = jnp.broadcast_to(jnp.arange(best_bw.shape[1], dtype=jnp.int32), best_bw.shape)
            frontier = Frontier(
                jnp.concatenate([_take(frontier.path_bwe, parent_slot_bw), _take(ids_ba, best_bw)[..., None]], 2),
                jnp.concatenate([_take(frontier.slots_bwe, parent_slot_bw), new_slot_bw[..., None]], 2),
                parent_slot_bw.astype(jnp.int32), score_bw)
            frontier_node_bw = (offset + best_bw).astype(jnp.int32)
        offset += w * k
    tokens_ba, score_ba, parent_ba = (jnp.concatenate(x, axis=1) for x in (tokens, scores, parents))
    depth_a = jnp.asarray(np.concatenate(depths))
    _, keep_bn = jax.lax.top_k(score_ba, spec.nodes)  # the N best; parents rank before their children
    keep_bn = jnp.sort(keep_bn, axis=1)  # candidate order: depth by depth, siblings in rank order
    rows_b1 = jnp.arange(b)[:, None]
    node_of_ba = jnp.full(score_ba.shape, -1, jnp.int32).at[rows_b1, keep_bn].set(
        jnp.arange(1, spec.nodes + 1, dtype=jnp.int32))
    parent_cand_bn = parent_ba[rows_b1, keep_bn]
    parent_bn = jnp.where(parent_cand_bn < 0, 0, node_of_ba[rows_b1, jnp.maximum(parent_cand_bn, 0)])
    zeros_b1 = jnp.zeros((b, 1), jnp.int32)
    return TreeProposal(jnp.concatenate([root_b.astype(jnp.int32)[:, None], tokens_ba[rows_b1, keep_bn]], 1),
                        jnp.concatenate([zeros_b1, parent_bn], 1),
                        jnp.concatenate([zeros_b1, depth_a[keep_bn]], 1),
                        jnp.concatenate([jnp.zeros((b, 1), jnp.float32), score_ba[rows_b1, keep_bn]], 1)), carry


def grow_from_candidates(spec: DynamicTree, root_b: jax.Array, ids_bmr: jax.Array,
                         logp_bmr: jax.Array) -> TreeProposal:
    """Medusa heads (and any proposer whose depth-d candidates do not depend on the path): every node of depth
    d - 1 gets the same K children, head d - 1's top-K ids_bmr[:, d - 1] with log-probs logp_bmr[:, d - 1]."""
    def expand(depth, frontier, carry):
        w = frontier.path_bwe.shape[1]
        shape = (root_b.shape[0], w, spec.top_k)
        return (jnp.broadcast_to(ids_bmr[:, None, depth - 1], shape),
                jnp.broadcast_to(logp_bmr[:, None, depth - 1], shape), carry)

    return grow_tree(spec, root_b, expand)[0]


@dataclasses.dataclass(frozen=True)
class RowTree:
    """A per-row tree as verification and acceptance read it (the per-row counterpart of TreeBuffers)."""

    parent_bt: jax.Array  # [b, T]
    depth_bt: jax.Array  # [b, T]
    ancestor_mask_btt: jax.Array  # [b, T, T] node t sees its ancestors and itself
    retrieve_bce: jax.Array  # [b, C, E] node of candidate path c (node c + 1's path) at depth e, 0-padded
    retrieve_valid_bce: jax.Array  # [b, C, E] False on padding
    children_btj: jax.Array  # [b, T, J] children in rank order, -1-padded (J = K)
    earlier_btt: jax.Array  # [b, T, T] [t, s]: s is a sibling of t tried before it
    depth: int  # E - 1: the deepest path (static)


def row_tree(proposal: TreeProposal, spec: DynamicTree) -> RowTree:
    """The derived arrays of a proposal whose nodes are sorted parents first, with at most K children per node,
    siblings in rank order and depth <= D (what `grow_tree` makes)."""
    parent_bt, depth_bt = proposal.parent_bt.astype(jnp.int32), proposal.depth_bt.astype(jnp.int32)
    b, t = parent_bt.shape
    node_t = jnp.arange(t, dtype=jnp.int32)
    chain = [jnp.broadcast_to(node_t, (b, t))]  # chain[i]: each node's i-th ancestor (the root is its own parent)
    for _ in range(spec.depth):
        chain.append(jnp.take_along_axis(parent_bt, chain[-1], axis=1))
    chain_bte = jnp.stack(chain, axis=2)
    ancestor_mask_btt = jnp.any(chain_bte[..., None] == node_t, axis=2)
    e_e = jnp.arange(spec.depth + 1, dtype=jnp.int32)
    valid_bte = e_e <= depth_bt[..., None]
    retrieve_bte = jnp.take_along_axis(chain_bte, jnp.clip(depth_bt[..., None] - e_e, 0, spec.depth), axis=2)
    retrieve_bte = jnp.where(valid_bte, retrieve_bte, 0)
    later_tt = (node_t[None, :] < node_t[:, None]) & (node_t[None, :] > 0)  # [t, s]: s > 0 comes before t > 0
    earlier_btt = (parent_bt[:, :, None] == parent_bt[:, None, :]) & later_tt
    sibling_rank_bt = jnp.sum(earlier_btt, axis=2)
    slot_bt = jnp.where(node_t > 0, parent_bt, t)  # the root is nobody's child: its entry is dropped
    children_btj = jnp.full((b, t, spec.top_k), -1, jnp.int32).at[
        jnp.arange(b)[:, None], slot_bt, sibling_rank_bt].set(jnp.broadcast_to(node_t, (b, t)), mode="drop")
    return RowTree(parent_bt, depth_bt, ancestor_mask_btt, retrieve_bte[:, 1:], valid_bte[:, 1:], children_btj,
                   earlier_btt, spec.depth)


def scratch_slots(tree: "TreeBuffers | DynamicTree") -> int:
    """KV-cache slots past each row's length that a step may write: the T verified tokens, and for an EAGLE
    drafter (which shares the cache size) its D + 2 catch-up entries and a dynamic tree's (D - 1) K block entries."""
    if isinstance(tree, DynamicTree):
        return max(tree.num_tokens, (tree.depth - 1) * tree.top_k, tree.depth + 2)
    return tree.num_tokens
