"""The tree chooser's predictions against what it measures: `benchmark.py calibration`.

For each batch size: the heads' tree is chosen the way `generate.py --heads` chooses it (`choose.choose_tree`:
step costs timed on this machine on first use, then cached; `--fresh` times them again, as in a fresh clone
with an empty cache), and also as the shipped trees.json says (calibration skipped). Then the MT-Bench questions
are decoded greedily by plain decoding, the calibrated choice and the shipped choice, interleaved batch by batch
(compilation excluded), and each choice's predicted speedup and tokens/step sit beside the measured ones;
every Medusa answer is checked token by token against plain greedy decoding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

import jax

from medusa_jax.trees.tree import DynamicTree
from medusa_jax.trees.trees_file import trees_of
from medusa_jax.trees.policy import calibration
from medusa_jax.trees.policy.choose import choose_tree
from medusa_jax.inference.api import BatchSettings, generate_batch, plan_batches
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import machine_line


def _shipped_prediction(heads, batch: int) -> dict:
    """What trees.json predicted for the entry the shipped choice reads (build_tree's record), if anything."""
    trees = trees_of(heads)
    if trees is None:
        return {}
    for backend in trees.backends():
        batches = trees.built(backend).get("batches", {})
        if batches:
            usable = [int(b) for b in batches if int(b) <= batch] or [min(int(b) for b in batches)]
            record = batches[str(max(usable))]
            return {"predicted_speedup": record.get("predicted_speedup_vs_plain"),
                    "predicted_tokens_per_step": record.get("predicted_tokens_per_step")}
    return {}


def _nodes(tree) -> int:
    """Verified nodes per step (root excluded): 0 for plain decoding."""
    if tree is None:
        return 0
    return tree.nodes if isinstance(tree, DynamicTree) else len(tree.paths)


def run(loaded: LoadedModel, prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int], max_new_tokens: int,
        fresh: bool, progress: Callable[[str], None] = print) -> dict:
    plain_model, model = ShardedModel(loaded.base, None), ShardedModel(loaded.base, loaded.heads)
    rows = []
    for batch in batch_sizes:
        start = time.perf_counter()
        picked = None if model.heads_trees is None else calibration.calibrated_paths(
            model, model.heads_trees, jax.default_backend(), batch, "redo" if fresh else "auto", progress=progress)
        calibrate_seconds = time.perf_counter() - start
        own = dict(heads_config=model.heads_config, trees=model.heads_trees, batch_size=batch, model=model,
                   progress=False)
        chosen = {"calibrated": choose_tree(**own, calibration="auto"),  # reads what was just cached
                  "shipped": choose_tree(**own, calibration="skip")}
        predicted = {"shipped": _shipped_prediction(loaded.heads, batch)}
        if isinstance(picked, calibration.Calibrated):
            predicted["calibrated"] = {"predicted_speedup": picked.record["predicted_speedup_vs_plain"],
                                       "predicted_tokens_per_step": picked.record["predicted_tokens_per_step"]}
        progress(f"batch {batch}: calibrated: {chosen['calibrated'].note}; shipped: {chosen['shipped'].note}")
        names = ["plain", "calibrated", "shipped"]
        settings = {"plain": (plain_model, BatchSettings(batch, max_new_tokens, None, eos_ids=loaded.eos_ids,
                                                         pad_id=loaded.pad_id))}
        for name in ("calibrated", "shipped"):
            settings[name] = (plain_model if chosen[name].tree is None else model,
                              BatchSettings(batch, max_new_tokens, chosen[name].tree, eos_ids=loaded.eos_ids,
                                            pad_id=loaded.pad_id))
        tokens = {n: [None] * len(prompts) for n in names}
        seconds, steps = {n: 0.0 for n in names}, {n: 0 for n in names}
        for number, indices in enumerate(plan_batches([len(p) for p in prompts], batch)):
            order = names[number % 3:] + names[: number % 3]  # each method first in turn
            for name in order:
                m, s = settings[name]
                out = generate_batch(m, [prompts[i] for i in indices], s, progress=False)
                seconds[name] += out.seconds - out.compile_seconds
                for i, r in zip(indices, out.results):
                    tokens[name][i] = list(r.token_ids)
                    steps[name] += r.steps
        new = {n: sum(len(t) for t in tokens[n]) for n in names}
        rate = {n: new[n] / max(seconds[n], 1e-9) for n in names}
        row = {"batch": batch, "calibrate_seconds": calibrate_seconds if isinstance(picked, calibration.Calibrated)
               and picked.measured else 0.0, "plain_tokens_per_s": rate["plain"]}
        for name in ("calibrated", "shipped"):
            row[name] = {"tree": chosen[name].note,
                         "nodes": _nodes(chosen[name].tree),
                         "tokens_per_s": rate[name], "speedup": rate[name] / rate["plain"],
                         "tokens_per_step": new[name] / max(steps[name], 1),
                         "mismatches": sum(a != b for a, b in zip(tokens[name], tokens["plain"])),
                         **predicted.get(name, {})}
        progress(f"batch {batch}: plain {rate['plain']:.1f} tok/s; calibrated x{row['calibrated']['speedup']:.2f} "
                 f"(predicted x{row['calibrated'].get('predicted_speedup') or 1.0:.2f}); shipped "
                 f"x{row['shipped']['speedup']:.2f}")
        rows.append(row)
    return {"questions": len(prompts), "max_new_tokens": max_new_tokens, "fresh": fresh, "batches": rows}


def markdown(results: dict, command: str, machine: str) -> str:
    lines = [f"Command: `{command}`", machine, "",
             f"{results['questions']} MT-Bench first turns, greedy, at most {results['max_new_tokens']} new tokens; "
             "plain, the calibrated choice and the shipped choice interleaved batch by batch (compilation "
             "excluded). Predicted = the chooser's prediction (speedup over plain, tokens/step).", "",
             "| batch | choice | tree | predicted speedup | measured speedup | predicted tokens/step | "
             "measured tokens/step | mismatches |", "|---" * 8 + "|"]
    for row in results["batches"]:
        for name in ("calibrated", "shipped"):
            r = row[name]
            pred_s = r.get("predicted_speedup")
            pred_t = r.get("predicted_tokens_per_step")
            lines.append(f"| {row['batch']} | {name} | {r['tree']} | "
                         f"{'-' if pred_s is None else f'{pred_s:.2f}x'} | {r['speedup']:.2f}x | "
                         f"{'-' if pred_t is None else f'{pred_t:.2f}'} | {r['tokens_per_step']:.2f} | "
                         f"{r['mismatches']} |")
    lines += ["", "Plain tokens/s and calibration time per batch size:", "",
              "| batch | plain tok/s | calibration seconds |", "|---|---|---|"]
    lines += [f"| {r['batch']} | {r['plain_tokens_per_s']:.1f} | {r['calibrate_seconds']:.1f} |"
              for r in results["batches"]]
    return "\n".join(lines) + "\n"


def write(results: dict, out: str | Path, command: str, machine: dict) -> Path:
    """OUT/calibration.json and calibration.md; returns the markdown file."""
    return write_files(out, {"calibration.json": json.dumps({"command": command, "machine": machine, **results},
                                                            indent=1) + "\n",
                             "calibration.md": markdown(results, command, machine_line(machine))})["calibration.md"]
