"""How much a mix's draft-size costs move from one calibration to the next (`inference.draft_size`): the same step
calls calibrated again and again, the old way (7 interleaved rounds, each size's median over the plain step's
median) and the current one (`draft_size.timed_ratios`: per-round ratios, their interquartile mean, until stable),
taking turns so that a change in load hits both alike; per size, the mean, standard deviation and range of the
costs, and the seconds and rounds of one calibration (warm-up included; the first compilation apart).

  python -m medusa_jax.bench.calibration_noise --mix default+recycle+lookup --budget 4 --repeats 8 \
      > bench/calibration_noise/results.json

(the results as JSON on stdout, each calibration's line on stderr)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np

from medusa_jax.inference import draft_size
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix, parse_mix
from medusa_jax.trees.policy.calibration import machine_description
from medusa_jax.trees.policy.step_cost import medusa_step_call, plain_step_call, time_interleaved

OLD_ROUNDS = 7


def old_costs(calls) -> tuple[list[float], int]:
    """The estimate before: medians of 7 interleaved rounds, each size's over the plain step's."""
    plain, *seconds = time_interleaved(calls, OLD_ROUNDS)
    return [s / plain for s in seconds], OLD_ROUNDS


def spread(runs: list[dict]) -> dict:
    costs_rs = np.array([r["costs"] for r in runs])
    return {"mean": costs_rs.mean(0).round(3).tolist(), "sd": costs_rs.std(0, ddof=1).round(3).tolist(),
            "range": (costs_rs.max(0) - costs_rs.min(0)).round(3).tolist(),
            "seconds": round(statistics.mean(r["seconds"] for r in runs), 1),
            "rounds": round(statistics.mean(r["rounds"] for r in runs), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", default="default+recycle+lookup")
    p.add_argument("--budget", type=int, default=4)
    p.add_argument("--repeats", type=int, default=8)
    a = p.parse_args(argv)
    machine = machine_description()
    untrained, trained = parse_mix(a.mix)
    loaded = load_model("default", trained or "default")
    mix, sizes = build_mix(loaded.base, untrained, loaded.heads if trained else None, a.budget,
                           costs=lambda s: (1.0,) * len(s))
    context, depth = 256, mix.depth
    cache_size = context + max(sizes.sizes) + 2 + depth
    calls = [plain_step_call(loaded.base, 1, context, cache_size)]
    calls += [medusa_step_call(loaded.base, mix, forced, 1, context, cache_size)
              for forced in draft_size.forced_sizes(sizes.sizes, depth)]
    start = time.perf_counter()
    old_costs(calls)  # compiles every step
    first = time.perf_counter() - start
    runs, budget = {"old": [], "new": []}, draft_size.default_budget()
    for i in range(a.repeats):
        for name, estimate in (("old", old_costs), ("new", draft_size.timed_ratios))[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            ratios, rounds = estimate(calls, *([budget] if name == "new" else []))
            runs[name].append({"costs": np.maximum.accumulate(ratios).round(4).tolist(), "rounds": rounds,
                               "seconds": round(time.perf_counter() - start, 2)})
            print(name, runs[name][-1], file=sys.stderr, flush=True)
    results = {"command": "python -m medusa_jax.bench.calibration_noise " + " ".join(argv or sys.argv[1:]),
               "machine": machine, "load_average_1m_at_the_end": machine_description()["load_average_1m"],
               "mix": f"{a.mix}@{a.budget}", "sizes": list(sizes.sizes), "budget": dataclasses.asdict(budget),
               "first_compile_and_calibration_seconds": round(first, 1),
               "spread": {name: spread(r) for name, r in runs.items()}, "runs": runs}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
