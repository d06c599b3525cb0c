"""Batch-generation throughput on MT-Bench prompts: batch sizes 1, 8, 32, plain vs Medusa greedy, one run.

Example (the README's figures):
  python scripts/benchmark_batch.py --model smollm2 --heads default --out bench/batch
Writes OUT/batch.json (every run: tokens, seconds, compile seconds, tokens/s with and without compilation,
tokens per step, rows where Medusa differs from plain) and OUT/batch.md (the table). Without trained heads
(`--heads random`) Medusa accepts almost nothing, so its figures show the cost of the tree, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv=None) -> int:
    from medusa_jax.bench.batch_benchmark import METHODS, BatchBenchConfig
    from medusa_jax.real_model import portable_path

    d = BatchBenchConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="HF model folder, or 'smollm2' for the packaged SmolLM2-135M-Instruct (default: %(default)s)")
    p.add_argument("--heads", default="default",
                   help="heads folder; 'default' for the heads shipped with medusa-jax; 'random' for untrained "
                        "heads sharing the base lm_head (default: %(default)s)")
    p.add_argument("--random-heads", type=int, default=4, help="number of heads with --heads random (default: 4)")
    p.add_argument("--tree", default=d.tree, help="tree preset name or tree JSON file (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=64,
                   help="MT-Bench first turns to generate for, taking the categories in turn (default: %(default)s)")
    p.add_argument("--question-file", default=None,
                   help="JSONL of questions (question_id, category, turns) (default: the packaged MT-Bench file)")
    p.add_argument("--batch-sizes", type=int_list, default=d.batch_sizes,
                   help="batch sizes, comma-separated (default: %s)" % ",".join(map(str, d.batch_sizes)))
    p.add_argument("--methods", default=",".join(d.methods),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="new tokens per answer at most (default: %(default)s)")
    p.add_argument("--mesh", default="",
                   help="device mesh, e.g. data=2,tensor=4; batch sizes must divide by data*fsdp (default: one device)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter dtype: float32 on CPU, bfloat16 on GPU (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--out", default="bench/batch", help="folder for batch.json and batch.md (default: %(default)s)")
    a = p.parse_args(argv)

    from medusa_jax.compile_cache import enable_compile_cache

    enable_compile_cache()  # compile seconds stay reported; a rerun loads the executables instead
    from medusa_jax.mtbench import load_mtbench_questions
    from medusa_jax.sharding import MeshConfig
    from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
    from medusa_jax.bench.batch_benchmark import markdown, run_batch_benchmark
    from medusa_jax.bench.bench_inputs import machine_description, resolve_heads, resolve_model_dir
    from medusa_jax.bench.benchmark import select_questions
    from medusa_jax.inference.sharded import load_sharded

    try:
        config = BatchBenchConfig(batch_sizes=a.batch_sizes, max_new_tokens=a.max_new_tokens, tree=a.tree,
                                  methods=tuple(m for m in a.methods.split(",") if m))
    except ValueError as e:
        p.error(str(e))
    folder = resolve_model_dir(a.model)
    random = a.heads == "random" and "medusa" in config.methods
    heads_dir = None if a.heads == "random" or "medusa" not in config.methods else resolve_heads(a.heads)
    model = load_sharded(folder, heads_dir, MeshConfig.parse(a.mesh), a.dtype,
                         random_heads=a.random_heads if random else 0)
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(folder, tokenizer)
    questions = select_questions(load_mtbench_questions(a.question_file), a.prompts)
    prompts = [encode_prompt(tokenizer, q.first_turn, chat=True) for q in questions]
    result = run_batch_benchmark(model, prompts, config, eos_ids=eos, pad_id=pad_token_id(tokenizer, eos),
                                 progress=not a.no_progress)
    heads_note = (f"{a.random_heads} random (untrained) heads sharing the base lm_head" if random
                  else str(heads_dir) if heads_dir else "none")
    command = " ".join(["python", "scripts/benchmark_batch.py", *(argv or sys.argv[1:])])
    result.update(model=portable_path(folder), heads=heads_note, mesh=a.mesh or "single device", dtype=a.dtype,
                  prompts=len(prompts), command=command, machine=machine_description())
    title = (f"Batch generation, {len(prompts)} MT-Bench first turns, {config.max_new_tokens} new tokens max, "
             f"{Path(folder).name} {a.dtype}, heads: {heads_note}, tree {config.tree}, mesh {result['mesh']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("batch.json", json.dumps(result, indent=1)), ("batch.md", markdown(result, title))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    print(markdown(result, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
