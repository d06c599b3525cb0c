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
from medusa_jax.training.recycle_table import TableBuildConfig, build_table_file
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, in_range
from medusa_jax.scripts.options import Option, add_fields, config_from


def parse_args(argv=None):
    d = TableBuildConfig()
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    options.DATA.add(p, default="sharegpt")
    p.add_argument("--output", required=True, help="the table file to write (.npz; written atomically)")
    add_fields(p, d, Option("--conversations", "conversations teacher-forced", check=at_least(1)),
               Option("--seq-len", "tokens of a conversation used, at most", check=at_least(2)))
    options.BATCH_SIZE.add(p, default=d.batch_size, more="conversations per forward")
    add_fields(p, d, Option("--top-k", "table width: successors kept per token", check=in_range(1, 64)),
               Option("--warmup", "conversations before the rank acceptance is counted", check=at_least(0)))
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        validate.output_file("--output", a.output, {"--model": options.model_location(a.model)})
        enable_compile_cache()
        folder = options.model_arg("--model", a.model)
        options.within_positions(f"--seq-len {a.seq_len}", a.seq_len, folder)
        summary = build_table_file(folder, None if a.data == "sharegpt" else a.data, a.output,
                                   config_from(TableBuildConfig, a))
    except (OSError, ValueError) as e:  # HubError is an OSError, the others ValueErrors
        return validate.fail(e)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
