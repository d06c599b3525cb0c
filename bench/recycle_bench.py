"""Token Recycling on MT-Bench: tokens per step at several template sizes, and speed against plain decoding
(interleaved batch by batch, every answer checked against plain greedy); docs/modules.md."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

from medusa_jax.heads.recycle import TEMPLATES, RecycleDrafter, template_tree
from medusa_jax.settings import at_least, check_settings, each, setting
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import table


@dataclasses.dataclass(frozen=True)
class RecycleBenchConfig:
    templates: tuple[str, ...] = ("recycle_4", "recycle_16", "recycle_64")
    batch_sizes: tuple[int, ...] = setting((1,), each(at_least(1)))
    max_new_tokens: int = setting(128, at_least(1))

    def __post_init__(self):
        unknown = [t for t in self.templates if t not in TEMPLATES]
        if unknown or not self.templates:
            raise ValueError(f"--templates {','.join(self.templates)}: unknown {unknown}; choose among "
                             f"{', '.join(TEMPLATES)}")
        check_settings(self)


@dataclasses.dataclass
class Tally:
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    mismatches: int = 0
    accepts: list[int] = dataclasses.field(default_factory=list)

    def row(self) -> dict:
        return {"new_tokens": self.tokens, "steps": self.steps, "tokens_per_step": self.tokens / max(self.steps, 1),
                "seconds": self.seconds, "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                "mismatches": self.mismatches, "accept_histogram": [self.accepts.count(a) for a in
                                                                    range(max(self.accepts, default=0) + 1)]}


def run_recycle_bench(loaded: LoadedModel, prompts: Sequence[Sequence[int]], make_drafter: Callable[[], RecycleDrafter],
                      config: RecycleBenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """{"batch_B": {"plain": row, "recycle_N": row + speedup, ...}} (rows: `Tally.row`)."""
    results = {}
    plain_model = ShardedModel(loaded.base)
    for batch in config.batch_sizes:
        settings = BatchSettings(batch_size=batch, max_new_tokens=config.max_new_tokens, eos_ids=loaded.eos_ids,
                                 pad_id=loaded.pad_id, engine="batches")
        models = {name: ShardedModel(loaded.base, make_drafter()) for name in config.templates}
        trees = {name: template_tree(name, models[name].heads_config.top_k) for name in config.templates}
        tallies = {name: Tally() for name in ("plain",) + config.templates}
        for start in range(0, len(prompts), batch):
            chunk = list(prompts[start: start + batch])
            plain = generate_batch(plain_model, chunk, settings, progress=False)
            reference = [r.token_ids for r in plain.results]
            _add(tallies["plain"], plain, reference)
            for name in config.templates:
                run = generate_batch(models[name], chunk, dataclasses.replace(settings, tree=trees[name]),
                                     progress=False)
                _add(tallies[name], run, reference)
            if progress is not None:
                progress(f"batch {batch}: {min(start + batch, len(prompts))}/{len(prompts)} prompts; " + ", ".join(
                    f"{n} {t.tokens / max(t.steps, 1):.2f} tok/step" for n, t in tallies.items() if n != "plain"))
        rows = {name: tally.row() for name, tally in tallies.items()}
        for name in config.templates:
            rows[name]["nodes"] = len(TEMPLATES[name])
            rows[name]["speedup"] = rows[name]["tokens_per_s"] / max(rows["plain"]["tokens_per_s"], 1e-9)
        results[f"batch_{batch}"] = rows
    return results


def _add(tally: Tally, run, reference: list[list[int]]) -> None:
    for result, want in zip(run.results, reference):
        tally.tokens += result.new_tokens
        tally.steps += result.steps
        tally.mismatches += int(result.token_ids != want)
        tally.accepts += list(result.accept_lengths or [])
    tally.seconds += run.seconds - run.compile_seconds


def markdown(results: dict, meta: dict) -> str:
    lines = ["# Token Recycling on MT-Bench (SmolLM2-135M-Instruct, greedy)", "",
             f"Command: `{meta['command']}`", "", meta["machine_line"], "",
             "The machine was shared with other jobs while this ran: the speed ratios compare methods interleaved "
             "batch by batch in the same run; absolute tokens/s are not representative.", "",
             f"{meta['questions']} MT-Bench first turns, {meta['max_new_tokens']} new tokens at most; drafter "
             f"started from {meta['table']}.", ""]
    for batch, rows in results.items():
        lines += [f"## {batch.replace('_', ' ')}", "",
                  *table("method | nodes | tokens/step | tokens/s | speedup vs plain | mismatches",
                         ([name, row.get("nodes", "-"), f"{row['tokens_per_step']:.2f}", f"{row['tokens_per_s']:.1f}",
                           f"{row.get('speedup', 1.0):.2f}x", row["mismatches"] if name != "plain" else "-"]
                          for name, row in rows.items())), ""]
    return "\n".join(lines)


def write_report(results: dict, meta: dict, out) -> str:
    """OUT/results.json and results.md; returns the markdown."""
    text = markdown(results, meta)
    write_files(out, {"results.json": json.dumps({"meta": meta, "results": results}, indent=1) + "\n",
                      "results.md": text + "\n"})
    return text
