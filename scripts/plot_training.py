"""Plot a head-training run's curves from its train_log.jsonl into a PNG.

Panels: total loss (train), per-head loss (train and held-out), per-head top-1 and top-5 accuracy (held-out).
Example:
  python scripts/plot_training.py heads/smollm2/train_log.jsonl --output heads/smollm2/curves.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from medusa_jax.atomic import save_figure_atomic
from medusa_jax.scripts import validate
from medusa_jax.scripts.cli_args import ArgumentParser


FIGURE_SUFFIXES = ("", ".png", ".pdf", ".svg", ".jpg", ".jpeg")  # formats matplotlib's Agg backend saves


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise validate.UsageError(f"{path}: not UTF-8 text ({e}); give a train_log.jsonl") from None
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise validate.UsageError(f"{path}: line {n + 1} is not JSON ({e}); give a train_log.jsonl")
        where = f"{path}: line {n + 1}"
        if not isinstance(record, dict):
            raise validate.UsageError(f"{where} is not a JSON object; give the train_log.jsonl of a run")
        needed = ("step", "loss", "head_loss") if record.get("kind") == "train" else ("step", "head_loss", "top1",
                                                                                     "top5")
        if "head_loss" in record:  # records without head_loss are not plotted (main refuses a log of only those)
            missing = [key for key in needed if key not in record]
            if missing:
                raise validate.UsageError(f"{where}: a {record.get('kind', 'eval')} record without "
                                          f"{', '.join(missing)}; give a train_heads.py train_log.jsonl")
            lists = [key for key in needed if key in ("head_loss", "top1", "top5")]
            if any(not isinstance(record[key], list) or not all(isinstance(v, (int, float)) for v in record[key])
                   for key in lists):
                raise validate.UsageError(f"{where}: {', '.join(lists)} must be lists of numbers; give a "
                                          f"train_heads.py train_log.jsonl")
        (train if record.get("kind") == "train" else evals).append(record)
    if not train and not evals:
        raise validate.UsageError(f"{path}: no training records; give the train_log.jsonl of a run")
    return train, evals


def plot(train: list[dict], evals: list[dict], output: Path, title: str) -> Path:
    import matplotlib  # lazy: seconds to import, and the Agg backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax.set(title="weighted loss (train)", xlabel="step")
    num_heads = len((train or evals)[0]["head_loss"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k in range(num_heads):
        c = colors[k % len(colors)]
        axes[0, 1].plot([r["step"] for r in train], [r["head_loss"][k] for r in train], lw=0.8, alpha=0.5, color=c)
        if evals:
            steps = [r["step"] for r in evals]
            axes[0, 1].plot(steps, [r["head_loss"][k] for r in evals], "o-", color=c, label=f"head {k} held-out")
            axes[1, 0].plot(steps, [r["top1"][k] for r in evals], "o-", color=c, label=f"head {k}")
            axes[1, 1].plot(steps, [r["top5"][k] for r in evals], "o-", color=c, label=f"head {k}")
    axes[0, 1].set(title="per-head loss (lines: train, dots: held-out)", xlabel="step")
    axes[1, 0].set(title="held-out top-1 accuracy", xlabel="step", ylim=(0, 1))
    axes[1, 1].set(title="held-out top-5 accuracy", xlabel="step", ylim=(0, 1))
    for a in (axes[0, 1], axes[1, 0], axes[1, 1]):
        if evals:
            a.legend(fontsize=8)
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure_atomic(fig, output, dpi=100)
    plt.close(fig)
    return output


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
        if not any("head_loss" in r for r in train + evals):
            raise validate.UsageError(f"{a.log}: its records have no head_loss; give a train_heads.py train_log.jsonl")
    except (validate.UsageError, OSError, UnicodeDecodeError) as e:
        return validate.fail(e)
    out = plot(train, evals, output, a.title or a.log.parent.name)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
