"""MT-Bench sampling benchmark: plain sampling vs Medusa exact vs typical acceptance at several temperatures,
with Medusa greedy as the tokens/step reference; docs/modules.md."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Sequence

from medusa_jax.paths import portable_path
from medusa_jax.settings import above, at_least, check_settings, each, setting
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.trees.trees_file import trees_of
from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.engine import PROMPT_BUCKET, round_up
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.trees.policy.choose import choose_tree
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import fmt, machine_line, table
from medusa_jax.mtbench import MTBenchQuestion

SAMPLED = ("plain", "exact", "typical")  # methods timed at each temperature
RATIO_TARGET = {"temperature": 0.7, "min_ratio": 0.85}


@dataclasses.dataclass(frozen=True)
class SamplingBenchConfig:
    temperatures: tuple[float, ...] = setting((0.7, 1.0), each(above(0.0)))
    max_new_tokens: int = setting(256, at_least(1))
    batch_size: int = setting(1, at_least(1))
    tree: str | None = None  # None: the heads' own tree for this backend and batch size (trees.json)
    seed: int = 0

    def __post_init__(self):
        check_settings(self)


class _Runner:
    """One method at one temperature (None: greedy) through the public API, compiled before it is timed."""

    def __init__(self, loaded: LoadedModel, tree: TreeBuffers, config: SamplingBenchConfig):
        self.loaded, self.tree, self.config = loaded, tree, config
        self._warm: set = set()

    def _call(self, method: str, temperature: float | None, prompts, seed: int):
        lm, n, b = self.loaded, self.config.max_new_tokens, self.config.batch_size
        common = dict(max_new_tokens=n, eos_ids=lm.eos_ids, pad_id=lm.pad_id, batch_size=b, seed=seed)
        if method == "plain":
            return generate(lm.base, prompts, sampling=SamplingConfig(temperature), **common)
        sampling = SamplingConfig() if method == "greedy" else SamplingConfig(temperature)
        return generate_medusa(lm.base, lm.heads, prompts, tree=self.tree, sampling=sampling,
                               acceptance=AcceptanceConfig(method), **common)

    def run(self, method: str, temperature: float | None, prompts, seed: int) -> dict:
        key = (method, temperature, round_up(max(len(p) for p in prompts), PROMPT_BUCKET))
        if key not in self._warm:
            self._call(method, temperature, prompts, seed + 10_000)  # compile (other draws than the timed run)
            self._warm.add(key)
        start = time.perf_counter()
        results = self._call(method, temperature, prompts, seed)
        seconds = time.perf_counter() - start
        return {"tokens": sum(r.new_tokens for r in results), "steps": sum(r.steps for r in results),
                "seconds": seconds}


def _totals(records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    steps = sum(r["steps"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "tokens_per_step": tokens / max(steps, 1),
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan")}


def run_sampling_benchmark(loaded: LoadedModel, questions: Sequence[MTBenchQuestion], config: SamplingBenchConfig,
                           progress: Callable[[str], None] = print) -> dict:
    """The results dict: per temperature each method's totals, speedups and the exact/greedy tokens/step ratio."""
    if loaded.heads is None:
        raise ValueError("the sampling benchmark needs Medusa heads")
    hc = loaded.heads.config
    chosen = choose_tree(hc, trees_of(loaded.heads), config.batch_size, config.tree)
    if chosen.tree is None:
        raise ValueError(f"no Medusa tree to benchmark at batch {config.batch_size}: {chosen.note}; pass --tree")
    tree = chosen.tree
    progress(f"tree: {chosen.note}")
    prompts = loaded.encode_chat([q.first_turn for q in questions])
    runner = _Runner(loaded, tree, config)
    runs = [("greedy", None)] + [(m, t) for t in config.temperatures for m in SAMPLED]
    records: dict[tuple, list[dict]] = {run: [] for run in runs}
    b = config.batch_size
    for i in range(0, len(prompts), b):
        for method, temperature in runs:
            records[(method, temperature)].append(runner.run(method, temperature, prompts[i: i + b],
                                                             config.seed + i))
        progress(f"[{min(i + b, len(prompts))}/{len(prompts)}] " + ", ".join(
            f"{m}@{t}: {records[(m, t)][-1]['tokens'] / max(records[(m, t)][-1]['steps'], 1):.2f} tok/step"
            for m, t in runs if m != "plain"))
    greedy = _totals(records[("greedy", None)])
    by_temperature = {}
    for t in config.temperatures:
        row = {m: _totals(records[(m, t)]) for m in SAMPLED}
        for m in SAMPLED:
            row[m]["speedup_vs_plain"] = row[m]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        row["exact_over_greedy_tokens_per_step"] = row["exact"]["tokens_per_step"] / greedy["tokens_per_step"]
        by_temperature[str(t)] = row
    return {"greedy_medusa": greedy, "by_temperature": by_temperature, "questions": len(prompts),
            "config": dataclasses.asdict(config), "ratio_target": RATIO_TARGET,
            "tree": {"spec": config.tree or chosen.note, "num_nodes": len(tree.paths), "depth": tree.depth},
            "heads": {"folder": portable_path(loaded.heads_folder), **dataclasses.asdict(hc)}}


def sampling_markdown(results: dict) -> str:
    meta, cfg, greedy = results["meta"], results["config"], results["greedy_medusa"]
    lines = [machine_line(meta["machine"]),
             f"Command: `{meta['command']}`",
             f"Model: {meta['model']}; heads: {results['heads']['folder']}; tree: {results['tree']['spec']} "
             f"({results['tree']['num_nodes']} nodes); {results['questions']} MT-Bench first turns, max "
             f"{cfg['max_new_tokens']} new tokens, batch {cfg['batch_size']}, top-p 1, no top-k.",
             f"Medusa greedy (same heads and tree): {fmt(greedy['tokens_per_step'])} tokens/step, "
             f"{fmt(greedy['tokens_per_s'], 1)} tokens/s.", ""]
    names = {"plain": "plain sampling", "exact": "Medusa, exact acceptance", "typical": "Medusa, typical acceptance"}
    for t, row in results["by_temperature"].items():
        lines += [f"### Temperature {t}", "", *table("method | tokens/s | tokens/step | speedup vs plain sampling", (
            [names[m], fmt(row[m]["tokens_per_s"], 1), fmt(row[m]["tokens_per_step"]),
             f"{fmt(row[m]['speedup_vs_plain'])}x"] for m in SAMPLED))]
        lines += ["", f"Exact tokens/step / greedy tokens/step: {fmt(row['exact_over_greedy_tokens_per_step'])}"
                  + (f" (target >= {RATIO_TARGET['min_ratio']})" if float(t) == RATIO_TARGET["temperature"] else ""),
                  ""]
    return "\n".join(lines)


def write_sampling_report(results: dict, out: str | Path) -> dict[str, Path]:
    """OUT/sampling.json and OUT/sampling.md, each written atomically."""
    files = write_files(out, {"sampling.json": json.dumps(results, indent=1, default=float) + "\n",
                              "sampling.md": sampling_markdown(results)})
    return {"json": files["sampling.json"], "markdown": files["sampling.md"]}
