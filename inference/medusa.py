"""Medusa decoding: prefill + a `jax.lax.while_loop` of tree steps, one jitted call per batch.

Shapes: B rows, P padded prompt length, N = max_new_tokens, S cache slots (S >= P + N + T), T tree tokens,
D tree depth, k top-k per head. Each step, per row:
  1. the proposer gives [B, D, k] candidates per (head, rank) from the hidden state that produced the root
     (the last emitted token, not yet in the cache); the tree picks its T tokens from [root, candidates]
     (or, for Hydra heads, the proposer drafts the T tree tokens itself, depth by depth);
  2. ONE verify forward of the T tokens at positions length + depth under the tree mask writes their K/V to
     slots [length, length + T);
  3. acceptance picks a path and its accept length a, plus the base model's next token after it (bonus);
  4. the K/V of the root and the a accepted nodes move to slots [length, length + a + 1) (a gather and a
     scatter of D + 1 slots per row; the rest of the tree block is scratch) and the row advances by a + 1.
Rows finish independently: tokens after an EOS inside the accepted path are dropped, the last step is cut
to max_new_tokens, and a finished row stops advancing (it keeps computing, writing scratch slots only).
"""

from __future__ import annotations

import dataclasses
import os
import time
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.heads import HeadsConfig, MedusaHeads, MedusaModel
from medusa_jax.heads_trees import HeadsTrees, resolve_tree, trees_of
from medusa_jax.hydra_heads import HydraHeads
from medusa_jax.kv_cache import KVCache, attention_mask
from medusa_jax.sharding import map_cache_rows
from medusa_jax.tree import TreeBuffers, build_tree, load_tree
from medusa_jax.inference.acceptance import AcceptanceConfig, accept_tree, sample_next
from medusa_jax.inference.autoregressive import is_eos, prefill
from medusa_jax.inference.engine import (GenerationResult, check_fits, check_positions, generate, pad_prompts,
                                         resolve_eos)
from medusa_jax.inference.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class ProposeInputs:
    """What a proposer sees at each step (inside the jitted loop)."""

    model: MedusaModel
    hidden_bd: jax.Array  # base hidden state of the last accepted node: its logits gave root_b
    root_b: jax.Array  # the newest emitted token (tree node 0)
    num_out_b: jax.Array  # tokens emitted so far, the root included
    step: jax.Array  # verify steps done so far (scalar)
    tree: TreeBuffers
    data: Any  # the proposer_data pytree given to generate_medusa


# A proposer returns either [B, tree.depth, tree.top_k] int32 candidate ids ([b, h, r] fills every tree node
# (head h, rank r)), or [B, T] int32 tree tokens (node 0 is root_b) when a node's children depend on its own
# path (Hydra heads). Verification, acceptance and cache compaction are the same for both.
Proposer = Callable[[ProposeInputs], jax.Array]


def heads_proposer(inputs: ProposeInputs) -> jax.Array:
    """The heads' proposal: Medusa heads' top-k tokens from the last accepted hidden state ([B, D, k]), or
    Hydra heads' tree drafted depth by depth along each node's path ([B, T])."""
    tree = inputs.tree
    if isinstance(inputs.model.heads, HydraHeads):
        return inputs.model.heads.tree_tokens(inputs.hidden_bd, inputs.root_b, inputs.model.base, tree)
    top_kbk = inputs.model.heads.top_k(inputs.hidden_bd, inputs.model.base, tree.top_k, num_heads=tree.depth)
    return top_kbk.transpose(1, 0, 2)


def tree_tokens(root_b: jax.Array, candidates_bhk: jax.Array, tree: TreeBuffers) -> jax.Array:
    """[B] roots + [B, D, k] candidates -> [B, T] tree tokens (flat list [root, head0 top-k, head1 top-k, ...])."""
    flat_bf = jnp.concatenate([root_b[:, None], candidates_bhk.reshape(root_b.shape[0], -1)], axis=1)
    return flat_bf[:, jnp.asarray(tree.candidate_index_t)].astype(jnp.int32)


