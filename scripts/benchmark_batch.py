"""What decoding costs as the batch grows, against the hardware. One entry point, four modes:

  benchmark_batch.py [flags]           batch-generation throughput on MT-Bench prompts (below)
  benchmark_batch.py scaling [flags]   plain and Medusa step time at several batch and cache sizes, against a
                                       floor measured in the same run (weights read once + batch x FLOPs)
  benchmark_batch.py decode [flags]    plain decode at batch 1: ours vs transformers' generate vs the memory
                                       floor (weight bytes / measured bandwidth), with an optional op profile
  benchmark_batch.py gpu [flags]       the whole jitted Medusa step vs a plain step, tree sizes x batch sizes,
                                       on the real SmolLM2 and Llama-shaped 1B/7B models (--tiny: CPU smoke test)
`benchmark_batch.py MODE --help` explains each mode's flags. Medusa vs plain on MT-Bench per question, sampling
and the oracle bound: scripts/benchmark.py; load memory: scripts/benchmark_loading.py.

Throughput: batch sizes 1, 8, 32, plain vs Medusa greedy, one run. Example (the README's figures):
  python scripts/benchmark_batch.py --model default --heads default --out bench/batch
Length-sorted batches vs refilled rows (continuous batching), plain greedy:
  python scripts/benchmark_batch.py --methods plain,refill --batch-sizes 16,32,64 --out bench/refill
Writes OUT/batch.json (every run: tokens, seconds, compile seconds, tokens/s with and without compilation,
tokens per step, rows where Medusa differs from plain) and OUT/batch.md (the table). Without trained heads
(`--heads random`) Medusa accepts almost nothing, so its figures show the cost of the tree, not a speedup.
"""

from __future__ import annotations

import sys

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.api import generate
from medusa_jax.inference.sharded import load_sharded
from medusa_jax.bench import decode_benchmark, gpu_bench, scaling_benchmark
from medusa_jax.bench.batch_benchmark import METHODS, BatchBenchConfig, run_batch_benchmark, write_report
from medusa_jax.paths import command_line
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.trees.policy.calibration import machine_description
from medusa_jax.bench.bench_inputs import mtbench_questions
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import (ArgumentParser, at_least, each, in_range, parse_int_list,
                                         parse_positive_int_list, run_mode)
from medusa_jax.scripts.options import Option, add_fields, config_from

FAILURES = (OSError, ValueError)  # CheckpointError, TokenizerError and MTBenchError are ValueErrors


def main(argv=None) -> int:
    return run_mode(argv, MODES, throughput_main)


def throughput_main(argv: list[str]) -> int:
    """The default mode: bench/batch_benchmark.py."""
    d = BatchBenchConfig()
    p = ArgumentParser(prog="benchmark_batch.py", description=__doc__)
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, default="default", more="; 'random' for untrained heads sharing the base lm_head")
    p.add_argument("--random-heads", check=at_least(1), type=int, default=4,
                   help="number of heads with --heads random (default: 4)")
    options.TREE.add(p, default=d.tree)
    p.add_argument("--prompts", check=at_least(1), type=int, default=64,
                   help="MT-Bench first turns to generate for, taking the categories in turn (default: %(default)s)")
    options.QUESTION_FILE.add(p)
    p.add_argument("--methods", default=",".join(d.methods),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: %(default)s)")
    options.MAX_NEW_TOKENS.add(p, default=d.max_new_tokens)
    add_fields(p, d, Option("--batch-sizes", "batch sizes, comma-separated", parse_int_list),
               Option("--chunk-steps", "method refill: decode steps between refills of finished rows"))
    options.MESH.add(p, default="", more="; batch sizes must divide by data*fsdp (default: one device)")
    options.DTYPE.add(p, default="float32")
    options.NO_PROGRESS.add(p, action="store_true")
    options.OUT.add(p, default="artifacts/benchmark_batch", more="folder for batch.json and batch.md; the "
                    "committed bench/batch is written only when named here")
    a = p.parse_args(argv)
    try:
        config = config_from(BatchBenchConfig, a, methods=tuple(m for m in a.methods.split(",") if m.strip()))
        if "medusa" in config.methods:
            options.tree_arg("--tree", a.tree)
        heads = None if a.heads == "random" or "medusa" not in config.methods else a.heads
        options.out_folder(a, heads)
        options.mesh_devices("--mesh", a.mesh)
        folder = options.model_arg("--model", a.model)
        heads_dir = options.heads_arg("--heads", heads) if heads else None
        questions = mtbench_questions(a.prompts, a.question_file)
        enable_compile_cache()  # compile seconds stay reported; a rerun loads the executables instead
        random = a.heads == "random" and "medusa" in config.methods
        model = load_sharded(folder, heads_dir, MeshConfig.parse(a.mesh), a.dtype,
                             random_heads=a.random_heads if random else 0)
        tokenizer = load_tokenizer(folder)
    except FAILURES as e:
        return validate.fail(e)
    eos = eos_token_ids(folder, tokenizer)
    prompts = [encode_prompt(tokenizer, q.first_turn, chat=True) for q in questions]
    result = run_batch_benchmark(model, prompts, config, eos_ids=eos, pad_id=pad_token_id(tokenizer, eos),
                                 progress=not a.no_progress)
    heads_note = (f"{a.random_heads} random (untrained) heads sharing the base lm_head" if random
                  else str(heads_dir) if heads_dir else "none")
    print(write_report(result, a.out, config, folder=folder, heads=heads_note, mesh=a.mesh, dtype=a.dtype,
                       prompts=len(prompts), command=command_line("scripts/benchmark_batch.py", argv),
                       machine=machine_description()))
    return 0


