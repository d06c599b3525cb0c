"""Sorted batches decoded directly (`ShardedModel.plain_decode` / `medusa_decode`, one jitted call per batch), for
the cases the generation engine refuses (`engine_refusal`); every other case runs through the engine's sorted
admission (`engine_batches.sorted_batches`). What stays here: a proposer in place of the heads' own proposal (its
`proposer_data` rows are a direct call's batch rows), several processes (the engine reads every row on its host)
and a drafter the engine cannot serve (`row_drafts.check_servable`).

Each batch's prompts are right-padded to `bucket` times a power of two, its cache follows the width, and its
`while_loop` runs until every row has finished; on a mesh a batch is padded up to a multiple of data x fsdp rows
with filler rows (copies of its first prompt, dropped). Batch i samples with seed + i.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.trees.dynamic_tree import scratch_slots
from medusa_jax.trees.policy.choose import ChosenTree
from medusa_jax.inference.batch_run import BatchRun, BatchSettings, GenerationResult, report_batch
from medusa_jax.inference.engine import cache_size_for, check_fits, pad_prompts
from medusa_jax.inference.medusa import Proposer
from medusa_jax.inference.row_drafts import check_servable
from medusa_jax.inference.sharded import ShardedModel

SEED_RANGE = 2**31  # batch seeds (seed + batch number) wrap here: they reach the jitted key as int32


def engine_refusal(model: ShardedModel, settings: BatchSettings, proposer: Proposer | None) -> str | None:
    """Why the generation engine cannot decode these settings (module docstring), or None when it can."""
    if jax.process_count() > 1:
        return "several processes: the engine reads every row on its own host"
    if settings.tree is None:
        return None
    if proposer is not None:
        return "a proposer: the engine drafts with the heads' own proposal"
    heads = nnx.merge(model.medusa_graphdef, model.medusa_params).heads
    try:
        check_servable(heads)
    except ValueError as refusal:
        return str(refusal)
    return None


def direct_batches(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings,
                   plan: list[list[int]], rows: int, chosen: ChosenTree | None, bar,
                   on_batch: Callable[[list[GenerationResult]], None] | None, proposer: Proposer | None,
                   proposer_data: Any) -> BatchRun:
    """`api.generate_batch`'s sorted batches, each one direct decode call (module docstring)."""
    extra = 0 if settings.tree is None else scratch_slots(settings.tree)
    results: list[GenerationResult | None] = [None] * len(prompts)
    shapes = set()
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
            report_batch(finished, on_batch, bar, new_tokens, start, number, len(plan))
    seconds = time.perf_counter() - start
    return BatchRun(results, seconds, min(run_compiles.compile_seconds, seconds), len(plan), len(shapes), chosen,
                    run_compiles)


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
