"""The tree chooser's predictions against what it measures (`benchmark.py calibration`): the calibrated and the
shipped choice per batch size, decoded with plain interleaved, predicted beside measured (docs/modules.md)."""

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
from medusa_jax.inference.api import BatchSettings
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import machine_line, table
from medusa_jax.bench.heads_comparison import interleaved


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
    return 0 if tree is None else tree.nodes if isinstance(tree, DynamicTree) else len(tree.paths)


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
        runs = interleaved({name: (plain_model if tree is None else model,
                                   BatchSettings(batch, max_new_tokens, tree, eos_ids=loaded.eos_ids,
                                                 pad_id=loaded.pad_id))
                            for name, tree in (("plain", None), ("calibrated", chosen["calibrated"].tree),
                                               ("shipped", chosen["shipped"].tree))}, prompts, batch)
        rate = {name: r["tokens_per_s"] for name, r in runs.items()}
        row = {"batch": batch, "calibrate_seconds": calibrate_seconds if isinstance(picked, calibration.Calibrated)
               and picked.measured else 0.0, "plain_tokens_per_s": rate["plain"]}
        for name in ("calibrated", "shipped"):
            row[name] = {"tree": chosen[name].note, "nodes": _nodes(chosen[name].tree),
                         "tokens_per_s": rate[name], "speedup": rate[name] / rate["plain"],
                         "tokens_per_step": runs[name]["new"] / max(runs[name]["steps"], 1),
                         "mismatches": sum(a != b for a, b in zip(runs[name]["tokens"], runs["plain"]["tokens"])),
                         **predicted.get(name, {})}
        progress(f"batch {batch}: plain {rate['plain']:.1f} tok/s; calibrated x{row['calibrated']['speedup']:.2f} "
                 f"(predicted x{row['calibrated'].get('predicted_speedup') or 1.0:.2f}); shipped "
                 f"x{row['shipped']['speedup']:.2f}")
        rows.append(row)
    return {"questions": len(prompts), "max_new_tokens": max_new_tokens, "fresh": fresh, "batches": rows}


def markdown(results: dict, command: str, machine: str) -> str:
    choices = [(row["batch"], name, row[name]) for row in results["batches"] for name in ("calibrated", "shipped")]
    lines = [f"Command: `{command}`", machine, "",
             f"{results['questions']} MT-Bench first turns, greedy, at most {results['max_new_tokens']} new tokens; "
             "plain, the calibrated choice and the shipped choice interleaved batch by batch (compilation "
             "excluded). Predicted = the chooser's prediction (speedup over plain, tokens/step).", "",
             *table("batch | choice | tree | predicted speedup | measured speedup | predicted tokens/step | "
                    "measured tokens/step | mismatches",
                    ([batch, name, r["tree"], _shown(r.get("predicted_speedup"), "x"), f"{r['speedup']:.2f}x",
                      _shown(r.get("predicted_tokens_per_step")), f"{r['tokens_per_step']:.2f}", r["mismatches"]]
                     for batch, name, r in choices)),
             "", "Plain tokens/s and calibration time per batch size:", "",
             *table("batch | plain tok/s | calibration seconds", ([r["batch"], f"{r['plain_tokens_per_s']:.1f}",
                                                                  f"{r['calibrate_seconds']:.1f}"]
                                                                 for r in results["batches"]))]
    return "\n".join(lines) + "\n"


def _shown(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def write(results: dict, out: str | Path, command: str, machine: dict) -> Path:
    """OUT/calibration.json and calibration.md; returns the markdown file."""
    return write_files(out, {"calibration.json": json.dumps({"command": command, "machine": machine, **results},
                                                            indent=1) + "\n",
                             "calibration.md": markdown(results, command, machine_line(machine))})["calibration.md"]
