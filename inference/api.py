"""The generation front-end: token-id prompts in, one `GenerationResult` per prompt out, on a device mesh
(`sharded.ShardedModel`; a single device is a mesh of one). `generate` (plain decoding) and `generate_medusa`
(Medusa decoding) are thin entry points for one batch on one device; `generate_batch` runs any number of
prompts on any mesh, and scripts/generate.py runs every request through it. Every path checks its prompts
with `engine.check_prompts`.

Two engines. Sorted batches (`BatchSettings.engine="batches"`): prompts are sorted by token length (longest
first) and cut into batches of exactly `batch_size` rows (the last one padded with filler rows that are
dropped; on a mesh the batch is padded up to a multiple of its data x fsdp rows the same way, so any batch size
works on any mesh); prompts that fit one batch keep their input order. Each batch's prompts are right-padded to `bucket`
times a power of two (`engine.bucket_length`) and its cache size follows the width, so the number of
compilations is bounded by the number of distinct prompt buckets (3 for 64 MT-Bench prompts at batch 8). Each
batch is one jitted call whose `while_loop` runs until every row has finished, so a long answer holds only
the rows of its own batch, and at most for `max_new_tokens` steps; Medusa trees decode this way.
Refilled slots (`engine="refill"`: a client of `generation_engine.GenerationEngine`, admission "fifo"):
`batch_size` rows run plain steps in jitted chunks and a finished row takes the next prompt between chunks
(continuous batching). On a 2-core CPU the former slot engine (inference/refill.py) measured faster than sorted
batches at batch 64 and slower at 16 and 32 (bench/refill/, docs/design.md "Refilled slots"), so
`engine="auto"` (the default) refills plain decoding on one device when batch_size >= REFILL_MIN_BATCH and
there are at least batch_size prompts, and forms sorted batches otherwise; the engine's rows are yet to be
measured on a quiet machine (bench/refill/engine_client.md). Greedy outputs are the same tokens
either way.

Results come back in input order with per-row stats. Under several processes every process passes the same
prompts; each feeds only the rows its devices hold (`sharded.put_rows`) and all processes get all results.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.trees.dynamic_tree import scratch_slots
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import DynamicTree, TreeBuffers, load_tree
from medusa_jax.inference.acceptance import AcceptanceConfig, DecodeConfig
from medusa_jax.trees.policy.calibration import check_mode
from medusa_jax.trees.policy.choose import HEADS_TREE, ChosenTree, HeadsOwnTree, choose_tree
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine, RequestParams, TokenEvent
from medusa_jax.inference.engine import (PROMPT_BUCKET, cache_size_for, check_fits, check_prompts, pad_prompts,
                                         resolve_eos, round_up)
from medusa_jax.inference.medusa import Proposer
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.sharded import ShardedModel

ENGINES = ("auto", "batches", "refill")
REFILL_MIN_BATCH = 64  # engine "auto" refills slots from this batch size on (bench/refill, module docstring)
REFILL_CHUNK_STEPS = 32  # decode steps between refills (bench/refill's setting)
SEED_RANGE = 2**31  # batch seeds (seed + batch number) wrap here: they reach the jitted key as int32


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    batch_size: int = 8
    max_new_tokens: int = 128
    # None: plain decoding; a tree (static TreeBuffers or a DynamicTree): Medusa (the model needs heads); DraftSizes:
    # mixed drafts (the model's heads a heads.mixed.MixedDrafter); HEADS_TREE: the heads' own tree for this backend
    # and batch_size, or plain decoding where none pays (`choose.choose_tree`)
    tree: TreeBuffers | DynamicTree | DraftSizes | HeadsOwnTree | None = None
    acceptance: AcceptanceConfig = AcceptanceConfig()  # tree decoding: how candidates are accepted
    sampling: SamplingConfig = SamplingConfig()  # plain and tree decoding (greedy at temperature 0)
    seed: int = 0  # batch i uses seed + i
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    bucket: int = 2 * PROMPT_BUCKET  # prompt widths are bucket * 2**k (engine.bucket_length)
    cache_size: int | None = None  # KV cache slots per row; None: sized per prompt width (engine.cache_size_for)
    engine: str = "auto"  # "batches" (sorted), "refill" (plain decoding on one device) or "auto" (`uses_refill`)
    # HEADS_TREE only: "auto" (step costs measured on this machine on first use, then cached), "redo" (measured
    # again), "skip" (the shipped trees.json as it is); None: $MEDUSA_JAX_CALIBRATION or "auto" (`calibration`)
    calibration: str | None = None

    def __post_init__(self):
        if not isinstance(self.tree, (TreeBuffers, DynamicTree, DraftSizes, HeadsOwnTree, type(None))):
            raise ValueError(f"tree must be TreeBuffers, None (plain), a DynamicTree, DraftSizes (mixed drafts) or "
                             f"HEADS_TREE, got {self.tree!r}")
        if self.calibration is not None:
            check_mode(self.calibration)
        if self.tree is not None:  # an acceptance that cannot honour the sampling: ValueError now
            DecodeConfig(self.sampling, self.acceptance)
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.bucket < 1:
            raise ValueError(f"batch_size, max_new_tokens and bucket must be >= 1, got {self.batch_size}, "
                             f"{self.max_new_tokens}, {self.bucket}")

    @property
    def decode(self) -> DecodeConfig:
        """The one decode config of a tree decoder: the sampling settings and the acceptance."""
        return DecodeConfig(self.sampling, self.acceptance)

    @property
    def method(self) -> str:
        return "plain" if self.tree is None else "medusa"


@dataclasses.dataclass
class GenerationResult:
    """One prompt's generation, with the stats of the batch call that produced it."""

    token_ids: list[int]  # the new tokens, EOS included when one was produced
    steps: int  # forward passes that produced them, prefill included (plain decoding: one per token)
    prompt_tokens: int = 0
    finish_reason: str = "length"  # "eos" or "length"
    index: int = 0  # position in the input list
    batch: int = 0  # which batch of the plan ran it
    batch_seconds: float = 0.0  # wall-clock time of that batch (all its rows together), compilation included
    batch_compile_seconds: float = 0.0  # of which tracing and compiling (0 once the batch shape was seen)
    accept_lengths: list[int] | None = None  # Medusa: candidates accepted at each verify step (0..tree depth)
    text: str | None = None  # the decoded new tokens, when a tokenizer was at hand (text_generation)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def seconds(self) -> float:
        """The batch call without compilation (rows of a batch share it)."""
        return self.batch_seconds - self.batch_compile_seconds

    def accept_histogram(self, depth: int) -> list[int]:
        """Medusa: how many verify steps accepted 0, 1, ..., depth candidates."""
        return np.bincount(np.asarray(self.accept_lengths or [], int), minlength=depth + 1).tolist()


