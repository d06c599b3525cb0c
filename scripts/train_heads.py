"""Train Medusa heads for a local HF model (Medusa-1: frozen backbone; --medusa2: joint training).

Examples:
  # self-distilled data, heads only, CPU: cache the backbone's hidden states once
  python scripts/train_heads.py --model default \
      --data data/smollm2_distill.jsonl --output heads/smollm2 --lm-head truncated:4096 --cache-hidden
  # a GPU pod slice: 8 devices, batch over data x fsdp, weights over fsdp x tensor
  python scripts/train_heads.py --model DIR --data sharegpt --output heads/x --mesh data=2,fsdp=2,tensor=2
Rerun with --resume to continue from the latest checkpoint. The output folder is a heads folder
(`medusa_jax.heads.folder.load_native_heads`), with train_log.jsonl (plot it: scripts/plot_training.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax

from medusa_jax.assets import is_default_model
from medusa_jax.hub import is_hub_id
from medusa_jax.compile_cache import CompileCounter, enable_compile_cache
from medusa_jax.model.config import LayerExecution
from medusa_jax.training.data import DataConfig
from medusa_jax.training.objectives import OBJECTIVES
from medusa_jax.training.run import RunConfig, TrainingDiverged, train_heads
from medusa_jax.training.trainer import TrainConfig
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, above
from medusa_jax.scripts.distributed import add_distributed_args, config_from_args, initialize
from medusa_jax.scripts.options import Option, add_fields



def build_parser() -> argparse.ArgumentParser:
    """The flags, grouped as the help shows them; each fills the field of the config it names (r: RunConfig,
    d: DataConfig, t: TrainConfig, layers: LayerExecution), whose value is its default."""
    r, d, t = RunConfig("", ""), DataConfig(), TrainConfig()
    p = ArgumentParser(description=__doc__)
    g = p.add_argument_group("model and data")
    options.MODEL.add(g, required=True)
    options.DATA.add(g, default="sharegpt", more="with a 'conversations' or 'messages' column; or a self-distilled "
                     "Arrow store (OUTPUT.arrow of scripts/self_distill.py --save-hidden) or a feature store "
                     "(scripts/build_features.py)")
    g.add_argument("--output", required=True, help="heads folder to write (it also holds train_log.jsonl and "
                   "checkpoints); a new or empty folder, or one this trainer wrote (marker file .medusa_jax_train); "
                   "one run at a time")
    add_fields(g, r, Option("--force-output", "write into an existing non-empty --output the trainer did not make "
                            "(it adds only its own files; a model folder is always refused)"),
               Option("--max-tokens", "a feature store as --data: use its first conversations holding this many "
                      "tokens (the 1M-token prefix of a 5M store is the 1M store of the same settings) (default: "
                      "all)", int))
    add_fields(g, d, Option("--seq-len", "tokens per packed row; longer conversations keep their first seq-len "
                            "tokens"),
               Option("--heldout-fraction", "fraction of conversations held out for evaluation"),
               Option("--max-conversations", "use only the first N usable conversations of --data (default: all)",
                      int, dest="limit"),
               Option("--num-proc", "processes for tokenisation (datasets.map); cached after the first run"))
    g = p.add_argument_group("heads")
    options.NUM_HEADS.add(g, default=r.num_heads, more="; head i predicts token t+2+i")
    add_fields(g, r, Option("--num-layers", "ResBlocks per head"), Option(
        "--head-type", "'medusa': every head reads only the base hidden state; 'hydra': head i also reads the "
        "embeddings of the tokens already drafted on its path (the base's next token and heads 0..i-1's picks), "
        "trained by teacher forcing; 'eagle': a feature-level drafter (one decoder layer of the base's "
        "architecture over the base's hidden states, drafting autoregressively: medusa_jax/heads/eagle.py), trained "
        "on a feature store (scripts/build_features.py) or on packed rows; hydra and eagle: Medusa-1 (frozen "
        "backbone) only. For eagle, --num-heads is the deepest tree it drafts and --num-layers its decoder "
        "layers; 'eagle3': the EAGLE-3 drafter (the base's residual stream entering layers 2, L // 2 and L - 3, "
        "fused; one decoder layer; medusa_jax/heads/eagle3.py), trained on packed rows with cross-entropy only "
        "over --eagle-train-depth unrolled steps (the training-time test: 3 or more)", choices=tuple(OBJECTIVES)),
               Option("--hydra-input", "how a Hydra head combines the hidden state h and its path embeddings "
                      "e_0..e_i: 'add' (h + a projection of [e_0..e_i]) or 'concat' (a projection of [h, "
                      "e_0..e_i]); see medusa_jax/heads/hydra.py", choices=("add", "concat")),
               Option("--lm-head", "each head's output layer: 'truncated:N' (own [D, N] over the N most frequent "
                      "training tokens; targets outside them count as misses; fast and small), 'own' (a full [D, V] "
                      "copy per head, initialised from the base lm_head; needs far more memory), or 'shared' "
                      "(reuse the base lm_head)"),
               Option("--heads-dtype", "storage dtype of the saved heads file: float16/bfloat16 halve its size; "
                      "the heads still load and compute in float32", choices=(*options.STEP_DTYPES, "float16")),
               Option("--base-model-name", "base model name recorded in the heads' config.json, e.g. a hub id "
                      "(default: the --model path)"))
    add_fields(g, t, Option("--freeze-lm-heads", "train only the ResBlocks; each head's own/truncated lm_head stays "
                            "the base lm_head (rows) it starts from: far fewer trainable weights (less overfitting on "
                            "small data), cheaper steps", dest="freeze_head_lm_heads"))
    g = p.add_argument_group("optimisation")
    options.BATCH_SIZE.add(g, default=r.batch_size, more="global packed rows per step (split over data x "
                           "fsdp and over hosts)")
    g.add_argument("--head-lr-multiplier", type=float, check=above(0.0), help="heads' learning rate / "
                   "--learning-rate (default: 1 for Medusa-1, 4 for --medusa2)")
    add_fields(g, t, Option("--max-steps", "optimiser steps; also the cosine schedule length"),
               Option("--learning-rate", "peak learning rate (the backbone's in Medusa-2; heads get it times "
                      "--head-lr-multiplier)"),
               Option("--warmup-steps", "linear warmup steps before the cosine decay"),
               Option("--weight-decay", "AdamW weight decay"),
               Option("--clip-norm", "global gradient-norm clip, 0 = off"),
               Option("--loss-decay", "head i's loss weight is decay**i"),
               Option("--head-loss", "what head i at position t learns: 'ce' the data's token t+2+i, 'kl' the "
                      "frozen base model's own distribution for it (its lm_head on its hidden state at t+1+i, from "
                      "the same forward or the cache; a truncated head's teacher is renormalised over the "
                      "token_map), 'ce+kl' both", choices=("ce", "kl", "ce+kl")),
               Option("--ce-weight", "weight of each head's cross-entropy in --head-loss ce+kl"),
               Option("--kl-weight", "weight of each head's KL in --head-loss kl and ce+kl"),
               Option("--eagle-noise", "eagle: uniform noise U(-x, x) added to the input features while training"),
               Option("--eagle-feature-weight", "eagle: weight of the SmoothL1 regression of the next feature"),
               Option("--eagle-ce-weight", "eagle: weight of the cross-entropy against the base's next-token "
                      "distribution"),
               Option("--eagle-train-depth", "eagle: depths trained; above 1, depths 2..N learn from the drafter's "
                      "own outputs along the true tokens (the chain a tree step drafts), weighted "
                      "--loss-decay**(k-1)"),
               options.COMPUTE_DTYPE, options.OPTIMIZER_DTYPE, options.LOSS_CHUNK)
    add_fields(g, r, Option("--eagle-init", "eagle: 'random' fc (default) or 'identity': fc starts passing the "
                            "feature through unchanged, the token embedding scaled to the feature's RMS (folded into "
                            "fc on export; medusa_jax/heads/eagle_init.py)", choices=("random", "identity")),
               Option("--backbone-dtype", "storage dtype of the frozen backbone's weights (Medusa-1): bfloat16 "
                      "halves their memory (a 70B backbone fits 8 x 80 GB with room for the step); the heads and "
                      "their optimiser state stay float32", choices=options.STEP_DTYPES))
    add_fields(g, t.layers, options.SCAN_LAYERS, options.REMAT, options.ATTENTION)
    options.SEED_OPTION.add(g, default=r.seed, more="data split/order and head initialisation")
    add_fields(p.add_argument_group("Medusa-2 (joint training)"), t,
               options.MEDUSA2,
               Option("--lm-loss-weight", "weight of the backbone's own objective added to the heads' loss"),
               Option("--distill-kl", "for self-distilled data: the backbone's objective is the KL divergence to the "
                      "frozen original model's next-token distribution instead of cross-entropy on the data"))
    add_fields(p.add_argument_group("CPU path"), r, Option(
        "--cache-hidden", "Medusa-1 only: train the heads on the backbone's hidden states computed once "
        "(OUTPUT/hidden_cache), or saved by scripts/self_distill.py --save-hidden (--data the OUTPUT.arrow store, "
        "read memory-mapped, or the JSONL next to it); each step then costs only the heads"),
               Option("--cached-batch-size", "with --cache-hidden: global token positions per step"),
               Option("--memory-limit", "GiB this run may use: the trainer estimates its peak memory before loading "
                      "anything and refuses a run that would not fit, with advice (default: MemAvailable from "
                      "/proc/meminfo on CPU, no check on accelerators; 0 = no check)", float, dest="memory_limit_gib"))
    options.MESH.add(p.add_argument_group("devices"), default=r.mesh, more=": batch over data x fsdp (--batch-size "
                     "must divide by it), weights over fsdp x tensor (default: one device)")
    add_distributed_args(p)
    g = p.add_argument_group("checkpoints and logging")
    add_fields(g, r, Option("--checkpoint-dir", "Orbax checkpoint folder (default: OUTPUT/checkpoints)"),
               Option("--save-every", "checkpoint every N steps, and at the end"),
               Option("--keep-checkpoints", "checkpoints kept"),
               Option("--resume", "continue from the latest checkpoint (parameters, optimiser, step, data position); "
                      "starts fresh if there is none"),
               Option("--eval-every", "held-out evaluation every N steps, and at the end"),
               Option("--eval-batches", "held-out batches per evaluation, at most"),
               Option("--log-every", "train_log.jsonl record every N steps"),
               dataclasses.replace(options.NO_PROGRESS, dest="progress"))
    g.add_argument("--wandb", metavar="PROJECT", dest="wandb_project", help="also log the metrics to Weights & "
                   "Biases under this project name (needs the wandb package; TensorBoard event files are always "
                   "written to OUTPUT/tensorboard/)")
    return p


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run's settings from the flags; the configs refuse what rules each other out (ValueError)."""
    multiplier = args.head_lr_multiplier if args.head_lr_multiplier is not None else 4.0 if args.medusa2 else 1.0
    train = options.config_from(TrainConfig, args, head_lr_multiplier=multiplier,
                                layers=options.config_from(LayerExecution, args))
    return options.config_from(RunConfig, args, data_config=options.config_from(DataConfig, args), train=train)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = run_config(args)
        inputs = {"--model": options.model_location(args.model), "--data": options.data_arg("--data", args.data)}
        validate.output_folder("--output", args.output, inputs)
        if args.checkpoint_dir is not None:
            validate.output_folder("--checkpoint-dir", args.checkpoint_dir, inputs)
        if not is_default_model(args.model) and not is_hub_id(args.model):
            options.model_folder("--model", args.model)
        initialize(config_from_args(args))  # before any other JAX call
        options.mesh_devices("--mesh", args.mesh)
        options.attention_here("--attention", args.attention)
        model = str(options.model_arg("--model", args.model))  # 'default' built, a Hub id resolved
        options.within_positions(f"--seq-len {args.seq_len}", args.seq_len, model)
        hub_id = args.model if is_hub_id(args.model) else None  # the heads' config names it, not this machine's cache
        limit = args.memory_limit_gib if args.memory_limit_gib is not None or jax.default_backend() == "cpu" else 0
        config = dataclasses.replace(config, model=model, memory_limit_gib=limit, base_model_name=hub_id if
                                     args.base_model_name is None else args.base_model_name)
        enable_compile_cache()
        with CompileCounter() as compiles:
            result = train_heads(config)
        print(json.dumps({**result, **compiles.summary()}))
        return 0
    except (ValueError, OSError) as e:  # every input error here is a ValueError (DataError, MeshError, ...)
        return validate.fail(e)
    except TrainingDiverged as e:  # not a bad input: the run itself went wrong (exit 1)
        validate.fail(e)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
