"""The generation engine's admission policies against each other and against the former direct sorted batches, in
one process, on the same prompts, interleaved (issue 38; results and method in bench/refill/sorted_engine.md and
docs/modules.md)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from medusa_jax.demo_model import resolve_model_dir
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.trees.tree import DEFAULT_TREE, load_tree
from medusa_jax.inference import api, engine_batches
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.bench.bench_inputs import mtbench_questions

METHODS = ("direct", "sorted", "fifo")
REPO = Path(__file__).resolve().parents[1]
# --prompt-set uneven: replies of uneven length (results in bench/refill/uneven/README.md)
COUNTRIES = ("France", "Japan", "Peru", "Kenya", "Canada", "Egypt", "Norway", "Chile", "India", "Italy", "Ghana",
             "Spain", "Brazil", "Poland", "Greece", "Mexico")
SUBJECTS = ("a lighthouse keeper", "a lost robot", "a dragon who bakes", "two rival chefs", "a haunted library",
            "a fox and a crow", "a sailor in a storm", "a city under the sea")


def uneven_questions(n: int) -> list[str]:
    """n prompts cycling through four kinds, so a reply's length is not tied to its prompt's (sorted batches sort
    by prompt length): an MT-Bench first turn (long prompt, long reply), a one-word question (short prompt, short
    reply), a story request (short prompt, long reply), an arithmetic question (short prompt, short reply)."""
    mtbench = [q.first_turn for q in mtbench_questions((n + 3) // 4)]
    kinds = (lambda i: mtbench[i],
             lambda i: f"Name the capital of {COUNTRIES[i % len(COUNTRIES)]} in one word.",
             lambda i: f"Write a long, detailed story about {SUBJECTS[i % len(SUBJECTS)]}.",
             lambda i: f"What is {7 * i + 2} plus {3 * i + 5}? Reply with the number only.")
    return [kinds[k % 4](k // 4) for k in range(n)]


def load_direct_api(rev: str):
    """inference/api.py as of git revision `rev`, imported as a module of its own (its imports are today's)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:inference/api.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "direct_api.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("direct_api", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["direct_api"] = module
    spec.loader.exec_module(module)
    return module


def run_method(method: str, model: ShardedModel, prompts, settings: api.BatchSettings, direct_api) -> dict:
    cpu_start = time.process_time()
    if method == "direct":
        fields = {f.name for f in dataclasses.fields(direct_api.BatchSettings)}
        old = direct_api.BatchSettings(**{k: getattr(settings, k) for k in fields})
        run = direct_api.generate_batch(model, prompts, dataclasses.replace(old, engine="batches"), progress=False)
    else:
        engine = "batches" if method == "sorted" else "refill"
        run = api.generate_batch(model, prompts, dataclasses.replace(settings, engine=engine), progress=False)
    cpu_seconds = time.process_time() - cpu_start
    decode_s = run.seconds - run.compile_seconds
    return {"tokens": [r.token_ids for r in run.results], "new_tokens": run.new_tokens,
            "seconds": round(run.seconds, 2), "compile_seconds": round(run.compile_seconds, 2),
            "tokens_per_s": round(run.new_tokens / max(decode_s, 1e-9), 2),
            "tokens_per_step": round(run.tokens_per_step, 3), "iterations": run.num_batches,
            "cpu_seconds": round(cpu_seconds, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (SmolLM2-135M-Instruct)")
    p.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="direct,sorted", help=f"comma-separated, of {','.join(METHODS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--direct-rev", default=None, help="git revision whose api.py is the direct method")
    p.add_argument("--random-heads", type=int, default=0,
                   help="Medusa decoding with this many randomly initialised heads and the default tree (0: plain)")
    p.add_argument("--prompt-set", default="mtbench", choices=("mtbench", "uneven"),
                   help="MT-Bench first turns, or uneven (uneven_questions: replies of uneven length)")
    p.add_argument("--refill-chunk-steps", type=int, default=engine_batches.REFILL_CHUNK_STEPS,
                   help="decode steps between the fifo method's refills (default: %(default)s)")
    p.add_argument("--out", required=True, help="JSON lines output")
    a = p.parse_args(argv)
    try:
        batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
        methods = a.methods.split(",")
    except ValueError:
        p.exit(2, "error: --batch-sizes takes comma-separated integers, e.g. 1,4,16\n")
    if min(batch_sizes + [a.prompts, a.max_new_tokens, a.rounds, a.refill_chunk_steps]) < 1 or a.random_heads < 0:
        p.exit(2, "error: --batch-sizes, --prompts, --max-new-tokens, --rounds and --refill-chunk-steps must be >= 1, "
                  "--random-heads >= 0\n")
    engine_batches.REFILL_CHUNK_STEPS = a.refill_chunk_steps  # read by refilled_slots at each call
    if set(methods) - set(METHODS) or ("direct" in methods and not a.direct_rev):
        p.exit(2, f"error: --methods takes {','.join(METHODS)}; direct needs --direct-rev\n")
    try:
        a.model = resolve_model_dir(a.model)
    except (OSError, RuntimeError, ValueError) as e:
        p.exit(2, f"error: --model {a.model}: {e}\n")
    if not (a.model / "config.json").is_file():
        p.exit(2, f"error: --model {a.model}: no config.json there; give a model folder or 'default'\n")
    if a.model.resolve() in Path(a.out).resolve().parents:
        p.exit(2, f"error: --out {a.out}: inside the --model folder; write the rows elsewhere\n")
    direct_api = load_direct_api(a.direct_rev) if "direct" in methods else None
    tokenizer = load_tokenizer(a.model)
    eos = eos_token_ids(a.model, tokenizer)
    questions = uneven_questions(a.prompts) if a.prompt_set == "uneven" else \
        [q.first_turn for q in mtbench_questions(a.prompts)]
    prompts = [encode_prompt(tokenizer, q, chat=True) for q in questions]
    base = load_pretrained(a.model)
    tree, heads = None, None
    if a.random_heads:
        heads = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=a.random_heads),
                           base, seed=0)
        tree = load_tree(DEFAULT_TREE, num_heads=a.random_heads, max_top_k=heads.config.head_vocab_size)
    model = ShardedModel(base, heads)
    with open(a.out, "w") as out:
        for batch in batch_sizes:
            settings = api.BatchSettings(batch_size=batch, max_new_tokens=a.max_new_tokens, tree=tree,
                                         eos_ids=tuple(eos), pad_id=pad_token_id(tokenizer, eos))
            rates, cpu = {m: [] for m in methods}, {m: [] for m in methods}
            for round_ in range(a.rounds):
                first = None
                for method in (methods if round_ % 2 == 0 else methods[::-1]):
                    row = run_method(method, model, prompts, settings, direct_api)
                    tokens = row.pop("tokens")
                    first = first or tokens
                    lengths = sorted(map(len, tokens))  # quartiles and the longest reply
                    row.update(batch_size=batch, method=method, round=round_, prompts=len(prompts),
                               rows_differing=sum(x != y for x, y in zip(tokens, first)),
                               reply_lengths=[lengths[len(lengths) * q // 4] for q in range(4)] + [lengths[-1]],
                               refill_chunk_steps=a.refill_chunk_steps)
                    rates[method].append(row["tokens_per_s"])
                    cpu[method].append(row["cpu_seconds"])
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), flush=True)
            base_rates = rates[methods[0]]
            for m in methods[1:]:
                ratios = [x / y for x, y in zip(rates[m], base_rates)]
                print(f"batch {batch}: {m} / {methods[0]} tokens/s per round "
                      f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})", flush=True)
                cpu_ratios = [x / y for x, y in zip(cpu[m][1:], cpu[methods[0]][1:])]
                if cpu_ratios:
                    print(f"batch {batch}: {m} / {methods[0]} CPU seconds per round after the first "
                          f"{', '.join(f'{r:.3f}' for r in cpu_ratios)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
