"""Shared by the losslessness tests (test_medusa, test_smollm2): a proposer that switches between the heads' own
drafts and planted ones by data, and accept targets that cycle through every accept length; and random kernels
that make heads' drafts vary (test_eagle, test_hydra)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import TreeProposal
from medusa_jax.inference.medusa import heads_proposer, tree_tokens
from medusa_jax.trees.search.oracle import planted_proposer


def heads_or_planted(inputs):
    """The heads' proposal or the planted one, chosen by data (one compile serves both runs of a test)."""
    use_planted = inputs.data["use_planted"]
    (from_heads, draft), (planted, _) = heads_proposer(inputs), planted_proposer(inputs)
    if isinstance(from_heads, TreeProposal):  # a dynamic tree
        return jax.tree.map(lambda p, h: jnp.where(use_planted, p, h), planted, from_heads), draft
    if from_heads.ndim == 2:  # Hydra heads and the EAGLE drafter propose the [B, T] tree tokens
        planted = tree_tokens(inputs.root_b, planted, inputs.tree)
    return jnp.where(use_planted, planted, from_heads), draft


def cycling_targets(batch: int, depth: int, steps: int) -> np.ndarray:
    """[batch, steps] accept lengths 0..depth in turn, each row shifted by one."""
    return (np.arange(steps)[None, :] + np.arange(batch)[:, None]) % (depth + 1)


def randomise_kernels(linears, seed: int, scale: float = 0.3) -> None:
    """Sets each linear's kernel to normal(0, scale) draws from one RandomState(seed), in the order given, so that
    the drafts differ from node to node (a comparison of drafts then means something)."""
    rng = np.random.RandomState(seed)
    for linear in linears:
        linear.kernel[...] = jnp.asarray(rng.normal(0, scale, linear.kernel.shape), jnp.float32)
