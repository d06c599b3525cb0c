"""The mix's draft-size costs (`draft_size`'s timing: each forced size's real mixed step over a plain step, timed
alone) at several (cached tokens, cache slots, attention window) settings: does a step cost more, in plain steps,
over a larger cache or window? SmolLM2, default+recycle+lookup@16, BATCH rows (default 1), sizes 0 / 2 / 5 / 16,
`TimingBudget(seconds=SECONDS)` per setting (default 20), settings in the order given. Beside each setting, what
the shipped calibration (`draft_size.measure_span_costs` at `SPAN_CONTEXTS`, priced by `draft_merge.SpanCosts`)
predicts there from the settings at its own two spans, when both are among the settings.

  python bench/size_costs_by_cache.py      (writes bench/size_costs_by_cache/batchBATCH.{json,md})

Environment: SETTINGS (default 256:284,1024:1052,256:2076,256:4124,200:1052:256,900:4124:1024:
context:cache_size[:window] items; 256:284 and 1024:1052 are what the calibration times), BATCH (1), SECONDS (20).
"""

import dataclasses
import json
import os
from pathlib import Path

from medusa_jax.bench.bench_inputs import env_int, usage_error, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.draft_merge import SpanCosts
from medusa_jax.inference.draft_size import SPAN_CONTEXTS, TimingBudget, forced_sizes, timed_ratios
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.trees.policy.calibration import machine_description
from medusa_jax.trees.policy.step_cost import medusa_step_call, plain_step_call, release_executables

SIZES = (0, 2, 5, 16)
SCRATCH = 28  # the free slots a forced 16-node step of the mix's depth-10 drafts needs past its context
DEFAULT_SETTINGS = "256:284,1024:1052,256:2076,256:4124,200:1052:256,900:4124:1024"
BATCH = env_int("BATCH", 1, 1, 16)
SECONDS = env_int("SECONDS", 20, 1, 600)
OUT = Path(__file__).resolve().parent / "size_costs_by_cache"


def settings() -> list[tuple[int, int, int | None]]:
    """$SETTINGS as (context, cache_size, window or None) items, each context + SCRATCH <= cache_size <= 8192 and
    context + SCRATCH <= window < cache_size, else one error line (exit 2) before any work."""
    text = os.environ.get("SETTINGS", DEFAULT_SETTINGS)
    out = []
    for item in text.split(","):
        try:
            context, cache, *window = (int(x) for x in item.split(":"))
        except ValueError:
            context, cache, window = -1, -1, []
        if not (1 <= context and context + SCRATCH <= cache <= 8192 and len(window) <= 1 and
                all(context + SCRATCH <= w < cache for w in window)):
            usage_error(f"$SETTINGS item {item!r}: give context:cache_size[:window] with context >= 1, "
                        f"context + {SCRATCH} <= cache_size <= 8192 and context + {SCRATCH} <= window < cache_size, "
                        f"e.g. 256:284 or 200:1052:256")
        out.append((context, cache, window[0] if window else None))
    return out


def windowed(call, window: int | None):
    """A step call (`step_cost`'s) whose cache attends over `window` slots (None: all of them)."""
    if window is not None:
        call.state = dataclasses.replace(call.state, cache=call.state.cache.replace(window=window))
    return call


def predicted(rows: list[dict]) -> dict[int, list[float]]:
    """Per row index, what the calibration's two spans (rows without a window at its caches) predict at the row's
    span (`SpanCosts.at`), when both spans were timed."""
    spans = [c + SCRATCH for c in SPAN_CONTEXTS]
    timed = {r["cache_size"]: r["costs"] for r in rows if r["window"] is None and r["cache_size"] in spans}
    if len(timed) < len(spans):
        return {}
    calibration = SpanCosts(tuple(spans), tuple(tuple(timed[s]) for s in spans))
    return {i: [round(c, 3) for c in calibration.at(r["window"] or r["cache_size"])] for i, r in enumerate(rows)}


def main() -> None:
    chosen = settings()
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    mix, _ = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH,
                       costs=lambda s: (1.0,) * len(s))
    rows = []
    for context, cache_size, window in chosen:
        calls = [windowed(plain_step_call(loaded.base, BATCH, context, cache_size), window)]
        calls += [windowed(medusa_step_call(loaded.base, mix, forced, BATCH, context, cache_size), window)
                  for forced in forced_sizes(SIZES, mix.depth)]
        ratios, _ = timed_ratios(calls, TimingBudget(seconds=SECONDS))
        del calls
        release_executables()
        rows.append({"context": context, "cache_size": cache_size, "window": window,
                     "costs": [round(float(c), 3) for c in ratios]})
        print(rows[-1])
    given = " ".join(f"{k}={os.environ[k]}" for k in ("SETTINGS", "BATCH", "SECONDS") if k in os.environ)
    command = (given + " " if given else "") + "python bench/size_costs_by_cache.py"
    lines = [f"# The mix's draft-size costs by cache size (SmolLM2, default+recycle+lookup@16, batch {BATCH})", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. Each size's step timed alone over a plain step of the "
             f"same cache (`draft_size.timed_ratios`, {SECONDS} s per setting).", "",
             "| cached tokens | cache slots | window | " + " | ".join(f"{n} nodes" for n in SIZES) +
             " | calibration's prediction |", "|---|---|---|" + "---|" * len(SIZES) + "---|"]
    guesses = predicted(rows)
    lines += [f"| {r['context']} | {r['cache_size']} | {r['window'] or 'all'} | " +
              " | ".join(f"{c:.3f}" for c in r["costs"]) +
              f" | {' / '.join(f'{c:.3f}' for c in guesses[i]) if i in guesses else '-'} |"
              for i, r in enumerate(rows)]
    name = f"batch{BATCH}"
    write_files(OUT, {f"{name}.json": json.dumps({"machine": machine, "command": command, "sizes": list(SIZES),
                                                  "rows": rows, "calibration_predicts": guesses},
                                                 indent=1) + "\n",
                      f"{name}.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
