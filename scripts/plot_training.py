"""Plot a head-training run's curves from its train_log.jsonl into a PNG.

Panels: total loss (train), per-head loss (train and held-out), per-head top-1 and top-5 accuracy (held-out).
Example:
  python scripts/plot_training.py heads/smollm2/train_log.jsonl --output heads/smollm2/curves.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from medusa_jax.training.metrics_log import plot_curves, read_log
from medusa_jax.scripts import validate
from medusa_jax.scripts.cli_args import ArgumentParser


FIGURE_SUFFIXES = ("", ".png", ".pdf", ".svg", ".jpg", ".jpeg")  # formats matplotlib's Agg backend saves


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("log", type=Path, help="train_log.jsonl written by scripts/train_heads.py")
    p.add_argument("--output", type=Path, default=None,
                   help="PNG to write (default: curves.png next to the log); never the log itself")
    p.add_argument("--title", default=None, help="figure title (default: the log's folder name)")
    a = p.parse_args(argv)
    try:
        validate.input_file("log", a.log)
        output = a.output or a.log.with_name("curves.png")
        validate.output_file("--output", output, {"log": a.log})
        if output.suffix.lower() not in FIGURE_SUFFIXES:
            raise validate.UsageError(f"--output {output}: give an image file name ending in "
                                      f"{', '.join(FIGURE_SUFFIXES[1:])} (no suffix: PNG)")
        train, evals = read_log(a.log)
    except (ValueError, OSError) as e:
        return validate.fail(e)
    print(plot_curves(train, evals, output, a.title or a.log.parent.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