@dataclasses.dataclass
class BatchRun:
    results: list[GenerationResult]  # in input order
    seconds: float  # wall-clock time of all batches, compilation included
    compile_seconds: float  # of which tracing and compiling (`compile_cache.CompileCounter`)
    num_batches: int  # sorted batches; refill: engine iterations (a decode chunk each)
    num_shapes: int  # distinct jitted call shapes (sorted batches: (prompt width, cache size) pairs; refill: the
    # executables the run asked XLA for)
    tree_choice: ChosenTree | None = None  # Medusa: the tree used (None: plain) and its origin / why plain
    compiles: CompileCounter | None = None  # executables compiled afresh / read from the persistent cache
    engine: str = "batches"  # which engine ran: "batches" or "refill"

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
    """Prompt indices grouped into batches of at most batch_size, longest prompts first (stable on ties); prompts
    that fit one batch keep their input order (so a caller's per-row data, e.g. proposer_data, lines up)."""
    if len(lengths) <= batch_size:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def _progress(total: int, enabled: bool):
    if not enabled or jax.process_index() != 0:
        return None

    return tqdm(total=total, unit="prompt", desc="generate", dynamic_ncols=True)


def generate_batch(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings = BatchSettings(),
                   *, progress: bool = True, on_batch: Callable[[list[GenerationResult]], None] | None = None,
                   proposer: Proposer | None = None, proposer_data: Any = None) -> BatchRun:
    """Generates a reply for every token-id prompt; returns the results in input order. `on_batch` is
    called with each finished batch's results (e.g. to stream them to a file; refilled slots: once, with
    all). `proposer` replaces the heads' top-k proposal in Medusa decoding (it receives `proposer_data`, whose
    rows are the batch's rows)."""
    check_prompts(prompts)
    if settings.tree is not None and not model.has_heads:
        raise ValueError("Medusa decoding (a tree was given) needs a ShardedModel built with heads")
    chosen = None
    if isinstance(settings.tree, DraftSizes):
        chosen = ChosenTree(settings.tree, f"mixed drafts ({settings.tree.name}: up to {settings.tree.nodes} nodes, "
                                           f"the size chosen per step from costs "
                                           f"{'/'.join(f'{c:.2f}' for c in settings.tree.costs)}x a plain step)")
    elif settings.tree is not None:
        given = None if isinstance(settings.tree, HeadsOwnTree) else settings.tree
        chosen = choose_tree(model.heads_config, model.heads_trees, settings.batch_size, given, model=model,
                             calibration=settings.calibration, progress=progress)
    if chosen is not None:
        settings = dataclasses.replace(settings, tree=chosen.tree)
    # on a mesh every batch is padded up to a multiple of its data x fsdp rows with filler rows (copies of the
    # batch's first prompt, dropped from the results; greedy fillers finish with the row they copy)
    rows = round_up(settings.batch_size, model.row_multiple)
    check_prompts(prompts, model.config.max_position_embeddings, settings.max_new_tokens)
    if uses_refill(model, settings, len(prompts), proposer):
        return _refill(model, prompts, settings, progress, on_batch)
    extra = 0 if settings.tree is None else scratch_slots(settings.tree)
    plan = plan_batches([len(p) for p in prompts], settings.batch_size)
    results: list[GenerationResult | None] = [None] * len(prompts)
    shapes = set()
    bar = _progress(len(prompts), progress)
    start = time.perf_counter()
    new_tokens = 0
    with CompileCounter() as run_compiles:
        for number, indices in enumerate(plan):
            batch = pad_prompts([prompts[i] for i in indices], settings.pad_id, rows, settings.bucket)
            if settings.cache_size is None:
                cache_size = cache_size_for(batch.tokens_bt.shape[1], settings.max_new_tokens, extra, settings.bucket)
            else:
                cache_size = check_fits(batch, settings.max_new_tokens, extra, settings.cache_size)
            shapes.add((batch.tokens_bt.shape[1], cache_size))
            t0 = time.perf_counter()
            with CompileCounter() as compiles:
                decoded = _decode(model, batch.tokens_bt, batch.lengths_b, cache_size, settings,
                                  (settings.seed + number) % SEED_RANGE, proposer, proposer_data)
            seconds = time.perf_counter() - t0
            compiling = min(compiles.compile_seconds, seconds)
            finished = []
            for row, index in enumerate(indices):
                tokens_o, num, steps, accepts = decoded[row]
                ids = tokens_o[:num].tolist()
                eos = bool(ids) and ids[-1] in settings.eos_ids
                results[index] = GenerationResult(ids, steps, len(prompts[index]), "eos" if eos else "length",
                                                  index, number, seconds, compiling, accepts)
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
    seconds = time.perf_counter() - start
    return BatchRun(results, seconds, min(run_compiles.compile_seconds, seconds), len(plan), len(shapes), chosen,
                    run_compiles)


