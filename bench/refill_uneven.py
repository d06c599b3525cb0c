"""The engine's two admission policies (refilled slots "fifo" vs sorted batches) on replies of uneven length: the
`generate_batch(engine="auto")` rule (`api.REFILL_MIN_BATCH`) re-measured where slots have something to refill
(results and method in bench/refill/uneven/README.md).

The prompts cycle through four kinds, so reply length is not tied to prompt length (sorted batches sort by prompt
length): an MT-Bench first turn (long prompt, long reply), a one-word question (short prompt, short reply), a story
request (short prompt, long reply), an arithmetic question (short prompt, short reply). Greedy: both policies make
the same tokens. Methods alternate within a round, the order reversed in the next."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference import api, engine_batches
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.bench.admission_benchmark import run_method
from medusa_jax.bench.bench_inputs import mtbench_questions

METHODS = ("sorted", "fifo")
COUNTRIES = ("France", "Japan", "Peru", "Kenya", "Canada", "Egypt", "Norway", "Chile", "India", "Italy", "Ghana",
             "Spain", "Brazil", "Poland", "Greece", "Mexico")
SUBJECTS = ("a lighthouse keeper", "a lost robot", "a dragon who bakes", "two rival chefs", "a haunted library",
            "a fox and a crow", "a sailor in a storm", "a city under the sea")


def uneven_questions(n: int) -> list[str]:
    """n prompts, the four kinds of the module docstring in turn."""
    mtbench = [q.first_turn for q in mtbench_questions((n + 3) // 4)]
    kinds = (lambda i: mtbench[i],
             lambda i: f"Name the capital of {COUNTRIES[i % len(COUNTRIES)]} in one word.",
             lambda i: f"Write a long, detailed story about {SUBJECTS[i % len(SUBJECTS)]}.",
             lambda i: f"What is {7 * i + 2} plus {3 * i + 5}? Reply with the number only.")
    return [kinds[k % 4](k // 4) for k in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (SmolLM2-135M-Instruct)")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--prompts", type=int, required=True, help="prompts (more than --batch-size, so slots refill)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--refill-chunk-steps", type=int, default=engine_batches.REFILL_CHUNK_STEPS,
                   help="decode steps between refills of the fifo runs (default: engine_batches.REFILL_CHUNK_STEPS)")
    p.add_argument("--out", required=True, help="JSON lines output (appended)")
    a = p.parse_args(argv)
    if min(a.batch_size, a.prompts, a.max_new_tokens, a.rounds, a.refill_chunk_steps) < 1:
        p.exit(2, "error: --batch-size, --prompts, --max-new-tokens, --rounds and --refill-chunk-steps must be >= 1\n")
    engine_batches.REFILL_CHUNK_STEPS = a.refill_chunk_steps  # what refilled_slots reads at each call
    enable_compile_cache()
    tokenizer = load_tokenizer(a.model)
    eos = eos_token_ids(a.model, tokenizer)
    prompts = [encode_prompt(tokenizer, q, chat=True) for q in uneven_questions(a.prompts)]
    model = ShardedModel(load_pretrained(a.model), None)
    settings = api.BatchSettings(batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, eos_ids=tuple(eos),
                                 pad_id=pad_token_id(tokenizer, eos))
    rates = {m: [] for m in METHODS}
    with open(a.out, "a") as out:
        for round_ in range(a.rounds):
            first = None
            for method in (METHODS if round_ % 2 == 0 else METHODS[::-1]):
                row = run_method(method, model, prompts, settings, None)
                tokens = row.pop("tokens")
                first = first or tokens
                lengths = sorted(map(len, tokens))
                row.update(batch_size=a.batch_size, method=method, round=round_, prompts=len(prompts),
                           max_new_tokens=a.max_new_tokens, refill_chunk_steps=a.refill_chunk_steps,
                           rows_differing=sum(x != y for x, y in zip(tokens, first)),
                           reply_length_quartiles=[lengths[len(lengths) * q // 4] for q in range(4)] + [lengths[-1]],
                           at_max_tokens=sum(n >= a.max_new_tokens for n in lengths))
                rates[method].append(row["tokens_per_s"])
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)
    ratios = [f / s for f, s in zip(rates["fifo"], rates["sorted"])]
    print(f"batch {a.batch_size}: fifo / sorted tokens/s per round {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
