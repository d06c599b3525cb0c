"""Build a warm Token Recycling table (`--heads recycle`) from the base model's own logits over chat text.

Example (the shipped SmolLM2 table, medusa_jax/assets/recycle/smollm2.npz):
  python scripts/build_recycle_table.py --model default --data sharegpt --conversations 160 --warmup 40 \
      --output medusa_jax/assets/recycle/smollm2.npz
Each conversation (chat template applied, at most --seq-len tokens) is teacher-forced through the model once;
the top-k ids of its logits at every position overwrite the table row of that position's token, in text order
(training/recycle_table.py). It prints the rank acceptance: how often the model's greedy next token after an
assistant token sat at rank 0..k-1 of that token's row (after --warmup conversations), the measure the drafting
templates of medusa_jax/heads/recycle.py are built from.
"""

from __future__ import annotations

import json
import sys

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.hf.load import load_pretrained
from medusa_jax.hub import HubError
from medusa_jax.text import TokenizerError, eos_token_ids, load_tokenizer
from medusa_jax.heads.recycle import empty_table
from medusa_jax.heads.recycle_file import model_fingerprint, save_table
from medusa_jax.training.recycle_table import TableBuildConfig, build_table
from medusa_jax.training.sharegpt import DataError, read_conversations
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, in_range


def parse_args(argv=None):
    d = TableBuildConfig()
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    options.DATA.add(p, default="sharegpt")
    p.add_argument("--output", required=True, help="the table file to write (.npz; written atomically)")
    p.add_argument("--conversations", type=int, default=d.conversations, check=at_least(1),
                   help="conversations teacher-forced (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, check=at_least(2),
                   help="tokens of a conversation used, at most (default: %(default)s)")
    options.BATCH_SIZE.add(p, default=d.batch_size, more="conversations per forward")
    p.add_argument("--top-k", type=int, default=d.top_k, check=in_range(1, 64),
                   help="table width: successors kept per token (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, check=at_least(0),
                   help="conversations before the rank acceptance is counted (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        validate.output_file("--output", a.output, {"--model": options.model_location(a.model)})
    except validate.UsageError as e:
        p.error(str(e))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    enable_compile_cache()
    try:
        folder = options.model_arg("--model", a.model)
        options.within_positions(f"--seq-len {a.seq_len}", a.seq_len, folder)
        conversations, report = read_conversations(None if a.data == "sharegpt" else a.data, a.conversations)
        tokenizer = load_tokenizer(folder)
        base = load_pretrained(folder)
        config = TableBuildConfig(len(conversations), a.seq_len, a.batch_size, a.top_k, a.warmup)
        done = [0]

        def progress(n):
            done[0] += n
            print(f"\r{done[0]}/{len(conversations)} conversations", end="", file=sys.stderr, flush=True)

        built = build_table(base, tokenizer, conversations, tuple(eos_token_ids(folder, tokenizer)), config,
                            progress)
        print(file=sys.stderr)
        note = (f"{len(conversations)} conversations of {report.source.split('/')[-1]}, at most {a.seq_len} tokens "
                f"each, teacher-forced ({built.tokens} positions); rank acceptance "
                f"{[round(x, 4) for x in built.rank_acceptance]} over {built.counted} assistant positions")
        save_table(a.output, built.table_vr, model=model_fingerprint(base), note=note)
    except (OSError, ValueError, DataError, TokenizerError, HubError) as e:
        return validate.fail(e)
    print(json.dumps({"output": str(a.output), "conversations": len(conversations), "positions": built.tokens,
                      "counted": built.counted, "rank_acceptance": [round(x, 4) for x in built.rank_acceptance],
                      "rows_seen": int((built.table_vr != empty_table(*built.table_vr.shape)).any(axis=1).sum())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
