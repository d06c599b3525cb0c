"""generate_batch through the generation engine against the direct decode calls it replaced, plain and a mix of
drafters, in one process (`medusa_jax.bench.engine_mix`):

  python scripts/benchmark_engine_mix.py --model default --heads default --mix default+recycle+lookup@4 \
      --questions 4 --batch-sizes 1,4 --max-new-tokens 128 --out bench/engine_mix/bucket128

Writes OUT/results.json and OUT/README.md (tokens/s engine / direct, tokens/step, mismatches) with the command.
"""

from __future__ import annotations

import sys

from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, each, parse_positive_int_list

from medusa_jax.inference.batch_run import BatchSettings
from medusa_jax.paths import command_line


def parse(argv):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    options.MODEL.add(p, default="default")
    options.HEADS.add(p, default="default", more="the part 'default' of --mix names")
    p.add_argument("--mix", default="default+recycle+lookup@4", help="a --heads mix and its node budget, MIX@NODES "
                   "(default: %(default)s)")
    options.QUESTIONS.add(p, default=4)
    p.add_argument("--batch-sizes", check=each(at_least(1)), type=parse_positive_int_list, default=(1, 4),
                   help="rows per call, each measured (default: 1,4)")
    options.MAX_NEW_TOKENS.add(p, default=128)
    p.add_argument("--bucket", check=at_least(1), type=int, default=BatchSettings.bucket,
                   help="prompt widths are BUCKET * 2**k, caches sized from them (default: generate_batch's, "
                        "%(default)s; bench/mixed_drafts pads every prompt to 512)")
    options.OUT.add(p, default="artifacts/engine_mix", more="report folder")
    a = p.parse_args(argv)
    try:
        mix, _, nodes = a.mix.partition("@")
        if not nodes.isdigit() or int(nodes) < 1:
            raise validate.UsageError(f"--mix {a.mix}: give MIX@NODES with NODES an integer >= 1, e.g. "
                                      f"default+recycle+lookup@4")
        options.heads_mix_arg("--mix", mix)
        options.heads_arg("--heads", a.heads)
        options.out_folder(a, heads=a.heads)
    except validate.UsageError as e:
        p.error(str(e))
    return a


def main(argv=None) -> int:
    a = parse(argv)
    from medusa_jax.bench import engine_mix  # after the checks: it imports JAX

    engine_mix.run(options.model_arg("--model", a.model), a.heads, a.mix, a.questions, list(a.batch_sizes),
                   a.max_new_tokens, a.bucket, a.out, command_line("scripts/benchmark_engine_mix.py", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
