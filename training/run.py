"""A whole head-training run: data, heads, trainer, checkpoints, logs, held-out evaluation, the heads folder
(`train_heads`, what scripts/train_heads.py calls); the outputs are listed in docs/modules.md."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from tqdm import tqdm

from medusa_jax.atomic import commit_entries
from medusa_jax.settings import SEED, at_least, check_settings, in_range, setting
from medusa_jax.text import load_tokenizer
from medusa_jax.model import sharding as shd
from medusa_jax.model.config import ModelConfig
from medusa_jax.hf.load import load_pretrained
from medusa_jax.hf.save import save_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.folder import write_heads_files
from medusa_jax.heads.eagle_init import identity_feature_init
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.kinds import drafter_class
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.training import hidden_store, losses, memory_plan, output_folder, sources
from medusa_jax.training.checkpointing import Checkpoints, TrainingDiverged
from medusa_jax.training.metrics_log import MetricsLog
from medusa_jax.training.data import DataConfig, top_token_ids
from medusa_jax.training.objectives import objective_for
from medusa_jax.training.trainer import TrainConfig, Trainer, schedule


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str
    output: str
    data: str | None = None  # None: the packaged ShareGPT file
    num_heads: int = setting(4, in_range(1, 64))
    num_layers: int = setting(1, at_least(0))
    lm_head: str = "truncated:3072"  # own | shared | truncated:N (3,072 divides tensor degrees 2, 3, 4, 6, 8)
    head_type: str = "medusa"  # a trainable drafter kind (training.objectives.OBJECTIVES): medusa | hydra (heads
    # that also see the drafted tokens) | eagle (a feature drafter, heads/eagle.py) | eagle3 (heads/eagle3.py,
    # packed rows only); hydra and the eagles: Medusa-1 only
    hydra_input: str = HeadsConfig.hydra_input  # hydra: add | concat (medusa_jax.heads.hydra)
    eagle_init: str = "random"  # eagle: random | identity (fc = [0; I], embedding at the feature's scale: heads.eagle_init)
    batch_size: int = setting(8, at_least(1))  # global packed rows per step
    cached_batch_size: int = setting(4096, at_least(1))  # global positions per step with cache_hidden
    cache_hidden: bool = False
    mesh: str = ""
    checkpoint_dir: str | None = None
    save_every: int = setting(500, at_least(1))
    keep_checkpoints: int = setting(3, at_least(1))
    resume: bool = False
    eval_every: int = setting(500, at_least(1))
    eval_batches: int = setting(50, at_least(1))  # at most this many held-out batches per evaluation
    log_every: int = setting(10, at_least(1))
    heads_dtype: str = "float32"  # storage dtype of the saved heads file (they load as float32)
    backbone_dtype: str = "float32"  # storage dtype of the backbone's weights in memory (bfloat16: Medusa-1 only)
    base_model_name: str | None = None  # recorded in the heads config (default: the --model path)
    seed: int = setting(0, SEED)
    progress: bool = True
    force_output: bool = False  # write into an existing folder the trainer did not make (never a model folder)
    memory_limit_gib: float | None = setting(None, at_least(0.0))  # None: MemAvailable; 0: no check (memory_plan)
    # a feature store as --data: train on its first conversations of this many tokens
    max_tokens: int | None = setting(None, at_least(1))
    wandb_project: str | None = None  # also log to Weights & Biases (training.metrics_log)
    data_config: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        """Each setting's rule, and the settings that rule each other out, named by their flags (ValueError)."""
        check_settings(self)
        objective, medusa2 = objective_for(self.head_type), self.train.medusa2
        if medusa2 and not objective.joint_backbone:
            raise ValueError(f"--head-type {self.head_type} trains with a frozen backbone (Medusa-1) only; drop "
                             f"--medusa2")
        if self.cache_hidden and medusa2:
            raise ValueError("--cache-hidden needs a frozen backbone (Medusa-1); drop it or --medusa2")
        if self.backbone_dtype != "float32" and medusa2:
            raise ValueError(f"--backbone-dtype {self.backbone_dtype} is for a frozen backbone (Medusa-1): Medusa-2 "
                             f"trains float32 master weights (halve its optimiser state with --optimizer-dtype "
                             f"bfloat16 instead); drop one")
        if objective.feature_rows and self.cache_hidden:
            raise ValueError(f"--head-type {self.head_type} reads the hidden states of every position: give a "
                             f"feature store (scripts/build_features.py) as --data instead of --cache-hidden")
        if objective.fused_features and (self.cache_hidden or self.num_layers != 1
                                         or hidden_store.is_store(self.data, hidden_store.FEATURES)):
            raise ValueError(f"--head-type {self.head_type} trains on packed rows (the fused features come from the "
                             f"backbone in the step) with one decoder layer: drop --cache-hidden, give chat data as "
                             f"--data (a feature store holds only the last hidden state) and use --num-layers 1")
        if self.eagle_init != "random" and not drafter_class(self.head_type).fc_options:
            raise ValueError(f"--eagle-init {self.eagle_init} initialises an EAGLE drafter; drop it or use "
                             f"--head-type eagle")
        parse_lm_head(self.lm_head)
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ValueError("--wandb: empty value; give a Weights & Biases project name (or leave the flag out)")
        if self.wandb_project is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb needs the wandb package: pip install wandb (or drop --wandb)")
        shd.check_rows_split(*(("--cached-batch-size", self.cached_batch_size) if self.cache_hidden else
                               ("--batch-size", self.batch_size)), self.mesh)


