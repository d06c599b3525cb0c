"""The step costs a mixed-draft step chooses its size with (`draft_merge.DraftSizes.costs`, measured here; the rule
it chooses by, on device inside the decode loop: `inference.size_choice`).

A size's cost is the time of the real mixed step (`medusa.medusa_step`, the decode loop's body, jitted alone as
`trees.policy.step_cost` times the Medusa steps) that drafts with the mix and verifies n nodes per row, over the
time of a plain decoding step (`autoregressive.plain_step`) over the same cache, at the batch size that decodes, for
each cache size of `SPAN_CONTEXTS` (a step prices its sizes at its own span: `draft_merge.SpanCosts`). Each size is
timed as its own forced step (a `DraftSizes` of that size alone); size 0 is a drafted step that verifies the root
alone (the drafting paid, one token verified). So a cost holds everything a step of that size does: the drafters and
their merge, the verify forward of n + 1 tokens (on a CPU its time grows with n), the acceptance, the drafters'
updates (recycling's top-k of every node's logits) and the bookkeeping. The pieces timed apart (a verify-shaped
forward over a one-token forward, plus the proposal alone) were not the step, by a margin that depends on the
machine's load: bench/mixed_drafts/real_step_costs (results.json's draft_sizes) has the real steps' costs its run
chose with.

Timing noise. On a shared machine a step's time varies from round to round and the load drifts, and the size rule
moves with the costs (two quiet calibrations of 7 rounds and a median each, 15 minutes apart, chose differently
enough to change MT-Bench's tokens/step: issue 37). So a round times every step once, in turn, a size's sample is
its step over the plain step of the same round (a load that changes between rounds scales both), and its cost is
the interquartile mean of its samples (robust to a loaded machine's spikes, less noisy than a median), timed round
after round until every cost's standard error is within `TimingBudget.tolerance` of it or the budget's seconds are
spent (bench/calibration_noise: repeated calibrations, the old way and this one).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Sequence

import jax
import numpy as np

from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.draft_merge import DraftSizes, SpanCosts
from medusa_jax.trees.policy.step_cost import (WARM_UP_CALLS, medusa_step_call, plain_step_call,
                                                  release_executables)

# the cost of the size a step never chooses when size 0 is timed: a drafted step then always verifies the root alone
UNPAYABLE = 1e9
# (nodes, cost in plain steps) of SmolLM2's mix (shipped heads + recycling + lookup) at batch 1 on a 2-core AMD EPYC,
# from the quiet calibrations of bench/mixed_drafts/session24_quiet (@4, @16) and session24_at64: the costs a mix
# gets when timing is skipped (`default_costs`)
DEFAULT_COST_POINTS = ((0, 1.11), (1, 1.55), (5, 1.67), (16, 2.31), (64, 5.78))
# the cached tokens of the spans a mix's sizes are timed at (each span: its context + the largest step's scratch
# slots; a step between or past them is priced along a line, `draft_merge.SpanCosts`): the smallest attention window
# and the server's default context (`kv_cache.attention_windows`, scripts/serve.py), 284 and 1,052 slots for
# SmolLM2's mix at 16 nodes. What a step costs depends on the slots its attention reads, not on the tokens cached
# (bench/size_costs_by_cache)
SPAN_CONTEXTS = (256, 1024)
SECONDS_ENV = "MEDUSA_JAX_CALIBRATION_SECONDS"  # the timing budget's seconds (the test suite: 0, min_rounds only)


@dataclasses.dataclass(frozen=True)
class TimingBudget:
    """How long the sizes are timed: at least `min_rounds` rounds, then until every cost's standard error is within
    `tolerance` of the cost, `seconds` of timing have passed (warm-up apart) or `max_rounds` are timed."""

    min_rounds: int = 10
    max_rounds: int = 200
    seconds: float = 15.0
    tolerance: float = 0.01


def default_budget() -> TimingBudget:
    """TimingBudget(), its seconds from `$MEDUSA_JAX_CALIBRATION_SECONDS` when set (ValueError: not seconds >= 0)."""
    text = os.environ.get(SECONDS_ENV)
    if text is None:
        return TimingBudget()
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"${SECONDS_ENV} must be a number of seconds >= 0, got {text!r}")
    return TimingBudget(seconds=seconds)


def forced_sizes(sizes: Sequence[int], depth: int) -> list[DraftSizes]:
    """One DraftSizes per size that makes every step draft and verify exactly that size: n alone, or for 0 the
    pair (0, 1) with size 1 priced out (`UNPAYABLE`)."""
    return [DraftSizes((n,), (1.0,), depth) if n else DraftSizes((0, 1), (1.0, UNPAYABLE), depth) for n in sizes]


def interquartile_mean(samples_n: Sequence[float]) -> tuple[float, float]:
    """(the mean of the middle half of the samples, its standard error: the standard deviation of the samples
    winsorized at the quartiles over half the square root of their number, Tukey and McLaughlin's)."""
    x_n = np.sort(np.asarray(samples_n, np.float64))
    n, cut = len(x_n), len(x_n) // 4
    middle_m = x_n[cut: n - cut]
    error = np.clip(x_n, middle_m[0], middle_m[-1]).std(ddof=1) / (0.5 * math.sqrt(n)) if n > 1 else math.inf
    return float(middle_m.mean()), float(error)


def timed_ratios(calls: Sequence[Callable[[], object]], budget: TimingBudget = TimingBudget(),
                 clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], int]:
    """(for each of calls[1:], the interquartile mean of its seconds over those of calls[0] in the same round; the
    rounds timed): each call `WARM_UP_CALLS` times untimed, then rounds of every call once in turn while `budget`
    lasts (module docstring)."""
    for fn in calls:
        for _ in range(WARM_UP_CALLS):
            jax.block_until_ready(fn())
    ratios: list[list[float]] = [[] for _ in calls[1:]]
    start = clock()
    while True:
        seconds = []
        for fn in calls:
            begin = clock()
            jax.block_until_ready(fn())
            seconds.append(clock() - begin)
        for samples, s in zip(ratios, seconds[1:]):
            samples.append(s / max(seconds[0], 1e-12))
        rounds = len(ratios[0])
        if rounds >= budget.max_rounds or rounds >= budget.min_rounds and (
                clock() - start >= budget.seconds or
                all(error <= budget.tolerance * cost for cost, error in map(interquartile_mean, ratios))):
            return [interquartile_mean(samples)[0] for samples in ratios], rounds


