"""Orbax checkpoints of a training run (parameters, optimiser state, step, data position, run signature); only
finite weights are saved, and a run resumes on any mesh; docs/modules.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from medusa_jax.training.trainer import Trainer


class CheckpointMismatch(ValueError):
    """The checkpoint was written by a run with a different model, heads or training mode."""


class TrainingDiverged(RuntimeError):
    """The loss or the weights became NaN or infinite; the last good (finite) checkpoint is kept."""


@jax.jit
def all_finite(tree) -> jax.Array:
    """True when every float array of `tree` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Checkpoints:
    def __init__(self, directory: str | Path, save_every: int, keep: int = 3, async_save: bool = True):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got {save_every}, {keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                               enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, trainer: Trainer, data_position: dict[str, int], signature: dict[str, Any],
             force: bool = False) -> bool:
        """Saves if `trainer.step` is due (or `force`). Returns whether a save was started. Raises
        TrainingDiverged (and writes nothing) when a parameter is NaN or infinite."""
        if not force and not self.manager.should_save(trainer.step):
            return False
        if not bool(all_finite(trainer.params)):
            self.wait()
            raise TrainingDiverged(
                f"the weights hold NaN or inf after step {trainer.step}; training stopped before saving them. The last "
                f"good checkpoint is step {self.latest_step()} in {self.directory} (lower --learning-rate or check "
                f"the data)")
        state = {"params": trainer.params, "opt_state": trainer.opt_state}
        meta = {"step": trainer.step, "data_position": data_position, "signature": signature}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self.manager.save(trainer.step, args=args, force=force)

    def restore(self, trainer: Trainer, signature: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Loads the latest (or given) checkpoint into `trainer`; returns its metadata (data_position...)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no complete checkpoint to resume from")
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        saved = meta.get("signature", {})
        if saved != json.loads(json.dumps(signature)):
            diff = sorted(k for k in set(saved) | set(signature) if saved.get(k) != signature.get(k))
            raise CheckpointMismatch(f"{self.directory}/{step}: written by a run with different {diff}: "
                                     f"checkpoint has {[saved.get(k) for k in diff]}, this run "
                                     f"{[signature.get(k) for k in diff]}")
        target = {"params": trainer.params, "opt_state": trainer.opt_state}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        trainer.params = restored.state["params"]
        trainer.opt_state = restored.state["opt_state"]
        trainer.step = int(meta["step"])
        return meta

    def restore_finite(self, trainer: Trainer, signature: dict[str, Any], log=print) -> dict[str, Any]:
        """Restores the newest checkpoint whose weights are all finite (skipping, with a log line, any that are
        not); raises TrainingDiverged if none is."""
        for step in sorted(self.all_steps(), reverse=True):
            meta = self.restore(trainer, signature, step)
            if bool(all_finite(trainer.params)):
                return meta
            log(f"checkpoint {self.directory}/{step} holds NaN/inf weights: skipped")
        raise TrainingDiverged(f"{self.directory}: no checkpoint with finite weights to resume from; start again "
                               f"without --resume in a new --output")

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
