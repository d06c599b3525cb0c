"""The mix's draft-size costs (`draft_size`'s timing: each forced size's real mixed step over a plain step, timed
alone) at several (cached tokens, cache slots) settings: does a step cost more, in plain steps, over a larger
cache? SmolLM2, default+recycle+lookup@16, BATCH rows (default 1), sizes 0 / 2 / 5 / 16, `TimingBudget(seconds=
SECONDS)` per setting (default 20), settings in the order given.

  python bench/size_costs_by_cache.py      (writes bench/size_costs_by_cache/batchBATCH.{json,md})

Environment: SETTINGS (default 900:1024,256:1024,256:284: context:cache_size pairs; 256:284 is what the
calibration times), BATCH (1), SECONDS (20).
"""

import json
import os
from pathlib import Path

from medusa_jax.bench.bench_inputs import env_int, usage_error, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference.draft_size import TimingBudget, forced_sizes, timed_ratios
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.trees.policy.calibration import machine_description
from medusa_jax.trees.policy.step_cost import medusa_step_call, plain_step_call, release_executables

SIZES = (0, 2, 5, 16)
BATCH = env_int("BATCH", 1, 1, 16)
SECONDS = env_int("SECONDS", 20, 1, 600)
OUT = Path(__file__).resolve().parent / "size_costs_by_cache"


def settings() -> list[tuple[int, int]]:
    """$SETTINGS as (context, cache_size) pairs, each context + 28 <= cache_size <= 8192 (a forced 16-node step of
    the mix's depth-10 drafts needs 28 free slots), else one error line (exit 2) before any work."""
    text = os.environ.get("SETTINGS", "900:1024,256:1024,256:284")
    out = []
    for item in text.split(","):
        try:
            context, cache = (int(x) for x in item.split(":"))
        except ValueError:
            context = cache = -1
        if not (1 <= context and context + 28 <= cache <= 8192):
            usage_error(f"$SETTINGS item {item!r}: give context:cache_size with context >= 1 and "
                        f"context + 28 <= cache_size <= 8192, e.g. 256:284")
        out.append((context, cache))
    return out


def main() -> None:
    chosen = settings()
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    mix, _ = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH,
                       costs=lambda s: (1.0,) * len(s))
    rows = []
    for context, cache_size in chosen:
        calls = [plain_step_call(loaded.base, BATCH, context, cache_size)]
        calls += [medusa_step_call(loaded.base, mix, forced, BATCH, context, cache_size)
                  for forced in forced_sizes(SIZES, mix.depth)]
        ratios, _ = timed_ratios(calls, TimingBudget(seconds=SECONDS))
        del calls
        release_executables()
        rows.append({"context": context, "cache_size": cache_size, "costs": [round(float(c), 3) for c in ratios]})
        print(rows[-1])
    given = " ".join(f"{k}={os.environ[k]}" for k in ("SETTINGS", "BATCH", "SECONDS") if k in os.environ)
    command = (given + " " if given else "") + "python bench/size_costs_by_cache.py"
    lines = [f"# The mix's draft-size costs by cache size (SmolLM2, default+recycle+lookup@16, batch {BATCH})", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. Each size's step timed alone over a plain step of the "
             f"same cache (`draft_size.timed_ratios`, {SECONDS} s per setting).", "",
             "| cached tokens | cache slots | " + " | ".join(f"{n} nodes" for n in SIZES) + " |",
             "|---|---|" + "---|" * len(SIZES)]
    lines += [f"| {r['context']} | {r['cache_size']} | " + " | ".join(f"{c:.3f}" for c in r["costs"]) + " |"
              for r in rows]
    name = f"batch{BATCH}"
    write_files(OUT, {f"{name}.json": json.dumps({"machine": machine, "command": command, "sizes": list(SIZES),
                                                  "rows": rows}, indent=1) + "\n",
                      f"{name}.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
