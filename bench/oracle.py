"""An oracle proposer for tests and upper-bound measurements: it knows the true continuation (from a plain
greedy run) and plants it at chosen (head, rank) slots, so that step s of row b accepts exactly
targets_bs[b, s] candidates under greedy acceptance (fewer only past the end of the known continuation).

Every other slot holds a wrong token (true + 1 + rank, distinct from its siblings), so nothing else can be
accepted. `planted_over_heads_proposer` also runs the heads (and ignores them), for timings that include
the heads' cost.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.tree import TreeBuffers
from medusa_jax.inference.medusa import ProposeInputs, heads_proposer, tree_tokens


def planted_data(tree: TreeBuffers, continuations: Sequence[Sequence[int]], targets_bs,
                 max_new_tokens: int) -> dict:
    """proposer_data for the planted proposers. continuations[b]: row b's plain greedy tokens; targets_bs
    [B, steps]: accept length wanted at each verify step (the last column repeats). For target a the truth is
    planted along the last tree path of length a (in sorted order), so high ranks get exercised too."""
    ranks_ad = np.zeros((tree.depth + 1, tree.depth), np.int32)
    for path in tree.paths:
        ranks_ad[len(path), : len(path)] = path
    targets_bs = np.asarray(targets_bs, np.int32)
    if targets_bs.ndim != 2 or targets_bs.shape[0] != len(continuations):
        raise ValueError(f"targets_bs must be [{len(continuations)}, steps], got shape {targets_bs.shape}")
    if targets_bs.min() < 0 or targets_bs.max() > tree.depth:
        raise ValueError(f"targets must lie in 0..{tree.depth} (the tree depth)")
    truth_bm = np.zeros((len(continuations), max_new_tokens + tree.depth + 1), np.int32)
    for b, tokens in enumerate(continuations):
        truth_bm[b, : len(tokens)] = tokens
    return {"truth_bm": jnp.asarray(truth_bm), "targets_bs": jnp.asarray(targets_bs),
            "ranks_ad": jnp.asarray(ranks_ad)}


def planted_proposer(inputs: ProposeInputs) -> jax.Array:
    """[B, D, k] candidates: head h < target holds the true token at rank ranks_ad[target, h]."""
    data, tree = inputs.data, inputs.tree
    truth_bm, targets_bs, ranks_ad = data["truth_bm"], data["targets_bs"], data["ranks_ad"]
    b, d, k = truth_bm.shape[0], tree.depth, tree.top_k
    rows_b = jnp.arange(b)
    target_b = targets_bs[rows_b, jnp.minimum(inputs.step, targets_bs.shape[1] - 1)]
    # the root is emitted token num_out - 1, so the depth-(h + 1) node is emitted token num_out + h
    idx_bd = jnp.minimum(inputs.num_out_b[:, None] + jnp.arange(d)[None, :], truth_bm.shape[1] - 1)
    true_bd = truth_bm[rows_b[:, None], idx_bd]
    wrong_bdk = (true_bd[..., None] + 1 + jnp.arange(k)) % inputs.model.base.config.vocab_size
    planted_bdk = ((jnp.arange(d)[None, :, None] < target_b[:, None, None])
                   & (jnp.arange(k)[None, None, :] == ranks_ad[target_b][:, :, None]))
    return jnp.where(planted_bdk, true_bd[..., None], wrong_bdk).astype(jnp.int32)


def planted_over_heads_proposer(inputs: ProposeInputs) -> jax.Array:
    """planted_proposer's candidates, after running the heads as the Medusa proposal would (their ids are
    never negative, so the select keeps the planted ones; the compiler cannot drop the heads)."""
    from_heads = heads_proposer(inputs)  # [B, D, k], or [B, T] tree tokens for Hydra heads
    planted = planted_proposer(inputs)
    if from_heads.ndim == 2:
        planted = tree_tokens(inputs.root_b, planted, inputs.tree)
    return jnp.where(from_heads < 0, from_heads, planted)