def draft_tree(heads, base: CausalLM, hidden_bd: jax.Array, root_b: jax.Array, tree: TreeBuffers) -> jax.Array:
    """[B, T] tree tokens the heads propose (Medusa or Hydra): what `heads_proposer` gives, placed in the tree."""
    if isinstance(heads, HydraHeads):
        return heads.tree_tokens(hidden_bd, root_b, base, tree)
    return tree_tokens(root_b, heads.top_k(hidden_bd, base, tree.top_k, num_heads=tree.depth).transpose(1, 0, 2),
                       tree)


def proposal_tokens(root_b: jax.Array, proposal: jax.Array, tree: TreeBuffers) -> jax.Array:
    """A proposer's output ([B, D, k] candidates or [B, T] tokens) -> [B, T] tree tokens, node 0 = root_b."""
    if proposal.ndim == 2:
        if proposal.shape[1] != tree.num_tokens:
            raise ValueError(f"a proposer returned {proposal.shape[1]} tree tokens; the tree has {tree.num_tokens}")
        return proposal.astype(jnp.int32).at[:, 0].set(root_b)
    return tree_tokens(root_b, proposal, tree)


def compact_accepted(cache: KVCache, nodes_bj: jax.Array) -> KVCache:
    """Moves the K/V of tree nodes nodes_bj (slots lengths + node) to slots lengths + j, j = 0..D, in every
    layer. Only D + 1 slots per row are read and written; lengths are unchanged. Under a mesh each device
    moves its own rows (`sharding.map_cache_rows`), with no collectives."""
    return map_cache_rows(_compact_rows, cache, nodes_bj)


def _compact_rows(cache: KVCache, nodes_bj: jax.Array) -> KVCache:
    rows_b1 = jnp.arange(cache.batch_size)[:, None]
    src_bj = cache.lengths_b[:, None] + nodes_bj
    dst_bj = cache.lengths_b[:, None] + jnp.arange(nodes_bj.shape[1])[None, :]

    def move(buf_lbshd):
        return buf_lbshd.at[:, rows_b1, dst_bj].set(buf_lbshd[:, rows_b1, src_bj])

    return cache.replace(k_lbshd=move(cache.k_lbshd), v_lbshd=move(cache.v_lbshd))


@dataclasses.dataclass(frozen=True)
class StepOutput:
    cache: KVCache  # tree K/V written, the accepted path's moved to slots [length, length + D]; same lengths
    tokens_bt: jax.Array  # the verified tree tokens
    accept_b: jax.Array  # accepted candidates (0..D)
    nodes_bj: jax.Array  # the chosen path's nodes, root first (the first accept_b + 1 are accepted)
    bonus_b: jax.Array  # the base model's token after the accepted path
    hidden_bd: jax.Array  # hidden state of the last accepted node (its logits gave bonus_b)


