"""Plain decoding with finished rows refilled (continuous batching): the slot engine of batch generation
(`api.generate_batch` at large batches), self-distillation and the batch benchmark.

Replies differ wildly in length (a greeting: 10 tokens; a greedy small model: often the whole budget). A
plain batch runs until its longest row ends, so most rows sit idle for most steps. Here b decode slots run in
jitted chunks of c steps (`run_chunk`); at each chunk boundary finished slots are given new prompts
(`admit_prompts` prefills them, in length groups, into their rows of the shared KV cache), so the batch stays
full. A chunk is the plain decode loop's own `autoregressive.plain_step` run while any slot is live;
admitting prompts uses its `prefill`. `refill_generate` drives the slots over a list of prompts.

For each emitted token the chunk also returns the hidden state that produced it (the last prompt token's for
a reply's first token, the previous reply token's after that): self-distillation keeps them, so Medusa-1
trains heads without a second pass over the backbone (head i's target for the hidden state of token j is
token j + 1 + i, position t + 2 + i, as in training/losses.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.inference.autoregressive import PlainState, prefill, run_plain_steps
from medusa_jax.inference.engine import PROMPT_BUCKET, check_prompts, round_up
from medusa_jax.inference.sampling import SamplingConfig, is_eos, sample_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """b decode rows over one KV cache. A row is idle when done_b (finished, or never filled)."""
    cache: KVCache
    last_token_b: jax.Array  # newest token of each row, not yet in the cache
    num_out_b: jax.Array  # tokens emitted for the row's current reply
    done_b: jax.Array

    @classmethod
    def empty(cls, config, batch_size: int, cache_size: int) -> "Slots":
        b = batch_size
        return cls(KVCache.zeros(config, b, cache_size), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32),
                   jnp.ones((b,), bool))


@partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_ids"), donate_argnames=("slots",))
def admit(graphdef, params, slots: Slots, rows_b, prompt_bt, prompt_lens_b, key, *, sampling: SamplingConfig,
          eos_ids: tuple[int, ...]):
    """Prefills the n prompts of prompt_bt (right-padded [n, P]; b runs over them here) into the slots' rows
    `rows_b` (index >= B: filler, dropped). Returns (slots, first token [n], hidden state that produced it
    [n, D])."""
    model: CausalLM = nnx.merge(graphdef, params)
    n, p = prompt_bt.shape
    fresh = KVCache.zeros(model.config, n, p, dtype=slots.cache.dtype)
    last_bd, fresh = prefill(model, prompt_bt, prompt_lens_b, fresh)
    first_b = sample_tokens(model.logits(last_bd), key, sampling)
    slots = Slots(slots.cache.put_rows(rows_b, fresh),
                  slots.last_token_b.at[rows_b].set(first_b, mode="drop"),
                  slots.num_out_b.at[rows_b].set(1, mode="drop"),
                  slots.done_b.at[rows_b].set(is_eos(first_b, eos_ids), mode="drop"))
    return slots, first_b, last_bd


ROW_BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # admission batch sizes; larger ones double
ADMIT_CALL_TOKENS = 512  # what one more admission call costs, in padded prompt positions (dispatch, scatter)


def _row_bucket(n: int, cap: int) -> int:
    """Admission batches come in a few sizes (ROW_BUCKETS, then doubling, at most the slots), not one compile
    per count; the steps are ~1.5x so filler rows stay under a third of a call."""
    size = next((s for s in ROW_BUCKETS if s >= n), None)
    if size is None:
        size = ROW_BUCKETS[-1]
        while size < n:
            size *= 2
    return min(size, cap)


def _admit_cost(n: int, longest: int, cap: int) -> int:
    """Padded prompt positions one admission call computes: its row bucket x its padded width."""
    return _row_bucket(n, cap) * round_up(longest, PROMPT_BUCKET) + ADMIT_CALL_TOKENS


def admission_groups(lengths: list[int], cap: int) -> list[list[int]]:
    """Splits prompts (by index) into admission calls so the padded positions computed stay close to the
    prompts' own: a prompt of 60 tokens admitted beside one of 380 costs a 384-wide row. Sorted by length,
    the prompts are cut into runs by dynamic programming over the padded cost (`_admit_cost`, which
    charges each call ADMIT_CALL_TOKENS, so similar prompts stay in one call). Returns the groups, each a list
    of indices into `lengths`, shortest prompts first."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [None] * n  # best[j]: cheapest cost of admitting order[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - cap), j):  # last group order[i:j]; its longest prompt is order[j - 1]
            cost = best[i] + _admit_cost(j - i, lengths[order[j - 1]], cap)
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]: j])
        j = cut[j]
    return groups[::-1]


