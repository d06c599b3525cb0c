"""Medusa decoding: prefill + a `jax.lax.while_loop` whose body is `medusa_step`, one jitted call per batch.

Shapes (axis letters as in the package legend): b rows, t tree tokens (node 0 = the root), o =
max_new_tokens, s cache slots (s >= prompt width + o + t), m heads used = tree depth, r top-k ranks,
e = m + 1 nodes along a path (depth 0 = the root). Each step, per row: propose, ONE verify forward of the t
tokens under the tree mask, accept a path and the bonus token, move the accepted K/V into place (deferred to the
next step's start). `medusa_step` is THE tree step: the loop body here and under a mesh (sharded.py), and what
step-cost timing jits. The step in full, dynamic trees and finished rows: docs/modules.md."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.kv_cache import KVCache, attention_mask, move_slots
from medusa_jax.model.sharding import map_cache_rows
from medusa_jax.heads.draft_merge import DraftSizes, keep_best, plain_row_tree
from medusa_jax.trees.dynamic_tree import TreeProposal, row_tree
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.inference.acceptance import DecodeConfig
from medusa_jax.inference.autoregressive import grouped_prefill_states, run_if
from medusa_jax.inference.row_acceptance import RowAcceptance, accept_step, first_token
from medusa_jax.inference.sampling import is_eos
from medusa_jax.inference.size_choice import (SizeChoiceState, accepted_per_size, choose, lookup_pays,
                                             predicted_accepts)

# the narrower widths of a cache move (`move_widths`; entry 0 is the root, which never moves): 3 holds an accepted
# path of up to 2 candidates, 6 of up to 5
MOVE_WIDTHS = (3, 6)


@dataclasses.dataclass(frozen=True)
class ProposeInputs:
    """What a proposer sees at each step (inside the jitted loop)."""

    model: MedusaModel
    hidden_bd: jax.Array  # base hidden state of the last accepted node: its logits gave root_b
    root_b: jax.Array  # the newest emitted token (tree node 0)
    num_out_b: jax.Array  # tokens emitted so far, the root included
    step: jax.Array  # verify steps done so far (scalar; the generation engine's: of this chunk)
    tree: TreeBuffers | DynamicTree
    data: Any  # the proposer_data pytree given to generate_medusa / generate_batch
    draft: Any = None  # the drafter state carried from step to step (heads.init_draft; None: none kept)
    active_b: jax.Array | None = None  # rows still decoding
    given: Any = None  # a mix's member proposals drafted earlier in the step (MixedDrafter.lookup_proposals)


# A proposer returns (proposal, draft): the proposal is either [b, m, r] int32 candidate ids (m = tree.depth
# heads, r = tree.top_k ranks: entry [b, m, r] fills tree node (head m, rank r) of row b), or [b, t] int32 tree
# tokens (node 0 is root_b) when a node's children depend on its own path (Hydra heads, the EAGLE drafter),
# or, for a DynamicTree, a TreeProposal (each row's tree: tokens, parents, depths; dynamic_tree.grow_tree);
# draft is the drafter state for the rest of the step (inputs.draft when it keeps none). Verification,
# acceptance and compaction are the same for every proposer.
Proposer = Callable[[ProposeInputs], tuple["jax.Array | TreeProposal", Any]]


def heads_proposer(inputs: ProposeInputs) -> tuple[jax.Array, Any]:
    """The heads' proposal (HeadsBase.propose): Medusa heads' top-k tokens from the last accepted hidden state
    ([b, m, r]), Hydra heads' or the EAGLE drafter's tree drafted depth by depth along each node's path
    ([b, t])."""
    model = inputs.model
    if inputs.given is not None:
        return model.heads.propose(inputs.hidden_bd, inputs.root_b, model.base, inputs.tree, inputs.draft,
                                   inputs.active_b, given=inputs.given)
    return model.heads.propose(inputs.hidden_bd, inputs.root_b, model.base, inputs.tree, inputs.draft,
                               inputs.active_b)


def tree_tokens(root_b: jax.Array, candidates_bmr: jax.Array, tree: TreeBuffers) -> jax.Array:
    """[b] roots + [b, m, r] candidates -> [b, t] tree tokens (flat list [root, head0 top-k, head1 top-k, ...])."""
    flat_candidates = jnp.concatenate(  # [b, 1 + m * r]
        [root_b[:, None], candidates_bmr.reshape(root_b.shape[0], -1)], axis=1)
    return flat_candidates[:, jnp.asarray(tree.candidate_index_t)].astype(jnp.int32)


def proposal_tokens(root_b: jax.Array, proposal: jax.Array, tree: TreeBuffers) -> jax.Array:
    """A proposer's output ([b, m, r] candidates or [b, t] tokens) -> [b, t] tree tokens, node 0 = root_b."""
    if isinstance(proposal, TreeProposal):
        raise ValueError(f"a proposer returned a dynamic tree (TreeProposal) for the static tree {tree.name}")
    if proposal.ndim == 2:
        if proposal.shape[1] != tree.num_tokens:
            raise ValueError(f"a proposer returned {proposal.shape[1]} tree tokens; the tree has {tree.num_tokens}")
        return proposal.astype(jnp.int32).at[:, 0].set(root_b)
    return tree_tokens(root_b, proposal, tree)


