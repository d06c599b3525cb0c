"""Decode-step scaling with the batch: step time and tokens/s of the plain and Medusa steps against a floor
(weights read once + batch x FLOPs, K/V reads apart) measured in the same run; the floor's terms: docs/modules.md."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.atomic import pyplot, save_figure_atomic
from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.trees.policy.step_cost import medusa_step_call, plain_step_call, time_call, time_interleaved
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.bench.decode_benchmark import BandwidthProbe, weight_bytes


def gemm_rate(rows: int, d_in: int, d_out: int, repeats: int = 5) -> float:
    """Sustained FLOP/s of a jitted fp32 [rows, d_in] x [d_in, d_out] product (median: `step_cost.time_call`)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, d_in, d_out)), jnp.float32)  # 8 weights: no cache-resident reuse
    f = jax.jit(lambda x, w: sum(x @ w[i] for i in range(w.shape[0])))
    return 2.0 * rows * d_in * d_out * w.shape[0] / time_call(lambda: f(x, w), repeats)


def flops_per_token(base: CausalLM, context: int) -> float:
    """Matmul FLOPs of one token through the backbone and lm_head, plus attention over `context` slots."""
    c = base.config
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    matmul_params = c.num_layers * per_layer + c.hidden_size * c.vocab_size
    return 2.0 * matmul_params + 4.0 * c.num_layers * c.num_heads * c.head_dim * context


def kv_bytes_per_row(base: CausalLM, context: int) -> float:
    """Bytes of K and V one row reads over `context` committed slots in one step (all layers)."""
    c = base.config
    return 2.0 * c.num_layers * c.num_kv_heads * c.head_dim * context * jnp.dtype(c.jnp_dtype).itemsize


def run_scaling(base: CausalLM, heads: MedusaHeads | None, tree: TreeBuffers | None, *,
                batch_sizes: tuple[int, ...], cache_sizes: tuple[int, ...], context_fraction: float = 0.75,
                rounds: int = 3, progress=print) -> dict:
    """Rows of {cache, batch, context, plain_ms, medusa_ms, plain_tok_s, floor_ms, floor_tok_s, of_floor,
    medusa_overhead} plus the measured probes."""
    bandwidth = BandwidthProbe(nbytes=512 << 20, repeats=3).measure()["best"] * 1e9
    c = base.config
    rate = max(gemm_rate(rows, c.hidden_size, c.intermediate_size) for rows in (64, 256, 1024))
    nbytes = weight_bytes(base)
    progress(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, GEMM {rate / 1e9:.1f} GFLOP/s, weights {nbytes / 1e6:.0f} MB")
    rows = []
    for size in cache_sizes:
        context = int(size * context_fraction)
        for b in batch_sizes:
            calls = [plain_step_call(base, b, context, size)]
            if heads is not None and tree is not None:
                calls.append(medusa_step_call(base, heads, tree, b, context, size))
            secs = time_interleaved(calls, rounds)
            floor = nbytes / bandwidth + b * flops_per_token(base, context) / rate
            floor_kv = floor + b * kv_bytes_per_row(base, context) / bandwidth
            row = {"cache": size, "batch": b, "context": context, "plain_ms": secs[0] * 1e3,
                   "plain_tok_s": b / secs[0], "floor_ms": floor * 1e3, "floor_tok_s": b / floor,
                   "of_floor": floor / secs[0], "floor_kv_ms": floor_kv * 1e3, "of_floor_kv": floor_kv / secs[0]}
            if len(secs) > 1:
                row.update(medusa_ms=secs[1] * 1e3, medusa_overhead=secs[1] / secs[0])
            rows.append(row)
            progress(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return {"read_bandwidth_gb_s": bandwidth / 1e9, "gemm_gflop_s": rate / 1e9, "weight_mb": nbytes / 1e6,
            "tree_tokens": None if tree is None else tree.num_tokens, "rows": rows}


def markdown(results: dict, command: str, machine: str) -> str:
    lines = ["# Decode-step scaling with the batch", "", f"Command: `{command}`", "", f"Machine: {machine}", "",
             f"Measured in the same run: read bandwidth {results['read_bandwidth_gb_s']:.1f} GB/s, fp32 GEMM "
             f"{results['gemm_gflop_s']:.1f} GFLOP/s, weights {results['weight_mb']:.0f} MB. Floor = weights / "
             f"bandwidth + batch x FLOPs per token / GEMM rate; + K/V adds each row's read of its context's K and V at "
             f"the read bandwidth. Medusa step: tree of {results['tree_tokens']} tokens.",
             "", "| cache | batch | plain ms/step | plain tok/s | floor ms | floor tok/s | % of floor | "
             "% of floor + K/V | tok/s vs batch 1 | Medusa ms/step | Medusa / plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    first = {}
    for r in results["rows"]:
        first.setdefault(r["cache"], r["plain_tok_s"])
        med = (f"{r['medusa_ms']:.1f} | {r['medusa_overhead']:.2f}x" if "medusa_ms" in r else "- | -")
        lines.append(f"| {r['cache']} | {r['batch']} | {r['plain_ms']:.1f} | {r['plain_tok_s']:.0f} | "
                     f"{r['floor_ms']:.1f} | {r['floor_tok_s']:.0f} | {100 * r['of_floor']:.0f}% | "
                     f"{100 * r['of_floor_kv']:.0f}% | {r['plain_tok_s'] / first[r['cache']]:.1f}x | {med} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for size in sorted({r["cache"] for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["cache"] == size]
        bs = [r["batch"] for r in rows]
        ax.plot(bs, [r["plain_tok_s"] for r in rows], "o-", label=f"plain, cache {size}")
        ax.plot(bs, [r["floor_tok_s"] for r in rows], "--", label=f"floor, cache {size}")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="batch", ylabel="tokens/s (decode steps)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)


def write(results: dict, out, command: str, machine: dict) -> str:
    """OUT/results.json, results.md and scaling.png; returns the markdown."""
    text = markdown(results, command, json.dumps(machine))
    write_files(out, {"results.json": json.dumps({"machine": machine, "command": command, **results}, indent=1),
                      "results.md": text})
    plot(results, Path(out) / "scaling.png")
    return text
