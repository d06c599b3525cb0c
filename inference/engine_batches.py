"""`api.generate_batch` as a client of the generation engine, with either admission policy (docs/design.md, "Batch
generation"). Prompt i samples with seed + i. `sorted_batches`: the planned batches, one chunk of max_new_tokens - 1
steps each, consecutive batches of one cache size sharing an engine; a drafter state the model keeps across calls
(Token Recycling's table) starts each engine and is handed back. `refilled_slots`: `batch_size` rows in chunks of
REFILL_CHUNK_STEPS steps, a finished row taking the next prompt between chunks."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
from flax import nnx

from medusa_jax.compile_cache import CompileCounter, MappingGuard
from medusa_jax.trees.dynamic_tree import scratch_slots
from medusa_jax.trees.policy.choose import ChosenTree
from medusa_jax.inference.batch_run import BatchRun, BatchSettings, GenerationResult, report_batch
from medusa_jax.inference.engine import PROMPT_BUCKET, cache_size_for, check_fits, pad_prompts, round_up
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import Request, RequestParams, TokenEvent
from medusa_jax.inference.medusa import Proposer, heads_proposer
from medusa_jax.inference.sharded import ShardedModel

REFILL_CHUNK_STEPS = 32  # decode steps between refills (bench/refill's setting)
# every batch call of this process: before a new engine runs a cache size's batches, the mappings held plus the
# largest that one such run added so far must fit the process's limit (`compile_cache.MappingGuard`): each new shape
# compiles executables that stay mapped, and past the limit XLA:CPU's compiler fails ("Cannot allocate memory")
MAPPINGS = MappingGuard("the engine of a batch call's next cache size",
                        "run fewer batch sizes, prompt lengths or max_new_tokens in one process (each shape compiles "
                        "executables that stay loaded)")
SEED_RANGE = 2**31  # request seeds (seed + prompt index) wrap here: they reach the jitted key as int32

OnBatch = Callable[[list[GenerationResult]], None]


def _params(settings: BatchSettings, index: int) -> RequestParams:
    return RequestParams(max_tokens=settings.max_new_tokens, sampling=settings.sampling,
                         seed=(settings.seed + index) % SEED_RANGE,
                         acceptance=None if settings.tree is None else settings.acceptance)


def _result(request: Request, index: int, batch: int, seconds: float, compiling: float,
            settings: BatchSettings, drafted: bool) -> GenerationResult:
    ids = request.tokens
    eos = bool(ids) and ids[-1] in settings.eos_ids
    # steps: the prefill (which yields the first token) plus the verify steps; plain decoding: one per token
    steps = 1 + request.verify_steps if drafted else len(ids)
    return GenerationResult(ids, steps, len(request.prompt_ids), "eos" if eos else "length", index, batch, seconds,
                            compiling, list(request.accept_lengths) if drafted else None)


def batch_cache_sizes(prompts: Sequence[Sequence[int]], settings: BatchSettings, plan: list[list[int]],
                      rows: int) -> list[tuple[int, int]]:
    """Each planned batch's (padded prompt width, cache size), as a direct decode call of it would have them."""
    extra = 0 if settings.tree is None else scratch_slots(settings.tree)
    sizes = []
    for indices in plan:
        batch = pad_prompts([prompts[i] for i in indices], settings.pad_id, rows, settings.bucket)
        if settings.cache_size is None:
            cache = cache_size_for(batch.tokens_bt.shape[1], settings.max_new_tokens, extra, settings.bucket)
        else:
            cache = check_fits(batch, settings.max_new_tokens, extra, settings.cache_size)
        sizes.append((int(batch.tokens_bt.shape[1]), cache))
    return sizes


def sorted_batches(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings,
                   plan: list[list[int]], rows: int, chosen: ChosenTree | None, bar,
                   on_batch: OnBatch | None, proposer: Proposer = heads_proposer, proposer_data: Any = None
                   ) -> BatchRun:
    """The planned batches (`api.plan_batches`, longest first) through the engine's sorted admission (module
    docstring). Each result carries its batch's number and wall-clock seconds (compilation counted apart).
    `proposer` drafts in place of the heads' own proposal with `proposer_data`, whose rows are a batch's rows
    in plan order (the engine fills a batch's rows in the order its requests came)."""
    tree = settings.tree
    extra = 0 if tree is None else scratch_slots(tree)
    sizes = batch_cache_sizes(prompts, settings, plan, rows)
    results: list[GenerationResult | None] = [None] * len(prompts)
    start, number, new_tokens = time.perf_counter(), 0, 0
    with CompileCounter() as run_compiles:
        while number < len(plan):
            cache = sizes[number][1]
            end = number
            while end < len(plan) and sizes[end][1] == cache:  # the next batches of this cache size
                end += 1
            group = range(number, end)
            indices = [i for n in group for i in plan[n]]
            config = EngineConfig(rows=rows, context=cache - extra, chunk_steps=max(settings.max_new_tokens - 1, 1),
                                  max_queue=len(indices), admission="sorted",
                                  sorted_batch=None if rows == settings.batch_size else settings.batch_size)
            key = (dataclasses.replace(config, max_queue=1, chunk_steps=1), settings.eos_ids, settings.pad_id, tree,
                   proposer)
            engine = _engine(model, key, config, proposer_data)
            finished: list[int] = []  # prompt indices, as their requests finish
            requests = {i: engine.submit(prompts[i], _params(settings, i), _on_finish(finished, i)) for i in indices}
            for _ in group:  # one batch: admitted when every row is free, run until its rows are free again
                t0 = time.perf_counter()
                finished.clear()
                with CompileCounter() as compiles:
                    engine.run_once()
                    while engine.rows_busy:
                        engine.run_once()
                seconds = time.perf_counter() - t0
                compiling = min(compiles.compile_seconds, seconds)
                if sorted(finished) != sorted(plan[number]):
                    raise RuntimeError(f"the engine's batch {number} is not the planned one")
                batch = [_result(requests[i], i, number, seconds, compiling, settings, tree is not None)
                         for i in plan[number]]
                for result in batch:
                    results[result.index] = result
                    new_tokens += result.new_tokens
                report_batch(batch, on_batch, bar, new_tokens, start, number, len(plan))
                number += 1
            if model.heads is not None:  # a drafter state kept across calls (Token Recycling's table): handed back
                model.keep_draft(engine.drafter_state())
            model.last_engine = LastEngine(key, engine, _kept(model))
            MAPPINGS.after()
    seconds = time.perf_counter() - start
    return BatchRun(results, seconds, min(run_compiles.compile_seconds, seconds), len(plan), len(set(sizes)), chosen,
                    run_compiles)


