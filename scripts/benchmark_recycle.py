"""Token Recycling (`--heads recycle`) on MT-Bench: tokens/step per template size and speed vs plain decoding.

Example (bench/recycle):
  python scripts/benchmark_recycle.py --model default --questions 16 --max-new-tokens 128 --out bench/recycle
Writes OUT/results.json and OUT/results.md (bench/recycle_bench.py explains what is counted and timed).
"""

from __future__ import annotations

import sys
from pathlib import Path

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.recycle import TEMPLATES, recycle_drafter
from medusa_jax.heads.recycle_file import starting_table
from medusa_jax.bench.bench_inputs import git_revision, mtbench_questions
from medusa_jax.bench.bench_report import machine_line
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.paths import command_line, portable_path
from medusa_jax.trees.policy.calibration import machine_description
from medusa_jax.bench.recycle_bench import RecycleBenchConfig, run_recycle_bench, write_report
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, parse_positive_int_list
from medusa_jax.scripts.options import Option, add_fields, config_from


def parse_args(argv=None):
    d = RecycleBenchConfig()
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    p.add_argument("--recycle-table", default=None,
                   help="table file to start from (default: the shipped SmolLM2 table where the model matches it)")
    options.QUESTIONS.add(p, default=16)
    options.MAX_NEW_TOKENS.add(p, default=d.max_new_tokens)
    p.add_argument("--templates", default=",".join(d.templates),
                   help=f"comma-separated templates among {', '.join(TEMPLATES)} (default: %(default)s)")
    add_fields(p, d, Option("--batch-sizes", "comma-separated batch sizes", parse_positive_int_list))
    options.OUT.add(p, required=True, more="folder for results.json and results.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        config = config_from(RecycleBenchConfig, a, templates=tuple(t for t in a.templates.split(",") if t))
        validate.recycle_table_file("--recycle-table", a.recycle_table)
        validate.output_file("--out", f"{a.out}/results.json", {"--model": options.model_location(a.model)})
        enable_compile_cache()
        machine = machine_description()  # the load average before the run
        options.model_arg("--model", a.model)
        questions = mtbench_questions(a.questions)
        loaded = load_model(a.model, None)
        origin = starting_table(loaded.base, a.recycle_table)[1]
        results = run_recycle_bench(loaded, loaded.encode_chat([q.first_turn for q in questions]),
                                    lambda: recycle_drafter(loaded.base, a.recycle_table), config,
                                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, ValueError) as e:  # HubError is an OSError, the others ValueErrors
        return validate.fail(e)
    meta = {"command": command_line("scripts/benchmark_recycle.py", argv), "machine": machine,
            "machine_line": machine_line(machine), "git": git_revision(Path(__file__).resolve().parents[1]),
            "model": portable_path(str(loaded.folder)), "questions": len(questions),
            "max_new_tokens": a.max_new_tokens, "table": origin,
            "templates": {name: [list(p) for p in TEMPLATES[name]] for name in config.templates}}
    print(write_report(results, meta, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
