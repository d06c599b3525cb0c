"""Prompt lookup (PLD): a drafter with no parameters that matches the last n tokens of each row against the row's
own tokens (prompt and output so far, a [b, s] buffer beside the KV cache) and drafts what followed the latest,
longest match, vectorised on device. The buffer, the matching and the proposal's scores: docs/modules.md."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.trees.dynamic_tree import TreeProposal

# P(a drafted token is accepted | its predecessor was) after an n-token match, n = 1, 2, 3, ...: measured on greedy
# SmolLM2-135M-Instruct answers to 6 MT-Bench and 6 input-grounded prompts (bench/mixed_drafts/README.md, "Prompt
# lookup's acceptance by match length": 164/435, 218/320 and 2094/2365 drafted tokens accepted; results.json's
# lookup_acceptance, from bench/mixed_drafts.lookup_acceptance)
MATCH_ACCEPTANCE = (0.377, 0.681, 0.885)
BRANCH_DISCOUNT = 0.9  # a later match's chain scores this factor (per node) below the latest's


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    n_max: int = 3  # longest n-gram matched
    n_min: int = 1  # shortest
    length: int = 8  # tokens drafted after a match (the chain's depth)
    branches: int = 1  # matches drafted (the latest, longest first); more than one: a tree of chains

    def __post_init__(self):
        for name in ("n_max", "n_min", "length", "branches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup {name} must be an integer >= 1, got {value!r}")
        if self.n_min > self.n_max:
            raise ValueError(f"lookup needs n_min <= n_max, got {self.n_min} > {self.n_max}")

    @property
    def num_nodes(self) -> int:
        return self.branches * self.length


def accept_log_prob(n_b: jax.Array) -> jax.Array:
    """log P(accept one drafted token) after a match of n_b tokens (`MATCH_ACCEPTANCE`, the last value beyond)."""
    table = jnp.log(jnp.asarray(MATCH_ACCEPTANCE, jnp.float32))
    return table[jnp.clip(n_b - 1, 0, len(MATCH_ACCEPTANCE) - 1)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LookupState:
    tokens_bs: jax.Array  # [b, s] each row's tokens (prompt, then emitted), the root not yet included
    length_b: jax.Array  # [b] tokens in tokens_bs


def init_lookup(prompt_bt: jax.Array, prompt_lens_b: jax.Array, cache_size: int) -> LookupState:
    b, width = prompt_bt.shape
    tokens_bs = jnp.zeros((b, cache_size), jnp.int32).at[:, :width].set(prompt_bt.astype(jnp.int32))
    return LookupState(tokens_bs, prompt_lens_b.astype(jnp.int32))


def append_accepted(state: LookupState, tokens_bt, nodes_be, accept_b, active_b) -> LookupState:
    """The root and the accepted nodes of this step (tokens_bt[nodes_be[:, :a + 1]]) appended to active rows."""
    b, e = nodes_be.shape
    path_be = jnp.take_along_axis(tokens_bt.astype(jnp.int32), nodes_be, axis=1)
    e_1e = jnp.arange(e)[None, :]
    keep_be = (e_1e <= accept_b[:, None]) & active_b[:, None]
    s = state.tokens_bs.shape[1]
    slot_be = jnp.where(keep_be, state.length_b[:, None] + e_1e, s)
    tokens_bs = state.tokens_bs.at[jnp.arange(b)[:, None], slot_be].set(path_be, mode="drop")
    return LookupState(tokens_bs, jnp.minimum(state.length_b + jnp.where(active_b, accept_b + 1, 0), s))


def lookup_matches(config: LookupConfig, query_bs: jax.Array, end_b: jax.Array):
    """Each row's `branches` best continuations: (their first position [b, w], the match length n [b, w], 0 where
    none). Position c continues an n-token match when the n tokens before it equal the query's last n (c < end_b,
    the query's own end excluded); each position counts with its longest n, keyed n * s + c. query_bs holds end_b
    known tokens (the root last)."""
    b, s = query_bs.shape
    c_s = jnp.arange(s, dtype=jnp.int32)
    padded_bs = jnp.concatenate([jnp.full((b, config.n_max), -1, jnp.int32), query_bs], axis=1)
    key_bs = jnp.full((b, s), -1, jnp.int32)
    for n in range(config.n_min, config.n_max + 1):
        last_bn = jnp.take_along_axis(query_bs, jnp.maximum(end_b[:, None] - n + jnp.arange(n), 0), axis=1)
        match_bs = (c_s[None, :] < end_b[:, None]) & (c_s[None, :] >= n) & (end_b[:, None] >= n)
        for i in range(n):  # token c - n + i
            start = config.n_max - n + i
            match_bs &= padded_bs[:, start: start + s] == last_bn[:, i: i + 1]
        key_bs = jnp.where(match_bs, n * s + c_s[None, :], key_bs)  # longer n overwrites shorter
    key_bw, next_bw = jax.lax.top_k(key_bs, config.branches)
    return next_bw.astype(jnp.int32), jnp.where(key_bw >= 0, key_bw // s, 0)


def lookup_proposal(config: LookupConfig, state: LookupState, root_b: jax.Array) -> TreeProposal:
    """The candidate forest of the module docstring: [b, 1 + branches * length] nodes, parents first."""
    b, s = state.tokens_bs.shape
    rows_b = jnp.arange(b)
    query_bs = state.tokens_bs.at[rows_b, jnp.minimum(state.length_b, s - 1)].set(root_b.astype(jnp.int32))
    end_b = jnp.minimum(state.length_b + 1, s)
    next_bw, n_bw = lookup_matches(config, query_bs, end_b)
    w, length = config.branches, config.length
    i_l = jnp.arange(length, dtype=jnp.int32)
    pos_bwl = next_bw[..., None] + i_l
    known_bwl = (pos_bwl < end_b[:, None, None]) & (n_bw[..., None] > 0)
    tokens_bwl = jnp.take_along_axis(query_bs, jnp.minimum(pos_bwl, s - 1).reshape(b, -1), axis=1).reshape(b, w, length)
    discount_w = jnp.arange(w, dtype=jnp.float32) * math.log(BRANCH_DISCOUNT)
    score_bwl = (i_l + 1) * (accept_log_prob(n_bw)[..., None] + discount_w[None, :, None])
    score_bwl = jnp.where(known_bwl, score_bwl, -jnp.inf)
    node_wl = 1 + jnp.arange(w * length, dtype=jnp.int32).reshape(w, length)
    parent_wl = jnp.where(i_l[None, :] == 0, 0, node_wl - 1)
    zeros_b1 = jnp.zeros((b, 1), jnp.int32)
    return TreeProposal(
        jnp.concatenate([root_b.astype(jnp.int32)[:, None], tokens_bwl.reshape(b, -1)], axis=1),
        jnp.concatenate([zeros_b1, jnp.broadcast_to(parent_wl.reshape(-1), (b, w * length))], axis=1),
        jnp.concatenate([zeros_b1, jnp.broadcast_to(jnp.tile(i_l + 1, w), (b, w * length))], axis=1),
        jnp.concatenate([jnp.zeros((b, 1), jnp.float32), score_bwl.reshape(b, -1)], axis=1))


class LookupDrafter(nnx.Module):
    """Prompt lookup with the drafter contract of `heads.medusa.HeadsBase` (init_draft / propose / accepted); it
    owns no parameters. `propose` returns the candidate forest (`lookup_proposal`); the mix
    (`heads.mixed.MixedDrafter`) merges it with the other drafters' into the tree that is verified."""

    head_type = "lookup"  # its kind in heads.kinds.DRAFTERS
    trained = False  # no heads folder
    decodes_alone = False  # its candidate forest is verified through a mix (`--heads lookup` is a mix of one)
    needs_prompt_hidden = False
    learns_prompt = False
    drafts_from_prompt = True  # its chains are what followed a match in the row's own tokens, prompt included
    feature_layers: tuple[int, ...] = ()  # reads no hidden state at all

    def __init__(self, config: LookupConfig = LookupConfig()):
        self.lookup = config

    @classmethod
    def mix_member(cls, base, budget: int, drafter: "LookupDrafter | None" = None) -> tuple["LookupDrafter", None]:
        """This kind in a mix of `budget` nodes (heads.kinds): `drafter`, or chains of up to 10 tokens, one
        matched branch per 4 nodes of budget (at most 4: at 16 nodes the other matches' chains added 0.11 tokens
        per step over the latest match's alone, replayed on recorded MT-Bench candidates, bench/mixed_tree); it
        sizes itself (no spec)."""
        return (drafter if drafter is not None else
                cls(LookupConfig(length=min(budget, 10), branches=max(1, min(4, budget // 4))))), None

    @property
    def depth(self) -> int:
        return self.lookup.length

    @property
    def num_nodes(self) -> int:
        """Candidate nodes proposed per step (the root excluded)."""
        return self.lookup.num_nodes

    def init_draft(self, base, prompt_bt, prompt_lens_b, hidden_btd, cache_size: int, max_depth: int) -> LookupState:
        return init_lookup(prompt_bt, prompt_lens_b, cache_size)

    def propose(self, hidden_bd, root_b, base, tree, draft: LookupState, active_b):
        return lookup_proposal(self.lookup, draft, root_b), draft

    def accepted(self, draft: LookupState, hidden_btd, tokens_bt, nodes_be, accept_b, active_b) -> LookupState:
        return append_accepted(draft, tokens_bt, nodes_be, accept_b, active_b)
