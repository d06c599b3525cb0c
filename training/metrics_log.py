"""A training run's metrics: the JSONL log, TensorBoard event files beside it, and optionally Weights & Biases.

    OUTPUT/train_log.jsonl    one JSON object per logged step ("train") and evaluation ("eval") (the record)
    OUTPUT/tensorboard/       event files of the same numbers, written with tensorboardX (no TensorFlow needed):
                              `tensorboard --logdir OUTPUT/tensorboard`
    Weights & Biases          with `wandb_project` (train_heads.py --wandb PROJECT), when wandb is installed
Scalars are named KIND/KEY (`train/loss`, `eval/top1/0` for head 0's held-out top-1: one tag per list element).
On resume TensorBoard drops the events of steps after the restored one (`purge_step`), as the JSONL log does
(`output_folder.truncate_log`), so each step appears once.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

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
    `log.close()` flushes. Only process 0 makes one (`enabled`)."""

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


class NoLog:
    """What processes other than 0 write: nothing."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
