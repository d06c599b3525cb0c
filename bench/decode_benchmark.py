"""Plain-decode benchmark: our jitted decode vs transformers' PyTorch `generate` at batch 1, interleaved, and
both vs the memory floor (weight bytes / measured bandwidth); docs/modules.md."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import ProfileData

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.model.backbone import CausalLM
from medusa_jax.inference.api import generate
from medusa_jax.inference.engine import PROMPT_BUCKET, round_up
from medusa_jax.trees.policy.step_cost import time_call
from medusa_jax.bench.bench_inputs import write_files


def weight_bytes(model: CausalLM) -> int:
    """Bytes of all parameters (a tied embedding counts once: the decode step reads it once, as lm_head)."""
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))))


@dataclasses.dataclass
class BandwidthProbe:
    """Sustained read bandwidth (numpy sum, jitted sum, jitted matrix-vector product), the median of `repeats`
    passes over a buffer far bigger than the caches; the floor uses the fastest way."""

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

    def measure(self) -> dict[str, float]:
        """GB/s of each way and `best` (the highest)."""
        ways = {"numpy_sum": self._host.sum, "jax_sum": lambda: self._sum(self._dev),
                "jax_gemv": lambda: self._gemv(self._vec, self._dev)}
        out = {name: self._host.nbytes / time_call(fn, self.repeats) / 1e9 for name, fn in ways.items()}
        out["best"] = max(out.values())
        return out


class TorchGenerate:
    """transformers' PyTorch model in float32, greedy `generate` of one prompt (the reference every benchmark
    compares our decoding with)."""

    def __init__(self, folder):
        import torch  # optional (the [torch] extra) and heavy: only the comparison with transformers needs them
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def __call__(self, prompt: Sequence[int], max_new_tokens: int, threads: int = 0, eos_ids: Sequence[int] = (),
                 pad_id: int = 0) -> list[int]:
        """The new tokens: exactly `max_new_tokens` without `eos_ids`, else up to and including the first EOS.
        threads > 0 sets torch's intra-op threads for this call only (0 keeps torch's setting)."""
        torch = self.torch
        saved = torch.get_num_threads()
        if threads > 0:
            torch.set_num_threads(threads)
        ids = torch.tensor([list(prompt)])
        try:
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=max_new_tokens,
                                          min_new_tokens=None if eos_ids else max_new_tokens,
                                          eos_token_id=list(eos_ids) or None, pad_token_id=pad_id)
        finally:
            torch.set_num_threads(saved)
        new = out[0, len(prompt):].tolist()
        return new[:next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_decode_benchmark(model: CausalLM, folder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                         torch_threads: Sequence[int] = (2,), rounds: int = 1, bandwidth_bytes: int = 1 << 30,
                         progress: Callable[[str], None] = lambda m: None) -> dict:
    """Runs the interleaved comparison; returns the results dict (see `summarize`).

    Per prompt and round: our call with `max_new_tokens`, our call with 1 new token (prefill + first token:
    subtracting it leaves the time of the max_new_tokens - 1 decode steps, which is what the floor bounds),
    transformers' call for each torch thread count (the first is the reference), then a bandwidth measurement."""
    torch_threads = tuple(torch_threads)
    hf = TorchGenerate(folder)
    probe = BandwidthProbe(bandwidth_bytes)
    nbytes = weight_bytes(model)

    def ours(prompt, n):
        return generate(model, [prompt], max_new_tokens=n, eos_ids=())[0].token_ids

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    compile_seconds: dict[int, float] = {}
    for threads in torch_threads:
        hf(prompts[0], 4, threads)  # warm PyTorch's allocator and kernels, untimed
    records = []
    for rnd in range(rounds):
        for i, prompt in enumerate(prompts):
            width = round_up(len(prompt), PROMPT_BUCKET)
            if width not in compile_seconds:
                with CompileCounter() as compiled:
                    ours(prompt, max_new_tokens)
                    ours(prompt, 1)
                compile_seconds[width] = compiled.compile_seconds
            calls = {"ours": lambda: ours(prompt, max_new_tokens), "ours_first": lambda: ours(prompt, 1)}
            for threads in torch_threads:
                calls[f"hf{threads}"] = lambda threads=threads: hf(prompt, max_new_tokens, threads)
            names = list(calls) if (i + rnd) % 2 == 0 else list(reversed(calls))
            res = {name: timed(calls[name]) for name in names}
            bandwidth = probe.measure()
            (ours_tokens, ours_s), (_, first_s) = res["ours"], res["ours_first"]
            hf_tps = {t: len(res[f"hf{t}"][0]) / res[f"hf{t}"][1] for t in torch_threads}
            rec = {
                "round": rnd, "prompt": i, "prompt_tokens": len(prompt),
                "ours_seconds": ours_s, "ours_prefill_seconds": first_s, "ours_tokens": len(ours_tokens),
                "ours_tokens_per_s": len(ours_tokens) / ours_s,
                "ours_decode_tokens_per_s": (len(ours_tokens) - 1) / max(ours_s - first_s, 1e-9),
                "hf_tokens_per_s": hf_tps[torch_threads[0]],
                "hf_tokens_per_s_by_threads": {str(t): v for t, v in hf_tps.items()},
                "hf_fastest_tokens_per_s": max(hf_tps.values()),
                "bandwidth_gb_s": bandwidth,
                "floor_tokens_per_s": bandwidth["best"] * 1e9 / nbytes,
                "same_tokens_prefix": min(common_prefix(ours_tokens, res[f"hf{t}"][0]) for t in torch_threads),
            }
            records.append(rec)
            hf_text = ", ".join(f"{v:.1f} ({t} threads)" for t, v in hf_tps.items())
            progress(f"round {rnd} prompt {i}: ours {rec['ours_tokens_per_s']:.1f} tok/s "
                     f"(decode steps {rec['ours_decode_tokens_per_s']:.1f}), transformers {hf_text} tok/s, "
                     f"floor {rec['floor_tokens_per_s']:.1f} tok/s ({bandwidth['best']:.1f} GB/s), "
                     f"same first {rec['same_tokens_prefix']} tokens")
    return summarize(records, nbytes, compile_seconds, max_new_tokens, torch_threads)


