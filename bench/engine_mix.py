"""generate_batch's sorted batches through the generation engine against the direct decode calls they replaced
(`inference/direct_batches.py`), for plain decoding and a mix of drafters, in one process (issue 38).

Four methods: plain and the mix, each through the engine (`api.generate_batch`, engine "batches": what users get)
and through the direct path (`direct_batches.direct_batches`, one jitted decode call per batch). Every method
decodes the same MT-Bench first turns greedily in calls of `batch` prompts; the methods take turns call by call,
the order reversed every other call, so a change in machine load hits them alike; a first call per method
(compilation) is not counted. Each path of the mix has a model of its own (its own Token Recycling table, warm
from call to call on both paths). Figures: tokens/s without compilation (new tokens / (seconds - compile
seconds)), engine / direct in the same run, tokens/step, mismatches against the direct plain path (must be 0).

    python scripts/benchmark_engine_mix.py --model default --heads default --mix default+recycle+lookup@4 \\
        --questions 4 --batch-sizes 1,4 --max-new-tokens 128 --out bench/engine_mix
"""

from __future__ import annotations

import json
import os
import sys
import time

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.load import load_heads
from medusa_jax.inference.api import BatchSettings, generate_batch, plan_batches
from medusa_jax.inference.direct_batches import direct_batches
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix, parse_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.bench.bench_inputs import mtbench_questions, write_files
from medusa_jax.trees.policy.calibration import machine_description

def run_call(path: str, model: ShardedModel, prompts, settings: BatchSettings) -> dict:
    if path == "engine":
        run = generate_batch(model, prompts, settings, progress=False)
    else:
        plan = plan_batches([len(p) for p in prompts], settings.batch_size)
        run = direct_batches(model, prompts, settings, plan, settings.batch_size, None, None, None, None, None)
    return {"tokens": run.new_tokens, "steps": sum(r.steps for r in run.results),
            "seconds": run.seconds - run.compile_seconds, "compile_seconds": run.compile_seconds,
            "token_ids": [r.token_ids for r in run.results]}


def measure(loaded, mix_name: str, budget: int, prompts, batch: int, max_new_tokens: int, bucket: int, say) -> dict:
    untrained, trained = parse_mix(mix_name)
    heads = load_heads(resolve_heads_dir(trained), base=loaded.base) if trained else None
    methods = {}
    for path in ("engine", "direct"):
        methods[f"plain/{path}"] = (ShardedModel(loaded.base, None, MeshConfig()), None, path)
        mix, sizes = build_mix(loaded.base, untrained, heads, budget, batch=batch)
        methods[f"mix/{path}"] = (ShardedModel(loaded.base, mix, MeshConfig()), sizes, path)
    rows = {label: [] for label in methods}
    groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
    for number, group in enumerate([groups[0]] + groups):  # the first call compiles: not counted
        order = list(methods) if number % 2 == 0 else list(methods)[::-1]
        for label in order:
            model, tree, path = methods[label]
            settings = BatchSettings(batch_size=batch, max_new_tokens=max_new_tokens, tree=tree,
                                     eos_ids=tuple(loaded.eos_ids), pad_id=loaded.pad_id, engine="batches",
                                     bucket=bucket)
            row = run_call(path, model, group, settings)
            if number:
                rows[label].append(row)
        say(f"batch {batch}: call {number}/{len(groups)} done ({time.strftime('%H:%M:%S')})")
    reference = [ids for row in rows["plain/direct"] for ids in row["token_ids"]]
    summary = {}
    for label, per in rows.items():
        tokens, steps, seconds = (sum(r[k] for r in per) for k in ("tokens", "steps", "seconds"))
        got = [ids for row in per for ids in row["token_ids"]]
        summary[label] = {"tokens_per_s": round(tokens / max(seconds, 1e-9), 2),
                          "tokens_per_step": round(tokens / max(steps, 1), 3), "new_tokens": tokens,
                          "mismatches": sum(a != b for a, b in zip(got, reference)),
                          "per_call_tokens_per_s": [round(r["tokens"] / max(r["seconds"], 1e-9), 2) for r in per]}
    for kind in ("plain", "mix"):
        engine, direct = summary[f"{kind}/engine"], summary[f"{kind}/direct"]
        summary[f"{kind} engine/direct"] = round(engine["tokens_per_s"] / direct["tokens_per_s"], 3)
    for path in ("engine", "direct"):
        summary[f"mix/plain {path}"] = round(summary[f"mix/{path}"]["tokens_per_s"]
                                             / summary[f"plain/{path}"]["tokens_per_s"], 3)
    return summary


def markdown(results: dict, command: str) -> str:
    lines = ["# generate_batch through the engine vs the direct path: plain and a mix (issue 38)", "",
             f"Machine: {results['machine']}; load average at the start {results['load_at_start']}. "
             f"Mix {results['mix']}, {results['questions']} MT-Bench first turns, {results['max_new_tokens']} new "
             f"tokens, greedy, prompt widths {results['bucket']} * 2**k.", "", "    " + command, "",
             "| batch | method | engine tok/s | direct tok/s | engine / direct | tokens/step | mix / plain (engine) "
             "| mix / plain (direct) | mismatches |", "|---|---|---|---|---|---|---|---|---|"]
    for batch, s in results["batches"].items():
        for kind in ("plain", "mix"):
            e, d = s[f"{kind}/engine"], s[f"{kind}/direct"]
            ratios = (f"{s['mix/plain engine']}x | {s['mix/plain direct']}x" if kind == "mix" else "- | -")
            lines.append(f"| {batch} | {kind} | {e['tokens_per_s']} | {d['tokens_per_s']} | "
                         f"{s[f'{kind} engine/direct']}x | {e['tokens_per_step']} / {d['tokens_per_step']} | "
                         f"{ratios} | {e['mismatches']} / {d['mismatches']} |")
    return "\n".join(lines) + "\n"


def run(model: str, heads: str, mix: str, questions: int, batches: list[int], max_new_tokens: int, bucket: int,
        out, command: str) -> dict:
    """The four methods over `questions` MT-Bench first turns at each batch size; writes OUT/results.json and
    OUT/README.md with `command`."""
    name, _, nodes = mix.partition("@")
    enable_compile_cache()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    loaded = load_model(model, heads)
    prompts = loaded.encode_chat([q.first_turn for q in mtbench_questions(questions)])
    results = {"machine": machine_description(), "load_at_start": round(os.getloadavg()[0], 1), "mix": mix,
               "questions": questions, "max_new_tokens": max_new_tokens, "bucket": bucket, "batches": {}}
    for batch in batches:
        results["batches"][batch] = measure(loaded, name, int(nodes), prompts, batch, max_new_tokens, bucket, say)
        say(json.dumps(results["batches"][batch]))
    results["command"] = command
    write_files(out, {"results.json": json.dumps(results, indent=1) + "\n", "README.md": markdown(results, command)})
    print(markdown(results, command))
    return results
