"""The generation engine's device side for plain decoding: b rows over one static KV cache, each serving its own
request with its own sampling settings, budget and stop ids. Three jitted calls take and donate the `Rows`:
`admit_rows`, `decode_chunk` and `release_rows`. A row is active while not done and within its budget; an inactive
row still computes (the batch is one matmul) but never advances its cache length. Shapes: b rows, s cache slots,
c chunk steps, n admitted rows, t padded prompt width, q per-row stop ids (padding -1)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.kv_cache import (KVCache, attention_mask, attention_window, attention_windows,
                                          causal_block)
from medusa_jax.inference.autoregressive import prefill
from medusa_jax.inference.engine_mesh import Placement, fetch
from medusa_jax.inference.row_sampling import RowSampling, sample_rows
from medusa_jax.inference.sampling import is_eos


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    cache: KVCache  # lengths_b: tokens of each row in the cache
    token_b: jax.Array  # the newest emitted token of each row, not yet in the cache
    num_out_b: jax.Array  # tokens emitted for the row's current request
    budget_b: jax.Array  # the request's max tokens
    done_b: jax.Array  # idle, or finished at an EOS / stop id
    stop_bq: jax.Array  # the request's own stop ids, -1 padded
    sampling: RowSampling

    @property
    def active_b(self) -> jax.Array:
        return ~self.done_b & (self.num_out_b < self.budget_b)

    @classmethod
    def empty(cls, model_config, b: int, cache_size: int, stop_width: int) -> "Rows":
        return cls(KVCache.zeros(model_config, b, cache_size), jnp.zeros((b,), jnp.int32),
                   jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool),
                   jnp.full((b, stop_width), -1, jnp.int32), jax.tree.map(jnp.asarray, RowSampling.greedy(b)))


def stops(token_b: jax.Array, stop_bq: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """Which tokens end their row: the model's EOS ids or the row's own stop ids."""
    return is_eos(token_b, eos_ids) | jnp.any(token_b[:, None] == stop_bq, axis=-1)


@partial(jax.jit, static_argnames=("graphdef", "eos_ids"), donate_argnames=("rows",))
def admit_rows(graphdef, params, rows: Rows, rows_n, prompt_nt, prompt_lens_n, budget_n, stop_nq,
               sampling_n: RowSampling, *, eos_ids: tuple[int, ...]):
    """Prefills the n right-padded prompts into rows rows_n (index >= b: filler, dropped) with their budgets,
    stop ids and sampling settings. Returns (rows, each prompt's first token [n])."""
    model: CausalLM = nnx.merge(graphdef, params)
    n, t = prompt_nt.shape
    fresh = KVCache.zeros(model.config, n, t, dtype=rows.cache.dtype)
    last_nd, fresh = prefill(model, prompt_nt, prompt_lens_n, fresh)
    first_n = sample_rows(model.logits(last_nd), sampling_n, jnp.zeros((n,), jnp.int32))

    def put(old, new):
        return old.at[rows_n].set(new.astype(old.dtype), mode="drop")

    rows = Rows(rows.cache.put_rows(rows_n, fresh), put(rows.token_b, first_n),
                put(rows.num_out_b, jnp.ones((n,), jnp.int32)), put(rows.budget_b, budget_n),
                put(rows.done_b, stops(first_n, stop_nq, eos_ids)), put(rows.stop_bq, stop_nq),
                rows.sampling.put_rows(rows_n, sampling_n))
    return rows, first_n


def row_step(model: CausalLM, rows: Rows, eos_ids: tuple[int, ...]) -> tuple[Rows, jax.Array, jax.Array]:
    """One plain step of every row: the forward of its newest token at slot `length`, the next token drawn with
    the row's settings. Returns (rows, token [b], active [b]: the rows that emitted it)."""
    active_b = rows.active_b
    cache, lengths_b = rows.cache, rows.cache.lengths_b
    mask_b1s = attention_mask(lengths_b, causal_block(1), cache.cache_size)
    hidden_b1d, cache = model(rows.token_b[:, None], lengths_b[:, None], mask_b1s, cache)
    token_b = sample_rows(model.logits(hidden_b1d[:, 0]), rows.sampling, rows.num_out_b)
    step_b = active_b.astype(jnp.int32)
    rows = dataclasses.replace(rows, cache=cache.replace(lengths_b=lengths_b + step_b),
                               token_b=jnp.where(active_b, token_b, rows.token_b), num_out_b=rows.num_out_b + step_b,
                               done_b=rows.done_b | (active_b & stops(token_b, rows.stop_bq, eos_ids)))
    return rows, token_b, active_b


@partial(jax.jit, static_argnames=("graphdef", "steps", "eos_ids", "pad_id"), donate_argnames=("rows",))
def decode_chunk(graphdef, params, rows: Rows, *, steps: int, eos_ids: tuple[int, ...], pad_id: int):
    """Up to `steps` row steps, while any row is active. Returns (rows, tokens [b, c], emitted [b], steps run):
    row b's new tokens are tokens[b, :emitted[b]]."""
    model: CausalLM = nnx.merge(graphdef, params)
    b = rows.token_b.shape[0]
    row_ids_b = jnp.arange(b)

    def body(carry):
        i, rows, out_bc, emitted_b = carry
        rows, token_b, active_b = row_step(model, rows, eos_ids)
        slot_b = jnp.where(active_b, emitted_b, steps)  # past the end: dropped
        return i + 1, rows, out_bc.at[row_ids_b, slot_b].set(token_b, mode="drop"), emitted_b + active_b

    carry = (jnp.int32(0), rows, jnp.full((b, steps), pad_id, jnp.int32), jnp.zeros((b,), jnp.int32))
    i, rows, out_bc, emitted_b = jax.lax.while_loop(lambda c: (c[0] < steps) & jnp.any(c[1].active_b), body, carry)
    return rows, out_bc, emitted_b, i


@partial(jax.jit, donate_argnames=("rows",))
def release_rows(rows, release_b):
    """Rows (or a drafted `MedusaState`) with release_b set become idle (their cache rows are simply overwritten by
    the next admission)."""
    return dataclasses.replace(rows, done_b=rows.done_b | release_b)


def stop_ids_array(stop_ids: list[tuple[int, ...]], width: int) -> np.ndarray:
    """Per-row stop ids as an int32 [n, width] array padded with -1."""
    out = np.full((len(stop_ids), width), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        out[i, : len(ids)] = ids
    return out


class SlotReach:
    """The host's bound on each row's cache length (its prompt and every token emitted since: at least the slots
    it holds), from which a chunk's attention window is chosen (`KVCache.window`): the rows still to decode
    attend over the smallest window that holds every slot a chunk of theirs may write. A short request in a large
    context then reads a fraction of the cache: SmolLM2, 16 rows, a plain step over 1024 slots took 62.7 ms, over
    a 256-slot window of them 44.1 ms (docs/design.md, "Attention windows")."""

    def __init__(self, rows: int, cache_size: int, scratch: int, per_step: int, enabled: bool = True):
        self.length_b = np.zeros((rows,), np.int64)
        self.cache_size, self.scratch, self.per_step, self.enabled = cache_size, scratch, per_step, enabled

    def admitted(self, rows_n: np.ndarray, lens_n: np.ndarray) -> None:
        rows_n = np.asarray(rows_n)
        kept = rows_n < len(self.length_b)  # filler rows are dropped
        self.length_b[rows_n[kept]] = np.asarray(lens_n)[kept]

    def emitted(self, count_b) -> None:
        self.length_b += np.asarray(count_b, np.int64)

    def window(self, steps: int, remaining_b: np.ndarray) -> int | None:
        """The window of a chunk of up to `steps` steps (None: the whole cache): the rows with tokens left
        (`remaining_b` > 0; the others are inactive and their outputs unread) reach at most their bound, plus what
        `steps` steps may commit (`per_step` slots each, within the tokens left), plus the slots a step writes past
        its length (`scratch`) and one step's commits as a margin."""
        remaining_b = np.asarray(remaining_b, np.int64)
        if not self.enabled:
            return None
        live_b = remaining_b > 0
        grow_b = np.minimum(steps * self.per_step, remaining_b)
        reach = int(np.max(np.where(live_b, self.length_b + grow_b, 0), initial=0))
        return attention_window(reach + self.scratch + self.per_step, self.cache_size)


def chunk_windows(reach: SlotReach) -> tuple[int | None, ...]:
    """Every window a chunk may attend over (None: the whole cache), for compiling ahead."""
    if not reach.enabled:
        return (None,)
    return tuple(attention_window(w, reach.cache_size) for w in attention_windows(reach.cache_size))


def with_window(cache: KVCache, window: int | None) -> KVCache:
    return cache if cache.window == window else cache.replace(window=window)


class PlainDecoder:
    """The engine's device side for plain decoding: the Rows and the three calls on them. Every method takes
    and returns host (NumPy) values; `chunk` gives each row's new tokens."""

    def __init__(self, model: CausalLM, rows: int, context: int, stop_width: int, *, eos_ids: tuple[int, ...],
                 pad_id: int, placement: Placement | None = None, windows: bool = True):
        self.placement = placement or Placement(None, rows)
        self.graphdef, params = nnx.split(model)
        self.params = self.placement.params(params)
        self.eos_ids, self.pad_id, self.stop_width = eos_ids, pad_id, stop_width
        # committed to the device(s) from the start, as every call's output is: the calls then share one compilation
        self.rows = self.placement.state(Rows.empty(model.config, rows, context, stop_width))
        self.reach = SlotReach(rows, context, 1, 1, windows)

    def _admit_args(self, rows_n, prompt_nt, lens_n, budget_n, stop_nq, sampling_n):
        return (self.graphdef, self.params, self.rows, rows_n, prompt_nt, lens_n, budget_n, stop_nq, sampling_n)

    def admit(self, rows_n, prompt_nt, lens_n, budget_n, stop_nq, sampling_n: RowSampling) -> np.ndarray:
        with self.placement.active():
            self.rows, first_n = admit_rows(*self._admit_args(rows_n, prompt_nt, lens_n, budget_n, stop_nq,
                                                              sampling_n), eos_ids=self.eos_ids)
        self.reach.admitted(rows_n, lens_n)
        return fetch(first_n)

    def chunk(self, steps: int, remaining_b: np.ndarray, together: bool = False) -> tuple[list[list[int]], int, int]:
        """Up to `steps` steps (budgets are on the device already; `together`, whether the rows end together, changes
        nothing in plain decoding). Returns (each row's new tokens, steps run, active row steps)."""
        rows = self._windowed(self.reach.window(steps, remaining_b))
        with self.placement.active():
            rows, tokens_bc, emitted_b, run = decode_chunk(self.graphdef, self.params, rows, steps=steps,
                                                           eos_ids=self.eos_ids, pad_id=self.pad_id)
        self.rows = dataclasses.replace(rows, cache=with_window(rows.cache, None))  # the other calls: no window
        tokens_bc, emitted_b, run = fetch((tokens_bc, emitted_b, run))
        self.reach.emitted(emitted_b)
        return [tokens_bc[r, : int(e)].tolist() for r, e in enumerate(emitted_b)], int(run), int(emitted_b.sum())

    def _windowed(self, window: int | None) -> Rows:
        return dataclasses.replace(self.rows, cache=with_window(self.rows.cache, window))

    def release(self, release_b: np.ndarray) -> None:
        with self.placement.active():
            self.rows = release_rows(self.rows, release_b)

    def compile(self, shapes: list[tuple[int, int]], steps: int,
                before: Callable[[str, int], None] = lambda kind, left: None) -> None:
        """Compiles ahead of time (nothing runs) the chunk over each attention window, then the admission of n
        prompts of each (n, width), calling `before(kind, left)` ahead of each compilation ("chunk" or "admission":
        the largest executables first; `left`: those of its kind still to compile, this one included)."""
        with self.placement.active():
            windows = chunk_windows(self.reach)
            for i, window in enumerate(windows):
                before("chunk", len(windows) - i)
                decode_chunk.lower(self.graphdef, self.params, self._windowed(window), steps=steps,
                                   eos_ids=self.eos_ids, pad_id=self.pad_id).compile()
            for i, (n, width) in enumerate(shapes):
                zeros_n = np.zeros((n,), np.int32)
                before("admission", len(shapes) - i)
                admit_rows.lower(*self._admit_args(zeros_n, np.zeros((n, width), np.int32), zeros_n + 1, zeros_n + 1,
                                                   stop_ids_array([()] * n, self.stop_width), RowSampling.greedy(n)),
                                 eos_ids=self.eos_ids).compile()