def summarize(records: list[dict], nbytes: int, compile_seconds: dict[int, float], max_new_tokens: int,
              torch_threads: tuple[int, ...]) -> dict:
    def med(values):
        return statistics.median(list(values))

    keys = {"ours": "ours_tokens_per_s", "ours_decode_steps": "ours_decode_tokens_per_s",
            "transformers": "hf_tokens_per_s", "floor": "floor_tokens_per_s"}
    return {
        "config": {"max_new_tokens": max_new_tokens, "batch_size": 1, "greedy": True, "torch_threads": list(torch_threads),
                   "timed_calls_per_method": len(records)},
        "weight_bytes": nbytes,
        "compile_seconds_by_prompt_bucket": {str(k): v for k, v in compile_seconds.items()},
        "tokens_per_s": {name: med(r[k] for r in records) for name, k in keys.items()},
        "best_tokens_per_s": {name: max(r[k] for r in records) for name, k in keys.items()},
        "prefill_seconds_median": med(r["ours_prefill_seconds"] for r in records),
        "bandwidth_gb_s_median": {way: med(r["bandwidth_gb_s"][way] for r in records)
                                  for way in records[0]["bandwidth_gb_s"]},
        # ratios per call (same moment, same load), then the median over calls
        "speedup_vs_transformers": med(r["ours_tokens_per_s"] / r["hf_tokens_per_s"] for r in records),
        "speedup_vs_fastest_transformers": med(r["ours_tokens_per_s"] / r["hf_fastest_tokens_per_s"] for r in records),
        "transformers_tokens_per_s_by_threads": {
            str(t): med(r["hf_tokens_per_s_by_threads"][str(t)] for r in records) for t in torch_threads},
        "fraction_of_floor": med(r["ours_decode_tokens_per_s"] / r["floor_tokens_per_s"] for r in records),
        "fraction_of_floor_with_prefill": med(r["ours_tokens_per_s"] / r["floor_tokens_per_s"] for r in records),
        "transformers_fraction_of_floor": med(r["hf_tokens_per_s"] / r["floor_tokens_per_s"] for r in records),
        "same_tokens_prefix_min": min(r["same_tokens_prefix"] for r in records),
        "targets": {"speedup_vs_transformers": 3.0, "fraction_of_floor": 0.7},
        "records": records,
    }


