"""Decode-step scaling with the batch: plain and Medusa step time and tokens/s at several batch and cache
sizes, against a floor measured in the same run (weights read once + batch x FLOPs at the measured GEMM
rate). See medusa_jax/bench/scaling_benchmark.py for the method.

Example:
  python scripts/benchmark_scaling.py --heads default --out bench/scaling
Writes OUT/results.json, OUT/results.md and OUT/scaling.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from medusa_jax.cli_args import parse_positive_int_list


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="HF model folder, or 'smollm2' for the packaged SmolLM2-135M-Instruct (default: %(default)s)")
    p.add_argument("--heads", default=None,
                   help="heads folder or 'default' (the shipped SmolLM2 heads) to time the Medusa step too; "
                        "omit for plain steps only")
    p.add_argument("--tree", default="mc_sim_7b_16", help="tree for the Medusa step (default: %(default)s)")
    p.add_argument("--batch-sizes", type=parse_positive_int_list, default=(1, 4, 8, 16, 32, 64),
                   help="comma-separated batch sizes (default: 1,4,8,16,32,64)")
    p.add_argument("--cache-sizes", type=parse_positive_int_list, default=(256, 1024),
                   help="comma-separated cache sizes in slots (default: 256,1024)")
    p.add_argument("--context-fraction", type=float, default=0.75,
                   help="committed tokens per row as a fraction of the cache (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per point (default: %(default)s)")
    p.add_argument("--out", default="artifacts/benchmark_scaling",
                   help="folder for results.json, results.md and scaling.png (default: %(default)s)")
    a = p.parse_args(argv)
    if not 0.0 < a.context_fraction < 1.0:
        p.error("--context-fraction must be in (0, 1)")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")

    from medusa_jax.atomic import write_text_atomic
    from medusa_jax.tree import load_tree
    from medusa_jax.bench.bench_inputs import load_model, machine_description
    from medusa_jax.bench.scaling_benchmark import markdown, plot, run_scaling

    try:
        loaded = load_model(a.model, a.heads)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    heads = loaded.heads
    tree = None if heads is None else load_tree(a.tree, num_heads=heads.config.num_heads,
                                                max_top_k=heads.config.head_vocab_size)
    results = run_scaling(loaded.base, heads, tree, batch_sizes=a.batch_sizes, cache_sizes=a.cache_sizes,
                          context_fraction=a.context_fraction, rounds=a.rounds,
                          progress=lambda m: print(m, flush=True))
    machine = machine_description()
    command = "python " + " ".join(shlex.quote(x) for x in ["scripts/benchmark_scaling.py",
                                                             *(argv if argv is not None else sys.argv[1:])])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results, command, json.dumps(machine))
    write_text_atomic(out / "results.json", json.dumps({"machine": machine, "command": command, **results}, indent=1))
    write_text_atomic(out / "results.md", text)
    plot(results, out / "scaling.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