def uses_refill(model: ShardedModel, settings: BatchSettings, num_prompts: int, proposer: Proposer | None = None
                ) -> bool:
    """Whether `generate_batch` refills slots: engine "refill", or "auto" with plain decoding on one device in
    one process, batch_size >= REFILL_MIN_BATCH, at least batch_size prompts and no fixed cache size (the
    rule of the module docstring)."""
    plain_on_one_device = (settings.tree is None and proposer is None and model.mesh.size == 1
                           and jax.process_count() == 1)
    if settings.engine == "refill":
        if not plain_on_one_device:
            raise ValueError("engine='refill' decodes plainly on one device: no tree, no proposer, no mesh")
        return True
    return (settings.engine == "auto" and plain_on_one_device and settings.cache_size is None
            and settings.batch_size >= REFILL_MIN_BATCH and num_prompts >= settings.batch_size)


def _refill(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings, progress: bool,
            on_batch: Callable[[list[GenerationResult]], None] | None) -> BatchRun:
    """`generate_batch` on refilled slots: a client of `GenerationEngine` (admission "fifo", `batch_size` rows,
    chunks of REFILL_CHUNK_STEPS steps); prompt i samples with seed + i. One run: every row shares its times."""
    bar = _progress(len(prompts), progress)
    base = nnx.merge(model.base_graphdef, model.base_params)
    context = round_up(max(map(len, prompts)) + settings.max_new_tokens, PROMPT_BUCKET)
    config = EngineConfig(rows=settings.batch_size, context=context, chunk_steps=REFILL_CHUNK_STEPS,
                          max_queue=len(prompts), admission="fifo")
    start = time.perf_counter()
    with CompileCounter() as compiles:
        engine = GenerationEngine(base, config, eos_ids=settings.eos_ids, pad_id=settings.pad_id)

        def on_event(event: TokenEvent) -> None:
            if event.finish_reason is not None and bar is not None:
                bar.update(1)

        requests = [engine.submit(p, RequestParams(max_tokens=settings.max_new_tokens, sampling=settings.sampling,
                                                   seed=(settings.seed + i) % SEED_RANGE), on_event)
                    for i, p in enumerate(prompts)]
        iterations = 0
        while any(r.finish_reason is None for r in requests):
            engine.run_once()
            iterations += 1
    seconds = time.perf_counter() - start
    compiling = min(compiles.compile_seconds, seconds)
    if bar is not None:
        bar.close()
    results = []
    for index, request in enumerate(requests):
        ids = request.tokens
        eos = bool(ids) and ids[-1] in settings.eos_ids
        results.append(GenerationResult(ids, len(ids), len(prompts[index]), "eos" if eos else "length", index, 0,
                                        seconds, compiling))
    if on_batch is not None:
        on_batch(results)
    return BatchRun(results, seconds, compiling, iterations, compiles.requests, None, compiles, "refill")


