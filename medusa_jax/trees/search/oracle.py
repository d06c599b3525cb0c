"""An oracle proposer for tests and upper-bound measurements: it knows the true continuation (from a plain
greedy run) and plants it at chosen (head, rank) slots, so that step i of row b accepts exactly
accept_targets[b, i] candidates under greedy acceptance (fewer only past the end of the known continuation).

Every other slot holds a wrong token (true + 1 + rank, distinct from its siblings), so nothing else can be
accepted. On a dynamic tree the same candidates grow the tree (as Medusa heads' do) with the truth at rank 0 and
a peaked draft distribution over ranks, so the true path is always the best path and is kept.
`planted_over_heads_proposer` also runs the heads (and ignores them), for timings that include
the heads' cost.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import TreeProposal, grow_from_candidates
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.inference.medusa import ProposeInputs, heads_proposer, tree_tokens

PLANTED_LOGP_GAP = 8.0  # dynamic trees: rank r's draft logit is -8 r (rank 0 has probability > 0.999)


def planted_data(tree: TreeBuffers | DynamicTree, continuations: Sequence[Sequence[int]], accept_targets,
                 max_new_tokens: int) -> dict:
    """proposer_data for the planted proposers. continuations[b]: row b's plain greedy tokens; accept_targets
    [B, steps]: accept length wanted at each verify step (the last column repeats). For target a the truth is
    planted along the last tree path of length a (in sorted order), so high ranks get exercised too."""
    ranks_em = np.zeros((tree.depth + 1, tree.depth), np.int32)  # [a, m]: head m's planted rank for target a
    for path in () if isinstance(tree, DynamicTree) else tree.paths:  # dynamic trees: the truth at rank 0
        ranks_em[len(path), : len(path)] = path
    accept_targets = np.asarray(accept_targets, np.int32)
    if accept_targets.ndim != 2 or accept_targets.shape[0] != len(continuations):
        raise ValueError(f"accept_targets must be [{len(continuations)}, steps], got shape "
                         f"{accept_targets.shape}")
    if accept_targets.min() < 0 or accept_targets.max() > tree.depth:
        raise ValueError(f"targets must lie in 0..{tree.depth} (the tree depth)")
    truth_bo = np.zeros((len(continuations), max_new_tokens + tree.depth + 1), np.int32)
    for b, tokens in enumerate(continuations):
        truth_bo[b, : len(tokens)] = tokens
    return {"truth_bo": jnp.asarray(truth_bo), "accept_targets": jnp.asarray(accept_targets),
            "ranks_em": jnp.asarray(ranks_em)}


def planted_proposer(inputs: ProposeInputs) -> tuple[jax.Array | TreeProposal, Any]:
    """[B, M, R] candidates: head m < target holds the true token at rank ranks_em[target, m]. On a dynamic tree,
    the tree grown from them (module docstring)."""
    data, tree = inputs.data, inputs.tree
    truth_bo, accept_targets, ranks_em = data["truth_bo"], data["accept_targets"], data["ranks_em"]
    b, m, r = truth_bo.shape[0], tree.depth, tree.top_k
    rows_b = jnp.arange(b)
    target_b = accept_targets[rows_b, jnp.minimum(inputs.step, accept_targets.shape[1] - 1)]
    # the root is emitted token num_out - 1, so the depth-(m + 1) node is emitted token num_out + m
    idx_bm = jnp.minimum(inputs.num_out_b[:, None] + jnp.arange(m)[None, :], truth_bo.shape[1] - 1)
    true_bm = truth_bo[rows_b[:, None], idx_bm]
    wrong_bmr = (true_bm[..., None] + 1 + jnp.arange(r)) % inputs.model.base.config.vocab_size
    planted_bmr = ((jnp.arange(m)[None, :, None] < target_b[:, None, None])
                   & (jnp.arange(r)[None, None, :] == ranks_em[target_b][:, :, None]))
    candidates_bmr = jnp.where(planted_bmr, true_bm[..., None], wrong_bmr).astype(jnp.int32)
    if isinstance(tree, DynamicTree):
        logp_r = jax.nn.log_softmax(-PLANTED_LOGP_GAP * jnp.arange(r, dtype=jnp.float32))
        logp_bmr = jnp.broadcast_to(logp_r, candidates_bmr.shape)
        return grow_from_candidates(tree, inputs.root_b, candidates_bmr, logp_bmr), inputs.draft
    return candidates_bmr, inputs.draft


def planted_over_heads_proposer(inputs: ProposeInputs) -> tuple[jax.Array | TreeProposal, Any]:
    """planted_proposer's candidates, after running the heads as the Medusa proposal would (their ids are
    never negative, so the select keeps the planted ones; the compiler cannot drop the heads)."""
    from_heads, draft = heads_proposer(inputs)  # [B, M, R], or [B, T] tree tokens (Hydra, EAGLE)
    planted, _ = planted_proposer(inputs)
    if isinstance(from_heads, TreeProposal):  # a dynamic tree
        keep_b1 = from_heads.tokens_bt[:, 1:2] < 0
        return jax.tree.map(lambda h, p: jnp.where(keep_b1, h, p), from_heads, planted), draft
    if from_heads.ndim == 2:
        planted = tree_tokens(inputs.root_b, planted, inputs.tree)
    return jnp.where(from_heads < 0, from_heads, planted), draft
