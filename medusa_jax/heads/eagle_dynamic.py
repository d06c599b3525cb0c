"""The EAGLE drafter (medusa_jax/heads/eagle.py) on a dynamic tree: EAGLE-2's growth inside the jitted tree step.

Per tree step and row (L = the row's committed length, after the drafter's catch-up, `EagleDrafter.catch_up`):
  depth 1: the root pair's output g_root gives the root's K children (top-K of the draft distribution);
  depth d = 2..D: the frontier, the K best nodes of depth d - 1 (dynamic_tree.grow_tree), runs ONE drafter forward
    over its K pairs (the parent's output g, the node's token) at position L - 1 + (d - 1); frontier slot w of
    round d writes block entry (d - 2) K + w, i.e. cache slot L + (d - 2) K + w, and attends to the committed
    slots and the block entries of its own ancestors (each an earlier round's frontier node) and itself. The
    outputs' top-K are the frontier nodes' children, scored by the drafter's log-probability.
The block entries are scratch, as in a static tree: the next step's catch-up recomputes the accepted path's pairs
from the verify's true features (`EagleDrafter.accepted`, unchanged). The cache needs (D - 1) K scratch slots past
L (dynamic_tree.scratch_slots). Axes: b rows, w frontier nodes, e depth along a path, s cache slots, d width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from medusa_jax.trees.dynamic_tree import TreeProposal, grow_tree, top_k_log_probs
from medusa_jax.trees.tree import DynamicTree


def propose_dynamic(drafter, hidden_bd: jax.Array, root_b: jax.Array, base, spec: DynamicTree, draft,
                    active_b: jax.Array) -> tuple[TreeProposal, object]:
    """(each row's dynamic tree, the drafter state with the catch-up committed); `drafter` is an EagleDrafter,
    `draft` its DraftState."""
    g_root_bd, cache, committed_b = drafter.catch_up(hidden_bd, root_b, base, draft, active_b)
    k = spec.top_k
    rel_bs = jnp.arange(cache.cache_size, dtype=jnp.int32)[None, :] - committed_b[:, None]  # slot - L

    def expand(depth, frontier, carry):
        cache, g_prev_bwd = carry  # g_prev_bwd: outputs of the previous round's frontier (round 1: the root's)
        if depth == 1:
            out_bwd = g_prev_bwd
        else:
            g_parent_bwd = jnp.take_along_axis(g_prev_bwd, frontier.parent_slot_bw[..., None], axis=1)
            node_depth = depth - 1
            positions_bw = jnp.broadcast_to(committed_b[:, None] - 1 + node_depth, frontier.score_bw.shape)
            # the block entries of the node's ancestors at depths 1..node_depth (itself last)
            entries_bwe = frontier.slots_bwe + k * jnp.arange(node_depth, dtype=jnp.int32)
            seen_bws = rel_bs[:, None, :] < 0
            for e in range(node_depth):
                seen_bws = seen_bws | (rel_bs[:, None, :] == entries_bwe[:, :, e:e + 1])
            out_bwd, cache = drafter(g_parent_bwd, frontier.path_bwe[:, :, -1], positions_bw, seen_bws, cache, base,
                                     offsets_b=committed_b + k * (depth - 2))
        ids_bwr, logp_bwr = top_k_log_probs(drafter.logits(out_bwd, base), k)
        return drafter.to_full_vocab(ids_bwr), logp_bwr, (cache, out_bwd)

    proposal, (cache, _) = grow_tree(spec, root_b, expand, (cache, g_root_bd[:, None]))
    return proposal, dataclasses.replace(draft, cache=cache.replace(lengths_b=committed_b))