def default_costs(sizes: Sequence[int]) -> tuple[float, ...]:
    """The step costs of `sizes` when they are not timed (calibration "skip"): `DEFAULT_COST_POINTS` interpolated
    linearly, past its last point along its last slope. A 2-core CPU's: on a GPU, where a step of more nodes costs
    about what a plain one does, they draft less than measured costs would."""
    nodes, costs = (np.asarray(axis, np.float64) for axis in zip(*DEFAULT_COST_POINTS))
    slope = (costs[-1] - costs[-2]) / (nodes[-1] - nodes[-2])
    return tuple(float(np.interp(n, nodes, costs) + slope * max(n - nodes[-1], 0)) for n in sizes)


def measure_span_costs(base: CausalLM, drafter, sizes: Sequence[int], *, batch: int = 1,
                       contexts: Sequence[int] = SPAN_CONTEXTS, budget: TimingBudget | None = None,
                       depth: int = 1) -> SpanCosts:
    """Seconds of the real mixed step of each size over a plain step of the same cache (`timed_ratios` under
    `budget`, by default `default_budget()`, a larger size never costing less than a smaller one, against timing
    noise), for a cache of each context of `contexts` plus the largest step's scratch slots (its span), one span
    after the other (one span's states and executables held at a time): the `by_span` costs of a DraftSizes for
    `drafter`, on this machine at this batch size."""
    scratch = max(sizes) + 2 + depth
    costs = []
    for context in contexts:
        calls = [plain_step_call(base, batch, context, context + scratch)]
        calls += [medusa_step_call(base, drafter, forced, batch, context, context + scratch)
                  for forced in forced_sizes(sizes, depth)]
        ratios, _ = timed_ratios(calls, budget or default_budget())
        del calls
        release_executables()
        costs.append(tuple(float(c) for c in np.maximum.accumulate(ratios)))
    return SpanCosts(tuple(context + scratch for context in contexts), tuple(costs))