def _decode(model: ShardedModel, prompt_bt: np.ndarray, lengths_b: np.ndarray, cache_size: int,
            settings: BatchSettings, seed: int, proposer: Proposer | None,
            proposer_data: Any) -> list[tuple[np.ndarray, int, int, list[int] | None]]:
    """One padded batch -> per row (tokens [o], number of new tokens, steps, accept lengths or None)."""
    common = dict(cache_size=cache_size, max_new_tokens=settings.max_new_tokens, seed=seed,
                  eos_ids=settings.eos_ids, pad_id=settings.pad_id)
    if settings.tree is None:
        tokens_bo, num_b = model.plain_decode(prompt_bt, lengths_b, sampling=settings.sampling, **common)
        return [(tokens_bo[i], int(num_b[i]), int(num_b[i]), None) for i in range(len(num_b))]
    tokens_bo, num_b, steps_b, accept_bo = model.medusa_decode(prompt_bt, lengths_b, tree=settings.tree,
                                                               acceptance=settings.decode, proposer=proposer,
                                                               proposer_data=proposer_data, **common)
    # steps count the prefill (which yields the first token) plus the verify steps
    return [(tokens_bo[i], int(num_b[i]), 1 + int(steps_b[i]), accept_bo[i, : steps_b[i]].tolist())
            for i in range(len(num_b))]


