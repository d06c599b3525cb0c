"""Shared by the losslessness tests (test_medusa, test_smollm2): a proposer that switches between the heads' own
drafts and planted ones by data, and accept targets that cycle through every accept length; and random kernels
that make heads' drafts vary (test_eagle, test_hydra)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import TreeProposal
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.inference.acceptance import GREEDY
from medusa_jax.inference.medusa import MedusaState, heads_proposer, medusa_step, tree_tokens
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


def planted_drafter_step(base, drafter, tree, truth, n: int, accept: int, cache, last_bd, draft):
    """One real tree step of `drafter` for one row whose first n tokens are in `cache` (`last_bd` gave truth[n]):
    its own proposal is run (so its state advances as in decoding) but the verified tree holds planted tokens, the
    chain [0], [0, 0], ... true up to `accept` and every other node wrong. Returns the MedusaState after it."""
    vocab = base.config.vocab_size
    chain = [truth[n + 1 + i] if i < accept else (truth[n + 1 + i] + 1) % vocab for i in range(3)]
    planted_t = [truth[n]] + [chain[len(q) - 1] if not any(q) else (truth[n + 1] + 2) % vocab for q in tree.paths]

    def planted(inputs):
        _, draft_ = drafter.propose(inputs.hidden_bd, inputs.root_b, base, tree, inputs.draft, inputs.active_b)
        return jnp.asarray([planted_t], jnp.int32), draft_

    out = jnp.zeros((1, 16), jnp.int32).at[0, 0].set(truth[n])
    moves = jnp.asarray([[n + i for i in range(tree.depth + 1)]], jnp.int32)
    state = MedusaState(cache, jnp.asarray([truth[n]]), last_bd, out, jnp.ones((1,), jnp.int32),
                        jnp.zeros((1,), bool), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 16), jnp.int32),
                        jnp.zeros((), jnp.int32), jax.random.key(0), moves, moves, draft)
    step = jax.jit(medusa_step, static_argnames=("tree", "acceptance", "eos_ids", "proposer"))
    return step(MedusaModel(base, drafter), state, tree=tree, acceptance=GREEDY, eos_ids=(),
                proposer=planted)


def prompts_of(lengths, seed: int = 3) -> list[list[int]]:
    """Random prompts of the given lengths, token ids in [3, 128) (the tiny models' vocabularies)."""
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 128, size=n).tolist() for n in lengths]
