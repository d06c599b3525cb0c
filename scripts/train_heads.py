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
import importlib.util
import json

import jax

from medusa_jax.assets import is_default_model
from medusa_jax.hub import is_hub_id
from medusa_jax.heads.kinds import drafter_class
from medusa_jax.compile_cache import CompileCounter, enable_compile_cache
from medusa_jax.model.config import ATTENTION_KINDS, REMAT_POLICIES, LayerExecution
from medusa_jax.model.sharding import MeshError
from medusa_jax.training.checkpointing import CheckpointMismatch
from medusa_jax.training import hidden_store
from medusa_jax.training.data import DataConfig
from medusa_jax.training.memory_plan import MemoryPlanError
from medusa_jax.training.objectives import OBJECTIVES
from medusa_jax.training.output_folder import OutputFolderError
from medusa_jax.training.run import RunConfig, TrainingDiverged, parse_lm_head, train_heads
from medusa_jax.training.sharegpt import DataError
from medusa_jax.training.trainer import TrainConfig
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, above, at_least, in_range
from medusa_jax.scripts.distributed import DistributedError, add_distributed_args, config_from_args, initialize


def build_parser() -> argparse.ArgumentParser:
    r, d, t = RunConfig("", ""), DataConfig(), TrainConfig()
    p = ArgumentParser(description=__doc__)

    def add(group, flag, help, **kw):
        if "default" in kw and kw["default"] is not None and kw.get("action") != "store_true":
            help += " (default: %(default)s)"
        group.add_argument(flag, help=help, **kw)

    g = p.add_argument_group("model and data")
    options.MODEL.add(g, required=True)
    options.DATA.add(g, default="sharegpt", more="with a 'conversations' or 'messages' column; or a self-distilled "
                     "Arrow store (OUTPUT.arrow of scripts/self_distill.py --save-hidden) or a feature store "
                     "(scripts/build_features.py)")
    add(g, "--output", "heads folder to write (it also holds train_log.jsonl and checkpoints); a new or empty "
        "folder, or one this trainer wrote (marker file .medusa_jax_train); one run at a time", required=True)
    add(g, "--force-output", "write into an existing non-empty --output the trainer did not make (it adds only its "
        "own files; a model folder is always refused)", action="store_true")
    add(g, "--seq-len", check=at_least(8), help="tokens per packed row; longer conversations keep their first seq-len tokens",
        type=int, default=d.seq_len)
    add(g, "--heldout-fraction", check=in_range(0.0, 1.0, high_open=True), help="fraction of conversations held out for evaluation", type=float,
        default=d.heldout_fraction)
    add(g, "--max-conversations", check=at_least(1), help="use only the first N usable conversations of --data (default: all)", type=int)
    add(g, "--max-tokens", check=at_least(1), help="a feature store as --data: use its first conversations holding this many tokens "
        "(the 1M-token prefix of a 5M store is the 1M store of the same settings) (default: all)", type=int)
    add(g, "--num-proc", check=at_least(1), help="processes for tokenisation (datasets.map); cached after the first run", type=int,
        default=d.num_proc)
    g = p.add_argument_group("heads")
    options.NUM_HEADS.add(g, default=r.num_heads, more="; head i predicts token t+2+i")
    add(g, "--num-layers", check=at_least(0), help="ResBlocks per head", type=int, default=r.num_layers)
    add(g, "--head-type", "'medusa': every head reads only the base hidden state; 'hydra': head i also reads the "
        "embeddings of the tokens already drafted on its path (the base's next token and heads 0..i-1's picks), "
        "trained by teacher forcing; 'eagle': a feature-level drafter (one decoder layer of the base's "
        "architecture over the base's hidden states, drafting autoregressively: medusa_jax/heads/eagle.py), trained "
        "on a feature store (scripts/build_features.py) or on packed rows; hydra and eagle: Medusa-1 (frozen "
        "backbone) only. For eagle, --num-heads is the deepest tree it drafts and --num-layers its decoder "
        "layers; 'eagle3': the EAGLE-3 drafter (the base's residual stream entering layers 2, L // 2 and L - 3, "
        "fused; one decoder layer; medusa_jax/heads/eagle3.py), trained on packed rows with cross-entropy only "
        "over --eagle-train-depth unrolled steps (the training-time test: 3 or more)", default=r.head_type,
        choices=tuple(OBJECTIVES))
    add(g, "--hydra-input", "how a Hydra head combines the hidden state h and its path embeddings e_0..e_i: 'add' "
        "(h + a projection of [e_0..e_i]) or 'concat' (a projection of [h, e_0..e_i]); see medusa_jax/heads/hydra.py",
        default=r.hydra_input, choices=("add", "concat"))
    add(g, "--lm-head", "each head's output layer: 'truncated:N' (own [D, N] over the N most frequent training "
        "tokens; targets outside them count as misses; fast and small), 'own' (a full [D, V] copy per head, "
        "initialised from the base lm_head; needs far more memory), or 'shared' (reuse the base lm_head)",
        default=r.lm_head)
    add(g, "--freeze-lm-heads", "train only the ResBlocks; each head's own/truncated lm_head stays the base "
        "lm_head (rows) it starts from: far fewer trainable weights (less overfitting on small data), cheaper "
        "steps", action="store_true")
    add(g, "--heads-dtype", "storage dtype of the saved heads file: float16/bfloat16 halve its size; the heads "
        "still load and compute in float32", default=r.heads_dtype, choices=("float32", "bfloat16", "float16"))
    add(g, "--base-model-name", "base model name recorded in the heads' config.json, e.g. a hub id "
        "(default: the --model path)")
    g = p.add_argument_group("optimisation")
    add(g, "--max-steps", check=at_least(1), help="optimiser steps; also the cosine schedule length", type=int, default=t.max_steps)
    options.BATCH_SIZE.add(g, default=r.batch_size, more="global packed rows per step (split over data x "
                           "fsdp and over hosts)")
    add(g, "--learning-rate", check=above(0.0), help="peak learning rate (the backbone's in Medusa-2; heads get it times "
        "--head-lr-multiplier)", type=float, default=t.learning_rate)
    add(g, "--head-lr-multiplier", check=above(0.0), help="heads' learning rate / --learning-rate (default: 1 for Medusa-1, 4 for "
        "--medusa2)", type=float)
    add(g, "--warmup-steps", check=at_least(0), help="linear warmup steps before the cosine decay", type=int, default=t.warmup_steps)
    add(g, "--weight-decay", check=at_least(0.0), help="AdamW weight decay", type=float, default=t.weight_decay)
    add(g, "--clip-norm", check=at_least(0.0), help="global gradient-norm clip, 0 = off", type=float, default=t.clip_norm)
    add(g, "--loss-decay", check=above(0.0), help="head i's loss weight is decay**i", type=float, default=t.loss_decay)
    add(g, "--head-loss", "what head i at position t learns: 'ce' the data's token t+2+i, 'kl' the frozen base "
        "model's own distribution for it (its lm_head on its hidden state at t+1+i, from the same forward or the "
        "cache; a truncated head's teacher is renormalised over the token_map), 'ce+kl' both",
        default=t.head_loss, choices=("ce", "kl", "ce+kl"))
    add(g, "--ce-weight", check=at_least(0.0), help="weight of each head's cross-entropy in --head-loss ce+kl", type=float,
        default=t.ce_weight)
    add(g, "--kl-weight", check=at_least(0.0), help="weight of each head's KL in --head-loss kl and ce+kl", type=float, default=t.kl_weight)
    add(g, "--eagle-noise", check=at_least(0.0), help="eagle: uniform noise U(-x, x) added to the input features while training",
        type=float, default=t.eagle_noise)
    add(g, "--eagle-feature-weight", check=at_least(0.0), help="eagle: weight of the SmoothL1 regression of the next feature", type=float,
        default=t.eagle_feature_weight)
    add(g, "--eagle-ce-weight", check=at_least(0.0), help="eagle: weight of the cross-entropy against the base's next-token distribution",
        type=float, default=t.eagle_ce_weight)
    add(g, "--eagle-train-depth", check=at_least(1), help="eagle: depths trained; above 1, depths 2..N learn from the drafter's own "
        "outputs along the true tokens (the chain a tree step drafts), weighted --loss-decay**(k-1)", type=int,
        default=t.eagle_train_depth)
    add(g, "--eagle-init", "eagle: 'random' fc (default) or 'identity': fc starts passing the feature through "
        "unchanged, the token embedding scaled to the feature's RMS (folded into fc on export; "
        "medusa_jax/heads/eagle_init.py)", default=r.eagle_init, choices=("random", "identity"))
    add(g, "--compute-dtype", "dtype the step computes in; weights and optimiser state stay float32 (use "
        "bfloat16 on GPU)", default=t.compute_dtype, choices=("float32", "bfloat16"))
    add(g, "--backbone-dtype", "storage dtype of the frozen backbone's weights (Medusa-1): bfloat16 halves their "
        "memory (a 70B backbone fits 8 x 80 GB with room for the step); the heads and their optimiser state stay "
        "float32", default=r.backbone_dtype, choices=("float32", "bfloat16"))
    add(g, "--optimizer-dtype", "storage dtype of Adam's two moments: bfloat16 halves the optimiser state (what "
        "lets 70B Medusa-2 fit 16 x 80 GB); they are updated in float32 within each step",
        default=t.optimizer_dtype, choices=("float32", "bfloat16"))
    add(g, "--loss-chunk", check=at_least(0), help="tokens per chunk of the heads' (and Medusa-2's LM) loss: "
        "only one chunk's [tokens, vocabulary] logits exist at a time, in the forward and the backward (exact; "
        "0 = whole rows)", type=int, default=t.loss_chunk)
    add(g, "--scan-layers", "run the backbone's layers under one scan over their stacked parameters: FSDP gathers "
        "one layer at a time and the program stays small (GPU/TPU pods; on CPU the unrolled default is faster)",
        action="store_true")
    add(g, "--remat", "what the backward pass keeps of each backbone layer (Medusa-2): none = everything, full = "
        "its input only (recompute the layer), dots = the matrix products' outputs",
        default=t.layers.remat, choices=REMAT_POLICIES)
    add(g, "--attention", "attention of the training rows: chunked (query blocks, scores recomputed for the "
        "backward), xla or cudnn (jax.nn.dot_product_attention; cudnn = fused flash attention on NVIDIA GPUs with "
        "--compute-dtype bfloat16)", default=t.layers.attention, choices=ATTENTION_KINDS)
    options.SEED_OPTION.add(g, default=r.seed, more="data split/order and head initialisation")
    g = p.add_argument_group("Medusa-2 (joint training)")
    add(g, "--medusa2", "train the backbone too (writes OUTPUT/base_model)", action="store_true")
    add(g, "--lm-loss-weight", check=at_least(0.0), help="weight of the backbone's own objective added to the heads' loss", type=float,
        default=t.lm_loss_weight)
    add(g, "--distill-kl", "for self-distilled data: the backbone's objective is the KL divergence to the frozen "
        "original model's next-token distribution instead of cross-entropy on the data", action="store_true")
    g = p.add_argument_group("CPU path")
    add(g, "--cache-hidden", "Medusa-1 only: train the heads on the backbone's hidden states computed once "
        "(OUTPUT/hidden_cache), or saved by scripts/self_distill.py --save-hidden (--data the OUTPUT.arrow store, "
        "read memory-mapped, or the JSONL next to it); each step then costs only the heads", action="store_true")
    add(g, "--cached-batch-size", check=at_least(1), help="with --cache-hidden: global token positions per step", type=int,
        default=r.cached_batch_size)
    add(g, "--memory-limit", check=at_least(0.0), help="GiB this run may use: the trainer estimates its peak memory before loading anything "
        "and refuses a run that would not fit, with advice (default: MemAvailable from /proc/meminfo on CPU, no "
        "check on accelerators; 0 = no check)", type=float)
    g = p.add_argument_group("devices")
    options.MESH.add(g, default=r.mesh, more=": batch over data x fsdp (--batch-size must divide by it), weights "
                      "over fsdp x tensor (default: one device)")
    add_distributed_args(p)
    g = p.add_argument_group("checkpoints and logging")
    add(g, "--checkpoint-dir", "Orbax checkpoint folder (default: OUTPUT/checkpoints)")
    add(g, "--save-every", check=at_least(1), help="checkpoint every N steps, and at the end", type=int, default=r.save_every)
    add(g, "--keep-checkpoints", check=at_least(1), help="checkpoints kept", type=int, default=r.keep_checkpoints)
    add(g, "--resume", "continue from the latest checkpoint (parameters, optimiser, step, data position); "
        "starts fresh if there is none", action="store_true")
    add(g, "--eval-every", check=at_least(1), help="held-out evaluation every N steps, and at the end", type=int, default=r.eval_every)
    add(g, "--eval-batches", check=at_least(1), help="held-out batches per evaluation, at most", type=int, default=r.eval_batches)
    add(g, "--log-every", check=at_least(1), help="train_log.jsonl record every N steps", type=int, default=r.log_every)
    add(g, "--no-progress", "no progress bar (for log files)", action="store_true")
    add(g, "--wandb", "also log the metrics to Weights & Biases under this project name (needs the wandb package; "
        "TensorBoard event files are always written to OUTPUT/tensorboard/)", metavar="PROJECT")
    return p


