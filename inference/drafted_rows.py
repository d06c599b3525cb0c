"""The generation engine's device side with a drafter: every row decodes with heads and a tree (`medusa.medusa_step`)
with its own acceptance (`row_acceptance.RowAcceptance`), the rows one `medusa.MedusaState` kept from chunk to chunk.
A chunk's output buffer holds c * e tokens (c verify steps, e = tree depth + 1); a row with R tokens of its budget
left starts writing at c * e - R, so the step's own cut stops it at its budget. Drafter state per row or shared:
`row_drafts`; a mix keeps ONE `size_choice.SizeChoiceState` for all rows. docs/serving.md, "Drafting"."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import tree_step_jit
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.trees.dynamic_tree import scratch_slots
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.medusa import MedusaHeads, MedusaModel
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.inference.engine_mesh import Placement, fetch
from medusa_jax.inference.medusa import MedusaState, Proposer, heads_proposer, medusa_step
from medusa_jax.inference.row_decode import SlotReach, chunk_windows, release_rows, with_window
from medusa_jax.inference.row_acceptance import RowAcceptance, first_row_tokens
from medusa_jax.inference.row_drafts import (check_servable, empty_draft, prompt_prefill, put_draft_rows,
                                             shared_fields, shared_part, shared_start)
from medusa_jax.inference.row_sampling import RowSampling
from medusa_jax.inference.sampling import is_eos
from medusa_jax.inference.size_choice import SizeChoiceState


def empty_state(model: MedusaModel, rows: int, cache_size: int, tree, steps: int) -> MedusaState:
    """Idle rows, every field shaped as a chunk leaves it (so the calls compile once), each its own buffer (the
    calls donate them)."""
    b, e, d = rows, tree.depth + 1, model.base.config.hidden_size

    def no_move():
        return jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (b, e)) + 0

    return MedusaState(KVCache.zeros(model.base.config, b, cache_size), jnp.zeros((b,), jnp.int32),
                       jnp.zeros((b, d), model.base.config.jnp_dtype), jnp.zeros((b, steps * e), jnp.int32),
                       jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), jnp.zeros((b,), jnp.int32),
                       jnp.zeros((b, steps), jnp.int32), jnp.zeros((), jnp.int32), jax.random.key(0), no_move(),
                       no_move(), empty_draft(model, rows, cache_size, tree.depth),
                       SizeChoiceState.start(tree) if isinstance(tree, DraftSizes) else None)


@partial(jax.jit, static_argnames=("graphdef", "tree", "eos_ids"), donate_argnames=("state", "sampling"))
def drafted_admit(graphdef, params, state: MedusaState, sampling: RowSampling, rows_n, prompt_nt, prompt_lens_n,
                  sampling_n: RowSampling, *, tree, eos_ids: tuple[int, ...]):
    """Prefills the n prompts into rows rows_n (index >= b: dropped) with their sampling settings; returns
    (state, every row's sampling settings, first token [n])."""
    model: MedusaModel = nnx.merge(graphdef, params)
    n, t = prompt_nt.shape
    shared = shared_fields(model.heads)
    engine_shared = shared_part(state.draft, shared) if any(jax.tree.leaves(shared)) else None
    last_nd, fresh, draft_n = prompt_prefill(model, prompt_nt, prompt_lens_n, t, tree.depth, state.cache.dtype,
                                             engine_shared, rows_n < state.root_b.shape[0])
    first_n = first_row_tokens(model.base.logits(last_nd), sampling_n)
    no_move_ne = prompt_lens_n[:, None] + jnp.arange(tree.depth + 1, dtype=jnp.int32)[None, :]

    def put(old, new):
        return old.at[rows_n].set(new.astype(old.dtype), mode="drop")

    return dataclasses.replace(state, cache=state.cache.put_rows(rows_n, fresh), root_b=put(state.root_b, first_n),
                               hidden_bd=put(state.hidden_bd, last_nd),
                               done_b=put(state.done_b, is_eos(first_n, eos_ids)),
                               move_src_be=put(state.move_src_be, no_move_ne),
                               move_dst_be=put(state.move_dst_be, no_move_ne),
                               draft=put_draft_rows(state.draft, rows_n, draft_n, shared)), \
        sampling.put_rows(rows_n, sampling_n), first_n


def _drafted_chunk(graphdef, params, state: MedusaState, sampling: RowSampling, remaining_b, emitted_b,
                   together, proposer_data=None, *, tree, steps: int, eos_ids: tuple[int, ...], pad_id: int,
                   proposer: Proposer = heads_proposer):
    """Up to `steps` tree steps while any row is active, each row accepting with its own settings; emitted_b [b]:
    each row's tokens so far; together (bool scalar): the rows end together, so a mix's size choice counts the rows
    with the most tokens left (`size_choice.SizeChoiceState.counted_rows`). Returns (state, tokens [b, c*e],
    first [b], end [b]): row b's new tokens are tokens[b, first[b]:end[b]]; state.steps_b counts its verify steps."""
    model: MedusaModel = nnx.merge(graphdef, params)
    b, width = state.root_b.shape[0], steps * (tree.depth + 1)
    start_b = width - jnp.clip(remaining_b, 0, width)
    zeros_b = jnp.zeros((b,), jnp.int32)
    state = dataclasses.replace(state, out_bo=jnp.full((b, width), pad_id, jnp.int32), num_out_b=start_b,
                                steps_b=zeros_b, accept_bo=jnp.zeros((b, steps), jnp.int32),
                                step=jnp.zeros((), jnp.int32), done_b=state.done_b | (remaining_b <= 0))
    if state.choice is not None:
        state = dataclasses.replace(state, choice=dataclasses.replace(state.choice, together=jnp.asarray(together)))

    def counted(inputs):  # the proposer counts a row's tokens from its reply's first, as in a decode call
        return proposer(dataclasses.replace(inputs, num_out_b=inputs.num_out_b - start_b + emitted_b))

    step = partial(medusa_step, model, proposer_data=proposer_data, tree=tree,
                   acceptance=RowAcceptance(sampling), eos_ids=eos_ids, proposer=counted)
    state = jax.lax.while_loop(lambda s: (s.step < steps) & jnp.any(s.active_b), step, state)
    return state, state.out_bo, start_b, state.num_out_b


def drafted_chunk(rows: int) -> Callable:
    """The jitted chunk of tree steps over `rows` rows, compiled with `backbone.tree_step_compiler_options(rows)`."""
    return tree_step_jit(_drafted_chunk, rows, static_argnames=("graphdef", "tree", "steps", "eos_ids", "pad_id",
                                                                "proposer"), donate_argnames=("state",))


class DraftedDecoder:
    """`row_decode.PlainDecoder`'s interface over tree decoding with heads."""

    def __init__(self, base, heads: MedusaHeads, tree: TreeBuffers | DynamicTree | DraftSizes, rows: int,
                 context: int, steps: int, *, eos_ids: tuple[int, ...], pad_id: int,
                 placement: Placement | None = None, proposer: Proposer = heads_proposer, proposer_data=None,
                 windows: bool = True):
        check_servable(heads)
        model = MedusaModel(base, heads)
        self.placement = placement or Placement(None, rows)
        self.graphdef, params = nnx.split(model)
        self.params = self.placement.params(params)
        self.tree, self.eos_ids, self.pad_id = tree, eos_ids, pad_id
        self.proposer, self.proposer_data = proposer, self.placement.draft(proposer_data, True)
        self.emitted_b = np.zeros((rows,), np.int32)  # each row's tokens so far (what the proposer counts)
        self.shared = shared_fields(heads)
        self.base, self.cache_size = base, context + scratch_slots(tree)
        # a step commits at most depth + 1 slots (the root and the accepted path) and writes scratch slots past them
        self.reach = SlotReach(rows, self.cache_size, scratch_slots(tree), tree.depth + 1, windows)
        state = empty_state(model, rows, self.cache_size, tree, steps)
        self.state = dataclasses.replace(self.placement.state(dataclasses.replace(state, draft=None)),
                                         draft=self.placement.draft(state.draft, self.shared))
        self.sampling = self.placement.state(jax.tree.map(jnp.asarray, RowSampling.greedy(rows)))

    def restart(self, heads: MedusaHeads | None = None, proposer_data=None) -> None:
        """Idle rows as a new decoder over the same model and shapes would start them, for the engine's next client
        (`engine_batches.sorted_batches`): the size choice from its start, `proposer_data` the proposer's, and the
        shared drafter state from `heads` (their kept state, e.g. a recycling table restored since) where given,
        else kept as the last chunk left it. Per-row state needs nothing: admission replaces a row's."""
        state = self.state
        if state.choice is not None:
            state = dataclasses.replace(state, choice=self.placement.state(SizeChoiceState.start(self.tree)))
        if heads is not None and any(jax.tree.leaves(self.shared)):
            start = shared_start(heads, self.base, len(self.emitted_b), self.cache_size, self.tree.depth)
            start = self.placement.draft(jax.tree.map(lambda x: jnp.array(x, copy=True), start), self.shared)
            draft = jax.tree.map(lambda is_shared, own, new: new if is_shared else own, self.shared, state.draft, start)
            state = dataclasses.replace(state, draft=draft)
        self.state = state
        self.proposer_data = self.placement.draft(proposer_data, True)

    def shared_draft(self):
        """The drafter state shared by all rows, on the host (Token Recycling's table; None over the parts kept
        row by row)."""
        return fetch(shared_part(self.state.draft, self.shared))

    def admit(self, rows_n, prompt_nt, lens_n, budget_n, stop_nq, sampling_n: RowSampling) -> np.ndarray:
        with self.placement.active():
            self.state, self.sampling, first_n = drafted_admit(self.graphdef, self.params, self.state, self.sampling,
                                                               rows_n, prompt_nt, lens_n, sampling_n, tree=self.tree,
                                                               eos_ids=self.eos_ids)
        self.emitted_b[rows_n[rows_n < len(self.emitted_b)]] = 1
        self.reach.admitted(rows_n, lens_n)
        return fetch(first_n)

    def _chunk_args(self, remaining_b: np.ndarray, together: bool, window: int | None = None) -> tuple:
        state = dataclasses.replace(self.state, cache=with_window(self.state.cache, window))
        return (self.graphdef, self.params, state, self.sampling, np.asarray(remaining_b, np.int32),
                self.emitted_b, np.bool_(together), self.proposer_data)

    def chunk(self, steps: int, remaining_b: np.ndarray, together: bool = False
              ) -> tuple[list[list[int]], int, int]:
        """`PlainDecoder.chunk`; `together`: the busy rows end together (no request waits for a row), which a mix's
        size choice weighs (`_drafted_chunk`)."""
        window = self.reach.window(steps, remaining_b)
        with self.placement.active():
            state, out_bo, start_b, end_b = drafted_chunk(len(self.emitted_b))(
                *self._chunk_args(remaining_b, together, window), tree=self.tree, steps=steps, eos_ids=self.eos_ids,
                pad_id=self.pad_id, proposer=self.proposer)
        self.state = dataclasses.replace(state, cache=with_window(state.cache, None))  # the other calls: no window
        out_bo, start_b, end_b, run, steps_b = fetch((out_bo, start_b, end_b, self.state.step, self.state.steps_b))
        self.emitted_b += end_b - start_b
        self.reach.emitted(end_b - start_b)
        return ([out_bo[r, s:e].tolist() for r, (s, e) in enumerate(zip(start_b, end_b))], int(run),
                int(steps_b.sum()))

    def release(self, release_b: np.ndarray) -> None:
        with self.placement.active():
            self.state = release_rows(self.state, release_b)

    def compile(self, shapes: list[tuple[int, int]], steps: int,
                before: Callable[[str, int], None] = lambda kind, left: None) -> None:
        """`PlainDecoder.compile`."""
        with self.placement.active():
            windows = chunk_windows(self.reach)
            for i, window in enumerate(windows):
                before("chunk", len(windows) - i)
                drafted_chunk(len(self.emitted_b)).lower(
                    *self._chunk_args(np.zeros(self.state.root_b.shape, np.int32), False, window), tree=self.tree,
                    steps=steps, eos_ids=self.eos_ids, pad_id=self.pad_id, proposer=self.proposer).compile()
            for i, (n, width) in enumerate(shapes):
                zeros_n = np.zeros((n,), np.int32)
                before("admission", len(shapes) - i)
                drafted_admit.lower(self.graphdef, self.params, self.state, self.sampling, zeros_n,
                                    np.zeros((n, width), np.int32), zeros_n + 1, RowSampling.greedy(n),
                                    tree=self.tree, eos_ids=self.eos_ids).compile()
