"""Throughput of batch generation (`inference.api.generate_batch`) on MT-Bench first turns: plain vs Medusa at
several batch sizes, and refilled (continuous) batching vs length-sorted batches; docs/modules.md."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Sequence

from flax import nnx

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.paths import portable_path
from medusa_jax.settings import at_least, check_settings, each, setting
from medusa_jax.trees.tree import DEFAULT_TREE, load_tree
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.inference.engine import PROMPT_BUCKET, check_prompts, round_up
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import RequestParams
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import table

METHODS = ("plain", "medusa", "refill")


@dataclasses.dataclass(frozen=True)
class BatchBenchConfig:
    batch_sizes: tuple[int, ...] = setting((1, 8, 32), each(at_least(1)))
    max_new_tokens: int = setting(128, at_least(1))
    tree: str = DEFAULT_TREE  # preset name or tree JSON file
    methods: tuple[str, ...] = ("plain", "medusa")
    chunk_steps: int = setting(32, at_least(1))  # refill: decode steps between refills

    def __post_init__(self):
        check_settings(self)
        if set(self.methods) - set(METHODS) or not self.methods:
            raise ValueError(f"--methods {','.join(self.methods)!r}: give a comma-separated subset of "
                             f"{','.join(METHODS)}")


def run_batch_benchmark(model: ShardedModel, prompts: Sequence[Sequence[int]], config: BatchBenchConfig, *,
                        eos_ids: tuple[int, ...], pad_id: int, progress: bool = True,
                        log: Callable[[str], None] = print) -> dict:
    """Runs every (batch size, method) on all prompts; returns {"config", "rows"}."""
    tree = None
    if "medusa" in config.methods:
        if not model.has_heads:
            raise ValueError("the Medusa runs need a ShardedModel with heads")
        tree = load_tree(config.tree, num_heads=model.heads_config.num_heads,
                         max_top_k=model.heads_config.head_vocab_size)
    rows = []
    for batch_size in config.batch_sizes:
        outputs = {}
        for method in config.methods:
            if method == "refill":
                rows.append(_refill_row(model, prompts, config, batch_size, eos_ids, pad_id, outputs.get("plain")))
                log(json.dumps(rows[-1]))
                continue
            settings = BatchSettings(batch_size=batch_size, max_new_tokens=config.max_new_tokens,
                                     tree=tree if method == "medusa" else None, eos_ids=eos_ids, pad_id=pad_id,
                                     engine="batches")
            run = generate_batch(model, prompts, settings, progress=progress)
            outputs[method] = [r.token_ids for r in run.results]
            row = {"batch_size": batch_size, "method": method, "prompts": len(prompts),
                   "new_tokens": run.new_tokens, "seconds": round(run.seconds, 2),
                   "compile_seconds": round(run.compile_seconds, 2),
                   "tokens_per_s": round(run.tokens_per_second, 2),
                   "tokens_per_s_excl_compile": round(run.decode_tokens_per_second, 2),
                   "tokens_per_step": round(run.tokens_per_step, 3), "batches": run.num_batches,
                   "compiled_shapes": run.num_shapes}
            if method == "medusa" and "plain" in outputs:
                row["rows_differing_from_plain"] = sum(a != b for a, b in zip(outputs["plain"], outputs["medusa"]))
            rows.append(row)
            log(json.dumps(row))
    return {"config": {**dataclasses.asdict(config), "tree_nodes": None if tree is None else tree.num_tokens - 1},
            "rows": rows}


def _refill_row(model: ShardedModel, prompts, config: BatchBenchConfig, batch_size: int, eos_ids, pad_id,
                plain_outputs) -> dict:
    if model.mesh.size > 1:
        raise ValueError("the refill runs use one device (run them without --mesh)")
    base = nnx.merge(model.base_graphdef, model.base_params)
    check_prompts(prompts, base.config.max_position_embeddings, config.max_new_tokens)
    context = round_up(max(map(len, prompts)) + config.max_new_tokens, PROMPT_BUCKET)
    engine = GenerationEngine(base, EngineConfig(rows=batch_size, context=context, chunk_steps=config.chunk_steps,
                                                 max_queue=len(prompts)), eos_ids=eos_ids, pad_id=pad_id)
    start, chunks = time.perf_counter(), 0
    with CompileCounter() as compiles:
        requests = [engine.submit(p, RequestParams(max_tokens=config.max_new_tokens)) for p in prompts]
        while any(r.finish_reason is None for r in requests):
            engine.run_once()
            chunks += 1
    seconds = time.perf_counter() - start
    compile_s = min(compiles.compile_seconds, seconds)
    tokens = [r.tokens for r in requests]
    new_tokens = sum(map(len, tokens))
    row = {"batch_size": batch_size, "method": "refill", "prompts": len(prompts), "new_tokens": new_tokens,
           "seconds": round(seconds, 2), "compile_seconds": round(compile_s, 2),
           "tokens_per_s": round(new_tokens / max(seconds, 1e-9), 2),
           "tokens_per_s_excl_compile": round(new_tokens / max(seconds - compile_s, 1e-9), 2), "tokens_per_step": 1.0,
           "chunks": chunks, "slot_use": round(new_tokens / max(batch_size * engine.metrics.decode_steps, 1), 3)}
    if plain_outputs is not None:
        row["rows_differing_from_plain"] = sum(a != b for a, b in zip(plain_outputs, tokens))
    return row


def markdown(result: dict, title: str) -> str:
    rows = result["rows"]
    keys = ("batch_size", "method", "new_tokens", "tokens_per_step", "tokens_per_s", "tokens_per_s_excl_compile",
            "seconds", "compile_seconds", "rows_differing_from_plain")
    lines = [title, "", *table("batch | method | new tokens | tokens/step | tokens/s | tokens/s excl. compile | "
                               "seconds | compile s | differs from plain", ([r.get(k, "") for k in keys] for r in rows))]
    by_size = {}
    for r in rows:
        by_size.setdefault(r["batch_size"], {})[r["method"]] = r
    for other, label in (("medusa", "Medusa"), ("refill", "Refill")):
        pairs = {b: v for b, v in by_size.items() if other in v and "plain" in v}
        if pairs:
            lines += ["", f"{label} / plain tokens/s (excl. compile): " + ", ".join(
                f"batch {b}: {v[other]['tokens_per_s_excl_compile'] / v['plain']['tokens_per_s_excl_compile']:.2f}x"
                for b, v in pairs.items())]
    use = [f"batch {r['batch_size']}: {r['slot_use']:.0%}" for r in rows if "slot_use" in r]
    if use:
        lines += ["", "Refill slot-steps that produced a token: " + ", ".join(use)]
    return "\n".join(lines) + "\n"


def write_report(result: dict, out, config: BatchBenchConfig, *, folder, heads: str, mesh: str, dtype: str,
                 prompts: int, command: str, machine: dict) -> str:
    """OUT/batch.json (the run and where it ran) and OUT/batch.md (its table); returns the markdown."""
    result.update(model=portable_path(folder), heads=heads, mesh=mesh or "single device", dtype=dtype,
                  prompts=prompts, command=command, machine=machine)
    text = markdown(result, f"Batch generation, {prompts} MT-Bench first turns, {config.max_new_tokens} new tokens "
                            f"max, {Path(folder).name} {dtype}, heads: {heads}, tree {config.tree}, mesh "
                            f"{result['mesh']}\n\nCommand: `{command}`")
    write_files(out, {"batch.json": json.dumps(result, indent=1), "batch.md": text})
    return text
