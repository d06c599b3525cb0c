"""Plain-decode benchmark: our jitted decode vs transformers' PyTorch `generate`, and both vs the memory floor.

Batch 1, greedy, a fixed number of new tokens (EOS ignored so every call makes exactly that many), question
by question, the two methods interleaved (their order alternating) so machine load hits both alike.
Each round also re-measures memory bandwidth, which gives the floor:
    floor tokens/s = bandwidth / weight bytes   (one decode step must read every weight once)
Timed figures are wall-clock seconds of the public API call, prefill included. Our first call for a new
prompt bucket compiles; it runs untimed first and its compile seconds are reported apart (from JAX's own
compile events).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.inference.engine import PROMPT_BUCKET, generate, round_up
from medusa_jax.inference.text_generation import compile_seconds as compile_events


def weight_bytes(model: CausalLM) -> int:
    """Bytes of all parameters (a tied embedding counts once: the decode step reads it once, as lm_head)."""
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))))


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclasses.dataclass
class BandwidthProbe:
    """Read bandwidth over a buffer far bigger than the caches, three ways; the best is the floor's bandwidth:
    numpy sum (one thread), a jitted JAX sum, and a jitted matrix-vector product (what a decode step does)."""

    nbytes: int = 1 << 30
    repeats: int = 3

    def __post_init__(self):
        cols = 4096
        rows = self.nbytes // (4 * cols)
        self._host = np.ones((rows, cols), np.float32)
        self._dev = jnp.asarray(self._host)
        self._vec = jnp.ones((1, rows), jnp.float32)
        self._sum = jax.jit(jnp.sum)
        self._gemv = jax.jit(lambda v, m: v @ m)
        self._sum(self._dev).block_until_ready()
        self._gemv(self._vec, self._dev).block_until_ready()

    def measure(self) -> dict[str, float]:
        """GB/s of each way and `best`."""
        n = self._host.nbytes
        out = {
            "numpy_sum": n / _best_seconds(lambda: self._host.sum(), self.repeats) / 1e9,
            "jax_sum": n / _best_seconds(lambda: self._sum(self._dev).block_until_ready(), self.repeats) / 1e9,
            "jax_gemv": n / _best_seconds(
                lambda: self._gemv(self._vec, self._dev).block_until_ready(), self.repeats) / 1e9,
        }
        out["best"] = max(out.values())
        return out


class TorchGenerate:
    """transformers' PyTorch model, greedy `generate` of exactly `max_new_tokens` tokens (EOS ignored)."""

    def __init__(self, folder, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def __call__(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        ids = self.torch.tensor([list(prompt)])
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_decode_benchmark(model: CausalLM, folder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                         torch_threads: int = 2, rounds: int = 1, bandwidth_bytes: int = 1 << 30,
                         progress: Callable[[str], None] = lambda m: None) -> dict:
    """Runs the interleaved comparison; returns the results dict (see `summarize`)."""
    hf = TorchGenerate(folder, torch_threads)
    probe = BandwidthProbe(bandwidth_bytes)
    nbytes = weight_bytes(model)
    ours = lambda p: generate(model, [p], max_new_tokens=max_new_tokens, eos_ids=())[0].token_ids
    compile_seconds: dict[int, float] = {}
    hf(prompts[0], 4)  # warm PyTorch's allocator and kernels, untimed
    records = []
    for rnd in range(rounds):
        for i, prompt in enumerate(prompts):
            width = round_up(len(prompt), PROMPT_BUCKET)
            if width not in compile_seconds:
                with compile_events() as ev:
                    ours(prompt)
                compile_seconds[width] = sum(ev)
            timed: dict[str, tuple[list[int], float]] = {}
            order = ("ours", "hf") if (i + rnd) % 2 == 0 else ("hf", "ours")
            for method in order:
                fn = ours if method == "ours" else (lambda p: hf(p, max_new_tokens))
                start = time.perf_counter()
                tokens = fn(prompt)
                timed[method] = (tokens, time.perf_counter() - start)
            bandwidth = probe.measure()
            rec = {
                "round": rnd, "prompt": i, "prompt_tokens": len(prompt),
                "ours_seconds": timed["ours"][1], "hf_seconds": timed["hf"][1],
                "ours_tokens": len(timed["ours"][0]), "hf_tokens": len(timed["hf"][0]),
                "ours_tokens_per_s": len(timed["ours"][0]) / timed["ours"][1],
                "hf_tokens_per_s": len(timed["hf"][0]) / timed["hf"][1],
                "bandwidth_gb_s": bandwidth,
                "floor_tokens_per_s": bandwidth["best"] * 1e9 / nbytes,
                "same_tokens_prefix": common_prefix(timed["ours"][0], timed["hf"][0]),
            }
            records.append(rec)
            progress(f"round {rnd} prompt {i}: ours {rec['ours_tokens_per_s']:.1f} tok/s, transformers "
                     f"{rec['hf_tokens_per_s']:.1f} tok/s, floor {rec['floor_tokens_per_s']:.1f} tok/s "
                     f"({bandwidth['best']:.1f} GB/s)")
    return summarize(records, nbytes, compile_seconds, max_new_tokens, torch_threads)


def summarize(records: list[dict], nbytes: int, compile_seconds: dict[int, float], max_new_tokens: int,
              torch_threads: int) -> dict:
    def med(key):
        return statistics.median(r[key] for r in records)

    ours, hf, floor = med("ours_tokens_per_s"), med("hf_tokens_per_s"), med("floor_tokens_per_s")
    per_run_speedup = [r["ours_tokens_per_s"] / r["hf_tokens_per_s"] for r in records]
    per_run_floor = [r["ours_tokens_per_s"] / r["floor_tokens_per_s"] for r in records]
    bandwidth = collections.defaultdict(list)
    for r in records:
        for k, v in r["bandwidth_gb_s"].items():
            bandwidth[k].append(v)
    return {
        "config": {"max_new_tokens": max_new_tokens, "batch_size": 1, "greedy": True, "torch_threads": torch_threads,
                   "timed_calls_per_method": len(records)},
        "weight_bytes": nbytes,
        "compile_seconds_by_prompt_bucket": {str(k): v for k, v in compile_seconds.items()},
        "tokens_per_s": {"ours": ours, "transformers": hf, "floor": floor},
        "best_tokens_per_s": {"ours": max(r["ours_tokens_per_s"] for r in records),
                              "transformers": max(r["hf_tokens_per_s"] for r in records),
                              "floor": max(r["floor_tokens_per_s"] for r in records)},
        "bandwidth_gb_s_median": {k: statistics.median(v) for k, v in bandwidth.items()},
        "speedup_vs_transformers": statistics.median(per_run_speedup),
        "fraction_of_floor": statistics.median(per_run_floor),
        "targets": {"speedup_vs_transformers": 3.0, "fraction_of_floor": 0.7},
        "records": records,
    }


def markdown(results: dict, machine: dict, command: str) -> str:
    tps, best, cfg = results["tokens_per_s"], results["best_tokens_per_s"], results["config"]
    bw = results["bandwidth_gb_s_median"]
    compile_s = ", ".join(f"{v:.1f} s (prompt bucket {k})" for k, v in results["compile_seconds_by_prompt_bucket"].items())
    lines = [
        f"Date: {machine['date']}. Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']} "
        f"({machine['backend']}), load average {machine['load_average_1m']:.1f} at start.",
        f"Command: `{command}`",
        f"SmolLM2-135M-Instruct fp32 ({results['weight_bytes'] / 1e6:.0f} MB of weights), MT-Bench first turns with "
        f"the chat template, greedy, batch 1, {cfg['max_new_tokens']} new tokens (EOS ignored), "
        f"{cfg['timed_calls_per_method']} timed calls per method, interleaved; transformers with "
        f"torch threads = {cfg['torch_threads']}. Wall clock of the public call, prefill included.",
        "",
        "| | tokens/s (median) | tokens/s (best) | vs transformers | of floor |",
        "|---|---|---|---|---|",
        f"| medusa-jax plain decode | {tps['ours']:.1f} | {best['ours']:.1f} | "
        f"{results['speedup_vs_transformers']:.2f}x | {100 * results['fraction_of_floor']:.0f}% |",
        f"| transformers generate | {tps['transformers']:.1f} | {best['transformers']:.1f} | 1.00x | "
        f"{100 * tps['transformers'] / tps['floor']:.0f}% |",
        f"| floor (weight bytes / bandwidth) | {tps['floor']:.1f} | {best['floor']:.1f} | | 100% |",
        "",
        f"Bandwidth (median GB/s): numpy sum {bw['numpy_sum']:.1f}, JAX sum {bw['jax_sum']:.1f}, JAX gemv "
        f"{bw['jax_gemv']:.1f}; the floor uses the best of the three in each round.",
        f"Compile (ours, apart from the timings): {compile_s}.",
        f"Targets: >= {results['targets']['speedup_vs_transformers']:.0f}x transformers, >= "
        f"{100 * results['targets']['fraction_of_floor']:.0f}% of the floor (ratios are medians over calls).",
    ]
    if results.get("profile"):
        lines += ["", "Where one decode step's time goes (XLA CPU ops, summed over threads):", "",
                  "| op | calls/step | ms/step |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.2f} |" for r in results["profile"]]
    return "\n".join(lines) + "\n"
