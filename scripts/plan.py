"""Will it fit? Compile the real train step or Medusa decode loop for a model and mesh on abstract inputs (no
weights are allocated, no accelerator is needed) and print per-device memory, collectives and the verdict.

Examples:
  python scripts/plan.py --model llama3-8b --mesh data=2,fsdp=4 --job train --batch 16 --seq 2048
  python scripts/plan.py --model llama3-70b --mesh tensor=8 --job decode --batch 8 --device h100-80g --search
  python scripts/plan.py --model path/to/hf_folder --mesh data=2,tensor=4 --job decode --json
The mesh runs on forced host CPU devices (the script sets XLA_FLAGS). Temporaries come from XLA's CPU compiler:
argument bytes are exact, temporaries approximate what a GPU/TPU compiler would need.

Two more modes (`plan.py MODE --help` explains their flags):
  plan.py table --out DIR   the README's "Will it fit?" table: Llama-3-8B/70B plans on 8x H100, 8x H200, v5e-16
  plan.py vs-device [flags] one decode call's plan next to the peak memory a real GPU/TPU used for it
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from medusa_jax.model.config import LayerExecution
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.sharded import load_sharded
from medusa_jax.training.memory_plan import estimate_per_device
from medusa_jax.training.plan import (JOBS, PRESETS, PlanConfig, compile_plan, device_capacity, largest_batch,
                                      measure_train_step, model_config)
from medusa_jax.training.plan_report import build_table, describe, warnings
from medusa_jax.progress import heartbeat
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, in_range, run_mode
from medusa_jax.scripts.options import Option, add_fields, config_from

MAX_BATCH = 1 << 20  # prompts or packed rows: far beyond any real job, far below what would overflow a plan
MAX_SEQ = 1 << 22  # tokens per row / cache slots (also bounded by the model's max_position_embeddings)


def refuse_old_heads_flag(p: ArgumentParser, argv: list[str]) -> None:
    """plan.py's count of random heads was --heads, the name of a heads folder in every other command."""
    if any(arg == "--heads" or arg.startswith("--heads=") for arg in argv):
        p.error("--heads is now --num-heads here (the number of random Medusa heads); e.g. --num-heads 4")


def parse_args(argv):
    p = ArgumentParser(prog="plan.py", description=__doc__)
    refuse_old_heads_flag(p, argv)
    options.MODEL.add(p, required=True, help="a preset (llama3-8b, llama3-70b, mistral-7b, qwen2-7b) or a "
                      "folder with a HF config.json")
    options.MESH.add(p, default="", more="(default: one device)")
    add_fields(p, PlanConfig, Option("--job", "train: the head-training step (scripts/train_heads.py); decode: "
                                     "prefill + the Medusa decode loop (scripts/generate.py)", choices=JOBS),
               Option("--batch", "global batch: packed rows (train) or prompts (decode)", check=in_range(1, MAX_BATCH)))
    p.add_argument("--seq", check=in_range(1, MAX_SEQ), type=int, default=None,
                   help="train: tokens per packed row (default 2048); decode: padded prompt length (default 1024)")
    add_fields(p, PlanConfig, Option("--cache", "decode: KV cache slots per row: prompt + new tokens + the tree's "
                                     "scratch block", check=in_range(1, MAX_SEQ)))
    options.TREE.add(p, default="mc_sim_7b_63", more="; decode only")
    options.NUM_HEADS.add(p, default=4)
    add_fields(p, PlanConfig, Option("--lm-head", "each head's own lm_head, or the base model's shared",
                                     choices=("own", "shared")))
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight storage dtype (default: float32 for train, as train_heads.py stores master "
                        "weights; a frozen Medusa-1 backbone in bfloat16 is train_heads.py --backbone-dtype "
                        "bfloat16; bfloat16 for decode)")
    add_train_step(p, options.COMPUTE_DTYPE)
    p.add_argument("--device", default="h100-80g",
                   help="h100-80g, h200-141g, tpu-v5e-16g or a byte count per device (default: %(default)s)")
    p.add_argument("--headroom", check=in_range(0.0, 1.0, high_open=True), type=float, default=0.1,
                   help="fraction of device memory kept free for the runtime (default: %(default)s)")
    p.add_argument("--search", action="store_true",
                   help="also find the largest batch that fits, by compiling a few more plans")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def add_train_step(p: ArgumentParser, *more: Option) -> None:
    """The train step's settings (--job train), declared in `options` as train_heads.py takes them."""
    train = p.add_argument_group("the train step (--job train), as train_heads.py's flags of the same names set it")
    add_fields(train, PlanConfig, options.MEDUSA2, options.LOSS_CHUNK, options.OPTIMIZER_DTYPE, *more)
    add_fields(train, LayerExecution, options.REMAT)
    add_fields(p, LayerExecution, options.SCAN_LAYERS, options.ATTENTION)  # train and decode (stacked cache, prefill)