def scaling_main(argv: list[str]) -> int:
    """`benchmark_batch.py scaling`: bench/scaling_benchmark.py."""
    p = ArgumentParser(prog="benchmark_batch.py scaling", description=scaling_benchmark.__doc__,
                       epilog="Example:\n  python scripts/benchmark_batch.py scaling --heads default --out "
                              "bench/scaling\nWrites OUT/results.json, OUT/results.md and OUT/scaling.png.")
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, more="to time the Medusa step too; omit for plain steps only")
    options.TREE.add(p, default="mc_sim_7b_16", more="for the Medusa step")
    p.add_argument("--batch-sizes", check=each(at_least(1)), type=parse_positive_int_list,
                   default=(1, 4, 8, 16, 32, 64), help="comma-separated batch sizes (default: 1,4,8,16,32,64)")
    p.add_argument("--cache-sizes", check=each(at_least(1)), type=parse_positive_int_list, default=(256, 1024),
                   help="comma-separated cache sizes in slots (default: 256,1024)")
    p.add_argument("--context-fraction", check=in_range(0.0, 1.0, low_open=True, high_open=True), type=float,
                   default=0.75, help="committed tokens per row as a fraction of the cache (default: %(default)s)")
    p.add_argument("--rounds", check=at_least(1), type=int, default=3,
                   help="interleaved timing rounds per point (default: %(default)s)")
    options.OUT.add(p, default="artifacts/benchmark_scaling",
                    more="folder for results.json, results.md and scaling.png")
    a = p.parse_args(argv)
    try:
        options.out_folder(a, a.heads)
        if a.heads is not None:
            options.heads_arg("--heads", a.heads)
            options.tree_arg("--tree", a.tree)
        loaded = load_model(options.model_arg("--model", a.model), a.heads)
    except FAILURES as e:
        return validate.fail(e)
    heads = loaded.heads
    tree = None if heads is None else load_tree(a.tree, num_heads=heads.config.num_heads,
                                                max_top_k=heads.config.head_vocab_size)
    results = scaling_benchmark.run_scaling(loaded.base, heads, tree, batch_sizes=a.batch_sizes,
                                            cache_sizes=a.cache_sizes, context_fraction=a.context_fraction,
                                            rounds=a.rounds, progress=lambda m: print(m, flush=True))
    print(scaling_benchmark.write(results, a.out, command_line("scripts/benchmark_batch.py scaling", argv),
                                  machine_description()))
    return 0


