"""generate_batch's sorted batches through the generation engine against the direct decode calls they replaced
(`inference/direct_batches.py`), for plain decoding and a mix of drafters, in one process (issue 38).

Four methods: plain and the mix, each through the engine (`api.generate_batch`, engine "batches": what users get)
and through the direct path (`direct_batches.direct_batches`, one jitted decode call per batch). Every method
decodes the same MT-Bench first turns greedily in calls of `batch` prompts; the methods take turns call by call,
the order reversed every other call, so a change in machine load hits them alike; a first call per method
(compilation) is not counted. Each path of the mix has a model of its own (its own Token Recycling table, warm
from call to call on both paths). Figures: tokens/s without compilation (new tokens / (seconds - compile
seconds)), engine / direct in the same run, tokens/step, mismatches against the direct plain path (must be 0).

    python -m medusa_jax.bench.engine_mix --model default --heads default --mix default+recycle+lookup@4 \\
        --questions 4 --batch-sizes 1,4 --max-new-tokens 128 --out bench/engine_mix
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.load import load_heads
from medusa_jax.inference.api import BatchSettings, generate_batch, plan_batches
from medusa_jax.inference.direct_batches import direct_batches
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix, parse_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.bench.bench_inputs import mtbench_questions
from medusa_jax.paths import command_line
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default", help="the trained part 'default' of --mix names")
    p.add_argument("--mix", default="default+recycle+lookup@4", help="a --heads mix and its node budget, MIX@NODES")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--bucket", type=int, default=BatchSettings.bucket,
                   help="prompt widths are BUCKET * 2**k, caches sized from them (default: generate_batch's, "
                        "%(default)s; bench/mixed_drafts pads every prompt to 512)")
    p.add_argument("--out", required=True, help="report folder")
    a = p.parse_args(argv)
    name, _, nodes = a.mix.partition("@")
    try:
        batches = [int(b) for b in a.batch_sizes.split(",")]
    except ValueError:
        p.exit(2, "error: --batch-sizes takes comma-separated integers, e.g. 1,4\n")
    if not nodes.isdigit() or int(nodes) < 1 or a.questions < 1 or a.max_new_tokens < 1 or min(batches) < 1 \
            or a.bucket < 1:
        p.exit(2, "error: --mix needs MIX@NODES with NODES >= 1; --questions, --max-new-tokens, --batch-sizes and "
                  "--bucket must be >= 1\n")
    enable_compile_cache()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    loaded = load_model(a.model, a.heads)
    prompts = loaded.encode_chat([q.first_turn for q in mtbench_questions(a.questions)])
    results = {"machine": machine_description(), "load_at_start": round(os.getloadavg()[0], 1), "mix": a.mix,
               "questions": a.questions, "max_new_tokens": a.max_new_tokens, "bucket": a.bucket, "batches": {}}
    for batch in batches:
        results["batches"][batch] = measure(loaded, name, int(nodes), prompts, batch, a.max_new_tokens, a.bucket,
                                            say)
        say(json.dumps(results["batches"][batch]))
    command = command_line("-m medusa_jax.bench.engine_mix", argv)
    results["command"] = command
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "README.md").write_text(markdown(results, command))
    print(markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