def admit_prompts(graphdef, params, slots: Slots, rows: list[int], prompts: list[list[int]], key, *, pad_id: int,
                  sampling: SamplingConfig, eos_ids: tuple[int, ...], shapes: set | None = None):
    """Prefills `prompts` into slot rows `rows`, in length groups (`admission_groups`), each one `admit` call
    padded to a few static shapes: rows to a ROW_BUCKETS size with filler rows that are dropped, prompt width
    to a multiple of PROMPT_BUCKET (each (rows, width) is added to `shapes` when given). Returns (slots, each
    prompt's first token [n] and the hidden state behind it [n, d], as NumPy)."""
    b = slots.done_b.shape[0]
    first = np.zeros((len(prompts),), np.int32)
    first_hidden = None
    for g, group in enumerate(admission_groups([len(p) for p in prompts], b)):
        n = _row_bucket(len(group), b)
        width = round_up(max(len(prompts[j]) for j in group), PROMPT_BUCKET)
        if shapes is not None:
            shapes.add((n, width))
        prompt_bt = np.full((n, width), pad_id, np.int32)
        lens_b = np.ones((n,), np.int32)
        rows_b = np.full((n,), b, np.int32)  # filler rows point past the batch: dropped
        for k, j in enumerate(group):
            prompt_bt[k, : len(prompts[j])] = prompts[j]
            lens_b[k], rows_b[k] = len(prompts[j]), rows[j]
        slots, first_b, first_bd = admit(graphdef, params, slots, jnp.asarray(rows_b), jnp.asarray(prompt_bt),
                                         jnp.asarray(lens_b), jax.random.fold_in(key, g), sampling=sampling,
                                         eos_ids=eos_ids)
        first_bd = np.asarray(first_bd)
        if first_hidden is None:
            first_hidden = np.zeros((len(prompts), first_bd.shape[1]), first_bd.dtype)
        first[group] = np.asarray(first_b)[: len(group)]
        first_hidden[group] = first_bd[: len(group)]
    return slots, first, first_hidden


@partial(jax.jit, static_argnames=("graphdef", "steps", "max_new_tokens", "sampling", "eos_ids", "pad_id"),
         donate_argnames=("slots",))
def run_chunk(graphdef, params, slots: Slots, key, *, steps: int, max_new_tokens: int, sampling: SamplingConfig,
              eos_ids: tuple[int, ...], pad_id: int):
    """Up to `steps` decode steps (`autoregressive.plain_step`, the decode loop's own) of every live row.
    Returns (slots, tokens [b, o], hidden [b, o, d], emitted [b]) with o = steps: row b's new tokens are
    tokens[b, :emitted[b]], each with the hidden state that produced it."""
    model: CausalLM = nnx.merge(graphdef, params)
    b, d = slots.last_token_b.shape[0], model.config.hidden_size
    budget_b = jnp.clip(max_new_tokens - slots.num_out_b, 0, steps)  # what is left of each reply, this chunk
    state = PlainState(slots.cache, slots.last_token_b, jnp.full((b, steps), pad_id, jnp.int32),
                       jnp.zeros((b,), jnp.int32), budget_b, slots.done_b, key,
                       jnp.zeros((b, steps, d), jnp.float32))
    state = run_plain_steps(model, state, sampling=sampling, eos_ids=eos_ids)
    num_out_b = slots.num_out_b + state.num_out_b
    slots = Slots(state.cache, state.token_b, num_out_b, state.done_b | (num_out_b >= max_new_tokens))
    return slots, state.out_bo, state.hidden_bod, state.num_out_b


