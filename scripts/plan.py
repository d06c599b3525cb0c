"""Will it fit? Compile the real train step or Medusa decode loop for a model and mesh on abstract inputs (no
weights are allocated, no accelerator is needed) and print per-device memory, collectives and the verdict.

Examples:
  python scripts/plan.py --model llama3-8b --mesh data=2,fsdp=4 --job train --batch 16 --seq 2048
  python scripts/plan.py --model llama3-70b --mesh tensor=8 --job decode --batch 8 --device h100-80g --search
  python scripts/plan.py --model path/to/hf_folder --mesh data=2,tensor=4 --job decode --json
The mesh runs on forced host CPU devices (the script sets XLA_FLAGS). Temporaries come from XLA's CPU compiler:
argument bytes are exact, temporaries approximate what a GPU/TPU compiler would need.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a preset (llama3-8b, llama3-70b, mistral-7b, qwen2-7b) or a folder with a HF config.json")
    p.add_argument("--mesh", default="", help="mesh axes, e.g. data=2,fsdp=4,tensor=1 (default: one device)")
    p.add_argument("--job", choices=("train", "decode"), default="decode",
                   help="train: the head-training step (scripts/train_heads.py); decode: prefill + the Medusa "
                        "decode loop (scripts/generate.py) (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="global batch: packed rows (train) or prompts (decode)")
    p.add_argument("--seq", type=int, default=None,
                   help="train: tokens per packed row (default 2048); decode: padded prompt length (default 1024)")
    p.add_argument("--cache", type=int, default=2048,
                   help="decode: KV cache slots per row: prompt + new tokens + the tree's scratch block "
                        "(default: %(default)s)")
    p.add_argument("--tree", default="mc_sim_7b_63", help="decode: tree preset or JSON file (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="number of Medusa heads (default: %(default)s)")
    p.add_argument("--lm-head", choices=("own", "shared"), default="own",
                   help="each head's own lm_head, or the base model's shared (default: %(default)s)")
    p.add_argument("--medusa2", action="store_true", help="train: joint training of the backbone (Medusa-2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight storage dtype (default: float32 for train, as train_heads.py stores master "
                        "weights; bfloat16 for decode)")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="train: the dtype the step computes in (default: %(default)s)")
    p.add_argument("--device", default="h100-80g",
                   help="h100-80g, h200-141g, tpu-v5e-16g or a byte count per device (default: %(default)s)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of device memory kept free for the runtime (default: %(default)s)")
    p.add_argument("--search", action="store_true",
                   help="also find the largest batch that fits, by compiling a few more plans")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from medusa_jax.bench.plan import PlanConfig, device_capacity
    from medusa_jax.presets import model_config
    from medusa_jax.sharding import MeshConfig

    try:
        mesh = MeshConfig.parse(args.mesh)
        device, capacity = device_capacity(args.device)
        if not 0 <= args.headroom < 1:
            raise ValueError(f"--headroom must be in [0, 1), got {args.headroom}")
        seq = args.seq or (2048 if args.job == "train" else 1024)
        dtype = args.dtype or ("float32" if args.job == "train" else "bfloat16")
        config = PlanConfig(model_config(args.model, dtype), mesh, job=args.job, batch=args.batch, seq=seq,
                            cache=args.cache, tree=args.tree, num_heads=args.heads, lm_head=args.lm_head,
                            medusa2=args.medusa2, compute_dtype=args.compute_dtype)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # host devices for the mesh: fixed when JAX's CPU backend starts, so before any JAX computation
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={max(mesh.size, 1)}").strip()
    import jax

    jax.config.update("jax_platforms", "cpu")
    from medusa_jax.bench.plan import compile_plan, largest_batch
    from medusa_jax.bench.plan_estimate import estimate
    from medusa_jax.bench.plan_report import describe, warnings

    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    try:
        plan = compile_plan(config)
    except ValueError as e:  # a mesh axis that does not divide the model (MeshError), a bad tree
        print(f"error: {e}", file=sys.stderr)
        return 2
    largest = None
    if args.search:
        largest, _ = largest_batch(config, capacity, args.headroom, first=plan, log=log)
    est = estimate(config)
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


if __name__ == "__main__":
    sys.exit(main())
