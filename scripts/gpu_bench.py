"""Medusa step cost on one GPU: whole jitted Medusa step vs one plain decoding step, tree sizes 16-128 and batch
sizes 1-32, bf16, on the real SmolLM2 (if its weights can be prepared here) and Llama-shaped ~1B and ~7B
models with random weights. Stops starting new measurements after --budget-seconds, so it finishes in about
5 minutes on one H200; --tiny runs tiny sizes on CPU (a smoke test).

Example:
  python scripts/gpu_bench.py --out gpu_bench/
Writes OUT/gpu_bench.json and OUT/gpu_bench.md. For real MT-Bench speedups with trained heads on a GPU, run
scripts/benchmark.py --dtype bfloat16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from medusa_jax.cli_args import parse_positive_int_list as parse_int_list


def main(argv=None) -> int:
    from medusa_jax.bench.gpu_bench import GpuBenchConfig

    d = GpuBenchConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="tiny float32 models, trees of 4 and 8 tokens, batches 1 and 2: a CPU smoke test "
                        "(the other size flags are ignored)")
    p.add_argument("--models", default=",".join(d.models),
                   help="comma-separated: smollm2 (real weights if they can be prepared, else random of its "
                        "shape), llama-1b, llama-7b, smollm2-shape, tiny-a, tiny-b (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float32"),
                   help="parameter and compute dtype (default: %(default)s)")
    p.add_argument("--tree-tokens", type=parse_int_list, default=d.tree_tokens,
                   help="tree sizes T (root included), comma-separated (default: %s)" % ",".join(map(str, d.tree_tokens)))
    p.add_argument("--batches", type=parse_int_list, default=d.batches,
                   help="batch sizes, comma-separated (default: %s)" % ",".join(map(str, d.batches)))
    p.add_argument("--context", type=int, default=d.context,
                   help="committed tokens in the KV cache during the timed steps (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls per point, median (default: %(default)s)")
    p.add_argument("--heads-lm-head", default=d.heads_lm_head, choices=("shared", "own"),
                   help="random heads' lm_head: shared with the base, or own [D, V] per head (default: %(default)s)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="no new measurement starts after this many seconds (default: %.0f; 120 with --tiny)"
                        % d.budget_seconds)
    p.add_argument("--out", default="gpu_bench", help="output folder (default: %(default)s)")
    a = p.parse_args(argv)
    if a.tiny:
        config = GpuBenchConfig.tiny(a.budget_seconds if a.budget_seconds is not None else 120.0)
    else:
        if min(a.tree_tokens) < 2:
            p.error("--tree-tokens must be >= 2 (the root and at least one node)")
        config = GpuBenchConfig(models=tuple(m for m in a.models.split(",") if m), dtype=a.dtype,
                                tree_tokens=a.tree_tokens, batches=a.batches, context=a.context, repeats=a.repeats,
                                heads_lm_head=a.heads_lm_head,
                                budget_seconds=a.budget_seconds if a.budget_seconds is not None else d.budget_seconds)

    from medusa_jax.bench.gpu_bench import markdown, run_gpu_bench
    from medusa_jax.tree_search import write_json_atomic

    try:
        results = run_gpu_bench(config, progress=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    write_json_atomic(out / "gpu_bench.json", json.loads(json.dumps(results, default=float)))
    text = markdown(results)
    (out / "gpu_bench.md.tmp").write_text(text)
    (out / "gpu_bench.md.tmp").replace(out / "gpu_bench.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