def main(argv=None) -> int:
    return run_mode(argv, MODES, plan_main)


def force_host_devices(count: int) -> None:
    """Host CPU devices for a mesh: fixed when JAX's CPU backend starts, so before any JAX computation."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={count}").strip()

    jax.config.update("jax_platforms", "cpu")


def plan_main(argv: list[str]) -> int:
    args = parse_args(argv)

    try:
        mesh = MeshConfig.parse(args.mesh)
        device, capacity = device_capacity(args.device)
        seq = args.seq or (2048 if args.job == "train" else 1024)
        dtype = args.dtype or ("float32" if args.job == "train" else "bfloat16")
        if args.model not in PRESETS and Path(args.model).is_dir():
            options.model_folder("--model", args.model, tokenizer=False, weights=False)
        if args.job == "decode":
            options.tree_arg("--tree", args.tree)
        config = config_from(PlanConfig, args, model=model_config(args.model, dtype), mesh=mesh, seq=seq,
                             layers=config_from(LayerExecution, args))
    except (ValueError, OSError) as e:
        return validate.fail(e)
    force_host_devices(max(mesh.size, 1))

    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    try:
        with heartbeat(f"compiling the {args.job} step for mesh {args.mesh or 'of one device'}"):
            plan = compile_plan(config)
    except ValueError as e:  # a mesh axis that does not divide the model (MeshError), a bad tree
        return validate.fail(e)
    largest = None
    if args.search:
        largest, _ = largest_batch(config, capacity, args.headroom, first=plan, log=log)
    est = estimate_per_device(config)
    if args.json:
        out = plan.to_dict()
        out.update(device=device, capacity_bytes=capacity, headroom=args.headroom,
                   fits=plan.device_bytes <= capacity * (1 - args.headroom), largest_batch=largest,
                   analytic=dict(params=est.params, optimizer=est.optimizer, kv_cache=est.kv_cache,
                                 activations=est.activations, total=est.total), warnings=warnings(plan))
        print(json.dumps(out, indent=1))
    else:
        print(describe(plan, est, device, capacity, args.headroom, largest))
    return 0


TABLE_DOC = """The README's "Will it fit?" table: compiled memory plans of Llama-3-8B and 70B, Medusa-1/2 training and
Medusa decoding (tree mc_sim_7b_63, batch 1/8/64), for one 8x H100-80G host, one 8x H200 host and a TPU v5e-16
slice. Each row is one compile per mesh (the two GPU hosts share the 8-device plan); a plan whose parameters,
optimiser state, KV cache and gradients alone (`training.memory_plan.lower_bound`, exact) exceed every device it is
planned for is not compiled ("> N GiB" in the table). Results are saved to OUT/plans.json as they come;
--resume continues an interrupted run.

Example:
  nice -n 15 python scripts/plan.py table --out artifacts/plan_table
Writes OUT/plans.json and OUT/table.md.
"""


def table_main(argv: list[str]) -> int:
    """`plan.py table`: medusa_jax.training.plan_report.build_table."""
    p = ArgumentParser(prog="plan.py table", description=TABLE_DOC)
    options.OUT.add(p, required=True, more="folder for plans.json and table.md")
    p.add_argument("--models", default="llama3-8b,llama3-70b", help="comma-separated presets (default: %(default)s)")
    p.add_argument("--headroom", check=in_range(0.0, 1.0, high_open=True), type=float, default=0.1, help="fraction of memory kept free (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="keep the plans already in OUT/plans.json")
    p.add_argument("--saved-only", action="store_true",
                   help="compile nothing: the table from OUT/plans.json (and the exact lower bounds), missing plans "
                        "shown as 'not planned'")
    args = p.parse_args(argv)
    with p.checking():
        options.out_folder(args)

    models = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        p.error(f"unknown presets {unknown} in --models {args.models!r}; choose from {', '.join(PRESETS)}")
    force_host_devices(16)

    print(build_table(models, args.out, args.headroom, resume=args.resume, saved_only=args.saved_only,
                      log=lambda m: print(m, flush=True)))
    return 0


VS_DEVICE_DOC = """The compiled memory plan of one decode call or train step next to what a real accelerator used for it.

Runs `plan.py` (forced CPU devices, abstract inputs) in a subprocess, then on this machine's first accelerator:
decode: loads the model with random heads (shared lm_head) and runs the same decode call once; train: builds the
model from its config.json with random weights and 4 heads with own lm_heads (as planned) and runs one train step
on random rows. It reads the device's peak memory (`memory_stats()["peak_bytes_in_use"]`, GPU and TPU runtimes
report it) and, for train, the device compiler's own figure for the step.