@dataclasses.dataclass(frozen=True)
class RefillRun:
    token_ids: list[list[int]]  # per prompt, in input order (EOS included when emitted)
    seconds: float
    compile_seconds: float
    slot_steps: int  # batch_size x decode steps run
    chunks: int
    shapes: int  # distinct jitted call shapes: admission (rows, width) pairs and the chunk

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def slot_use(self) -> float:
        """New tokens per slot-step: about the fraction of the batch's work that produced a token (the rest is
        rows idling at the end of a chunk or past their EOS; each prompt's first token comes from its prefill,
        so the ratio can slightly exceed the true fraction)."""
        return self.new_tokens / max(self.slot_steps, 1)


def refill_generate(model: CausalLM, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
                    eos_ids: tuple[int, ...], pad_id: int, sampling: SamplingConfig = SamplingConfig(),
                    seed: int = 0, chunk_steps: int = 32,
                    on_finish: Callable[[int], None] | None = None) -> RefillRun:
    """Decodes every prompt (at most max_new_tokens each) in `batch_size` slots refilled between chunks of
    `chunk_steps` steps; prompts are admitted in input order, as a server takes requests. `on_finish(i)` is
    called when prompt i is done."""
    if batch_size < 1 or max_new_tokens < 1 or chunk_steps < 1:
        raise ValueError(f"batch_size, max_new_tokens and chunk_steps must be >= 1, got {batch_size}, "
                         f"{max_new_tokens}, {chunk_steps}")
    check_prompts(prompts, model.config.max_position_embeddings, max_new_tokens)
    graphdef, params = nnx.split(model)
    cache_size = round_up(max(len(p) for p in prompts) + max_new_tokens, PROMPT_BUCKET)
    out: list[list[int]] = [[] for _ in prompts]
    row_prompt: list[int | None] = [None] * batch_size
    todo = deque(range(len(prompts)))
    key = jax.random.key(seed)
    slot_steps = chunks = 0
    shapes = set()

    def finished(i: int) -> bool:
        return len(out[i]) >= max_new_tokens or (bool(out[i]) and out[i][-1] in eos_ids)

    def done(r: int, i: int) -> None:
        row_prompt[r] = None
        if on_finish is not None:
            on_finish(i)

    with CompileCounter() as compiles:
        start = time.perf_counter()
        slots = Slots.empty(model.config, batch_size, cache_size)
        while True:
            free = [r for r in range(batch_size) if row_prompt[r] is None]
            admitted = [(r, todo.popleft()) for r in free[: len(todo)]]
            if admitted:
                key, sub = jax.random.split(key)
                slots, first, _ = admit_prompts(graphdef, params, slots, [r for r, _ in admitted],
                                                [list(prompts[i]) for _, i in admitted], sub, pad_id=pad_id,
                                                sampling=sampling, eos_ids=eos_ids, shapes=shapes)
                for j, (r, i) in enumerate(admitted):
                    out[i].append(int(first[j]))
                    row_prompt[r] = i
                    if finished(i):
                        done(r, i)
            if all(i is None for i in row_prompt):
                if not todo:
                    break
                continue
            key, sub = jax.random.split(key)
            slots, tokens_bo, _, emitted_b = run_chunk(graphdef, params, slots, sub, steps=chunk_steps,
                                                       max_new_tokens=max_new_tokens, sampling=sampling,
                                                       eos_ids=eos_ids, pad_id=pad_id)
            tokens_bo, emitted_b = jax.device_get((tokens_bo, emitted_b))
            chunks += 1
            slot_steps += batch_size * int(emitted_b.max(initial=0))
            for r, i in enumerate(row_prompt):
                if i is not None:
                    out[i].extend(tokens_bo[r, : int(emitted_b[r])].tolist())
                    if finished(i):
                        done(r, i)
        seconds = time.perf_counter() - start
    return RefillRun([list(t) for t in out], seconds, min(compiles.compile_seconds, seconds), slot_steps, chunks,
                     len(shapes) + 1)