def medusa_step(inputs: ProposeInputs, cache: KVCache, key: jax.Array, *, acceptance: AcceptanceConfig,
                proposer: Proposer = heads_proposer) -> StepOutput:
    """One tree step, items 1-4 of the module docstring but the length update: propose, verify, accept,
    compact. The decode loop runs exactly this each iteration, and build_tree's step timing does too."""
    model, tree = inputs.model, inputs.tree
    base = model.base
    lengths_b = cache.lengths_b
    tokens_bt = proposal_tokens(inputs.root_b, proposer(inputs), tree)
    mask_bts = attention_mask(lengths_b, jnp.asarray(tree.ancestor_mask_tt), cache.cache_size)
    positions_bt = lengths_b[:, None] + jnp.asarray(tree.depth_t)[None, :]
    hidden_btd, cache = base(tokens_bt, positions_bt, mask_bts, cache)
    accept_b, nodes_bj, bonus_b = accept_tree(tree, tokens_bt, base.logits(hidden_btd), key, acceptance)
    cache = compact_accepted(cache, nodes_bj)
    last_node_b = jnp.take_along_axis(nodes_bj, accept_b[:, None], axis=1)[:, 0]
    hidden_bd = jnp.take_along_axis(hidden_btd, last_node_b[:, None, None], axis=1)[:, 0]
    return StepOutput(cache, tokens_bt, accept_b, nodes_bj, bonus_b, hidden_bd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LoopState:
    cache: KVCache
    root_b: jax.Array  # the newest emitted token of each row, not yet in the cache
    hidden_bd: jax.Array  # the hidden state whose logits gave root_b
    out_bn: jax.Array  # emitted tokens, pad after a row's end
    num_out_b: jax.Array
    done_b: jax.Array
    steps_b: jax.Array  # verify steps each row took part in
    accept_bn: jax.Array  # accept length of each of a row's verify steps
    step: jax.Array
    key: jax.Array


@partial(jax.jit, static_argnames=("graphdef", "tree", "max_new_tokens", "acceptance", "eos_ids", "pad_id",
                                   "proposer"), donate_argnames=("cache",))
def medusa_decode(graphdef, params, cache: KVCache, prompt_bp, prompt_lens_b, key, proposer_data=None, *,
                  tree: TreeBuffers, max_new_tokens: int, acceptance: AcceptanceConfig,
                  eos_ids: tuple[int, ...], pad_id: int, proposer: Proposer = heads_proposer):
    """Prefill + Medusa decoding in one call. Returns (tokens [B, N], number of new tokens [B], verify steps
    [B], accept lengths [B, N] (the first steps[b] are valid), cache)."""
    model: MedusaModel = nnx.merge(graphdef, params)
    base = model.base
    b, n, depth = prompt_bp.shape[0], max_new_tokens, tree.depth
    last_bd, cache = prefill(base, prompt_bp, prompt_lens_b, cache)
    key, sub = jax.random.split(key)
    first_b = sample_next(base.logits(last_bd), sub, acceptance)
    out_bn = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(first_b)
    zeros_b = jnp.zeros((b,), jnp.int32)
    state = _LoopState(cache, first_b, last_bd, out_bn, jnp.ones((b,), jnp.int32), is_eos(first_b, eos_ids),
                       zeros_b, jnp.zeros((b, n), jnp.int32), jnp.zeros((), jnp.int32), key)
    rows_b1 = jnp.arange(b)[:, None]
    j_1j = jnp.arange(depth + 1)[None, :]

    def cond(s: _LoopState):
        return jnp.any(~s.done_b & (s.num_out_b < n))

    def body(s: _LoopState):
        active_b = ~s.done_b & (s.num_out_b < n)
        lengths_b = s.cache.lengths_b
        key, sub = jax.random.split(s.key)
        step = medusa_step(ProposeInputs(model, s.hidden_bd, s.root_b, s.num_out_b, s.step, tree, proposer_data),
                           s.cache, sub, acceptance=acceptance, proposer=proposer)
        tokens_bt, accept_b, nodes_bj, bonus_b = step.tokens_bt, step.accept_b, step.nodes_bj, step.bonus_b

        # emitted this step: the accepted candidates (depth 1..a of the path), then the bonus token
        path_tokens_bj = jnp.take_along_axis(tokens_bt, nodes_bj, axis=1)
        shifted_bj = jnp.concatenate([path_tokens_bj[:, 1:], path_tokens_bj[:, :1]], axis=1)
        emitted_bj = jnp.where(j_1j < accept_b[:, None], shifted_bj, bonus_b[:, None])
        eos_bj = is_eos(emitted_bj, eos_ids) & (j_1j <= accept_b[:, None])
        until_eos_b = jnp.where(jnp.any(eos_bj, axis=1), jnp.argmax(eos_bj, axis=1) + 1, depth + 1)
        count_b = jnp.minimum(jnp.minimum(accept_b + 1, until_eos_b), n - s.num_out_b)
        count_b = jnp.where(active_b, count_b, 0)
        keep_bj = j_1j < count_b[:, None]
        out_bn = s.out_bn.at[rows_b1, jnp.where(keep_bj, s.num_out_b[:, None] + j_1j, n)].set(
            emitted_bj, mode="drop")
        accept_bn = s.accept_bn.at[jnp.arange(b), jnp.where(active_b, s.steps_b, n)].set(accept_b, mode="drop")

        cache = step.cache.replace(lengths_b=lengths_b + count_b)
        return _LoopState(cache, jnp.where(active_b, bonus_b, s.root_b),
                          jnp.where(active_b[:, None], step.hidden_bd, s.hidden_bd), out_bn, s.num_out_b + count_b,
                          s.done_b | jnp.any(eos_bj & keep_bj, axis=1), s.steps_b + active_b.astype(jnp.int32),
                          accept_bn, s.step + 1, key)

    state = jax.lax.while_loop(cond, body, state)
    return state.out_bn, state.num_out_b, state.steps_b, state.accept_bn, state.cache


@dataclasses.dataclass(frozen=True)
class ChosenTree:
    tree: TreeBuffers | None  # None: decode plainly
    note: str  # where the tree came from, for logs and JSON rows


def choose_tree(heads_config: HeadsConfig, trees: HeadsTrees | None, batch_size: int,
                tree: "str | os.PathLike | TreeBuffers | None" = None) -> ChosenTree:
    """The tree to decode with: an explicit `tree` (preset name, JSON file or TreeBuffers) always wins; None
    takes the heads' own `trees` (their folder's trees.json) for this backend and batch size, which may say
    to decode plainly (see `medusa_jax.heads_trees.resolve_tree`)."""
    limits = dict(num_heads=heads_config.num_heads, max_top_k=heads_config.head_vocab_size)
    if tree is not None:
        buffers = load_tree(tree, **limits)
        return ChosenTree(buffers, f"tree {buffers.name} of {len(buffers.paths)} nodes (given)")
    resolution = resolve_tree(trees, jax.default_backend(), batch_size)
    if resolution.plain:
        return ChosenTree(None, resolution.note)
    if resolution.preset is not None:
        return ChosenTree(load_tree(resolution.preset, **limits), resolution.note)
    name = f"heads_{resolution.backend}_batch{resolution.batch}"
    return ChosenTree(build_tree(resolution.paths, name=name, **limits), resolution.note)


def generate_medusa(base: CausalLM, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *,
                    tree: "str | TreeBuffers | None" = None, max_new_tokens: int = 128,
                    acceptance: AcceptanceConfig = AcceptanceConfig(), seed: int = 0,
                    eos_ids: Sequence[int] | None = None, pad_id: int = 0, batch_size: int | None = None,
                    cache_size: int | None = None, proposer: Proposer | None = None, proposer_data: Any = None,
                    timings: dict | None = None) -> list[GenerationResult]:
    """Medusa decoding of one batch of token-id prompts (ragged lengths are fine). `tree` is a preset name,
    a JSON file or TreeBuffers; None: the heads' own tree for this backend and batch size (`choose_tree`),
    and plain decoding (`engine.generate`, same sampling) where their trees.json says no tree pays.
    `proposer` replaces the heads' top-k proposal (it receives `proposer_data`). Each result's `steps` counts
    the prefill and the verify steps; `accept_lengths` lists each step's. `timings` gets "seconds" and
    "tree" (the tree's origin, or why decoding was plain)."""
    chosen = choose_tree(heads.config, trees_of(heads), batch_size or len(prompts), tree)
    if timings is not None:
        timings["tree"] = chosen.note
    if chosen.tree is None:
        sampling = (SamplingConfig() if acceptance.kind == "greedy" else
                    SamplingConfig(acceptance.temperature, acceptance.top_p, acceptance.top_k))
        return generate(base, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                        eos_ids=eos_ids, pad_id=pad_id, batch_size=batch_size, cache_size=cache_size,
                        timings=timings)
    tree = chosen.tree
    batch = pad_prompts(prompts, pad_id, batch_size)
    check_positions(base.config.max_position_embeddings, batch.lengths_b.tolist(), max_new_tokens)
    size = check_fits(batch, max_new_tokens, tree.num_tokens, cache_size)
    graphdef, params = nnx.split(MedusaModel(base, heads))
    cache = KVCache.zeros(base.config, batch.tokens_bp.shape[0], size)
    start = time.perf_counter()
    out_bn, num_b, steps_b, accept_bn, _ = medusa_decode(
        graphdef, params, cache, jnp.asarray(batch.tokens_bp), jnp.asarray(batch.lengths_b),
        jax.random.key(seed), proposer_data, tree=tree, max_new_tokens=max_new_tokens, acceptance=acceptance,
        eos_ids=resolve_eos(base, eos_ids), pad_id=pad_id, proposer=proposer or heads_proposer)
    out_bn, num_b, steps_b, accept_bn = map(np.asarray, (out_bn, num_b, steps_b, accept_bn))
    if timings is not None:
        timings["seconds"] = time.perf_counter() - start
    return [GenerationResult(out_bn[i, : num_b[i]].tolist(), steps=1 + int(steps_b[i]),
                             accept_lengths=accept_bn[i, : steps_b[i]].tolist())
            for i in range(batch.num_real)]
