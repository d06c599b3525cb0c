"""The engine's mixed-draft chunk compiled with and without YNNPACK, in the real decode loop, in one process:
SmolLM2 with the shipped heads' mix `default+recycle+lookup@16`, BATCH rows (default 4), greedy, 128 new tokens, the
first 8 MT-Bench first turns in calls of BATCH prompts, REPEATS interleaved rounds (the median), plain decoding in the
same rounds. Arms, each with the chunk as shipped (`backbone.tree_step_compiler_options(BATCH)`) and with the other
options (`TREE_STEP_COMPILER_OPTIONS` or none):
- "never drafting": every step of the mix skips the drafting (`mixed_drafts.never_drafting_step`): a plain step of
  the mixed loop;
- "every step N nodes": every step drafts and verifies N nodes (2, 5), no size choice.
Per arm: the loop's cost per step in plain steps, the calls' time after their first token (each call timed again
stopped after one token: the prefill and the drafters' admission) over the steps of the call's slowest row.

  python bench/ynnpack_loop_ab.py      (writes bench/mixed_drafts_batch4/ynnpack/{results.json,README.md})

Environment: BATCH (4; 1 writes results_batch1.*), REPEATS (3).
"""

import dataclasses
import json
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_choice, env_int, mtbench_questions, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference import medusa, size_choice
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.inference.draft_size import forced_sizes
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model import backbone
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

BATCH = int(env_choice("BATCH", "4", ("1", "2", "4", "8"), "one batch size"))
REPEATS = env_int("REPEATS", 3, 1, 100)
OUT = Path(__file__).resolve().parent / "mixed_drafts_batch4" / "ynnpack"
SHIPPED = backbone.tree_step_compiler_options


@contextmanager
def chunk_options(shipped: bool, kind: str | None):
    """While a call runs (and its chunk is traced): the chunk's compile options as shipped or the others; `kind`
    "never": the mix never drafts; "fixed": its one size is never learnt from (every step drafts it)."""
    other = {} if SHIPPED(BATCH) else backbone.TREE_STEP_COMPILER_OPTIONS
    backbone.tree_step_compiler_options = SHIPPED if shipped else (lambda rows: other)
    step, drafted = medusa.mixed_step, size_choice.SizeChoiceState.drafted
    if kind == "never":
        medusa.mixed_step = mixed_drafts.never_drafting_step
    if kind == "fixed":
        size_choice.SizeChoiceState.drafted = lambda self, *args: self
    try:
        yield
    finally:
        backbone.tree_step_compiler_options = SHIPPED
        medusa.mixed_step, size_choice.SizeChoiceState.drafted = step, drafted


def main() -> None:
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    shipped_label = "with YNNPACK" if SHIPPED(BATCH) == {} else "without YNNPACK"
    other_label = "without YNNPACK" if shipped_label == "with YNNPACK" else "with YNNPACK"
    arms = {"plain": (ShardedModel(loaded.base, None, MeshConfig()), None, None, True)}
    for nudge, (name, kind, nodes) in enumerate((("never drafting", "never", None), ("every step 2 nodes", "fixed", 2),
                                                 ("every step 5 nodes", "fixed", 5))):
        for shipped in (True, False):
            # costs nudged per arm: each arm's DraftSizes differs, so no arm reuses another's traced chunk
            mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16,
                                   costs=lambda s: tuple(1.0 + 1e-3 * (2 * nudge + shipped) for _ in s))
            tree = forced_sizes((nodes,), sizes.depth)[0] if nodes else sizes
            label = f"{name}, chunk {shipped_label if shipped else other_label}{' (shipped)' if shipped else ''}"
            arms[label] = (ShardedModel(loaded.base, mix, MeshConfig()), tree, kind, shipped)
    prompts = loaded.encode_chat([q.first_turn for q in mtbench_questions(8)])
    per_arm = {label: [] for label in arms}
    for i in range(0, len(prompts), BATCH):
        group = prompts[i: i + BATCH]
        runs = {label: [] for label in arms}
        for round_ in range(REPEATS + 1):  # round 0 compiles
            for label, (model, tree, kind, shipped) in arms.items():
                kept = model.draft_snapshot()
                settings = BatchSettings(batch_size=BATCH, max_new_tokens=128, tree=tree, eos_ids=tuple(loaded.eos_ids),
                                         pad_id=loaded.pad_id, engine="batches", bucket=mixed_drafts.PROMPT_WIDTH)
                with chunk_options(shipped, kind):
                    results = generate_batch(model, group, settings, progress=False).results
                    first = generate_batch(model, group, dataclasses.replace(settings, max_new_tokens=1),
                                           progress=False).results
                model.restore_draft(kept)
                if round_:
                    runs[label].append({"seconds": results[0].seconds - first[0].seconds,
                                        "steps": max(r.steps for r in results) - 1,
                                        "token_ids": [r.token_ids for r in results]})
        for label, rounds in runs.items():
            per_arm[label].append({"seconds": float(np.median([r["seconds"] for r in rounds])),
                                   "steps": rounds[0]["steps"], "token_ids": rounds[0]["token_ids"]})
        print(f"prompts {i + len(group)}/{len(prompts)}", flush=True)
    plain = per_arm["plain"]
    plain_step = sum(c["seconds"] for c in plain) / sum(c["steps"] for c in plain)
    results = {"machine": machine, "batch": BATCH, "repeats": REPEATS, "plain_ms_per_step": round(plain_step * 1e3, 2),
               "methods": {}}
    for label, calls in per_arm.items():
        mismatches = sum(a != b for c, p in zip(calls, plain) for a, b in zip(c["token_ids"], p["token_ids"]))
        if label.startswith("every step") or label == "plain":
            assert mismatches == 0, label  # a lossless loop answers as plain greedy does
        step = sum(c["seconds"] for c in calls) / sum(c["steps"] for c in calls)
        results["methods"][label] = {"ms_per_step": round(step * 1e3, 2), "plain_steps": round(step / plain_step, 3),
                                     "speed_vs_plain": round(sum(c["seconds"] for c in plain)
                                                             / sum(c["seconds"] for c in calls), 3),
                                     "steps": [c["steps"] for c in calls]}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("BATCH", "REPEATS") if k in os.environ)
    command = (settings + " " if settings else "") + "python bench/ynnpack_loop_ab.py"
    results["command"] = command
    lines = [f"# The mixed-draft chunk with and without YNNPACK (SmolLM2, batch {BATCH}, greedy, 128 new tokens)", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. MT-Bench first turns 0-7 in calls of {BATCH}, "
             f"{REPEATS} interleaved rounds per call, the median; times after each call's first token.", "",
             "| arm | ms per step | plain steps per step | speed vs plain | steps of the slowest row, per call |",
             "|---|---|---|---|---|"]
    for label, r in results["methods"].items():
        lines.append(f"| {label} | {r['ms_per_step']:.1f} | {r['plain_steps']:.3f} | {r['speed_vs_plain']:.3f}x | "
                     + " ".join(map(str, r["steps"])) + " |")
    suffix = "" if BATCH == 4 else f"_batch{BATCH}"
    write_files(OUT, {f"results{suffix}.json": json.dumps(results, indent=1) + "\n",
                      f"README{suffix}.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