def parse_lm_head(spec: str) -> tuple[str, int | None]:
    """'own' | 'shared' | 'truncated:N' -> (mode, N)."""
    mode, _, n = spec.partition(":")
    if mode == "truncated":
        if not (n.isascii() and n.isdigit()) or int(n) < 1:
            raise ValueError(f"--lm-head truncated needs a size, e.g. truncated:4096, got {spec!r}")
        return mode, int(n)
    if mode in ("own", "shared") and not n:
        return mode, None
    raise ValueError(f"--lm-head must be own, shared or truncated:N, got {spec!r}")


def _signature(cfg: RunConfig, base, heads: MedusaHeads) -> dict[str, Any]:
    token_map = "" if heads.token_map is None else hashlib.sha256(
        np.asarray(heads.token_map[...]).tobytes()).hexdigest()[:16]
    return {"model": repr(base.config), "heads": heads.config.to_dict(), "token_map": token_map,
            "medusa2": cfg.train.medusa2, "distill_kl": cfg.train.distill_kl, "cache_hidden": cfg.cache_hidden,
            "freeze_lm_heads": cfg.train.freeze_head_lm_heads, "head_loss": cfg.train.head_loss,
            "seq_len": cfg.data_config.seq_len, "batch_size": cfg.cached_batch_size if cfg.cache_hidden else
            cfg.batch_size, "seed": cfg.seed}


def evaluate(trainer: Trainer, batches: list[dict]) -> dict[str, Any]:
    total = None
    for batch in batches:
        stats, _ = trainer.eval_stats(batch)
        total = stats if total is None else jax.tree.map(np.add, total, stats)
    return losses.HeadStats.summary(total) if total is not None else {}