def verify_inputs(proposal, root_b: jax.Array, lengths_b: jax.Array, cache_size: int,
                  tree: TreeBuffers | DynamicTree):
    """(tree tokens [b, t] with node 0 = root_b, attention mask [b, t, s], positions [b, t], the tree acceptance
    reads: the static TreeBuffers, or a dynamic tree's per-row RowTree)."""
    if not isinstance(tree, DynamicTree):
        tokens_bt = proposal_tokens(root_b, proposal, tree)
        mask_bts = attention_mask(lengths_b, jnp.asarray(tree.ancestor_mask_tt), cache_size)
        return tokens_bt, mask_bts, lengths_b[:, None] + jnp.asarray(tree.depth_t)[None, :], tree
    if not isinstance(proposal, TreeProposal) or proposal.tokens_bt.shape[1] != tree.num_tokens:
        raise ValueError(f"the dynamic tree {tree.name} needs a TreeProposal of {tree.num_tokens} nodes per row "
                         f"(dynamic_tree.grow_tree), got {type(proposal).__name__}")
    rows = row_tree(proposal, tree)
    tokens_bt = proposal.tokens_bt.astype(jnp.int32).at[:, 0].set(root_b.astype(jnp.int32))
    mask_bts = attention_mask(lengths_b, rows.ancestor_mask_btt, cache_size)
    return tokens_bt, mask_bts, lengths_b[:, None] + rows.depth_bt, rows


