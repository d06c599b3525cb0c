"""Tree acceptance with every row's own sampling settings, so greedy and sampled requests share one drafted step
(the generation engine's drafted rows: inference/drafted_rows.py).

`RowAcceptance` carries a `RowSampling` (per-row temperature, top-p, top-k, seed). A row at temperature 0 takes
greedy acceptance (its tokens are plain greedy decoding's); a sampled row takes exact acceptance
(`exact_acceptance`) against `row_target_logits`, its own settings' distribution, so its tokens have the law of
plain sampling with those settings. A row's coins come from fold_in(fold_in(key(seed), DRAFTED_STREAM), length)
with `length` its tokens in the cache at the step: they depend on the request's seed and position only, not on
its row, the step count or what else shares the batch (a request with a fixed seed is reproducible). A step
whose rows are all greedy skips the sampling work (one `lax.cond`): a sort of the vocabulary per tree node.

`accept_step` and `first_token` are what the tree decoder calls: they take either this per-row acceptance or
the batch-wide static `DecodeConfig` (inference/acceptance.py) of `api.generate_batch`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from medusa_jax.trees.dynamic_tree import RowTree
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.inference.acceptance import GREEDY, DecodeConfig, accept_tree, sample_next
from medusa_jax.inference.exact_acceptance import exact_walk
from medusa_jax.inference.row_sampling import RowSampling, row_keys, row_target_logits, sample_rows

DRAFTED_STREAM = 1  # folded into a row's seed key before its position: tree steps' coins, apart from sample_rows'


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowAcceptance:
    sampling: RowSampling  # [b] arrays: temperature 0 rows accept greedily, the others exactly


def exact_rows(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, lengths_b: jax.Array,
               sampling: RowSampling) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact acceptance of every row with its own settings and coins (module docstring): (accept length [b],
    accepted nodes [b, e], bonus token [b])."""
    seed_keys_b = row_keys(sampling.seed_b, jnp.full(lengths_b.shape, DRAFTED_STREAM, jnp.int32))
    keys_b = jax.vmap(jax.random.fold_in)(seed_keys_b, lengths_b)
    coin_keys_b, bonus_keys_b = jax.vmap(jax.random.split, out_axes=1)(keys_b)
    uniform_bt = jax.vmap(lambda key: jax.random.uniform(key, tokens_bt.shape[1:]))(coin_keys_b)
    length_b, nodes_be, residual_bv = exact_walk(tree, tokens_bt, row_target_logits(logits_btv, sampling),
                                                 uniform_bt)
    bonus_b = jax.vmap(jax.random.categorical)(bonus_keys_b, residual_bv)
    return length_b, nodes_be, bonus_b.astype(jnp.int32)


def accept_rows(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, lengths_b: jax.Array,
                acceptance: RowAcceptance) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance for rows at temperature 0, exact for the others; `accept_tree`'s outputs."""
    greedy = accept_tree(tree, tokens_bt, logits_btv, jax.random.key(0), GREEDY)  # the key is unused
    sampled_b = acceptance.sampling.temperature_b > 0

    def mixed():
        exact = exact_rows(tree, tokens_bt, logits_btv, lengths_b, acceptance.sampling)
        return jax.tree.map(lambda g, x: jnp.where(sampled_b.reshape(sampled_b.shape + (1,) * (g.ndim - 1)), x, g),
                            greedy, exact)

    return jax.lax.cond(jnp.any(sampled_b), mixed, lambda: greedy)


def accept_step(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, key: jax.Array,
                lengths_b: jax.Array, acceptance: DecodeConfig | RowAcceptance):
    """The tree step's acceptance: per row (`accept_rows`) or batch-wide (`acceptance.accept_tree`, with `key`)."""
    if isinstance(acceptance, RowAcceptance):
        return accept_rows(tree, tokens_bt, logits_btv, lengths_b, acceptance)
    return accept_tree(tree, tokens_bt, logits_btv, key, acceptance)


def first_token(logits_bv: jax.Array, key: jax.Array, acceptance: DecodeConfig | RowAcceptance) -> jax.Array:
    """The token after the prompt: each row's own (`sample_rows`, its token number 0) or batch-wide
    (`acceptance.sample_next`, with `key`)."""
    if isinstance(acceptance, RowAcceptance):
        return sample_rows(logits_bv, acceptance.sampling, jnp.zeros(logits_bv.shape[:1], jnp.int32))
    return sample_next(logits_bv, key, acceptance)
