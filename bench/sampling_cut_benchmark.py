"""`row_target_logits` (inference/vocab_cut.py: no sort unless the largest few logits leave the cut undecided)
against the full sort it replaced (`vocab_cut.sorted_threshold` over every row), on SmolLM2's vocabulary size for
batch 1/4/16 and 1/5/17 tree nodes; both timed in interleaved rounds, medians. Writes bench/sampling/vocab_cut/.

    python -m medusa_jax.bench.sampling_cut_benchmark

Logits: "lm-like", Zipf-shaped (the r-th largest is -log r plus noise, shuffled), where an LM's top 1024 tokens
hold top_p = 0.9 of the mass; "flat", normal(0, 1), where they do not (top-p falls back to the sort: the worst
case, the candidates' cost on top of the sort).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.bench_report import fmt, machine_line, table
from medusa_jax.inference.row_sampling import RowSampling, row_target_logits
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.vocab_cut import sorted_threshold
from medusa_jax.trees.policy.calibration import machine_description

VOCAB = 49152  # SmolLM2's
BATCHES, NODES, ROUNDS = (1, 4, 16), (1, 5, 17), 5
CASES = {"temperature 0.7": (SamplingConfig(0.7), "lm-like"), "top-k 50": (SamplingConfig(0.7, top_k=50), "lm-like"),
         "top-p 0.9": (SamplingConfig(0.7, top_p=0.9), "lm-like"),
         "top-p 0.9, flat": (SamplingConfig(0.7, top_p=0.9), "flat")}
OUT = Path(__file__).resolve().parent / "sampling" / "vocab_cut"


def sorted_target_logits(logits_bxv: jax.Array, sampling: RowSampling) -> jax.Array:
    """The replaced `row_target_logits`: every row through the full sort (sampled rows only, as in the benchmark)."""
    def per_row(x_b):
        return x_b.reshape(x_b.shape + (1,) * (logits_bxv.ndim - 1))

    scaled_bxv = logits_bxv.astype(jnp.float32) / per_row(sampling.temperature_b)
    v = scaled_bxv.shape[-1]
    k_b = jnp.where((sampling.top_k_b > 0) & (sampling.top_k_b < v), sampling.top_k_b, v)
    threshold_bx1 = sorted_threshold(scaled_bxv, per_row(k_b), per_row(sampling.top_p_b))
    return jnp.where(scaled_bxv >= threshold_bx1, scaled_bxv, -jnp.inf)


def logits_btv(kind: str, b: int, t: int, rng: np.random.Generator) -> jax.Array:
    if kind == "flat":
        return jnp.asarray(rng.normal(size=(b, t, VOCAB)), jnp.float32)
    zipf_btv = -np.log(np.arange(1, VOCAB + 1)) + 0.1 * rng.normal(size=(b, t, VOCAB))
    return jnp.asarray(rng.permuted(zipf_btv, axis=-1), jnp.float32)


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run() -> dict:
    rng = np.random.default_rng(0)
    new, old = jax.jit(row_target_logits), jax.jit(sorted_target_logits)
    rows = []
    for case, (config, kind) in CASES.items():
        for b in BATCHES:
            for t in NODES:
                x_btv, sampling = logits_btv(kind, b, t, rng), RowSampling.of([config] * b, range(b))
                differing = int(jnp.sum(jnp.any(new(x_btv, sampling) != old(x_btv, sampling), axis=-1)))  # compiles
                times = {"new": [], "old": []}
                for _ in range(ROUNDS):
                    times["new"].append(seconds(new, x_btv, sampling))
                    times["old"].append(seconds(old, x_btv, sampling))
                new_s, old_s = statistics.median(times["new"]), statistics.median(times["old"])
                rows.append({"case": case, "batch": b, "nodes": t, "new_ms": 1e3 * new_s, "sort_ms": 1e3 * old_s,
                             "ratio_new_over_sort": new_s / old_s, "rows_differing": differing})
                print(f"{case}, batch {b}, nodes {t}: {1e3 * new_s:.2f} ms vs sort {1e3 * old_s:.2f} ms, "
                      f"ratio {new_s / old_s:.3f}, {differing} of {b * t} rows differing")
    return {"rows": rows, "vocab": VOCAB, "rounds": ROUNDS}


def markdown(results: dict) -> str:
    lines = [machine_line(results["machine"]), f"Command: `{results['command']}`",
             f"`row_target_logits` on {results['vocab']} logits per node, every row sampled with the case's settings, "
             f"against the full sort it replaced; median of {results['rounds']} interleaved rounds. Rows differing: "
             f"rows (batch x nodes) whose kept logits differ from the sort's, possible only where the top-p boundary "
             f"lies within float rounding of top_p (inference/vocab_cut.py).", ""]
    lines += table("case | batch | nodes | new ms | sort ms | new / sort | rows differing", (
        [r["case"], r["batch"], r["nodes"], fmt(r["new_ms"]), fmt(r["sort_ms"]), fmt(r["ratio_new_over_sort"], 3),
         f"{r['rows_differing']} of {r['batch'] * r['nodes']}"] for r in results["rows"]))
    return "\n".join(lines) + "\n"


def main() -> int:
    results = {"command": "python -m medusa_jax.bench.sampling_cut_benchmark", "machine": machine_description(),
               **run()}
    files = write_files(OUT, {"results.json": json.dumps(results, indent=1) + "\n", "README.md": markdown(results)})
    print("wrote", ", ".join(str(p) for p in files.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
