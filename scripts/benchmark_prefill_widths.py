"""`scripts/benchmark_mixed.py` with every method run twice per round, interleaved: its prompts admitted at the
widths of `engine.width_ladder` (64, 96, 128, 192, 256, 384, ...), and, labelled "old widths", at the former
ladder 64 * 2**k (so a prompt of 300 tokens is prefilled 384 wide, or 512). Takes benchmark_mixed's arguments:

  python scripts/benchmark_prefill_widths.py --mixes default+recycle+lookup@4 --questions 0 \
      --grounded 4 --max-new-tokens 128 --repeats 3 --first-token --out bench/mixed_drafts/prefill_widths
"""

import sys

from medusa_jax.bench import mixed_drafts
from medusa_jax.inference import generation_engine
from medusa_jax.paths import command_line
from medusa_jax.scripts import benchmark_mixed

OLD = " old widths"
ladder_width = generation_engine.bucket_length
old_models: set[int] = set()
at_old = [False]


def old_width(n: int, smallest: int) -> int:
    size = smallest
    while size < n:
        size *= 2
    return size


def admission_width(n: int, smallest: int) -> int:
    return (old_width if at_old[0] else ladder_width)(n, smallest)


def build_twice(loaded, chosen, heads_of, batch=1):
    """Each method's model, then a second copy of it (its own drafter state) that admits at the old widths."""
    new, old = (build_models(loaded, chosen, heads_of, batch) for _ in range(2))
    old_models.update(id(model) for model, _ in old.values())
    return {name: models[label] for label in new for name, models in ((label, new), (label + OLD, old))}


def generate_batch(model, *args, **kwargs):
    at_old[0] = id(model) in old_models
    return generate(model, *args, **kwargs)


generate, build_models = mixed_drafts.generate_batch, mixed_drafts.build_models
generation_engine.bucket_length = admission_width
mixed_drafts.generate_batch = generate_batch
mixed_drafts.build_models = build_twice
benchmark_mixed.command_line = lambda script, argv: command_line("scripts/benchmark_prefill_widths.py", argv)

if __name__ == "__main__":
    sys.exit(benchmark_mixed.main())
