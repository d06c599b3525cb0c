"""What the mixed decode loop costs when it never drafts: every step of each mix replaced by its skip branch (a
plain step of the same loop, the size choice's `skipped()`; `medusa.mixed_step` swapped for that branch before
anything is traced), the Hydra heads, Token Recycling, prompt lookup and their mix each alone, against plain
decoding. SmolLM2, BATCH rows, greedy, 128 new tokens, MT-Bench first turns PROMPTS (0-based, categories in turn)
in calls of BATCH, REPEATS interleaved rounds (`bench.mixed_drafts.run_set`, the median). The drafters' work is left
out, so what is left is the loop's own cost per step: its state, its branches and its cache layout.

  python bench/never_drafting_loop.py       (writes bench/mixed_drafts/never_drafting/{results.json,README.md};
                                             BATCH > 1: never_drafting_batchBATCH)

Environment: PROMPTS (default 0,7: the two slowest against plain in the mix's runs of 2026-12-06), REPEATS (3),
BATCH (1), ARMS (default heads,recycle,lookup,mix: the methods beside plain).
"""

import json
import os
from pathlib import Path

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_choices, env_int, mtbench_questions, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference import medusa
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", ("0", "7"), tuple(str(i) for i in range(80)))]
REPEATS = env_int("REPEATS", 3, 1, 100)
BATCH = env_int("BATCH", 1, 1, 64)
MEMBERS = {"heads": ((), True), "recycle": (("recycle",), False), "lookup": (("lookup",), False),
           "mix": (("recycle", "lookup"), True)}
ARMS = env_choices("ARMS", tuple(MEMBERS), tuple(MEMBERS))
OUT = Path(__file__).resolve().parent / "mixed_drafts" / ("never_drafting" if BATCH == 1 else
                                                          f"never_drafting_batch{BATCH}")


def main() -> None:
    medusa.mixed_step = mixed_drafts.never_drafting_step
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    models = {"plain": (ShardedModel(loaded.base, None, MeshConfig()), None)}
    for label, (untrained, trained) in ((a, MEMBERS[a]) for a in ARMS):
        mix, sizes = build_mix(loaded.base, untrained, loaded.heads if trained else None, 16,
                               costs=lambda s: (1.0,) * len(s))
        models[label] = (ShardedModel(loaded.base, mix, MeshConfig()), sizes)
    questions = mtbench_questions(max(PROMPTS) + 1)
    prompts = loaded.encode_chat([questions[i].first_turn for i in PROMPTS])
    rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, batch=BATCH,
                                repeats=REPEATS)
    calls_of = [PROMPTS[i: i + BATCH] for i in range(0, len(PROMPTS), BATCH)]
    results = {"machine": machine, "prompts": PROMPTS, "batch": BATCH, "repeats": REPEATS, "methods": {}}
    for label, calls in rows.items():
        assert all(c["token_ids"] == p["token_ids"] for c, p in zip(calls, rows["plain"])), label
        results["methods"][label] = [{"prompts": ids, "steps": c["steps"],
                                      "ms_per_step": round(c["seconds"] / c["steps"] * 1e3, 2),
                                      "speed_vs_plain": round(p["seconds"] / c["seconds"], 3)}
                                     for ids, c, p in zip(calls_of, calls, rows["plain"])]
        results["methods"][label].append({"prompts": "all", "speed_vs_plain": round(
            sum(p["seconds"] for p in rows["plain"]) / sum(c["seconds"] for c in calls), 3)})
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PROMPTS", "REPEATS", "BATCH", "ARMS") if k in os.environ)
    command = (settings + " " if settings else "") + "python bench/never_drafting_loop.py"
    results["command"] = command
    lines = [f"# The mixed decode loop when it never drafts (SmolLM2, batch {BATCH}, greedy, 128 new tokens)", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. {REPEATS} interleaved rounds per call, the median.", "",
             "| method | " + " | ".join(f"MT-Bench #{','.join(map(str, ids))}: ms/step, speed vs plain"
                                     for ids in calls_of) + " | all: speed vs plain |",
             "|---|" + "---|" * (len(calls_of) + 1)]
    for label, per in results["methods"].items():
        cells = [f"{r['ms_per_step']:.2f}, {r['speed_vs_plain']:.3f}x" for r in per[:-1]]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {per[-1]['speed_vs_plain']:.3f}x |")
    write_files(OUT, {"results.json": json.dumps(results, indent=1) + "\n", "README.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