def markdown(results: dict, machine: dict, command: str) -> str:
    tps, best, cfg = results["tokens_per_s"], results["best_tokens_per_s"], results["config"]
    bw, floor = results["bandwidth_gb_s_median"], tps["floor"]
    speed, frac = results["speedup_vs_transformers"], results["fraction_of_floor"]
    ref_threads = cfg["torch_threads"][0]
    compile_s = ", ".join(f"{v:.1f} s (prompt bucket {k})" for k, v in results["compile_seconds_by_prompt_bucket"].items())
    lines = [
        f"Date: {machine['date']}. Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']} "
        f"({machine['backend']}), load average {machine['load_average_1m']:.1f} at start.",
        f"Command: `{command}`",
        f"SmolLM2-135M-Instruct fp32 ({results['weight_bytes'] / 1e6:.0f} MB of weights), MT-Bench first turns with "
        f"the chat template, greedy, batch 1, {cfg['max_new_tokens']} new tokens (EOS ignored), "
        f"{cfg['timed_calls_per_method']} timed calls per method, interleaved. Wall clock of the public call, "
        f"prefill included, except the \"decode steps\" row (our call minus a 1-token call: the "
        f"{cfg['max_new_tokens'] - 1} steps alone). Ratios are medians of per-call ratios (same moment, same load).",
        "",
        f"| | tokens/s (median) | tokens/s (best) | vs transformers ({ref_threads} threads) | of floor |",
        "|---|---|---|---|---|",
        f"| medusa-jax plain decode | {tps['ours']:.1f} | {best['ours']:.1f} | {speed:.2f}x | "
        f"{100 * results['fraction_of_floor_with_prefill']:.0f}% |",
        f"| medusa-jax, decode steps only | {tps['ours_decode_steps']:.1f} | {best['ours_decode_steps']:.1f} | | "
        f"{100 * frac:.0f}% |",
    ]
    for threads, value in results["transformers_tokens_per_s_by_threads"].items():
        vs = "1.00x" if int(threads) == ref_threads else f"{value / tps['transformers']:.2f}x"
        lines.append(f"| transformers generate, torch threads = {threads} | {value:.1f} | | {vs} | "
                     f"{100 * value / floor:.0f}% |")
    lines += [
        f"| floor (weight bytes / bandwidth) | {floor:.1f} | {best['floor']:.1f} | | 100% |",
        "",
        f"Against the fastest transformers setting of each call: {results['speedup_vs_fastest_transformers']:.2f}x.",
        f"Sustained read bandwidth (median GB/s): numpy sum {bw['numpy_sum']:.1f}, JAX sum {bw['jax_sum']:.1f}, "
        f"JAX gemv {bw['jax_gemv']:.1f}; the floor uses the fastest of the three in each round.",
        f"Our prefill + first token: {1e3 * results['prefill_seconds_median']:.0f} ms (median). "
        f"Compile (ours, not in the timings): {compile_s}.",
        f"Greedy tokens identical to transformers' for the first {results['same_tokens_prefix_min']} tokens "
        f"(minimum over calls).",
        f"Targets: >= {results['targets']['speedup_vs_transformers']:.0f}x transformers with {ref_threads} threads "
        f"({'met' if speed >= 3 else 'not met'}), >= {100 * results['targets']['fraction_of_floor']:.0f}% of the "
        f"floor for the decode steps ({'met' if frac >= 0.7 else 'not met'}).",
    ]
    if results.get("profile"):
        lines += ["", "Where one decode step's time goes (XLA CPU ops, summed over threads):", "",
                  "| op | calls/step | ms/step |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.2f} |" for r in results["profile"]]
    return "\n".join(lines) + "\n"


def write(results: dict, out, command: str, machine: dict) -> str:
    """OUT/results.json and results.md; returns the markdown and a line naming the files."""
    text = markdown(results, machine, command)
    paths = write_files(out, {"results.json": json.dumps({"machine": machine, "command": command, **results},
                                                         indent=1), "results.md": text})
    return text + "\nwrote " + " and ".join(str(p) for p in paths.values())


# ---- where the time of a jitted call goes: XLA op events under jax.profiler.trace, summed by op kind (on CPU,
# threads add up, so the total can exceed the wall clock) ---------------------------------------------------------
_SKIP = ("ThunkExecutor", "end: ")


def op_times(fn: Callable[[], object], per: int = 1, top: int = 12) -> list[dict]:
    """Runs fn() once under the profiler; returns the `top` op kinds by time, each with calls and ms divided
    by `per` (e.g. the number of decode steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(fn())
        planes = sorted(Path(tmp).rglob("*.xplane.pb"))
        if not planes:
            raise RuntimeError("the profiler wrote no trace")
        data = ProfileData.from_file(str(planes[-1]))
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        for line in plane.lines:
            if "Eigen" not in line.name and "XLA" not in line.name:
                continue
            for event in line.events:
                if any(event.name.startswith(s) for s in _SKIP) or event.name.startswith("$"):
                    continue
                kind = re.sub(r"\.\d+$", "", event.name)
                totals[kind][0] += 1
                totals[kind][1] += event.duration_ns / 1e6
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"op": k, "calls_per_step": n / per, "ms_per_step": ms / per} for k, (n, ms) in rows]