@dataclasses.dataclass
class LastEngine:
    """The engine of a ShardedModel's last sorted-batch call (`ShardedModel.last_engine`), idle: the next call whose
    engine would be built alike (`key`: its config but the queue and the chunk length, EOS and pad ids, tree,
    proposer) restarts it instead, which saves building its decoder state (0.07 s plain, 0.18 s a mix, SmolLM2 on
    2 CPU cores).
    `kept`: the model's kept drafter state after the call (`_kept`), so that a state restored since is seen."""

    key: tuple
    engine: GenerationEngine
    kept: tuple


def _kept(model: ShardedModel) -> tuple:
    """The arrays of the model's kept drafter state (`ShardedModel.draft_snapshot`; () without one)."""
    return tuple(jax.tree.leaves(model.draft_snapshot()))


def _same(a: tuple, b: tuple) -> bool:
    """Whether two `_kept` are the same arrays (identity: the model's are replaced, never written into)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _engine(model: ShardedModel, key: tuple, config: EngineConfig, proposer_data: Any) -> GenerationEngine:
    """The model's last engine restarted where its key is `key` and its chunks are no shorter than `config`'s (a
    sorted batch then still runs in one chunk; `LastEngine`; its drafter state from the model's kept one where that
    changed since), else a new one, built once the last is let go (never two engines' caches at once). The last
    engine is taken off the model first: a call that fails leaves none behind."""
    last, model.last_engine = model.last_engine, None
    _, eos_ids, pad_id, tree, proposer = key
    if last is not None and last.key == key and last.engine.config.chunk_steps >= config.chunk_steps:
        last.engine.restart(config.max_queue, None if _same(last.kept, _kept(model)) else model.heads, proposer_data)
        return last.engine
    del last
    MAPPINGS.before("cache size")  # a new engine compiles its shapes as it runs (an engine restarted has them)
    base, heads = _parts(model, tree is not None)
    return GenerationEngine(base, config, eos_ids=eos_ids, pad_id=pad_id, heads=heads, tree=tree,
                            mesh=model.mesh if model.mesh.size > 1 else None, proposer=proposer,
                            proposer_data=proposer_data)


def refilled_slots(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings, bar,
                   on_batch: OnBatch | None) -> BatchRun:
    """`api.generate_batch` on refilled slots: plain decoding on one device."""
    base, _ = _parts(model, False)
    context = round_up(max(map(len, prompts)) + settings.max_new_tokens, PROMPT_BUCKET)
    config = EngineConfig(rows=settings.batch_size, context=context, chunk_steps=REFILL_CHUNK_STEPS,
                          max_queue=len(prompts), admission="fifo")
    start = time.perf_counter()
    MAPPINGS.before("cache size")
    with CompileCounter() as compiles:
        engine = GenerationEngine(base, config, eos_ids=settings.eos_ids, pad_id=settings.pad_id)

        def on_event(event: TokenEvent) -> None:
            if event.finish_reason is not None and bar is not None:
                bar.update(1)

        requests = [engine.submit(p, _params(settings, i), on_event) for i, p in enumerate(prompts)]
        iterations = 0
        while any(r.finish_reason is None for r in requests):
            engine.run_once()
            iterations += 1
    MAPPINGS.after()
    seconds = time.perf_counter() - start
    compiling = min(compiles.compile_seconds, seconds)
    results = [_result(r, i, 0, seconds, compiling, settings, False) for i, r in enumerate(requests)]
    if on_batch is not None:
        on_batch(results)
    return BatchRun(results, seconds, compiling, iterations, compiles.requests, None, compiles, "refill")


def _on_finish(finished: list[int], index: int) -> Callable[[TokenEvent], None]:
    def on_event(event: TokenEvent) -> None:
        if event.finish_reason is not None:
            finished.append(index)
    return on_event


def _parts(model: ShardedModel, drafted: bool):
    """The engine's (base model, heads or None) from a ShardedModel's placed parameters."""
    if not drafted:
        return nnx.merge(model.base_graphdef, model.base_params), None
    medusa = nnx.merge(model.medusa_graphdef, model.medusa_params)
    return medusa.base, medusa.heads