def check_args(args: argparse.Namespace) -> None:
    """What the flag rules cannot say alone, and the paths: named before anything is loaded (UsageError)."""
    fail = validate.UsageError
    objective = OBJECTIVES[args.head_type]
    if args.medusa2 and not objective.joint_backbone:
        raise fail(f"--head-type {args.head_type} trains with a frozen backbone (Medusa-1) only; drop --medusa2")
    if args.cache_hidden and args.medusa2:
        raise fail("--cache-hidden needs a frozen backbone (Medusa-1); drop it or --medusa2")
    if args.distill_kl and not args.medusa2:
        raise fail("--distill-kl trains the backbone: it needs --medusa2")
    if args.backbone_dtype != "float32" and args.medusa2:
        raise fail(f"--backbone-dtype {args.backbone_dtype} is for a frozen backbone (Medusa-1): Medusa-2 trains "
                   f"float32 master weights (halve its optimiser state with --optimizer-dtype bfloat16 instead); "
                   f"drop one")
    if objective.feature_rows and args.cache_hidden:
        raise fail(f"--head-type {args.head_type} reads the hidden states of every position: give a feature store "
                   "(scripts/build_features.py) as --data instead of --cache-hidden")
    if objective.fused_features and (args.cache_hidden or hidden_store.is_store(args.data, hidden_store.FEATURES)
                                     or args.num_layers != 1):
        raise fail(f"--head-type {args.head_type} trains on packed rows (the fused features come from the backbone "
                   "in the step) with one decoder layer: drop --cache-hidden, give chat data as --data (a feature "
                   "store holds only the last hidden state) and use --num-layers 1")
    if args.eagle_init != "random" and not drafter_class(args.head_type).fc_options:
        raise fail(f"--eagle-init {args.eagle_init} initialises an EAGLE drafter; drop it or use --head-type eagle")
    if args.eagle_feature_weight + args.eagle_ce_weight == 0:
        raise fail("--eagle-feature-weight and --eagle-ce-weight are both 0: nothing to train; make one > 0")
    weights = {"ce": (args.ce_weight,), "kl": (args.kl_weight,), "ce+kl": (args.ce_weight, args.kl_weight)}
    if not any(weights[args.head_loss]):
        raise fail(f"--head-loss {args.head_loss}: its weights (--ce-weight/--kl-weight) are all 0; make one > 0")
    try:
        parse_lm_head(args.lm_head)
    except ValueError as e:
        raise fail(str(e)) from None
    validate.given("--wandb", args.wandb, "a Weights & Biases project name")
    if args.wandb is not None:
        if importlib.util.find_spec("wandb") is None:
            raise fail("--wandb needs the wandb package: pip install wandb (or drop --wandb)")
    options.divides_rows("--cached-batch-size" if args.cache_hidden else "--batch-size",
                          args.cached_batch_size if args.cache_hidden else args.batch_size, "--mesh", args.mesh)
    data = options.data_arg("--data", args.data)
    inputs = {"--model": options.model_location(args.model), "--data": data}
    validate.output_folder("--output", args.output, inputs)
    if args.checkpoint_dir is not None:
        validate.output_folder("--checkpoint-dir", args.checkpoint_dir, inputs)
    if not is_default_model(args.model) and not is_hub_id(args.model):
        options.model_folder("--model", args.model)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    try:
        check_args(args)
        initialize(config_from_args(args))  # before any other JAX call
        options.mesh_devices("--mesh", args.mesh)
        if args.base_model_name is None and is_hub_id(args.model):
            args.base_model_name = args.model  # the heads' config names the Hub id, not this machine's cache
        args.model = str(options.model_arg("--model", args.model))  # 'default' built, a Hub id resolved
        positions = options.max_positions(args.model)
        if args.seq_len > positions:
            raise validate.UsageError(f"--seq-len {args.seq_len}: the model has {positions} positions; lower it to "
                                      f"at most {positions}")
        return run(args)
    except (ValueError, OSError, DistributedError, MeshError, CheckpointMismatch, MemoryPlanError,
            OutputFolderError, DataError) as e:
        return validate.fail(e)
    except TrainingDiverged as e:  # not a bad input: the run itself went wrong (exit 1)
        validate.fail(e)
        return 1