def _one_batch(prompts: Sequence[Sequence[int]], batch_size: int | None) -> int:
    """The batch size of a one-batch call (default: the number of prompts)."""
    check_prompts(prompts)
    batch_size = batch_size or len(prompts)
    if len(prompts) > batch_size:
        raise ValueError(f"{len(prompts)} prompts do not fit a batch of {batch_size}")
    return batch_size


def _max_new_tokens(max_new_tokens: int) -> int:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return max_new_tokens


def generate(model: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
             sampling: SamplingConfig = SamplingConfig(), seed: int = 0, eos_ids: Sequence[int] | None = None,
             pad_id: int = 0, batch_size: int | None = None, cache_size: int | None = None,
             timings: dict | None = None) -> list[GenerationResult]:
    """Plain decoding of one batch of token-id prompts (ragged lengths are fine) on one device: `generate_batch`
    on a mesh of one, prompts padded to 64 * 2**k tokens. `timings` gets "seconds" (the whole call)."""
    settings = BatchSettings(batch_size=_one_batch(prompts, batch_size), max_new_tokens=_max_new_tokens(max_new_tokens),
                             sampling=sampling, seed=seed, eos_ids=resolve_eos(model, eos_ids), pad_id=pad_id,
                             bucket=PROMPT_BUCKET, cache_size=cache_size)
    run = generate_batch(ShardedModel(model, None, MeshConfig()), prompts, settings, progress=False)
    if timings is not None:
        timings["seconds"] = run.seconds
    return run.results


def generate_medusa(base: CausalLM, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *,
                    tree: "str | TreeBuffers | DynamicTree | None" = None, max_new_tokens: int = 128,
                    sampling: SamplingConfig = SamplingConfig(), acceptance: AcceptanceConfig = AcceptanceConfig(),
                    seed: int = 0, eos_ids: Sequence[int] | None = None, pad_id: int = 0, batch_size: int | None = None,
                    cache_size: int | None = None, proposer: Proposer | None = None, proposer_data: Any = None,
                    timings: dict | None = None) -> list[GenerationResult]:
    """Medusa decoding of one batch of token-id prompts (ragged lengths are fine) on one device, as `generate`.
    `tree` is a preset name, "dynamic:N[,k=K,d=D]" (a dynamic tree, EAGLE-2 style), a JSON file, TreeBuffers or
    a DynamicTree; None: the heads' own tree for this backend and batch
    size (`choose.choose_tree`), and plain decoding (same sampling) where their trees.json says no tree pays.
    `sampling` is the one sampling config (greedy at temperature 0), `acceptance` how candidates are accepted
    (kind None: greedy at temperature 0, exact, i.e. lossless, above; `acceptance.DecodeConfig`).
    `proposer` replaces the heads' top-k proposal (it receives `proposer_data`). Each result's `steps` counts
    the prefill and the verify steps; `accept_lengths` lists each step's. `timings` gets "seconds" and
    "tree" (the tree's origin, or why decoding was plain)."""
    limits = dict(num_heads=heads.config.num_heads, max_top_k=heads.config.head_vocab_size)
    settings = BatchSettings(batch_size=_one_batch(prompts, batch_size), max_new_tokens=_max_new_tokens(max_new_tokens),
                             tree=HEADS_TREE if tree is None else tree if isinstance(tree, DraftSizes)
                             else load_tree(tree, **limits), acceptance=acceptance,
                             sampling=sampling,
                             seed=seed, eos_ids=resolve_eos(base, eos_ids), pad_id=pad_id, bucket=PROMPT_BUCKET,
                             cache_size=cache_size)
    run = generate_batch(ShardedModel(base, heads, MeshConfig()), prompts, settings, progress=False,
                         proposer=proposer, proposer_data=proposer_data)
    if timings is not None:
        timings.update(seconds=run.seconds, tree=run.tree_choice.note)
    return run.results