def accepted_moves(lengths_b: jax.Array, nodes_be: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Source and destination slots ([b, e] each) that compact the tree nodes nodes_be of a tree block written
    at slots lengths_b + node: node nodes_be[b, i] goes to slot lengths_b[b] + i."""
    return lengths_b[:, None] + nodes_be, lengths_b[:, None] + jnp.arange(nodes_be.shape[1])[None, :]


def move_widths(e: int) -> tuple[int, ...]:
    """The static widths a move of e entries per row is made at (`move_cache_slots`): MOVE_WIDTHS below e, then e."""
    return tuple(w for w in MOVE_WIDTHS if w < e) + (e,)


def move_cache_slots(cache: KVCache, src_be: jax.Array, dst_be: jax.Array) -> KVCache:
    """`kv_cache.move_slots` in every layer over the first w of the e entries per row, w the narrowest of
    `move_widths(e)` past the last entry that any row moves (src != dst), and no move when every entry is a no-op
    (the move after a step that accepted no candidate, e.g. a plain step of a mix). A move costs its width in
    every layer, and the entries past the accepted path are no-ops, so a step that accepted a short path moves a
    few slots, not the deepest path's (bench/mixed_drafts/move_width). One `run_if` per width, so the cache is
    still updated in place. Under a mesh each device moves its own rows and decides for them
    (`sharding.map_cache_rows`), with no collectives."""
    def move(cache_: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
        e = src.shape[1]
        last = jnp.max(jnp.where(jnp.any(src != dst, axis=0), jnp.arange(1, e + 1), 0))  # entries [0, last) move
        narrower = 0
        for w in move_widths(e):
            cache_ = run_if((last > narrower) & (last <= w),
                            lambda c, w=w: move_slots(c, src[:, :w], dst[:, :w]), cache_)
            narrower = w
        return cache_
    return map_cache_rows(move, cache, src_be, dst_be)


def compact_accepted(cache: KVCache, nodes_be: jax.Array) -> KVCache:
    """Moves the K/V of tree nodes nodes_be (slots lengths + node) to slots lengths + i, i = 0..e-1, in every
    layer; lengths are unchanged."""
    return move_cache_slots(cache, *accepted_moves(cache.lengths_b, nodes_be))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MedusaState:
    """b decode rows over one KV cache, between two tree steps."""

    cache: KVCache  # lengths_b: tokens of each row in the cache
    root_b: jax.Array  # the newest emitted token of each row, not yet in the cache (the next tree's node 0)
    hidden_bd: jax.Array  # the hidden state whose logits gave root_b
    out_bo: jax.Array  # emitted tokens, pad after a row's end
    num_out_b: jax.Array  # tokens of each row in out_bo
    done_b: jax.Array  # finished: an EOS emitted
    steps_b: jax.Array  # verify steps each row took part in
    accept_bo: jax.Array  # accept length of each of a row's verify steps (the first steps_b are valid)
    step: jax.Array  # verify steps run (scalar)
    key: jax.Array
    # the previous step's accepted path, still in its tree block: slot move_src_be[b, i] -> move_dst_be[b, i],
    # made at the start of the next step (`finish_moves` after the loop); no-op moves (src == dst) at first
    move_src_be: jax.Array
    move_dst_be: jax.Array
    draft: Any = None  # the proposer's drafter state (heads.init_draft), None for heads that keep none
    # mixed drafts: whether the next step drafts and how its size is chosen (size_choice.SizeChoiceState); None:
    # every step drafts and sizes from the drafters' own predictions
    choice: Any = None

    def finish_moves(self) -> KVCache:
        """The cache with the pending move made: every committed slot holds its token's K/V."""
        return move_cache_slots(self.cache, self.move_src_be, self.move_dst_be)

    @property
    def active_b(self) -> jax.Array:
        return ~self.done_b & (self.num_out_b < self.out_bo.shape[1])


def medusa_step(model: MedusaModel, state: MedusaState, proposer_data: Any = None, *,
                tree: TreeBuffers | DynamicTree,
                acceptance: DecodeConfig | RowAcceptance, eos_ids: tuple[int, ...],
                proposer: Proposer = heads_proposer) -> MedusaState:
    """One tree step, items 1-4 of the module docstring: make the previous step's pending move (item 4), propose,
    verify, accept and record this step's move, then emit the accepted tokens and the bonus token (cut at an
    EOS and at the output buffer's end) and advance each active row's cache length by their number; an
    inactive row changes nothing but scratch slots."""
    if isinstance(tree, DraftSizes):  # priced at the slots this step attends over (its window, else its cache)
        tree = tree.at_span(state.cache.window or state.cache.cache_size)
    inputs = ProposeInputs(model, state.hidden_bd, state.root_b, state.num_out_b, state.step, tree, proposer_data,
                           state.draft, state.active_b)
    if isinstance(tree, DraftSizes):
        return mixed_step(model, state, proposer, inputs, tree, acceptance, eos_ids)
    proposal, draft = proposer(inputs)
    verified = verify_inputs(proposal, state.root_b, state.cache.lengths_b, state.cache.cache_size, tree)
    return verify_and_emit(model, state, verified, draft, acceptance, eos_ids)


def sized_verify(model: MedusaModel, state: MedusaState, proposal: TreeProposal, draft: Any, sizes: DraftSizes,
                 acceptance: DecodeConfig | RowAcceptance, eos_ids: tuple[int, ...],
                 lookup: Sequence[TreeProposal] = ()) -> MedusaState:
    """A drafted mixed-draft step (`draft_merge.DraftSizes`): the proposal's best n nodes are verified, n the size of
    `sizes` the size-choice state picks (`size_choice.SizeChoiceState.choose`: the step's predictions scaled by each
    size's ratio of accepted to predicted tokens in this run, prompt lookup's chains `lookup` as a floor), or with no
    such state the drafters' predictions alone (`size_choice.choose`); one branch per static size (size 0: the root
    alone, a plain step), each run by `run_if`. The size-choice state learns what each size up to the verified one
    would have accepted (`size_choice.accepted_per_size`). Predictions and outcomes are those of the rows the choice
    counts (`counted_rows`)."""
    lengths_b = state.cache.lengths_b
    counted_b = state.active_b if state.choice is None else counted_rows(state)
    rows = jnp.sum(counted_b).astype(jnp.float32)
    accepts_k = predicted_accepts(proposal, sizes, counted_b)
    if state.choice is None:
        choice = choose(accepts_k, sizes, rows)
    else:
        lookup_k = sum((predicted_accepts(p, sizes, counted_b) for p in lookup), jnp.zeros_like(accepts_k))
        choice = state.choice.choose(accepts_k, lookup_k, sizes, rows)

    def branch(index: int, nodes: int):
        def run(state_: MedusaState) -> MedusaState:
            kept = keep_best(proposal, nodes) if nodes else None
            if nodes == 0:
                verified = plain_inputs(state_, sizes.depth)
            else:
                verified = verify_inputs(kept, state_.root_b, lengths_b, state_.cache.cache_size, sizes.tree(nodes))
            after = verify_and_emit(model, state_, verified, state_.draft, acceptance, eos_ids)
            if state_.choice is None:
                return after
            if nodes == 0:
                accepted_k = jnp.zeros((len(sizes.sizes),), jnp.float32)
            else:  # the accepted path, read back from the tokens emitted (cut at an EOS) and the pending move
                accept_b = jnp.maximum(after.num_out_b - state_.num_out_b - 1, 0)
                accepted_k = accepted_per_size(kept.score_bt[:, 1:], after.move_src_be - lengths_b[:, None],
                                               accept_b, counted_b, sizes, nodes)
            return dataclasses.replace(after, choice=state_.choice.drafted(sizes, jnp.int32(index), accepted_k, rows,
                                                                           accepts_k))
        return run

    state = dataclasses.replace(state, draft=draft)
    for index, nodes in enumerate(sizes.sizes):
        state = run_if(choice == index, branch(index, nodes), state)
    return state


def mixed_step(model: MedusaModel, state: MedusaState, proposer: Proposer, inputs: ProposeInputs, sizes: DraftSizes,
               acceptance: DecodeConfig | RowAcceptance, eos_ids: tuple[int, ...]) -> MedusaState:
    """A mixed-draft step: drafted (`sized_verify`) or, while the size choice backs off after drafted steps that
    did not pay (`size_choice.SizeChoiceState`) and prompt lookup's chains alone do not promise a paying step
    (`size_choice.lookup_pays`), a plain step that skips the drafting (the drafters' states still see its token).
    With no size-choice state in `state` (one built by hand), every step drafts. Prompt lookup's proposals are
    drafted once, before the decision, and handed to the drafted branch (`MixedDrafter.lookup_proposals`)."""
    given = model.heads.lookup_proposals(state.draft, state.root_b) if hasattr(model.heads, "lookup_proposals") \
        else None

    # The drafting reads the step's inputs by closure, so XLA hoists it (and each size's verify inputs) out of its
    # one-trip loop (`run_if`): it runs on every step, a skipped one too, beside that step's forward. Read from the
    # carry it ran only where needed, with 5-10% less work at 4 rows, but 1.6-4 points slower at 4 rows and level at
    # one row on a 2-core CPU (bench/mixed_drafts/branch_inputs: the hoisted drafting overlaps the forward there)
    def drafted(state_: MedusaState) -> MedusaState:
        proposal, draft = proposer(dataclasses.replace(inputs, draft=state_.draft, given=given))
        return sized_verify(model, state_, proposal, draft, sizes, acceptance, eos_ids,
                            list((given or {}).values()))

    if state.choice is None:
        return drafted(state)
    drafts = state.choice.drafts | lookup_pays(list((given or {}).values()), sizes, counted_rows(state))
    state = run_if(~drafts, partial(skipped_step, model, sizes=sizes, acceptance=acceptance, eos_ids=eos_ids), state)
    return run_if(drafts, drafted, state)


def counted_rows(state: MedusaState) -> jax.Array:
    """[b] bool: the rows whose tokens the size choice counts (`size_choice.SizeChoiceState.counted_rows`; a row's
    budget left: its output buffer's free end)."""
    return state.choice.counted_rows(state.active_b, state.out_bo.shape[1] - state.num_out_b)


def skipped_step(model: MedusaModel, state: MedusaState, *, sizes: DraftSizes,
                 acceptance: DecodeConfig | RowAcceptance, eos_ids: tuple[int, ...]) -> MedusaState:
    """A mixed-draft step that skips the drafting: a plain step of the same loop (the drafters' states still see its
    token), the size choice told so."""
    state = verify_and_emit(model, state, plain_inputs(state, sizes.depth), state.draft, acceptance, eos_ids)
    return dataclasses.replace(state, choice=state.choice.skipped())


def plain_inputs(state: MedusaState, depth: int):
    """`verify_inputs`' tuple for the root alone: a plain step (accept length 0, the bonus token from the root's
    logits)."""
    lengths_b, b = state.cache.lengths_b, state.root_b.shape[0]
    tokens_bt = state.root_b.astype(jnp.int32)[:, None]
    mask_bts = attention_mask(lengths_b, jnp.ones((1, 1), bool), state.cache.cache_size)
    return tokens_bt, mask_bts, lengths_b[:, None], plain_row_tree(b, depth)


def verify_and_emit(model: MedusaModel, state: MedusaState, verified, draft: Any,
                    acceptance: DecodeConfig | RowAcceptance, eos_ids: tuple[int, ...]) -> MedusaState:
    """Items 2-4 of the module docstring for one proposed tree (`verify_inputs`' tuple): verify, accept, record
    the move, emit."""
    tokens_bt, mask_bts, positions_bt, verified = verified
    base, (b, o), e = model.base, state.out_bo.shape, verified.depth + 1
    active_b = state.active_b
    lengths_b = state.cache.lengths_b
    key, sub = jax.random.split(state.key)
    # the drafter's features of the tree nodes: the final hidden states, or (EAGLE-3) the residual stream
    # entering its feature_layers, from this same forward
    hidden_btd, cache, taps_btf = base.forward_taps(tokens_bt, positions_bt, mask_bts, state.finish_moves(),
                                                    model.heads.feature_layers)
    logits_btv = base.logits(hidden_btd)
    accept_b, nodes_be, bonus_b = accept_step(verified, tokens_bt, logits_btv, sub, lengths_b, acceptance)
    draft = model.heads.accepted(draft, hidden_btd if taps_btf is None else taps_btf, tokens_bt, nodes_be, accept_b,
                                 active_b)
    draft = model.heads.verified(draft, tokens_bt, logits_btv, active_b)
    rows_b1, e_1e = jnp.arange(b)[:, None], jnp.arange(e)[None, :]
    # made by the next step (docstring, item 4); the path's root and accepted nodes only: the slots past them are
    # scratch (past the committed length), so a step that accepted nothing leaves a no-op that is skipped
    move_src_be, move_dst_be = accepted_moves(lengths_b, nodes_be)
    move_src_be = jnp.where(e_1e <= accept_b[:, None], move_src_be, move_dst_be)
    last_node_b = jnp.take_along_axis(nodes_be, accept_b[:, None], axis=1)[:, 0]
    hidden_bd = jnp.take_along_axis(hidden_btd, last_node_b[:, None, None], axis=1)[:, 0]

    # emitted this step: the accepted candidates (depth 1..a of the path), then the bonus token
    path_tokens_be = jnp.take_along_axis(tokens_bt, nodes_be, axis=1)
    shifted_be = jnp.concatenate([path_tokens_be[:, 1:], path_tokens_be[:, :1]], axis=1)
    emitted_be = jnp.where(e_1e < accept_b[:, None], shifted_be, bonus_b[:, None])
    eos_be = is_eos(emitted_be, eos_ids) & (e_1e <= accept_b[:, None])
    until_eos_b = jnp.where(jnp.any(eos_be, axis=1), jnp.argmax(eos_be, axis=1) + 1, e)
    count_b = jnp.minimum(jnp.minimum(accept_b + 1, until_eos_b), o - state.num_out_b)
    count_b = jnp.where(active_b, count_b, 0)
    keep_be = e_1e < count_b[:, None]
    out_bo = state.out_bo.at[rows_b1, jnp.where(keep_be, state.num_out_b[:, None] + e_1e, o)].set(
        emitted_be, mode="drop")
    accept_bo = state.accept_bo.at[jnp.arange(b), jnp.where(active_b, state.steps_b, o)].set(accept_b, mode="drop")
    return MedusaState(cache.replace(lengths_b=lengths_b + count_b), jnp.where(active_b, bonus_b, state.root_b),
                       jnp.where(active_b[:, None], hidden_bd, state.hidden_bd), out_bo, state.num_out_b + count_b,
                       state.done_b | jnp.any(eos_be & keep_be, axis=1), state.steps_b + active_b.astype(jnp.int32),
                       accept_bo, state.step + 1, key, move_src_be, move_dst_be, draft,
                       state.choice)


DECODE_STATICS = ("graphdef", "tree", "max_new_tokens", "acceptance", "eos_ids", "pad_id", "proposer",
                  "prefill_groups")


@partial(jax.jit, static_argnames=DECODE_STATICS, donate_argnames=("cache",))
def medusa_decode(graphdef, params, cache: KVCache, prompt_bt, prompt_lens_b, key, proposer_data=None, *,
                  tree: TreeBuffers | DynamicTree, max_new_tokens: int, acceptance: DecodeConfig,
                  eos_ids: tuple[int, ...], pad_id: int, proposer: Proposer = heads_proposer,
                  prefill_groups: int = 1):
    """Prefill (`autoregressive.grouped_prefill_states`; the heads' drafter state from it) + Medusa decoding in
    one call: a `jax.lax.while_loop` whose body is `medusa_step`. Returns (tokens [b, o], number of new tokens
    [b], verify steps [b], accept lengths [b, o] (the first steps[b] are valid), cache)."""
    state = decode_states(graphdef, params, cache, prompt_bt, prompt_lens_b, key, proposer_data, tree=tree,
                          max_new_tokens=max_new_tokens, acceptance=acceptance, eos_ids=eos_ids, pad_id=pad_id,
                          proposer=proposer, prefill_groups=prefill_groups)
    return state.out_bo, state.num_out_b, state.steps_b, state.accept_bo, state.finish_moves()


@partial(jax.jit, static_argnames=DECODE_STATICS, donate_argnames=("cache",))
def medusa_decode_keeping_draft(graphdef, params, cache: KVCache, prompt_bt, prompt_lens_b, key,
                                proposer_data=None, *, tree: TreeBuffers | DynamicTree, max_new_tokens: int,
                                acceptance: DecodeConfig, eos_ids: tuple[int, ...], pad_id: int,
                                proposer: Proposer = heads_proposer, prefill_groups: int = 1):
    """`medusa_decode` for heads that keep their drafter state across calls (`keeps_draft`, e.g. Token
    Recycling's table): (tokens, new tokens, verify steps, accept lengths, final drafter state, cache)."""
    state = decode_states(graphdef, params, cache, prompt_bt, prompt_lens_b, key, proposer_data, tree=tree,
                          max_new_tokens=max_new_tokens, acceptance=acceptance, eos_ids=eos_ids, pad_id=pad_id,
                          proposer=proposer, prefill_groups=prefill_groups)
    return state.out_bo, state.num_out_b, state.steps_b, state.accept_bo, state.draft, state.finish_moves()


def decode_states(graphdef, params, cache: KVCache, prompt_bt, prompt_lens_b, key, proposer_data=None, *,
                  tree: TreeBuffers | DynamicTree, max_new_tokens: int, acceptance: DecodeConfig | RowAcceptance,
                  eos_ids: tuple[int, ...], pad_id: int, proposer: Proposer = heads_proposer,
                  prefill_groups: int = 1) -> MedusaState:
    """The body of the decode calls (traced inside them): prefill, then the while_loop; the final MedusaState."""
    model: MedusaModel = nnx.merge(graphdef, params)
    base = model.base
    b, o = prompt_bt.shape[0], max_new_tokens
    heads = model.heads
    last_bd, cache, hidden_btd = grouped_prefill_states(base, prompt_bt, prompt_lens_b, cache, prefill_groups,
                                                        all_hidden=heads.needs_prompt_hidden,
                                                        taps=heads.feature_layers)
    draft = heads.init_draft(base, prompt_bt, prompt_lens_b, hidden_btd, cache.cache_size, tree.depth)
    key, sub = jax.random.split(key)
    first_b = first_token(base.logits(last_bd), sub, acceptance)
    out_bo = jnp.full((b, o), pad_id, jnp.int32).at[:, 0].set(first_b)
    zeros_b = jnp.zeros((b,), jnp.int32)
    no_move_be = cache.lengths_b[:, None] + jnp.arange(tree.depth + 1)[None, :]
    state = MedusaState(cache, first_b, last_bd, out_bo, jnp.ones((b,), jnp.int32), is_eos(first_b, eos_ids),
                        zeros_b, jnp.zeros((b, o), jnp.int32), jnp.zeros((), jnp.int32), key, no_move_be, no_move_be,
                        draft, SizeChoiceState.start(tree) if isinstance(tree, DraftSizes) else None)
    step = partial(medusa_step, model, proposer_data=proposer_data, tree=tree, acceptance=acceptance,
                   eos_ids=eos_ids, proposer=proposer)
    return jax.lax.while_loop(lambda s: jnp.any(s.active_b), step, state)