def run(args: argparse.Namespace) -> int:
    enable_compile_cache()

    multiplier = args.head_lr_multiplier if args.head_lr_multiplier is not None else (4.0 if args.medusa2 else 1.0)
    config = RunConfig(
        model=args.model, output=args.output, data=args.data, num_heads=args.num_heads,
        num_layers=args.num_layers, head_type=args.head_type, hydra_input=args.hydra_input,
        eagle_init=args.eagle_init, lm_head=args.lm_head, batch_size=args.batch_size, cached_batch_size=args.cached_batch_size,
        cache_hidden=args.cache_hidden, mesh=args.mesh, checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every,
        heads_dtype=args.heads_dtype, backbone_dtype=args.backbone_dtype, base_model_name=args.base_model_name,
        seed=args.seed,
        progress=not args.no_progress, force_output=args.force_output,
        memory_limit_gib=args.memory_limit if args.memory_limit is not None or jax.default_backend() == "cpu" else 0,
        max_tokens=args.max_tokens, wandb_project=args.wandb,
        data_config=DataConfig(seq_len=args.seq_len, heldout_fraction=args.heldout_fraction, seed=args.seed,
                               num_proc=args.num_proc, limit=args.max_conversations),
        train=TrainConfig(learning_rate=args.learning_rate, head_lr_multiplier=multiplier,
                          warmup_steps=args.warmup_steps, max_steps=args.max_steps, weight_decay=args.weight_decay,
                          clip_norm=args.clip_norm, loss_decay=args.loss_decay, medusa2=args.medusa2,
                          lm_loss_weight=args.lm_loss_weight, distill_kl=args.distill_kl,
                          compute_dtype=args.compute_dtype, freeze_head_lm_heads=args.freeze_lm_heads,
                          head_loss=args.head_loss, ce_weight=args.ce_weight, kl_weight=args.kl_weight,
                          eagle_noise=args.eagle_noise, eagle_feature_weight=args.eagle_feature_weight,
                          eagle_ce_weight=args.eagle_ce_weight, eagle_train_depth=args.eagle_train_depth,
                          layers=LayerExecution(scan=args.scan_layers, remat=args.remat,
                                                attention=args.attention),
                          loss_chunk=args.loss_chunk, optimizer_dtype=args.optimizer_dtype))
    with CompileCounter() as compiles:
        result = train_heads(config)
    print(json.dumps({**result, **compiles.summary()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
