"""One generation engine: requests queued, admitted into free rows of a running jitted decode (continuous batching
over a static KV cache), each with its own sampling settings, budget and stop ids; tokens handed out chunk by chunk
(`engine_requests.TokenEvent`s, the last with the finish reason: "stop", "length" or "cancelled"); a request can be
cancelled. `start()` serves in a thread of its own, `generate_all` in the caller's. Rows, drafting, the admission
policies ("fifo": refilled slots, "sorted": sorted batches) and compilation: docs/serving.md, "The engine"."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict, deque
from typing import Callable, Sequence

import numpy as np
from jax.sharding import Mesh

from medusa_jax.compile_cache import MappingGuard
from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.inference.acceptance import AcceptanceConfig, DecodeConfig
from medusa_jax.inference.autoregressive import prefill_widths
from medusa_jax.inference.engine import PROMPT_BUCKET, bucket_length
from medusa_jax.inference.engine_mesh import Placement, fetch
from medusa_jax.inference.engine_metrics import EngineMetrics
from medusa_jax.inference.engine_requests import EngineClosed, QueueFull, Request, RequestParams, TokenEvent
from medusa_jax.inference.drafted_rows import DraftedDecoder
from medusa_jax.inference.medusa import Proposer, heads_proposer
from medusa_jax.inference.row_decode import PlainDecoder, chunk_windows, stop_ids_array
from medusa_jax.inference.row_sampling import RowSampling

ADMISSIONS = ("fifo", "sorted")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    rows: int = 16  # requests decoded at once
    context: int = 1024  # KV cache slots per row: a prompt plus its max_tokens must fit
    chunk_steps: int = 8  # decode steps between admissions (and between streamed pieces)
    max_queue: int = 64  # requests waiting for a row at most; more are refused (QueueFull)
    max_stop_ids: int = 8  # stop ids per request at most
    admission: str = "fifo"
    # how a sampled request that names no acceptance accepts drafted trees: exact (kind None) or typical
    acceptance: AcceptanceConfig = AcceptanceConfig()
    # "sorted" only: requests per batch at most (None: rows); a batch client on a mesh keeps its batch size
    # while rows are rounded up to a multiple of data x fsdp (the other rows stay idle)
    sorted_batch: int | None = None
    # each chunk attends over the smallest window of cache slots that its rows can reach (`row_decode.SlotReach`)
    # instead of all `context` slots; off: one chunk executable over the whole cache
    attention_windows: bool = True

    def __post_init__(self):
        for name in ("rows", "context", "chunk_steps", "max_queue", "max_stop_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.acceptance.kind == "greedy":
            raise ValueError("the engine's acceptance is that of sampled requests: exact (None) or typical")
        if self.sorted_batch is not None and not (self.admission == "sorted" and 1 <= self.sorted_batch <= self.rows):
            raise ValueError(f"sorted_batch needs admission 'sorted' and 1 <= sorted_batch <= rows ({self.rows}), "
                             f"got {self.sorted_batch} with {self.admission!r}")


def admission_sizes(rows: int) -> tuple[int, ...]:
    """The row counts an admission call is padded to: 1, 2, 4, ... below `rows`, then `rows` (few shapes; a
    filler row computes a whole prompt's prefill, so the steps stay small: bench/refill/engine_client.md)."""
    sizes, n = [], 1
    while n < rows:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (rows,)


class GenerationEngine:
    """With `heads` and a `tree`, every row decodes with the tree (`drafted_rows.DraftedDecoder`); else plainly
    (`row_decode.PlainDecoder`). With a `mesh`, the parameters and the rows' state are sharded over it
    (`engine_mesh.Placement`: rows over data x fsdp, which must divide config.rows). `proposer` drafts in place
    of the heads' own proposal (`medusa.Proposer`), reading `proposer_data` by engine row."""

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig(), *, eos_ids: tuple[int, ...],
                 pad_id: int = 0, heads: MedusaHeads | None = None,
                 tree: TreeBuffers | DynamicTree | DraftSizes | None = None, mesh: Mesh | None = None,
                 proposer: Proposer = heads_proposer, proposer_data=None):
        self.config, self.eos_ids, self.pad_id = config, tuple(eos_ids), pad_id
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.config.max_position_embeddings
        if (heads is None) != (tree is None):
            raise ValueError("tree decoding needs both heads and a tree")
        self.drafted = heads is not None
        placement = Placement(mesh, config.rows, model.config)
        if self.drafted:
            self._decoder = DraftedDecoder(model, heads, tree, config.rows, config.context, config.chunk_steps,
                                           eos_ids=self.eos_ids, pad_id=pad_id, placement=placement,
                                           proposer=proposer, proposer_data=proposer_data,
                                           windows=config.attention_windows)
        else:
            self._decoder = PlainDecoder(model, config.rows, config.context, config.max_stop_ids,
                                         eos_ids=self.eos_ids, pad_id=pad_id, placement=placement,
                                         windows=config.attention_windows)
        self._row_request: list[Request | None] = [None] * config.rows
        self._pending: deque[Request] = deque()
        self._cv = threading.Condition()
        self._closing = self._drain = False
        self._client_waiting: int | None = None  # generate_all's prompts not yet submitted; None: no batch client
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the engine's thread, if anything did
        self.metrics = EngineMetrics()

    # ---- any thread ------------------------------------------------------------------------------------------
    def check(self, prompt_ids: Sequence[int], params: RequestParams) -> None:
        """Raises ValueError (one sentence naming the field and the fix) for a request the engine cannot serve."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        limit = min(self.config.context, self.max_positions)
        if len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context of {limit} tokens must also hold "
                             f"the reply: shorten the prompt to at most {limit - 1} tokens")
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: "
                             f"together they exceed the context of {limit} tokens; lower max_tokens to at most "
                             f"{max(limit - len(prompt_ids), 0)} or shorten the prompt")
        if params.sampling.top_k > self.vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {self.vocab_size} (0: no cut), got "
                             f"{params.sampling.top_k}")
        if len(params.stop_ids) > self.config.max_stop_ids:
            raise ValueError(f"at most {self.config.max_stop_ids} stop token ids, got {len(params.stop_ids)}")
        if any(not 0 <= t < self.vocab_size for t in params.stop_ids):
            raise ValueError(f"stop token ids must be in [0, {self.vocab_size})")
        DecodeConfig(params.sampling, self.acceptance_of(params))  # ValueError: an acceptance the sampling can't use

    def acceptance_of(self, params: RequestParams) -> AcceptanceConfig:
        """A request's tree acceptance: its own, else the engine's for a sampled request (greedy ones greedy)."""
        if params.acceptance is not None:
            return params.acceptance
        return AcceptanceConfig() if params.sampling.greedy else self.config.acceptance

    def restart(self, max_queue: int, heads: MedusaHeads | None = None, proposer_data=None) -> None:
        """Readies an idle engine (no request running or waiting, no thread serving it) for a new batch client of the
        same shapes (`engine_batches.sorted_batches`): a queue of `max_queue`, the drafter as
        `DraftedDecoder.restart` leaves it (`heads`: the drafter state to start from; `proposer_data`)."""
        if self.rows_busy or self._pending or self._thread is not None or self.failure is not None:
            raise RuntimeError("only an idle engine with no thread serving it restarts")
        self.config = dataclasses.replace(self.config, max_queue=max_queue)
        if self.drafted:
            self._decoder.restart(heads, proposer_data)

    def drafter_state(self):
        """The drafter state the engine shares across rows and requests, on the host (Token Recycling's table;
        None over parts kept row by row; None without a drafter)."""
        return self._decoder.shared_draft() if self.drafted else None

    def submit(self, prompt_ids: Sequence[int], params: RequestParams,
               on_event: Callable[[TokenEvent], None] | None = None) -> Request:
        """Queues a request (ValueError: it cannot be served; QueueFull; EngineClosed)."""
        self.check(prompt_ids, params)
        request = Request([int(t) for t in prompt_ids], params, on_event)
        with self._cv:
            if self._closing or self.failure is not None:
                self.metrics.add(rejected=1)
                raise EngineClosed("the engine is shutting down" if self.failure is None else
                                   f"the engine failed: {self.failure}")
            if len(self._pending) >= self.config.max_queue:
                self.metrics.add(rejected=1)
                raise QueueFull(f"{len(self._pending)} requests are waiting already; retry later")
            self._pending.append(request)
            self.metrics.add(requests=1)
            self._cv.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Ends the request at the next chunk boundary (its row freed; its last event says "cancelled")."""
        with self._cv:
            request.cancel_requested = True
            self._cv.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def rows_busy(self) -> int:
        return sum(r is not None for r in self._row_request)

    def prometheus_text(self) -> str:
        return self.metrics.prometheus_text(self.queue_depth, self.rows_busy, self.config.rows)

    def warm_up(self, fix: str = "use fewer rows or a shorter context") -> int:
        """Compiles every call shape ahead of time (each admission size x prompt width, and the chunk over each
        attention window; nothing runs), so no request waits for XLA: a later call finds its executable in JAX's
        compilation caches (the in-memory one, or the persistent one where the caller enabled it). Returns the
        number of shapes. Stops with `compile_cache.MappingLimitError` (its message ending in `fix`) before a
        compilation that would pass the process's limit on memory mappings."""
        shapes = [(n, w) for w in prefill_widths(self.config.context) for n in admission_sizes(self.config.rows)]
        guard = MappingGuard(f"the engine's call shapes ({self.config.rows} rows, a context of "
                             f"{self.config.context} tokens)", fix)
        self._decoder.compile(shapes, self.config.chunk_steps, guard.before)
        return len(shapes) + len(chunk_windows(self._decoder.reach))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="generation-engine", daemon=True)
        self._thread.start()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; with drain, finishes every queued and running one first, else cancels them."""
        with self._cv:
            self._closing, self._drain = True, drain
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine's thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._pending or self.rows_busy or self._closing):
                        self._cv.wait()
                    if self._closing and (not self._drain or not (self._pending or self.rows_busy)):
                        break
                self.run_once()
        except BaseException as e:  # answer every request rather than leave a client waiting forever
            self.failure = e
            raise
        finally:
            self._end_all("cancelled" if self.failure is None else "error")

    def _end_all(self, reason: str) -> None:
        with self._cv:
            left = [r for r in self._row_request if r is not None] + list(self._pending)
            self._pending.clear()
            self._row_request = [None] * self.config.rows
        for request in left:
            self._finish(request, reason, ())

    def run_once(self) -> bool:
        """One iteration: cancellations, admissions, one decode chunk. Returns whether any request was served."""
        self._drop_cancelled()
        admitted = self._admit()
        busy = [r for r in range(self.config.rows) if self._row_request[r] is not None]
        if busy:
            self._chunk(busy)
        return bool(admitted or busy)

    def generate_all(self, prompts: Sequence[Sequence[int]], params: RequestParams) -> list[list[int]]:
        """Every prompt's tokens (EOS included), the engine driven in this thread (not started): a batch client."""
        requests, todo = [], deque(prompts)
        try:
            while todo or any(r.finish_reason is None for r in requests):
                while todo and len(self._pending) < self.config.max_queue:
                    requests.append(self.submit(todo.popleft(), params))
                self._client_waiting = len(todo)
                self.run_once()
        finally:
            self._client_waiting = None
        return [r.tokens for r in requests]

    def _rows_end_together(self) -> bool:
        """Whether the busy rows end together: a batch client's last requests (none waiting for a row), or sorted
        admission's batch (the next one waits for every row). A mix's size choice then counts the rows with the most
        tokens left (`size_choice.SizeChoiceState.counted_rows`); a server's rows answer requests each of its own."""
        if self.config.admission == "sorted":
            return True
        with self._cv:
            return self._client_waiting == 0 and not self._pending

    def _finish(self, request: Request, reason: str, tokens: Sequence[int]) -> None:
        request.finish_reason = reason
        self.metrics.finish(reason)
        request.emit(tokens, reason)

    def _finish_reason(self, request: Request) -> str | None:
        last = request.tokens[-1] if request.tokens else None
        if last is not None and (last in self.eos_ids or last in request.params.stop_ids):
            return "stop"
        return "length" if len(request.tokens) >= request.params.max_tokens else None

    def _drop_cancelled(self) -> None:
        with self._cv:
            waiting = [r for r in self._pending if r.cancel_requested]
            for request in waiting:
                self._pending.remove(request)
            released = [i for i, r in enumerate(self._row_request) if r is not None and r.cancel_requested]
            running = [self._row_request[i] for i in released]
            for i in released:
                self._row_request[i] = None
        if released:
            release_b = np.zeros((self.config.rows,), bool)
            release_b[released] = True
            self._decoder.release(release_b)
        for request in waiting + running:
            self._finish(request, "cancelled", ())

    def _admit(self) -> list[Request]:
        with self._cv:
            free = [i for i, r in enumerate(self._row_request) if r is None]
            if self.config.admission == "sorted":
                batch = self.config.sorted_batch or self.config.rows
                longest = sorted(self._pending, key=lambda r: -len(r.prompt_ids))[: batch] \
                    if len(free) == self.config.rows else []
                chosen = [r for r in self._pending if any(r is s for s in longest)]  # rows in submission order
            else:
                chosen = list(self._pending)[: len(free)]
            for row, request in zip(free, chosen):
                self._pending.remove(request)
                self._row_request[row] = request  # reserved now: a failure below still answers it (_end_all)
        if not chosen:
            return []
        by_width = defaultdict(list)
        for row, request in zip(free, chosen):
            width = min(bucket_length(len(request.prompt_ids), PROMPT_BUCKET), self.config.context)
            by_width[width].append((row, request))
        for width, group in sorted(by_width.items()):
            self._admit_group(width, group)
        return chosen

    def _admit_group(self, width: int, group: list[tuple[int, Request]]) -> None:
        n = next(size for size in admission_sizes(self.config.rows) if size >= len(group))
        prompt_nt = np.full((n, width), self.pad_id, np.int32)
        lens_n, rows_n = np.ones((n,), np.int32), np.full((n,), self.config.rows, np.int32)  # filler: dropped
        budget_n = np.ones((n,), np.int32)
        for k, (row, request) in enumerate(group):
            prompt_nt[k, : len(request.prompt_ids)] = request.prompt_ids
            lens_n[k], rows_n[k], budget_n[k] = len(request.prompt_ids), row, request.params.max_tokens
        params = [r.params for _, r in group] + [RequestParams()] * (n - len(group))
        sampling_n = RowSampling.of([p.sampling for p in params], [p.seed for p in params],
                                    [self.acceptance_of(p) for p in params])
        stop_nq = stop_ids_array([p.stop_ids for p in params], self.config.max_stop_ids)
        first_n = self._decoder.admit(rows_n, prompt_nt, lens_n, budget_n, stop_nq, sampling_n)
        now = time.perf_counter()
        self.metrics.add(prompt_tokens=int(lens_n[: len(group)].sum()), generated_tokens=len(group))
        for k, (row, request) in enumerate(group):
            request.first_token_at = now
            self.metrics.first_token(now - request.submitted)
            self._deliver(row, request, [int(first_n[k])])

    def _chunk(self, busy: list[int]) -> None:
        remaining_b = np.zeros((self.config.rows,), np.int32)  # idle rows: 0, so a drafted row stops at once
        for row in busy:
            request = self._row_request[row]
            remaining_b[row] = request.params.max_tokens - len(request.tokens)
        tokens, steps, row_steps = self._decoder.chunk(self.config.chunk_steps, remaining_b,
                                                       self._rows_end_together())
        if self.drafted:  # each row's verify steps of the chunk and their accept lengths
            steps_b, accept_bc = fetch((self._decoder.state.steps_b, self._decoder.state.accept_bo))
            for row in busy:
                request = self._row_request[row]
                request.verify_steps += int(steps_b[row])
                request.accept_lengths.extend(accept_bc[row, : steps_b[row]].tolist())
        emitted = sum(len(tokens[row]) for row in busy)
        self.metrics.add(decode_steps=steps, row_steps=row_steps, step_tokens=emitted, generated_tokens=emitted)
        for row in busy:
            self._deliver(row, self._row_request[row], tokens[row])

    def _deliver(self, row: int, request: Request, tokens: list[int]) -> None:
        stops = set(self.eos_ids) | set(request.params.stop_ids)
        end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))  # a drafted step may run
        tokens = tokens[: min(end, request.params.max_tokens - len(request.tokens))]  # past a stop id: cut there
        request.tokens.extend(tokens)
        reason = self._finish_reason(request)
        if reason is None:
            if tokens:
                request.emit(tokens, None)
            return
        with self._cv:
            self._row_request[row] = None
        self._finish(request, reason, tokens)
