"""The step costs a mixed-draft step chooses its size with (`draft_merge.DraftSizes.costs`, measured here; the rule
it chooses by, on device inside the decode loop: `inference.size_choice`).

A size's cost is the time of the real mixed step (`medusa.medusa_step`, the decode loop's body, jitted alone as
`trees.policy.step_cost` times the Medusa steps) that drafts with the mix and verifies n nodes per row, over the time
of a plain decoding step (`autoregressive.plain_step`), after `context` cached tokens, at the batch size that
decodes. Each size is timed as its own forced step (a `DraftSizes` of that size alone); size 0 is a drafted step
that verifies the root alone (the drafting paid, one token verified). So a cost holds everything a step of that size
does: the drafters and their merge, the verify forward of n + 1 tokens (on a CPU its time grows with n), the
acceptance, the drafters' updates (recycling's top-k of every node's logits) and the bookkeeping. The pieces timed
apart (a verify-shaped forward over a one-token forward, plus the proposal alone) were not the step, by a margin
that depends on the machine's load: bench/mixed_drafts/real_step_costs (results.json's draft_sizes) has the real
steps' costs its run chose with.
"""

from __future__ import annotations

from typing import Sequence

from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.trees.policy.step_cost import medusa_step_call, plain_step_call, time_interleaved

# the cost of the size a step never chooses when size 0 is timed: a drafted step then always verifies the root alone
UNPAYABLE = 1e9


def forced_sizes(sizes: Sequence[int], depth: int) -> list[DraftSizes]:
    """One DraftSizes per size that makes every step draft and verify exactly that size: n alone, or for 0 the
    pair (0, 1) with size 1 priced out (`UNPAYABLE`)."""
    return [DraftSizes((n,), (1.0,), depth) if n else DraftSizes((0, 1), (1.0, UNPAYABLE), depth) for n in sizes]


def measure_size_costs(base: CausalLM, drafter, sizes: Sequence[int], *, batch: int = 1, context: int = 256,
                       rounds: int = 7, depth: int = 1) -> tuple[float, ...]:
    """Seconds of the real mixed step of each size over a plain step (module docstring; interleaved rounds, the
    median; a larger size never costs less than a smaller one, against timing noise): the `costs` of a
    DraftSizes for `drafter`, on this machine at this batch size."""
    cache_size = context + max(sizes) + 2 + depth
    calls = [plain_step_call(base, batch, context, cache_size)]
    calls += [medusa_step_call(base, drafter, forced, batch, context, cache_size)
              for forced in forced_sizes(sizes, depth)]
    plain, *seconds = time_interleaved(calls, rounds)
    costs, highest = [], 0.0
    for s in seconds:  # a larger step never costs less (each drafts alike; timing noise on a loaded machine)
        highest = max(highest, s / plain)
        costs.append(highest)
    return tuple(costs)