Examples (on a GPU machine):
  python scripts/plan.py vs-device --model default --batch 8 --seq 128 --cache 512
  python scripts/plan.py vs-device --job train --model CONFIG_FOLDER --batch 8 --seq 1024 --medusa2 --scan-layers \\
      --remat full
"""


def vs_device_main(argv: list[str]) -> int:
    """`plan.py vs-device`: the plan of one decode call or train step vs the device's measured peak memory."""
    p = ArgumentParser(prog="plan.py vs-device", description=VS_DEVICE_DOC)
    refuse_old_heads_flag(p, argv)
    add_fields(p, PlanConfig, Option("--job", "what to run", choices=JOBS))
    options.MODEL.add(p, default="default", more="(train: config.json is enough)")
    p.add_argument("--batch", check=in_range(1, MAX_BATCH), type=int, default=8, help="prompts or packed rows per call (default: %(default)s)")
    p.add_argument("--seq", check=in_range(1, MAX_SEQ), type=int, default=128, help="padded prompt length or tokens per row (default: %(default)s)")
    p.add_argument("--cache", check=in_range(1, MAX_SEQ), type=int, default=512, help="decode: KV cache slots (default: %(default)s)")
    options.TREE.add(p, default="mc_sim_7b_63", more="; decode only")
    options.NUM_HEADS.add(p, default=4, more="(random)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="weights (default: bf16)")
    add_train_step(p)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    if device.platform == "cpu" or not (device.memory_stats() or {}).get("peak_bytes_in_use"):
        print(f"error: {device.platform} device reports no peak memory; run this on a GPU or TPU", file=sys.stderr)
        return 2
    try:
        if args.job == "train":
            options.model_folder("--model", args.model, tokenizer=False, weights=False)
            folder = args.model
        else:
            folder = str(options.model_arg("--model", args.model, tokenizer=False))
    except (ValueError, OSError) as e:
        return validate.fail(e)
    common = ["--model", folder, "--job", args.job, "--batch", str(args.batch), "--seq", str(args.seq), "--num-heads",
              str(args.num_heads), "--dtype", args.dtype, "--attention", args.attention, "--json"]
    extra = (["--remat", args.remat, "--loss-chunk", str(args.loss_chunk), "--optimizer-dtype", args.optimizer_dtype]
             + ["--medusa2"] * args.medusa2 if args.job == "train" else
             ["--lm-head", "shared", "--cache", str(args.cache), "--tree", args.tree]) + ["--scan-layers"] * args.scan
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *common, *extra], capture_output=True,
                          text=True)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    plan = json.loads(proc.stdout)
    mib = 2**20
    if args.job == "train":
        config = PlanConfig(model_config(folder, args.dtype), MeshConfig(), job="train", batch=args.batch,
                            seq=args.seq, num_heads=args.num_heads, medusa2=args.medusa2,
                            layers=config_from(LayerExecution, args), loss_chunk=args.loss_chunk,
                            optimizer_dtype=args.optimizer_dtype)
        measured = measure_train_step(config)
        before, peak = measured["state"], measured["peak"]
        print(f"{device.device_kind}: {device.platform} compiler's figure for the step "
              f"{measured['compiled'] / mib:.1f} MiB")
    else:
        model = load_sharded(folder, dtype=args.dtype, random_heads=args.num_heads,
                             layers=LayerExecution(scan=args.scan, attention=args.attention))
        tree = load_tree(args.tree, num_heads=args.num_heads)
        before = device.memory_stats()["bytes_in_use"]
        prompts = np.ones((args.batch, args.seq), np.int32)
        model.medusa_decode(prompts, np.full((args.batch,), args.seq, np.int32), tree=tree, cache_size=args.cache,
                            max_new_tokens=args.cache - args.seq - tree.num_tokens)
        peak = device.memory_stats()["peak_bytes_in_use"]
    resident = "parameters and optimiser state" if args.job == "train" else "weights"
    print(f"{device.device_kind}: {resident} resident before the call {before / mib:.1f} MiB, peak {peak / mib:.1f} MiB")
    print(f"plan (CPU compile): total {plan['device_bytes'] / mib:.1f} MiB (parameters "
          f"{plan['arguments']['params'] / mib:.1f}, optimiser {plan['arguments']['optimizer'] / mib:.1f}, KV cache "
          f"{plan['arguments']['kv_cache'] / mib:.1f}, temporaries {plan['device_temp_bytes'] / mib:.1f}); analytic "
          f"{plan['analytic']['total'] / mib:.1f} MiB")
    print(f"plan / measured peak = {plan['device_bytes'] / peak:.2f}")
    return 0


MODES = {"table": table_main, "vs-device": vs_device_main}


if __name__ == "__main__":
    sys.exit(main())
