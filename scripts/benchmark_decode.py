"""Plain-decode speed on SmolLM2: our jitted decode vs transformers' PyTorch generate vs the memory floor.

A few MT-Bench first turns (chat template), greedy, batch 1, a fixed number of new tokens; the two methods
run interleaved prompt by prompt; memory bandwidth is re-measured every round and gives the floor
(weight bytes / bandwidth). Compile time is reported apart from the timed calls.

Example:
  python scripts/benchmark_decode.py --prompts 4 --out artifacts/benchmark_decode/
Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


from medusa_jax.cli_args import parse_positive_int_list as parse_int_list


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="HF model folder, or 'smollm2' for the packaged SmolLM2-135M-Instruct (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4,
                   help="MT-Bench first turns to use, taking the 8 categories in turn (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2,
                   help="passes over the prompts; every pass times each method once per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per call (default: %(default)s)")
    p.add_argument("--torch-threads", type=parse_int_list, default=(2, 1),
                   help="torch.set_num_threads settings to time transformers with, comma-separated; the first is "
                        "the reference for the speed-up (default: 2,1)")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="size of the buffer read to measure memory bandwidth, MiB; keep it far above the CPU "
                        "caches (default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one of our decode calls and tabulate where a step's time goes")
    p.add_argument("--out", default="artifacts/benchmark_decode",
                   help="folder for results.json and results.md (default: %(default)s)")
    a = p.parse_args(argv)
    if min(a.prompts, a.rounds, a.max_new_tokens, a.bandwidth_mib) < 1:
        p.error("--prompts, --rounds, --max-new-tokens and --bandwidth-mib must be >= 1")

    from medusa_jax.atomic import write_text_atomic
    from medusa_jax.mtbench import MTBenchError, load_mtbench_questions
    from medusa_jax.bench.bench_inputs import load_model, machine_description
    from medusa_jax.bench.benchmark import select_questions
    from medusa_jax.bench.decode_benchmark import markdown, run_decode_benchmark
    from medusa_jax.inference.engine import generate
    from medusa_jax.bench.op_profile import op_times

    machine = machine_description()
    try:
        questions = select_questions(load_mtbench_questions(), a.prompts)
        loaded = load_model(a.model, None)
    except (FileNotFoundError, MTBenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = loaded.encode_chat([q.first_turn for q in questions])
    results = run_decode_benchmark(loaded.base, loaded.folder, prompts, max_new_tokens=a.max_new_tokens,
                                   torch_threads=a.torch_threads, rounds=a.rounds,
                                   bandwidth_bytes=a.bandwidth_mib << 20, progress=lambda m: print(m, flush=True))
    if a.profile:
        results["profile"] = op_times(
            lambda: generate(loaded.base, [prompts[0]], max_new_tokens=a.max_new_tokens, eos_ids=()),
            per=a.max_new_tokens)
    results["questions"] = [{"question_id": q.question_id, "category": q.category} for q in questions]
    command = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results, machine, command)
    write_text_atomic(out / "results.json", json.dumps({"machine": machine, "command": command, **results}, indent=1))
    write_text_atomic(out / "results.md", text)
    print(text)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
