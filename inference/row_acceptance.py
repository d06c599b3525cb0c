"""Tree acceptance with every row's own sampling settings, so greedy and sampled requests share one drafted step
(`RowAcceptance`; greedy rows accept greedily, sampled rows exactly, typical rows typically; coins per request
seed and position). `accept_step` and `first_token` are what the tree decoder calls, with this or the batch-wide
`DecodeConfig` (inference/acceptance.py). The rules in full: docs/modules.md."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from medusa_jax.trees.dynamic_tree import RowTree
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.inference.acceptance import (GREEDY, DecodeConfig, accept_tree, path_end, sample_next,
                                             typical_bound, typical_set_logits, typical_walk)
from medusa_jax.inference.exact_acceptance import exact_walk
from medusa_jax.inference.row_sampling import RowSampling, row_keys, row_target_logits, sample_rows

DRAFTED_STREAM = 1  # folded into a row's seed key before its position: tree steps' coins, apart from sample_rows'


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowAcceptance:
    sampling: RowSampling  # [b] arrays: temperature 0 rows accept greedily, the others exactly


def step_keys(sampling: RowSampling, lengths_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's coin and bonus keys for a tree step with lengths_b tokens in its cache (module docstring)."""
    seed_keys_b = row_keys(sampling.seed_b, jnp.full(lengths_b.shape, DRAFTED_STREAM, jnp.int32))
    keys_b = jax.vmap(jax.random.fold_in)(seed_keys_b, lengths_b)
    return jax.vmap(jax.random.split, out_axes=1)(keys_b)


def typical_scaled(logits_bxv: jax.Array, sampling: RowSampling) -> tuple[jax.Array, jax.Array]:
    """(logits over each typical row's temperature [b, ..., v] fp32, their typical threshold [b, ...]): every row's
    own posterior threshold and alpha (rows not typical: temperature 1, unused)."""
    def per_row(x_b, ndim):
        return x_b.reshape(x_b.shape + (1,) * (ndim - 1))

    typical_b = sampling.typical_rows_b
    temperature_b = jnp.where(typical_b, sampling.temperature_b, 1.0)
    scaled_bxv = logits_bxv.astype(jnp.float32) / per_row(temperature_b, logits_bxv.ndim)
    threshold_bx = typical_bound(jax.nn.softmax(scaled_bxv, axis=-1),
                                 per_row(sampling.posterior_threshold_b, logits_bxv.ndim - 1),
                                 per_row(sampling.posterior_alpha_b, logits_bxv.ndim - 1))
    return scaled_bxv, threshold_bx


def typical_rows(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, lengths_b: jax.Array,
                 sampling: RowSampling) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Typical acceptance of every row with its own temperature, threshold and alpha (`acceptance.typical_walk`)
    and its bonus token from the typical set at the path's end, drawn with the row's bonus key."""
    scaled_btv, threshold_bt = typical_scaled(logits_btv, sampling)
    length_b, nodes_be = typical_walk(tree, tokens_bt, jax.nn.softmax(scaled_btv, axis=-1), threshold_bt)
    last_bv = typical_set_logits(path_end(scaled_btv, nodes_be, length_b),
                                 path_end(threshold_bt[..., None], nodes_be, length_b)[:, 0])
    bonus_b = jax.vmap(jax.random.categorical)(step_keys(sampling, lengths_b)[1], last_bv)
    return length_b, nodes_be, bonus_b.astype(jnp.int32)


def exact_rows(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, lengths_b: jax.Array,
               sampling: RowSampling) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact acceptance of every row with its own settings and coins (module docstring): (accept length [b],
    accepted nodes [b, e], bonus token [b])."""
    coin_keys_b, bonus_keys_b = step_keys(sampling, lengths_b)
    uniform_bt = jax.vmap(lambda key: jax.random.uniform(key, tokens_bt.shape[1:]))(coin_keys_b)
    length_b, nodes_be, residual_bv = exact_walk(tree, tokens_bt, row_target_logits(logits_btv, sampling),
                                                 uniform_bt)
    bonus_b = jax.vmap(jax.random.categorical)(bonus_keys_b, residual_bv)
    return length_b, nodes_be, bonus_b.astype(jnp.int32)


def where_rows(flag_b: jax.Array, yes, no):
    """Row by row, `yes`'s outputs where flag_b holds, else `no`'s (tuples of [b, ...] arrays)."""
    return jax.tree.map(lambda y, n: jnp.where(flag_b.reshape(flag_b.shape + (1,) * (y.ndim - 1)), y, n), yes, no)


def accept_rows(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, lengths_b: jax.Array,
                acceptance: RowAcceptance) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance for rows at temperature 0, typical for sampled rows marked typical, exact for the other
    sampled rows; `accept_tree`'s outputs."""
    sampling = acceptance.sampling
    greedy = accept_tree(tree, tokens_bt, logits_btv, jax.random.key(0), GREEDY)  # the key is unused
    sampled_b, typical_b = sampling.temperature_b > 0, sampling.typical_rows_b

    def mixed():
        chosen = where_rows(sampled_b, exact_rows(tree, tokens_bt, logits_btv, lengths_b, sampling), greedy)
        if sampling.typical_b is None:
            return chosen
        return jax.lax.cond(jnp.any(typical_b), lambda: where_rows(
            typical_b, typical_rows(tree, tokens_bt, logits_btv, lengths_b, sampling), chosen), lambda: chosen)

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
        return first_row_tokens(logits_bv, acceptance.sampling)
    return sample_next(logits_bv, key, acceptance)


def first_row_tokens(logits_bv: jax.Array, sampling: RowSampling) -> jax.Array:
    """Each row's token after its prompt (its token number 0): `sample_rows`'s, or for a typical row a draw from
    its typical set with the same key (as the batch path's `acceptance.sample_next` for typical acceptance)."""
    zeros_b = jnp.zeros(logits_bv.shape[:1], jnp.int32)
    first_b = sample_rows(logits_bv, sampling, zeros_b)
    if sampling.typical_b is None:
        return first_b
    typical_b = sampling.typical_rows_b

    def typical():
        scaled_bv, threshold_b = typical_scaled(logits_bv, sampling)
        drawn_b = jax.vmap(jax.random.categorical)(row_keys(sampling.seed_b, zeros_b),
                                                   typical_set_logits(scaled_bv, threshold_b))
        return jnp.where(typical_b, drawn_b.astype(jnp.int32), first_b)

    return jax.lax.cond(jnp.any(typical_b), typical, lambda: first_b)