def decode_main(argv: list[str]) -> int:
    """`benchmark_batch.py decode`: bench/decode_benchmark.py."""
    p = ArgumentParser(prog="benchmark_batch.py decode", description=decode_benchmark.__doc__,
                       epilog="Example:\n  python scripts/benchmark_batch.py decode --prompts 4 --out "
                              "artifacts/benchmark_decode/\nWrites OUT/results.json and OUT/results.md.")
    options.MODEL.add(p, default="default")
    p.add_argument("--prompts", check=at_least(1), type=int, default=4,
                   help="MT-Bench first turns to use, taking the 8 categories in turn (default: %(default)s)")
    p.add_argument("--rounds", check=at_least(1), type=int, default=2,
                   help="passes over the prompts; every pass times each method once per prompt (default: %(default)s)")
    options.MAX_NEW_TOKENS.add(p, default=128, help="new tokens per call")
    p.add_argument("--torch-threads", check=each(at_least(1)), type=parse_positive_int_list, default=(2, 1),
                   help="torch.set_num_threads settings to time transformers with, comma-separated; the first is "
                        "the reference for the speed-up (default: 2,1)")
    p.add_argument("--bandwidth-mib", check=at_least(1), type=int, default=1024,
                   help="size of the buffer read to measure memory bandwidth, MiB; keep it far above the CPU "
                        "caches (default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one of our decode calls and tabulate where a step's time goes")
    options.OUT.add(p, default="artifacts/benchmark_decode", more="folder for results.json and results.md")
    a = p.parse_args(argv)
    try:
        options.out_folder(a)
        questions = mtbench_questions(a.prompts)
        folder = options.model_arg("--model", a.model)
        options.within_positions(f"--max-new-tokens {a.max_new_tokens}", a.max_new_tokens + 1, folder,
                                 "lower it, leaving room for the prompt's tokens")
        loaded = load_model(folder, None)
    except FAILURES as e:
        return validate.fail(e)
    machine = machine_description()
    prompts = loaded.encode_chat([q.first_turn for q in questions])
    results = decode_benchmark.run_decode_benchmark(
        loaded.base, loaded.folder, prompts, max_new_tokens=a.max_new_tokens, torch_threads=a.torch_threads,
        rounds=a.rounds, bandwidth_bytes=a.bandwidth_mib << 20, progress=lambda m: print(m, flush=True))
    if a.profile:
        results["profile"] = decode_benchmark.op_times(
            lambda: generate(loaded.base, [prompts[0]], max_new_tokens=a.max_new_tokens, eos_ids=()),
            per=a.max_new_tokens)
    results["questions"] = [{"question_id": q.question_id, "category": q.category} for q in questions]
    print(decode_benchmark.write(results, a.out, command_line("scripts/benchmark_batch.py decode", argv), machine))
    return 0


def gpu_main(argv: list[str]) -> int:
    """`benchmark_batch.py gpu`: bench/gpu_bench.py."""
    d = gpu_bench.GpuBenchConfig()
    p = ArgumentParser(prog="benchmark_batch.py gpu", description=gpu_bench.__doc__,
                       epilog="Stops starting new measurements after --budget-seconds, so it finishes in "
                              "about 5 minutes on one H200. Example:\n  python scripts/benchmark_batch.py gpu "
                              "--out gpu_bench/\nWrites OUT/gpu_bench.json and OUT/gpu_bench.md. For real "
                              "MT-Bench speedups with trained heads on a GPU, run\nscripts/benchmark.py "
                              "--dtype bfloat16.")
    p.add_argument("--tiny", action="store_true",
                   help="tiny float32 models, trees of 4 and 8 tokens, batches 1 and 2: a CPU smoke test "
                        "(the other size flags are ignored)")
    p.add_argument("--models", default=",".join(d.models),
                   help="comma-separated: smollm2 (real weights if they can be prepared, else random of its "
                        "shape), llama-1b, llama-7b, smollm2-shape, tiny-a, tiny-b (default: %(default)s)")
    add_fields(p, d, Option("--dtype", "parameter and compute dtype", choices=("bfloat16", "float32")),
               Option("--tree-tokens", "tree sizes T (root included), comma-separated", parse_positive_int_list,
                      each(at_least(2))),
               Option("--batches", "batch sizes, comma-separated", parse_positive_int_list, each(at_least(1))),
               Option("--context", "committed tokens in the KV cache during the timed steps", check=at_least(1)),
               Option("--repeats", "timed calls per point, median", check=at_least(1)),
               Option("--heads-lm-head", "random heads' lm_head: shared with the base, or own [D, V] per head",
                      choices=("shared", "own")))
    p.add_argument("--budget-seconds", check=at_least(0.0), type=float, default=None,
                   help="no new measurement starts after this many seconds (default: %.0f; 120 with --tiny)"
                        % d.budget_seconds)
    options.OUT.add(p, default="artifacts/gpu_bench", more="folder")
    a = p.parse_args(argv)
    budget = a.budget_seconds if a.budget_seconds is not None else 120.0 if a.tiny else d.budget_seconds
    try:  # --models is checked with --tiny too, which ignores it
        config = config_from(gpu_bench.GpuBenchConfig, a, budget_seconds=budget,
                             models=tuple(m for m in a.models.split(",") if m.strip()))
        options.out_folder(a)
        results = gpu_bench.run_gpu_bench(gpu_bench.GpuBenchConfig.tiny(budget) if a.tiny else config,
                                          progress=lambda m: print(m, flush=True))
    except ValueError as e:
        return validate.fail(e)
    print(gpu_bench.write(results, a.out))
    return 0


MODES = {"scaling": scaling_main, "decode": decode_main, "gpu": gpu_main}


if __name__ == "__main__":
    sys.exit(main())