def plan_memory(cfg: RunConfig) -> memory_plan.MemoryEstimate:
    """The run's peak-memory estimate from the model's config.json (no weights loaded)."""
    mode, n_trunc = parse_lm_head(cfg.lm_head)
    try:
        hf = json.loads((Path(cfg.model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {cfg.model}: cannot read its config.json ({e})") from None
    missing = [key for key in memory_plan.CONFIG_KEYS if key not in hf]
    if missing:
        raise ValueError(f"--model {cfg.model}: config.json lacks {missing}; not a Llama-family model")
    return memory_plan.estimate_run(
        ModelConfig.from_hf_config(hf, dtype=cfg.backbone_dtype), num_heads=cfg.num_heads, num_layers=cfg.num_layers,
        head_vocab=None if mode == "shared" else min(n_trunc or hf["vocab_size"], hf["vocab_size"]),
        batch_size=cfg.batch_size,
        seq_len=cfg.data_config.seq_len, cached_batch_size=cfg.cached_batch_size, cache_hidden=cfg.cache_hidden,
        medusa2=cfg.train.medusa2, distill_kl=cfg.train.distill_kl, freeze_lm_heads=cfg.train.freeze_head_lm_heads,
        optimizer_dtype=cfg.train.optimizer_dtype)


def train_heads(cfg: RunConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Checks the output folder and the memory plan, takes the folder's lock, then runs (see output_folder)."""
    output_folder.check_output(cfg.output, cfg.force_output)
    plan = plan_memory(cfg)
    memory_plan.check_fits(plan, cfg.memory_limit_gib, cfg.cache_hidden, cfg.lm_head, cfg.train.medusa2)
    is_main = jax.process_index() == 0
    with output_folder.OutputLock(cfg.output) if is_main else contextlib.nullcontext():
        output_folder.check_previous_run(cfg.output, cfg.checkpoint_dir or Path(cfg.output) / "checkpoints",
                                         cfg.resume)
        log(f"memory estimate: {plan.describe()}")
        return _run(cfg, log)


def _run(cfg: RunConfig, log: Callable[[str], None]) -> dict[str, Any]:
    is_main = jax.process_index() == 0
    output = Path(cfg.output)
    mesh = shd.MeshConfig.parse(cfg.mesh).make_mesh()
    tokenizer = load_tokenizer(cfg.model)
    # --scan-layers: the layers are read straight into the stacked layout the step scans (hf/load.py), so the
    # per-layer form is never held beside it; the trainer keeps and returns the form it is given
    base = load_pretrained(cfg.model, dtype=cfg.backbone_dtype,
                           sharding_for=shd.sharding_for(mesh) if mesh.size > 1 else None, layers=cfg.train.layers)
    eos = tuple(base.config.eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    mode, n_trunc = parse_lm_head(cfg.lm_head)
    if n_trunc is not None and n_trunc > base.config.vocab_size:  # e.g. the default truncated:3072, tiny vocab
        log(f"--lm-head {cfg.lm_head}: the vocabulary has only {base.config.vocab_size} tokens; using all of them")
        n_trunc = base.config.vocab_size
    source = sources.open_source(cfg.data, cfg.cache_hidden, objective_for(cfg.head_type).feature_rows)
    settings = sources.FeedSettings(
        num_heads=cfg.num_heads, with_path=objective_for(cfg.head_type).path_tokens, teacher=cfg.train.uses_teacher,
        batch_size=cfg.batch_size, cached_batch_size=cfg.cached_batch_size, eval_batches=cfg.eval_batches,
        seed=cfg.seed, data=cfg.data_config, memory_limit_gib=cfg.memory_limit_gib,
        hidden_cache_dir=output / "hidden_cache", max_tokens=cfg.max_tokens)
    feed = source.feed(settings, sources.RunInputs(base, tokenizer, eos, log))
    heads_config = HeadsConfig(base.config.hidden_size, base.config.vocab_size, cfg.num_heads, cfg.num_layers,
                               mode, n_trunc, base_model_name_or_path=cfg.base_model_name or str(cfg.model),
                               head_type=cfg.head_type, hydra_input=cfg.hydra_input)
    token_map = top_token_ids(feed.loss_tokens, n_trunc, base.config.vocab_size) if mode == "truncated" else None
    heads = init_heads(heads_config, base, cfg.seed, token_map)
    if cfg.eagle_init == "identity":  # train_heads refuses it for kinds without the EAGLE-1 fc
        heads = identity_feature_init(heads, base)
    trainer = Trainer(base, heads, cfg.train, mesh)
    it, eval_batches, tokens_per_step = feed.iterator, feed.eval_batches, feed.tokens_per_step

    signature = _signature(cfg, base, heads)
    ckpt = Checkpoints(cfg.checkpoint_dir or output / "checkpoints", cfg.save_every, cfg.keep_checkpoints)
    resumed = None
    if cfg.resume and ckpt.latest_step() is not None:
        meta = ckpt.restore_finite(trainer, signature, log)
        resumed = trainer.step
        it.epoch, it.index = meta["data_position"]["epoch"], meta["data_position"]["index"]
        dropped = output_folder.truncate_log(output, trainer.step) if is_main else 0
        log(f"resumed from {ckpt.directory}/{trainer.step} (data epoch {it.epoch}, batch {it.index}; "
            f"{dropped} log records after that step dropped)")
    elif ckpt.latest_step() is not None:
        raise FileExistsError(f"{ckpt.directory} already holds checkpoints (latest step {ckpt.latest_step()}); "
                              f"pass --resume to continue that run, or choose another --checkpoint-dir/--output")
    elif is_main:
        output.mkdir(parents=True, exist_ok=True)
        output_folder.truncate_log(output, 0)  # --resume before the first checkpoint: the log starts again

    metrics = (MetricsLog(output, resume_step=resumed, wandb_project=cfg.wandb_project,
                          run_config=json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
               if is_main else None)  # the other processes log nothing
    try:
        result = _loop(cfg, trainer, it, ckpt, signature, metrics.write if metrics else lambda record: None, log,
                       tokens_per_step, eval_batches)
    except BaseException:
        ckpt.wait()  # commit a checkpoint still being written (Ctrl-C, an error) before leaving
        raise
    finally:
        if metrics is not None:
            metrics.close()
    if trainer.step not in ckpt.all_steps():
        ckpt.save(trainer, it.position, signature, force=True)
    ckpt.close()
    if not result:
        result = evaluate(trainer, eval_batches)
    if is_main:
        summary = {"steps": trainer.step, "heldout": result, "lm_head": cfg.lm_head, "medusa2": cfg.train.medusa2,
                   "head_type": cfg.head_type}
        staging = output / f".final.{os.getpid()}.tmp"  # one commit of all final files (docs/modules.md: run.py)
        staging.mkdir(exist_ok=True)
        write_heads_files(trainer.heads(), staging, extra_config={"training": summary},
                          storage_dtype=None if cfg.heads_dtype == "float32" else cfg.heads_dtype)
        if cfg.train.medusa2:
            save_pretrained(trainer.base(), staging / "base_model", cfg.model)
        commit_entries(staging, output, last="config.json")
    return {"steps": trainer.step, "heldout": result, "output": str(output)}


def _loop(cfg: RunConfig, trainer: Trainer, it, ckpt: Checkpoints, signature, write_log, log, tokens_per_step,
          eval_batches) -> dict[str, Any]:
    """Steps until max_steps: NaN check, progress bar, JSONL log, checkpoints, held-out evaluation."""
    bar = None
    if cfg.progress and jax.process_index() == 0:
        bar = tqdm(total=cfg.train.max_steps, initial=trainer.step, unit="step", dynamic_ncols=True)
    head_lr = schedule(cfg.train.learning_rate * cfg.train.head_lr_multiplier, cfg.train)
    t_start, tokens_done, result = time.perf_counter(), 0, {}
    while trainer.step < cfg.train.max_steps:
        batch = next(it)
        metrics = trainer.train_step(batch)
        tokens_done += tokens_per_step(batch)
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            ckpt.wait()
            raise TrainingDiverged(
                f"loss {loss}, gradient norm {grad_norm} at step {trainer.step}; training stopped before saving it. "
                f"The last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory} (lower --learning-rate "
                f"or check the data)")
        elapsed = time.perf_counter() - t_start
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_done / elapsed:.0f}")
        if trainer.step % cfg.log_every == 0 or trainer.step == cfg.train.max_steps:
            write_log({"kind": "train", "step": trainer.step, "loss": loss, "grad_norm": grad_norm,
                       "head_lr": float(head_lr(trainer.step - 1)), "tokens_per_s": tokens_done / elapsed,
                       "elapsed_s": elapsed, "epoch": it.epoch, **metrics["stats"].summary(),
                       **{k: float(v) for k, v in metrics.items() if k not in ("loss", "grad_norm", "stats")}})
        ckpt.save(trainer, it.position, signature)
        if trainer.step % cfg.eval_every == 0 or trainer.step == cfg.train.max_steps:
            result = evaluate(trainer, eval_batches)
            write_log({"kind": "eval", "step": trainer.step, **result})
            log(f"step {trainer.step}: held-out top-1 per head {np.round(result.get('top1', []), 3).tolist()}")
    if bar is not None:
        bar.close()
    return result
