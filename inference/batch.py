"""Batch generation for many prompts: length-sorted fixed-size batches on a (possibly multi-host) mesh.

Plan. Prompts are sorted by token length (longest first) and cut into batches of exactly `batch_size` rows
(the last one padded with filler rows that are dropped). Each batch's prompts are right-padded to `bucket`
times a power of two (`engine.bucket_length`) and its cache size follows the width, so the number of
compilations is bounded by the number of distinct prompt buckets (3 for 64 MT-Bench prompts at batch 8), not
the number of prompts; sorting makes a batch's rows share a bucket, so little compute goes to padding.

Why batches formed this way and not rows refilled. Each batch is one jitted call whose `while_loop` runs
until every row has finished (EOS or `max_new_tokens`), so a long answer holds only the rows of its own
batch, never the rest of the prompts, and costs at most `max_new_tokens` steps. Refilling a finished row
mid-loop (continuous batching) would need a prefill of the new prompt inside the loop: a second shape in the
loop body for plain decoding and for the Medusa tree step alike, and a loop that must return to Python to
fetch prompts, which is what makes one call per batch fast. On GPUs a decode step costs about the same for
any batch size up to the memory-bandwidth limit, so idle rows waste little time; on CPUs a smaller
`batch_size` bounds the waste.

Results come back in input order with per-row stats. Under several processes every process passes the same
prompts; each feeds only the rows its devices hold (`sharded.put_rows`) and all processes get all results.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from medusa_jax.tree import TreeBuffers
from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.engine import PROMPT_BUCKET, cache_size_for, check_positions, pad_prompts
from medusa_jax.inference.medusa import ChosenTree, choose_tree
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.sharded import ShardedModel


HEADS_TREE = "heads"  # BatchSettings.tree: the heads' own tree for the backend and batch size

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]  # tracing + lowering + XLA compilation time of this process, from JAX's own events


def _on_event(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    batch_size: int = 8
    max_new_tokens: int = 128
    # None: plain decoding; a tree: Medusa (the model needs heads); HEADS_TREE: the heads' own tree for this
    # backend and batch_size, or plain decoding where their trees.json says no tree pays (`medusa.choose_tree`)
    tree: TreeBuffers | str | None = None
    acceptance: AcceptanceConfig = AcceptanceConfig()  # Medusa only
    sampling: SamplingConfig = SamplingConfig()  # plain only
    seed: int = 0  # batch i uses seed + i
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    bucket: int = 2 * PROMPT_BUCKET  # prompt widths are bucket * 2**k (engine.bucket_length)

    def __post_init__(self):
        if isinstance(self.tree, str) and self.tree != HEADS_TREE:
            raise ValueError(f"tree must be TreeBuffers, None (plain) or {HEADS_TREE!r}, got {self.tree!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.bucket < 1:
            raise ValueError(f"batch_size, max_new_tokens and bucket must be >= 1, got {self.batch_size}, "
                             f"{self.max_new_tokens}, {self.bucket}")

    @property
    def method(self) -> str:
        return "plain" if self.tree is None else "medusa"


@dataclasses.dataclass
class RowResult:
    index: int  # position in the input list
    token_ids: list[int]  # new tokens, EOS included when one was produced
    prompt_tokens: int
    steps: int  # forward passes that produced the tokens, prefill included (plain: one per token)
    finish_reason: str  # "eos" or "length"
    batch: int  # which batch of the plan ran it
    batch_seconds: float  # wall-clock time of that batch (all its rows together), compilation included
    batch_compile_seconds: float  # of which tracing and compiling (0 once the batch shape was seen)
    accept_lengths: list[int] | None = None  # Medusa: candidates accepted at each verify step

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)


@dataclasses.dataclass
class BatchRun:
    results: list[RowResult]  # in input order
    seconds: float  # wall-clock time of all batches, compilation included
    compile_seconds: float  # of which tracing and compiling (JAX's compile events)
    num_batches: int
    num_shapes: int  # distinct (prompt width, cache size) pairs = compilations of the decode loop
    tree_choice: ChosenTree | None = None  # Medusa: the tree used (None: plain) and its origin / why plain

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Throughput without the one-off compilation time."""
        return self.new_tokens / max(self.seconds - self.compile_seconds, 1e-9)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(sum(r.steps for r in self.results), 1)


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped into batches of at most batch_size, longest prompts first (stable on ties)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def _progress(total: int, enabled: bool):
    if not enabled or jax.process_index() != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="prompt", desc="generate", dynamic_ncols=True)


