"""Benchmark results to files (results.json, results.md, PNG plots), each written atomically."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

from medusa_jax.atomic import pyplot, save_figure_atomic
from medusa_jax.bench.bench_inputs import write_files

TARGETS = {"acceleration_rate": 3.0, "speedup_batch1": 2.5, "speedup_batch8": 1.5}
PLOTS = ("speedup_by_category.png", "accept_lengths.png", "speedup_vs_tree_size.png", "batched_throughput.png")
_METHOD_NAMES = {"plain": "plain decode (ours)", "medusa": "Medusa (ours)", "hf": "transformers generate"}


def machine_line(machine: dict) -> str:
    """Date, CPU, devices and load of a run (`calibration.machine_description`), one sentence."""
    return (f"Date: {machine['date']}. Machine: {machine['cpu']}, {machine['cpu_count']} cores ({machine['devices']}, "
            f"JAX {machine['jax']}, load average {fmt(machine['load_average_1m'], 1)} at start).")


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table(header: str, rows: Iterable[Sequence]) -> list[str]:
    """A Markdown table: the `header` row ('a | b | c'), its rule, and a line per row of cells."""
    return [f"| {header} |", "|---" * (header.count("|") + 1) + "|", *(f"| {' | '.join(map(str, r))} |" for r in rows)]


def target_status(results: dict) -> dict:
    """Each target with the measured value (None when not measured) and whether it is met."""
    batched = {row["batch_size"]: row["speedup"] for row in results.get("batched", [])}
    measured = {"acceleration_rate": results["acceleration_rate"], "speedup_batch1": batched.get(1),
                "speedup_batch8": batched.get(8)}
    return {k: {"target": t, "measured": measured[k], "met": measured[k] is not None and measured[k] >= t}
            for k, t in TARGETS.items()}


def markdown(results: dict) -> str:
    meta, ov, tree = results["meta"], results["overall"], results["tree"]
    lines = [
        machine_line(meta["machine"]),
        f"Command: `{meta['command']}`",
        f"Model: {meta['model']}; heads: {results['heads']['folder']} ({results['heads']['num_heads']} heads, "
        f"lm_head={results['heads']['lm_head']}); tree: {tree.get('origin', tree['spec'])} "
        f"({tree['num_nodes']} nodes + root, depth {tree['depth']}); {ov['questions']} MT-Bench first turns, greedy, max {results['config']['max_new_tokens']} "
        f"new tokens, batch {results['config']['batch_size']}.",
        "", *table("method | tokens/s | tokens/step | ms/step | speedup vs plain",
                   ([_METHOD_NAMES[m], fmt(tps, 1), fmt(ov["tokens"][m] / ov["steps"][m]),
                     fmt(1e3 * ov["seconds"][m] / ov["steps"][m], 1), f"{fmt(tps / ov['tokens_per_s']['plain'])}x"]
                    for m, tps in ov["tokens_per_s"].items()))]
    lines += ["", f"Acceleration rate {fmt(results['acceleration_rate'])} tokens/step; step overhead "
              f"{fmt(results['step_overhead'])}x; speedup {fmt(results['speedup'])}x; Medusa/plain mismatches: "
              f"{results['mismatches']} of {ov['questions']}."
              + (f" Predicted by build_tree: {fmt(tree['predicted_tokens_per_step'])} tokens/step."
                 if "predicted_tokens_per_step" in tree else "")
              + (f" transformers vs our plain: {ov['hf_mismatches']} outputs differ (fp32 rounding can flip a "
                 f"near-tie argmax)." if "hf_mismatches" in ov else "")]
    lines += ["", *table("category | questions | plain tok/s | Medusa tok/s | speedup | tokens/step | step overhead",
                         ([c, s["questions"], fmt(s["tokens_per_s"]["plain"], 1), fmt(s["tokens_per_s"]["medusa"], 1),
                           f"{fmt(s['speedup'])}x", fmt(s["acceleration_rate"]), f"{fmt(s['step_overhead'])}x"]
                          for c, s in results["per_category"].items()))]
    if results.get("batched"):
        lines += ["", *table("batch | questions | plain tok/s (total) | Medusa tok/s (total) | speedup | tokens/step "
                             "| mismatches", ([r["batch_size"], r["questions"], fmt(r["tokens_per_s"]["plain"], 1),
                                               fmt(r["tokens_per_s"]["medusa"], 1), f"{fmt(r['speedup'])}x",
                                               fmt(r["acceleration_rate"]), r["mismatches"]]
                                              for r in results["batched"]))]
    if results.get("tree_sweep"):
        lines += ["", *table("tree nodes | tokens/step | Medusa tok/s | plain tok/s (same questions, timed alongside) "
                             "| speedup", ([f"{r['num_nodes']}{' (main)' if r['is_main_tree'] else ''}",
                                            fmt(r["acceleration_rate"]), fmt(r["tokens_per_s"], 1),
                                            fmt(r["plain_tokens_per_s"], 1), f"{fmt(r['speedup'])}x"]
                                           for r in results["tree_sweep"]))]
    prof = results.get("step_profile")
    if prof:
        lines += ["", f"Where a Medusa step's time goes (batch 1, {prof['context']} tokens of context, each piece "
                      f"jitted alone, ms): " + ", ".join(f"{k.replace('_', ' ')} {fmt(v, 1)}"
                                                          for k, v in prof["pieces_ms"].items())
                  + f"; the whole step in one jitted call {fmt(prof['medusa_step_ms'], 1)}; a plain step "
                    f"{fmt(prof['plain_step_ms'], 1)}."]
    lines += ["", *table("target | goal | measured | met", ([name, f">= {t['target']}", fmt(t["measured"]),
                                                           "yes" if t["met"] else "no"]
                                                          for name, t in target_status(results).items()))]
    return "\n".join(lines) + "\n"


def plot_all(results: dict, out: Path) -> list[Path]:
    plt = pyplot()
    written = []

    def save(fig, name):
        save_figure_atomic(fig, out / name, dpi=110, bbox_inches="tight")
        written.append(out / name)

    cats = list(results["per_category"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    values = [results["per_category"][c]["speedup"] for c in cats] + [results["speedup"]]
    ax.bar(cats + ["overall"], values, color=["#4c72b0"] * len(cats) + ["#c44e52"])
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set(ylabel="Medusa speedup vs plain decode",
           title=f"Speedup by MT-Bench category (batch {results['config']['batch_size']})")
    ax.tick_params(axis="x", rotation=30)
    save(fig, PLOTS[0])

    hist = results["accept_length_histogram"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    total = max(sum(hist), 1)
    ax.bar(range(len(hist)), [h / total for h in hist], color="#55a868")
    ax.set(xlabel="accepted candidates per verify step", ylabel="fraction of steps", xticks=range(len(hist)),
           title=f"Accept lengths (mean {results['acceleration_rate']:.2f} tokens/step incl. bonus)")
    save(fig, PLOTS[1])

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    sweep = results.get("tree_sweep") or []
    if sweep:
        xs = [r["num_nodes"] for r in sweep]
        ax.plot(xs, [r["speedup"] for r in sweep], "o-", color="#c44e52", label="speedup")
        ax.plot(xs, [r["acceleration_rate"] for r in sweep], "s--", color="#4c72b0", label="tokens/step")
        main = [r for r in sweep if r["is_main_tree"]]
        if main:
            ax.plot([main[0]["num_nodes"]], [main[0]["speedup"]], "*", ms=14, color="black", label="benchmarked tree")
        ax.set_xscale("log", base=2)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no tree sweep in this run", ha="center", va="center", transform=ax.transAxes)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set(xlabel="tree nodes (root excluded)", title="Speedup vs tree size")
    save(fig, PLOTS[2])

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    rows = results.get("batched") or []
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tokens_per_s"]["plain"] for r in rows], 0.4, label="plain", color="#8c8c8c")
    ax.bar([x + 0.2 for x in xs], [r["tokens_per_s"]["medusa"] for r in rows], 0.4, label="Medusa", color="#c44e52")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["tokens_per_s"]["medusa"], f"x{r['speedup']:.2f}", ha="center", va="bottom")
    ax.set(xticks=list(xs), xticklabels=[str(r["batch_size"]) for r in rows], xlabel="batch size",
           ylabel="total tokens/s", title="Throughput by batch size")
    ax.legend()
    save(fig, PLOTS[3])
    return written


def write_report(results: dict, out: str | os.PathLike) -> dict[str, Path]:
    """Writes results.json, results.md and the plots into `out`; returns their paths."""
    results = {**results, "targets": target_status(results)}
    files = write_files(out, {"results.json": json.dumps(results, indent=1, default=float) + "\n",
                              "results.md": markdown(results)})
    return {"json": files["results.json"], "markdown": files["results.md"],
            **{p.stem: p for p in plot_all(results, Path(out))}}
