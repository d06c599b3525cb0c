"""A training run's metrics: OUTPUT/train_log.jsonl, TensorBoard event files beside it, optionally Weights &
Biases; on resume the steps after the restored one are dropped from each."""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

from medusa_jax.atomic import pyplot, save_figure_atomic

TENSORBOARD_DIR = "tensorboard"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a log record as {KIND/KEY[/i]: value} (kind and step excluded)."""
    kind = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        if key in ("kind", "step") or isinstance(value, bool):
            continue
        if isinstance(value, numbers.Number):
            out[f"{kind}/{key}"] = float(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Number) and not isinstance(v, bool)
                                                      for v in value):
            out.update({f"{kind}/{key}/{i}": float(v) for i, v in enumerate(value)})
    return out


class MetricsLog:
    """`log.write(record)` appends to the JSONL log and writes its scalars to TensorBoard (and W&B);
    `log.close()` flushes. Only process 0 makes one (training.run)."""

    def __init__(self, output: str | Path, *, resume_step: int | None = None, wandb_project: str | None = None,
                 run_config: dict[str, Any] | None = None, log_name: str = "train_log.jsonl"):
        from tensorboardX import SummaryWriter  # lazy: only training writes events

        self.output = Path(output)
        self.path = self.output / log_name
        purge = resume_step + 1 if resume_step is not None else None
        self.tensorboard = SummaryWriter(logdir=str(self.output / TENSORBOARD_DIR), purge_step=purge, flush_secs=30)
        self.wandb = None
        if wandb_project is not None:
            import wandb

            self.wandb = wandb.init(project=wandb_project, config=run_config or {}, dir=str(self.output),
                                    resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record.get("step", 0))
        values = scalars(record)
        for tag, value in values.items():
            self.tensorboard.add_scalar(tag, value, step)
        if record.get("kind") == "eval":
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    """A train_log.jsonl's train and eval records, each checked for what `plot_curves` reads (ValueError)."""
    train, evals = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); give a train_log.jsonl") from None
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n + 1} is not JSON ({e}); give a train_log.jsonl")
        where = f"{path}: line {n + 1}"
        if not isinstance(record, dict):
            raise ValueError(f"{where} is not a JSON object; give the train_log.jsonl of a run")
        needed = ("step", "loss", "head_loss") if record.get("kind") == "train" else ("step", "head_loss", "top1",
                                                                                     "top5")
        if "head_loss" in record:  # records without head_loss are not plotted (a log of only those is refused below)
            missing = [key for key in needed if key not in record]
            if missing:
                raise ValueError(f"{where}: a {record.get('kind', 'eval')} record without "
                                          f"{', '.join(missing)}; give a train_heads.py train_log.jsonl")
            lists = [key for key in needed if key in ("head_loss", "top1", "top5")]
            if any(not isinstance(record[key], list) or not all(isinstance(v, (int, float)) for v in record[key])
                   for key in lists):
                raise ValueError(f"{where}: {', '.join(lists)} must be lists of numbers; give a "
                                          f"train_heads.py train_log.jsonl")
        (train if record.get("kind") == "train" else evals).append(record)
    if not train and not evals:
        raise ValueError(f"{path}: no training records; give the train_log.jsonl of a run")
    if not any("head_loss" in r for r in train + evals):
        raise ValueError(f"{path}: its records have no head_loss; give a train_heads.py train_log.jsonl")
    return train, evals


def plot_curves(train: list[dict], evals: list[dict], output: Path, title: str) -> Path:
    """Loss, per-head loss and held-out top-1/top-5 against the step, one figure of four panels."""
    plt = pyplot()
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
    return output