def generate_batch(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings = BatchSettings(),
                   *, progress: bool = True,
                   on_batch: Callable[[list[RowResult]], None] | None = None) -> BatchRun:
    """Generates a reply for every token-id prompt; returns the results in input order. `on_batch` is
    called with each finished batch's results (e.g. to stream them to a file)."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if settings.tree is not None and not model.has_heads:
        raise ValueError("Medusa decoding (a tree was given) needs a ShardedModel built with heads")
    chosen = None
    if settings.tree is not None:
        chosen = choose_tree(model.heads_config, model.heads_trees, settings.batch_size,
                             None if settings.tree == HEADS_TREE else settings.tree)
        settings = dataclasses.replace(settings, tree=chosen.tree)
    model.check_batch_size(settings.batch_size)
    check_positions(model.config.max_position_embeddings, [len(p) for p in prompts], settings.max_new_tokens)
    extra = 0 if settings.tree is None else settings.tree.num_tokens
    plan = plan_batches([len(p) for p in prompts], settings.batch_size)
    results: list[RowResult | None] = [None] * len(prompts)
    shapes = set()
    bar = _progress(len(prompts), progress)
    start, compile_start = time.perf_counter(), _compile_seconds[0]
    new_tokens = 0
    for number, indices in enumerate(plan):
        batch = pad_prompts([prompts[i] for i in indices], settings.pad_id, settings.batch_size, settings.bucket)
        cache_size = cache_size_for(batch.tokens_bp.shape[1], settings.max_new_tokens, extra, settings.bucket)
        shapes.add((batch.tokens_bp.shape[1], cache_size))
        t0, c0 = time.perf_counter(), _compile_seconds[0]
        rows = _decode(model, batch.tokens_bp, batch.lengths_b, cache_size, settings, settings.seed + number)
        seconds, compiling = time.perf_counter() - t0, _compile_seconds[0] - c0
        finished = []
        for row, index in enumerate(indices):
            tokens_n, num, steps, accepts = rows[row]
            ids = tokens_n[:num].tolist()
            eos = bool(ids) and ids[-1] in settings.eos_ids
            results[index] = RowResult(index, ids, len(prompts[index]), steps, "eos" if eos else "length",
                                       number, seconds, compiling, accepts)
            finished.append(results[index])
            new_tokens += num
        if on_batch is not None:
            on_batch(finished)
        if bar is not None:
            bar.update(len(indices))
            rate = new_tokens / (time.perf_counter() - start)
            bar.set_postfix(tok_s=f"{rate:.1f}", batch=f"{number + 1}/{len(plan)}")
    if bar is not None:
        bar.close()
    return BatchRun(results, time.perf_counter() - start, _compile_seconds[0] - compile_start, len(plan), len(shapes),
                    chosen)


def _decode(model: ShardedModel, prompt_bp: np.ndarray, lengths_b: np.ndarray, cache_size: int,
            settings: BatchSettings, seed: int) -> list[tuple[np.ndarray, int, int, list[int] | None]]:
    """One padded batch -> per row (tokens [N], number of new tokens, steps, accept lengths or None)."""
    common = dict(cache_size=cache_size, max_new_tokens=settings.max_new_tokens, seed=seed,
                  eos_ids=settings.eos_ids, pad_id=settings.pad_id)
    if settings.tree is None:
        tokens_bn, num_b = model.plain_decode(prompt_bp, lengths_b, sampling=settings.sampling, **common)
        return [(tokens_bn[i], int(num_b[i]), int(num_b[i]), None) for i in range(len(num_b))]
    tokens_bn, num_b, steps_b, accept_bn = model.medusa_decode(prompt_bp, lengths_b, tree=settings.tree,
                                                               acceptance=settings.acceptance, **common)
    # steps count the prefill (which yields the first token) plus the verify steps, as generate_medusa does
    return [(tokens_bn[i], int(num_b[i]), 1 + int(steps_b[i]), accept_bn[i, : steps_b[i]].tolist())
            for i in range(len(num_b))]
