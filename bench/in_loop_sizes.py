"""What the mix's draft sizes cost in the decode loop, against the costs its size rule was calibrated with, and what
each buys at a batch size: SmolLM2, default+recycle+lookup@16, BATCH rows (default 4), greedy, 128 new tokens, the
first PROMPTS (default 16) MT-Bench first turns in `generate_batch` calls of BATCH (sorted batches, the padded
width of `bench.mixed_drafts.PROMPT_WIDTH`), REPEATS (default 3) interleaved rounds, the median per call.

Methods: plain decoding, the mix as shipped (its size chosen step by step on the device, `inference.size_choice`),
and the mix with every step forced to verify one size (`draft_size.forced_sizes`; 0: a drafted step that verifies
the root alone). Per method: the loop's steps (each call's longest row: the batch runs until its last row ends), the
tokens per step and row, the speed against plain, and the cost of a step in the loop: its seconds past plain
decoding's first token (each round also times plain's call stopped at its first token: the prefill, taken as every
method's) per step, over plain's. A forced size's cost in the
loop is what its calibrated cost (`draft_size.measure_span_costs`: one step timed alone) stands for.

  python bench/in_loop_sizes.py       (writes bench/in_loop_sizes/batchBATCH/{results.json,README.md})
"""

import dataclasses
import json
import os
import statistics
from pathlib import Path

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_int, mtbench_questions, write_files
from medusa_jax.bench.bench_report import table
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference.batch_run import BatchSettings
from medusa_jax.inference.draft_size import forced_sizes
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

BATCH = env_int("BATCH", 4, 1, 64)
PROMPTS = env_int("PROMPTS", 16, 1, 80)
REPEATS = env_int("REPEATS", 3, 1, 100)
NEW_TOKENS = 128
OUT = Path(__file__).resolve().parent / "in_loop_sizes" / f"batch{BATCH}"


def main() -> None:
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH)
    drafted = ShardedModel(loaded.base, mix, MeshConfig())
    methods = {"plain": (ShardedModel(loaded.base, None, MeshConfig()), None), "mix (size rule)": (drafted, sizes)}
    calibrated = {"plain": 1.0}
    for n, cost, forced in zip(sizes.sizes, sizes.costs, forced_sizes(sizes.sizes, sizes.depth)):
        methods[f"mix, {n} nodes every step"] = (ShardedModel(loaded.base, mix, MeshConfig()), forced)
        calibrated[f"mix, {n} nodes every step"] = cost
    # plain's calls stopped at the first token (the prefill) run on a model of their own, which keeps its last engine
    # for the next call of its shapes (`engine_batches.LastEngine`), so neither kind of call rebuilds one. Only
    # plain's: every method's executables stay mapped in this process, and XLA:CPU's memory mappings per process are
    # limited (docs/design.md, "Memory mappings"; with each method's first-token calls too the run passed 65,530)
    first_model = ShardedModel(loaded.base, None, MeshConfig())
    questions = mtbench_questions(PROMPTS)
    prompts = loaded.encode_chat([q.first_turn for q in questions])
    totals = {label: {"seconds": 0.0, "after_first": 0.0, "steps": 0, "tokens": 0} for label in methods}
    for start in range(0, len(prompts), BATCH):
        group = prompts[start: start + BATCH]
        kept = drafted.draft_snapshot()
        rounds = {label: [] for label in methods}
        answers, firsts = {}, []
        for _ in range(REPEATS):
            for label, (model, tree) in methods.items():
                if tree is not None:
                    model.restore_draft(kept)  # every round drafts from the same recycling table
                settings = BatchSettings(batch_size=BATCH, max_new_tokens=NEW_TOKENS, tree=tree,
                                         eos_ids=tuple(loaded.eos_ids), pad_id=loaded.pad_id, engine="batches",
                                         bucket=mixed_drafts.PROMPT_WIDTH)
                results, seconds = mixed_drafts.timed_call(model, group, settings)
                rounds[label].append(seconds)
                answers[label] = results
            _, seconds = mixed_drafts.timed_call(first_model, group, dataclasses.replace(settings, tree=None,
                                                                                         max_new_tokens=1))
            firsts.append(seconds)
        first = statistics.median(firsts)
        for label, results in answers.items():
            ids = [r.token_ids for r in results]
            if ids != [r.token_ids for r in answers["plain"]]:
                raise SystemExit(f"{label} answered differently from plain greedy decoding")
            total = totals[label]
            total["seconds"] += statistics.median(rounds[label])
            total["after_first"] += statistics.median(rounds[label]) - first
            total["steps"] += max(r.steps for r in results)
            total["tokens"] += sum(r.new_tokens for r in results)
    plain = totals["plain"]
    rows = []
    for label, total in totals.items():
        rows.append({"method": label, "steps": total["steps"], "tokens": total["tokens"],
                     "tokens_per_step_and_row": round(total["tokens"] / total["steps"] / BATCH, 3),
                     "speed_vs_plain": round(plain["seconds"] / total["seconds"], 3),
                     "cost_in_loop": round((total["after_first"] / total["steps"])
                                           / (plain["after_first"] / plain["steps"]), 3),
                     "calibrated_cost": None if label not in calibrated else round(calibrated[label], 3)})
    command = " ".join(f"{k}={os.environ[k]}" for k in ("BATCH", "PROMPTS", "REPEATS") if k in os.environ)
    command = (command + " " if command else "") + "python bench/in_loop_sizes.py"
    results = {"machine": machine, "batch": BATCH, "prompts": PROMPTS, "repeats": REPEATS,
               "max_new_tokens": NEW_TOKENS, "draft_sizes": {"sizes": list(sizes.sizes), "costs": list(sizes.costs)},
               "methods": rows, "command": command}
    lines = [f"# The mix's draft sizes in the decode loop (SmolLM2, default+recycle+lookup@16, batch {BATCH})", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. MT-Bench first turns 1-{PROMPTS}, {NEW_TOKENS} new "
             f"tokens, greedy, calls of {BATCH}, {REPEATS} interleaved rounds per call (the median). Steps: each "
             f"call's longest row. Cost in the loop: seconds per step past plain's first token (its prefill), "
             f"over plain's.", ""]
    lines += table("method | steps | tokens per step and row | speed vs plain | cost in the loop | calibrated cost",
                   ((r["method"], r["steps"], f"{r['tokens_per_step_and_row']:.2f}", f"{r['speed_vs_plain']:.3f}x",
                     f"{r['cost_in_loop']:.3f}",
                     "-" if r["calibrated_cost"] is None else f"{r['calibrated_cost']:.3f}") for r in rows))
    write_files(OUT, {"results.json": json.dumps(results, indent=1) + "\n", "README.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
