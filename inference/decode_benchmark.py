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


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclasses.dataclass
class BandwidthProbe:
    """Sustained read bandwidth over a buffer far bigger than the CPU caches, three ways: numpy sum (one
    thread), a jitted JAX sum, and a jitted matrix-vector product (what a decode step does). Each is the
    median of `repeats` passes (under a shared machine's load, a best-of would pick quiet moments that a
    seconds-long decode never gets); the floor uses the fastest way."""

    nbytes: int = 1 << 30
    repeats: int = 5

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
        """GB/s of each way and `best` (the highest)."""
        n = self._host.nbytes
        out = {
            "numpy_sum": n / _median_seconds(lambda: self._host.sum(), self.repeats) / 1e9,
            "jax_sum": n / _median_seconds(lambda: self._sum(self._dev).block_until_ready(), self.repeats) / 1e9,
            "jax_gemv": n / _median_seconds(
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
    """Runs the interleaved comparison; returns the results dict (see `summarize`).

    Per prompt and round: our call with `max_new_tokens`, our call with 1 new token (prefill + first token:
    subtracting it leaves the time of the max_new_tokens - 1 decode steps, which is what the floor bounds),
    transformers' call, then a bandwidth measurement."""
    hf = TorchGenerate(folder, torch_threads)
    probe = BandwidthProbe(bandwidth_bytes)
    nbytes = weight_bytes(model)

    def ours(prompt, n):
        return generate(model, [prompt], max_new_tokens=n, eos_ids=())[0].token_ids

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    compile_seconds: dict[int, float] = {}
    hf(prompts[0], 4)  # warm PyTorch's allocator and kernels, untimed
    records = []
    for rnd in range(rounds):
        for i, prompt in enumerate(prompts):
            width = round_up(len(prompt), PROMPT_BUCKET)
            if width not in compile_seconds:
                with compile_events() as ev:
                    ours(prompt, max_new_tokens)
                    ours(prompt, 1)
                compile_seconds[width] = sum(ev)
            calls = {
                "ours": lambda: ours(prompt, max_new_tokens),
                "ours_first": lambda: ours(prompt, 1),
                "hf": lambda: hf(prompt, max_new_tokens),
            }
            names = list(calls) if (i + rnd) % 2 == 0 else list(reversed(calls))
            res = {name: timed(calls[name]) for name in names}
            bandwidth = probe.measure()
            (ours_tokens, ours_s), (_, first_s), (hf_tokens, hf_s) = res["ours"], res["ours_first"], res["hf"]
            rec = {
                "round": rnd, "prompt": i, "prompt_tokens": len(prompt),
                "ours_seconds": ours_s, "ours_prefill_seconds": first_s, "hf_seconds": hf_s,
                "ours_tokens": len(ours_tokens), "hf_tokens": len(hf_tokens),
                "ours_tokens_per_s": len(ours_tokens) / ours_s,
                "ours_decode_tokens_per_s": (len(ours_tokens) - 1) / max(ours_s - first_s, 1e-9),
                "hf_tokens_per_s": len(hf_tokens) / hf_s,
                "bandwidth_gb_s": bandwidth,
                "floor_tokens_per_s": bandwidth["best"] * 1e9 / nbytes,
                "same_tokens_prefix": common_prefix(ours_tokens, hf_tokens),
            }
            records.append(rec)
            progress(f"round {rnd} prompt {i}: ours {rec['ours_tokens_per_s']:.1f} tok/s "
                     f"(decode steps {rec['ours_decode_tokens_per_s']:.1f}), transformers "
                     f"{rec['hf_tokens_per_s']:.1f} tok/s, floor {rec['floor_tokens_per_s']:.1f} tok/s "
                     f"({bandwidth['best']:.1f} GB/s), same first {rec['same_tokens_prefix']} tokens")
    return summarize(records, nbytes, compile_seconds, max_new_tokens, torch_threads)


def summarize(records: list[dict], nbytes: int, compile_seconds: dict[int, float], max_new_tokens: int,
              torch_threads: int) -> dict:
    def med(values):
        return statistics.median(list(values))

    bandwidth = collections.defaultdict(list)
    for r in records:
        for k, v in r["bandwidth_gb_s"].items():
            bandwidth[k].append(v)
    keys = {"ours": "ours_tokens_per_s", "ours_decode_steps": "ours_decode_tokens_per_s",
            "transformers": "hf_tokens_per_s", "floor": "floor_tokens_per_s"}
    return {
        "config": {"max_new_tokens": max_new_tokens, "batch_size": 1, "greedy": True, "torch_threads": torch_threads,
                   "timed_calls_per_method": len(records)},
        "weight_bytes": nbytes,
        "compile_seconds_by_prompt_bucket": {str(k): v for k, v in compile_seconds.items()},
        "tokens_per_s": {name: med(r[k] for r in records) for name, k in keys.items()},
        "best_tokens_per_s": {name: max(r[k] for r in records) for name, k in keys.items()},
        "prefill_seconds_median": med(r["ours_prefill_seconds"] for r in records),
        "bandwidth_gb_s_median": {k: med(v) for k, v in bandwidth.items()},
        # ratios per call (same moment, same load), then the median over calls
        "speedup_vs_transformers": med(r["ours_tokens_per_s"] / r["hf_tokens_per_s"] for r in records),
        "fraction_of_floor": med(r["ours_decode_tokens_per_s"] / r["floor_tokens_per_s"] for r in records),
        "fraction_of_floor_with_prefill": med(r["ours_tokens_per_s"] / r["floor_tokens_per_s"] for r in records),
        "transformers_fraction_of_floor": med(r["hf_tokens_per_s"] / r["floor_tokens_per_s"] for r in records),
        "same_tokens_prefix_min": min(r["same_tokens_prefix"] for r in records),
        "targets": {"speedup_vs_transformers": 3.0, "fraction_of_floor": 0.7},
        "records": records,
    }


def markdown(results: dict, machine: dict, command: str) -> str:
    tps, best, cfg = results["tokens_per_s"], results["best_tokens_per_s"], results["config"]
    bw = results["bandwidth_gb_s_median"]
    speed, frac = results["speedup_vs_transformers"], results["fraction_of_floor"]
    compile_s = ", ".join(f"{v:.1f} s (prompt bucket {k})" for k, v in results["compile_seconds_by_prompt_bucket"].items())
    lines = [
        f"Date: {machine['date']}. Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']} "
        f"({machine['backend']}), load average {machine['load_average_1m']:.1f} at start.",
        f"Command: `{command}`",
        f"SmolLM2-135M-Instruct fp32 ({results['weight_bytes'] / 1e6:.0f} MB of weights), MT-Bench first turns with "
        f"the chat template, greedy, batch 1, {cfg['max_new_tokens']} new tokens (EOS ignored), "
        f"{cfg['timed_calls_per_method']} timed calls per method, interleaved; transformers with "
        f"torch threads = {cfg['torch_threads']}. Wall clock of the public call, prefill included, except the "
        f"\"decode steps\" row (our call minus a 1-token call, i.e. the {cfg['max_new_tokens'] - 1} steps alone).",
        "",
        "| | tokens/s (median) | tokens/s (best) | vs transformers | of floor |",
        "|---|---|---|---|---|",
        f"| medusa-jax plain decode | {tps['ours']:.1f} | {best['ours']:.1f} | {speed:.2f}x | "
        f"{100 * results['fraction_of_floor_with_prefill']:.0f}% |",
        f"| medusa-jax, decode steps only | {tps['ours_decode_steps']:.1f} | {best['ours_decode_steps']:.1f} | | "
        f"{100 * frac:.0f}% |",
        f"| transformers generate | {tps['transformers']:.1f} | {best['transformers']:.1f} | 1.00x | "
        f"{100 * results['transformers_fraction_of_floor']:.0f}% |",
        f"| floor (weight bytes / bandwidth) | {tps['floor']:.1f} | {best['floor']:.1f} | | 100% |",
        "",
        f"Sustained read bandwidth (median GB/s): numpy sum {bw['numpy_sum']:.1f}, JAX sum {bw['jax_sum']:.1f}, "
        f"JAX gemv {bw['jax_gemv']:.1f}; the floor uses the fastest of the three in each round.",
        f"Our prefill + first token: {1e3 * results['prefill_seconds_median']:.0f} ms (median). "
        f"Compile (ours, not in the timings): {compile_s}.",
        f"Greedy tokens identical to transformers' for the first {results['same_tokens_prefix_min']} tokens "
        f"(minimum over calls).",
        f"Targets: >= {results['targets']['speedup_vs_transformers']:.0f}x transformers "
        f"({'met' if speed >= 3 else 'not met'}), >= {100 * results['targets']['fraction_of_floor']:.0f}% of the "
        f"floor for the decode steps ({'met' if frac >= 0.7 else 'not met'}); ratios are medians of per-call ratios.",
    ]
    if results.get("profile"):
        lines += ["", "Where one decode step's time goes (XLA CPU ops, summed over threads):", "",
                  "| op | calls/step | ms/step |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.2f} |" for r in results["profile"]]
    return "\n".join(lines) + "\n"
