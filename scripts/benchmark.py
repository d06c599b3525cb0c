"""What Medusa heads buy on text: our Medusa decode vs our plain decode. One entry point, five modes:

  benchmark.py [flags]                MT-Bench, greedy (below); with --temperatures, sampling (below)
  benchmark.py quick [flags]          four fixed prompts, every tree preset, with the heads and with an oracle
                                      that plants the true continuation (this tree's upper bound); no files
  benchmark.py heads --heads L=DIR... several heads side by side: held-out top-1/top-5, tokens/step at
                                      4/16/64 tree nodes, wall-clock speedup at batch 1 and 4 (bench/heads);
                                      --dynamic-nodes 16,64: dynamic trees vs static (bench/dynamic_trees)
  benchmark.py calibration [flags]    the tree chooser (calibrated on this machine, and as shipped) at batch
                                      1/4/8: its predictions against measured MT-Bench speedups (bench/calibration)
  benchmark.py teacher-mass [flags]   how much of the base model's next-token mass a truncated head
                                      (--lm-head truncated:N) cannot represent, on a self-distilled store
`benchmark.py MODE --help` explains each mode's flags. Batch throughput, step scaling and the plain-decode
floor: scripts/benchmark_batch.py; load memory: scripts/benchmark_loading.py.

Greedy: plain vs Medusa (and transformers' generate with --hf), interleaved question by question; then total
throughput at several batch sizes and a tree-size sweep.

Example (the README's figures):
  python scripts/benchmark.py --model default --heads default --hf --out bench/medusa
(the shipped heads decode with their own trees: medusa_jax/assets/heads/smollm2/trees.json)
Writes OUT/results.json (speedup, acceleration_rate, step_overhead, mismatches, tokens_per_s per method, per
category, batched, tree sweep, per question), OUT/results.md (tables) and PNG plots.

Sampling mode (--temperatures): plain sampling vs Medusa exact vs Medusa typical acceptance at each temperature,
with Medusa greedy's tokens/step as reference; writes OUT/sampling.json and OUT/sampling.md:
  python scripts/benchmark.py --model default --heads default --questions 8 --max-new-tokens 128 \
      --temperatures 0.7,1.0 --out bench/sampling
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from medusa_jax.paths import command_line, portable_path
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.trees.tree import PRESETS
from medusa_jax.training.hidden_store import is_store
from medusa_jax.bench import calibration_report, heads_comparison, quick, teacher_mass
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.trees.policy.calibration import machine_description
from medusa_jax.bench.bench_inputs import git_revision, mtbench_questions
from medusa_jax.bench.bench_report import write_report
from medusa_jax.bench.benchmark import BenchmarkConfig, run_benchmark
from medusa_jax.bench.heads_comparison import CompareConfig
from medusa_jax.bench.quick import PROMPTS, QuickConfig, run_quick
from medusa_jax.bench.sampling_benchmark import SamplingBenchConfig, run_sampling_benchmark, write_sampling_report
from medusa_jax.bench.teacher_mass import TeacherMassConfig, outside_mass
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import (ArgumentParser, above, at_least, each, in_range,
                                         parse_float_list, parse_int_list, parse_positive_int_list, run_mode)
from medusa_jax.scripts.options import Option, add_fields, config_from

FAILURES = (OSError, ValueError)  # CheckpointError, MTBenchError and TreeError are ValueErrors


def main(argv=None) -> int:
    return run_mode(argv, MODES, mtbench_main)


def mtbench_main(argv: list[str]) -> int:
    """The default mode: MT-Bench greedy (bench/benchmark.py), or sampling with --temperatures."""
    d = BenchmarkConfig()
    p = ArgumentParser(prog="benchmark.py", description=__doc__)
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, default="default")
    options.TREE.add(p, default=d.tree, more="(default: the heads' own tree for this backend and each batch "
                     "size, from their trees.json built by scripts/build_tree.py, plain decoding where it says no tree "
                     "pays; the mc_sim_7b_16 preset for heads without trees.json)")
    options.QUESTIONS.add(p, default=16)
    options.QUESTION_FILE.add(p)
    options.MAX_NEW_TOKENS.add(p, default=d.max_new_tokens)
    options.BATCH_SIZE.add(p, default=d.batch_size, more="rows per call in the main per-question comparison")
    add_fields(p, d, Option("--calibration", "without --tree: auto times this machine's steps on first use (cached) "
                            "to choose the heads' tree, redo times them again, skip takes the shipped trees.json as "
                            "it is (default: $MEDUSA_JAX_CALIBRATION, else auto)", choices=("auto", "redo", "skip")),
               Option("--batched-sizes", "further batch sizes for the total-throughput table, comma-separated; '' "
                      "for none", parse_int_list),
               Option("--sweep-sizes", "tree sizes (nodes) for the speedup-vs-tree-size plot: prefixes of the tree's "
                      "greedy order; '' for none", parse_int_list),
               Option("--sweep-questions", "questions per tree size in the sweep; 0 skips it"),
               Option("--no-profile", "skip timing each piece of a Medusa step (verify forward, base logits, "
                      "acceptance, heads top-k, cache compaction)", dest="profile"),
               Option("--hf", "also time transformers' PyTorch generate (greedy) on every question"),
               Option("--hf-threads", "PyTorch intra-op threads for --hf; 0 keeps torch's default (on a machine "
                      "shared with other work torch's spinning OpenMP threads slow generate down)"))
    options.DTYPE.add(p, default="float32")
    p.add_argument("--temperatures", check=each(above(0.0)), type=parse_float_list, default=None,
                   help="sampling mode: comma-separated temperatures (e.g. 0.7,1.0); times plain sampling, Medusa "
                        "with exact acceptance and with typical acceptance at each (uses --tree, --questions, "
                        "--max-new-tokens, --batch-size; ignores the greedy-only flags) and writes sampling.json "
                        "and sampling.md (default: the greedy benchmark)")
    options.SEED_OPTION.add(p, default=0, more="sampling mode: question i samples with seed + i")
    options.OUT.add(p, default="artifacts/benchmark", more="folder for results.json, results.md and plots "
                    "(sampling: sampling.json, sampling.md); the committed results in bench/ are written only when "
                    "named here")
    a = p.parse_args(argv)
    with p.checking():  # the flags, before anything loads
        config = config_from(BenchmarkConfig, a)
        options.tree_arg("--tree", a.tree)
        options.out_folder(a, heads=a.heads)
        options.heads_arg("--heads", a.heads)
    run, write = run_benchmark, write_report
    if a.temperatures is not None:  # sampling mode (bench/sampling_benchmark.py)
        config, run, write = config_from(SamplingBenchConfig, a), run_sampling_benchmark, write_sampling_report
    try:
        machine = machine_description()  # the load average before the run
        questions = mtbench_questions(a.questions, a.question_file)
        loaded = load_model(options.model_arg("--model", a.model), a.heads, dtype=a.dtype)
        results = run(loaded, questions, config, progress=lambda m: print(m, flush=True))
    except FAILURES as e:
        return validate.fail(e)
    results["meta"] = {"command": command_line("scripts/benchmark.py", argv), "machine": machine,
                       "model": portable_path(loaded.folder), "git_revision": git_revision(Path(__file__).resolve().parent)}
    paths = write(results, a.out)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def quick_main(argv: list[str]) -> int:
    """`benchmark.py quick`: bench/quick.py."""
    p = ArgumentParser(prog="benchmark.py quick", description=quick.__doc__,
                       epilog="Example:\n  python scripts/benchmark.py quick --max-new-tokens 64 --batch-sizes 1,4")
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, more="(default: fresh init_heads, 4 heads: the base lm_head copied)")
    p.add_argument("--trees", default=",".join(PRESETS),
                   help="comma-separated tree presets or JSON files (default: all presets)")
    p.add_argument("--batch-sizes", check=each(in_range(1, len(PROMPTS))), type=parse_positive_int_list, default=(1, 4),
                   help=f"comma-separated batch sizes, at most {len(PROMPTS)} (default: 1,4)")
    options.MAX_NEW_TOKENS.add(p, default=64, help="tokens generated per prompt")
    p.add_argument("--stop-at-eos", action="store_true", help="end rows at the model's EOS ids (default: "
                   "ignore them, so every row generates exactly --max-new-tokens)")
    p.add_argument("--repeats", check=at_least(1), type=int, default=2, help="timed calls per configuration after "
                   "the warm-up; the fastest counts (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    a = p.parse_args(argv)
    trees = tuple(t for t in a.trees.split(",") if t.strip())
    with p.checking():  # the flags, before anything loads
        if not trees:
            raise ValueError(f"--trees {a.trees!r}: give at least one tree preset or JSON file, comma-separated")
        for tree in trees:
            options.tree_arg("--trees", tree)
        if a.heads is not None:
            options.heads_arg("--heads", a.heads)
        config = config_from(QuickConfig, a, trees=trees)
    try:
        loaded = load_model(options.model_arg("--model", a.model), a.heads)
        heads = loaded.heads or init_heads(
            HeadsConfig(loaded.base.config.hidden_size, loaded.base.config.vocab_size, num_heads=4), loaded.base)
        run_quick(loaded.base, heads, loaded.encode_chat(PROMPTS), config, eos_ids=loaded.eos_ids,
                  pad_id=loaded.pad_id, as_json=a.json)
    except FAILURES as e:
        return validate.fail(e)
    return 0


def teacher_mass_main(argv: list[str]) -> int:
    """`benchmark.py teacher-mass`: bench/teacher_mass.py."""
    d = TeacherMassConfig()
    p = ArgumentParser(prog="benchmark.py teacher-mass", description=teacher_mass.__doc__,
                       epilog="Prints one JSON object. Example:\n  python scripts/benchmark.py teacher-mass "
                              "--model default --data data/smollm2_distill.jsonl.arrow --sizes 2048,4096,8192")
    options.MODEL.add(p, required=True, more="(the one the store was generated with)")
    options.DATA.add(p, required=True, help="self-distilled Arrow store (self_distill.py --save-hidden)")
    add_fields(p, d, Option("--sizes", "token_map sizes N to measure, comma-separated", parse_positive_int_list),
               Option("--heldout-fraction", "share of conversations the mass is measured on; the map comes from the "
                      "rest"), Option("--max-positions", "held-out positions measured at most"))
    options.SEED_OPTION.add(p, default=d.seed, more="the held-out split")
    a = p.parse_args(argv)
    with p.checking():  # the flags, before anything loads
        config = config_from(TeacherMassConfig, a)
        if not is_store(a.data):
            raise ValueError(f"--data {a.data} is not a self-distilled Arrow store")
    try:
        base = load_pretrained(options.model_arg("--model", a.model, tokenizer=False))
    except FAILURES as e:
        return validate.fail(e)
    print(json.dumps(outside_mass(base, a.data, config), indent=1))
    return 0


def heads_main(argv: list[str]) -> int:
    """`benchmark.py heads`: bench/heads_comparison.py."""
    d = CompareConfig()
    p = ArgumentParser(prog="benchmark.py heads", description=heads_comparison.__doc__,
                       epilog="Example (bench/heads):\n  python scripts/benchmark.py heads --model default "
                              "--heads before=default --heads kl=heads/smollm2-kl --out bench/heads")
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, action="append", required=True, metavar="LABEL=FOLDER",
                      more="to compare under a label (LABEL=FOLDER), or drafts that need no training: 'recycle', "
                           "'lookup' or a mix joined by '+' (e.g. mix=default+recycle+lookup); repeat the flag")
    options.QUESTIONS.add(p, default=16)
    options.MAX_NEW_TOKENS.add(p, default=d.max_new_tokens)
    add_fields(p, d, Option("--tree-sizes", "nodes of the greedy trees whose tokens/step is counted",
                            parse_positive_int_list),
               Option("--chains", "lengths of the chain trees ([[0], [0, 0], ...]) whose tokens/step is counted, "
                      "where the heads reach that deep; '' for none", parse_int_list),
               Option("--batch-sizes", "timed batch sizes, plain vs Medusa; '' for none", parse_int_list),
               Option("--dynamic-nodes", "also count dynamic trees (EAGLE-2 style, grown per step from the heads' "
                      "probabilities) of these node budgets N, against the greedy static tree of N nodes (default: "
                      "none)", parse_int_list),
               Option("--dynamic-top-k", "K values to try for each dynamic tree: children per expanded node and "
                      "frontier width (default: the default K of dynamic:N, see "
                      "medusa_jax.trees.tree.default_dynamic_top_k)", parse_positive_int_list, each(at_least(1))),
               Option("--dynamic-depth", "D values (drafting depths) to try for each dynamic tree, at most the "
                      "heads' number (default: 4, or the number of heads if fewer)", parse_positive_int_list,
                      each(at_least(1))),
               Option("--timed-nodes", "greedy tree size timed for heads without trees.json"),
               Option("--heldout", "held-out ShareGPT prompts (the last of the file) for the accuracy table"))
    options.DATA.add(p, help="ShareGPT-style conversations for the held-out prompts (default: the packaged ShareGPT "
                             "file)")
    add_fields(p, d, Option("--continuation-tokens", "greedy tokens generated per held-out prompt"))
    options.QUESTION_FILE.add(p)
    options.OUT.add(p, default="artifacts/benchmark_heads", more="folder for heads.json, heads.md and "
                    "heads.png; the committed bench/heads is written only when named here")
    a = p.parse_args(argv)
    with p.checking():  # the flags, before anything loads
        labels = heads_comparison.parse_labels(a.heads)
        config = config_from(CompareConfig, a)
        drafts = {label: name for label, name in labels.items() if heads_comparison.is_drafts(name)}
        for label, folder in labels.items():
            options.out_folder(a, heads=options.heads_mix_arg("--heads", folder) if label in drafts else folder,
                               data=a.data)
    try:
        folders = {label: options.heads_arg("--heads", f) for label, f in labels.items() if label not in drafts}
        loaded = load_model(options.model_arg("--model", a.model), None)
        heads = {label: (load_heads(f, base=loaded.base), portable_path(f)) for label, f in folders.items()}
    except FAILURES as e:
        return validate.fail(e)

    def heads_of(location: str):  # a mix's trained part
        return load_heads(options.heads_arg("--heads", location), base=loaded.base)

    prompts = loaded.encode_chat([q.turns[0] for q in mtbench_questions(a.questions, a.question_file)])
    results = heads_comparison.compare(loaded, heads, prompts, config, drafts_by_label=drafts, heads_of=heads_of)
    command = command_line("scripts/benchmark.py heads", argv)
    print(heads_comparison.write(results, a.out, command, machine_description()).read_text())
    return 0


def calibration_main(argv: list[str]) -> int:
    """`benchmark.py calibration`: bench/calibration_report.py."""
    p = ArgumentParser(prog="benchmark.py calibration", description=calibration_report.__doc__,
                       epilog="Example (bench/calibration):\n  python scripts/benchmark.py calibration --model "
                              "default --heads default --batch-sizes 1,4,8 --questions 16 --fresh "
                              "--out bench/calibration")
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, default="default", more="with a trees.json")
    p.add_argument("--batch-sizes", check=each(at_least(1)), type=parse_positive_int_list, default=(1, 4, 8),
                   help="batch sizes to choose a tree for and time (default: 1,4,8)")
    options.QUESTIONS.add(p, default=16)
    options.MAX_NEW_TOKENS.add(p, default=96)
    p.add_argument("--fresh", action="store_true",
                   help="time the steps again instead of reading this machine's cached calibration (as on first use)")
    options.QUESTION_FILE.add(p)
    options.OUT.add(p, required=True, more="folder for calibration.json and calibration.md (no default: "
                    "the committed bench/calibration is written only when named here)")
    a = p.parse_args(argv)
    with p.checking():
        options.out_folder(a, heads=a.heads)
    try:
        options.heads_arg("--heads", a.heads)
        loaded = load_model(options.model_arg("--model", a.model), a.heads)
    except FAILURES as e:
        return validate.fail(e)
    prompts = loaded.encode_chat([q.turns[0] for q in mtbench_questions(a.questions, a.question_file)])
    results = calibration_report.run(loaded, prompts, a.batch_sizes, a.max_new_tokens, a.fresh)
    command = command_line("scripts/benchmark.py calibration", argv)
    print(calibration_report.write(results, a.out, command, machine_description()).read_text())
    return 0


MODES = {"quick": quick_main, "teacher-mass": teacher_mass_main, "heads": heads_main,
         "calibration": calibration_main}


if __name__ == "__main__":
    sys.exit(main())
