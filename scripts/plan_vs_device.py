"""The compiled memory plan of one Medusa decode call next to what a real accelerator used for it.

Runs scripts/plan.py (forced CPU devices, abstract inputs) in a subprocess, then loads the model on this
machine's first accelerator with random heads (shared lm_head), runs the same decode call once and reads the
device's peak memory (`memory_stats()["peak_bytes_in_use"]`, GPU and TPU runtimes report it).

Example (on a GPU machine):
  python scripts/plan_vs_device.py --model smollm2 --batch 8 --seq 128 --cache 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="HF model folder, or 'smollm2' (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="prompts per call (default: %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="padded prompt length (default: %(default)s)")
    p.add_argument("--cache", type=int, default=512, help="KV cache slots (default: %(default)s)")
    p.add_argument("--tree", default="mc_sim_7b_63", help="tree preset (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="random Medusa heads (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="weights (default: bf16)")
    args = p.parse_args(argv)
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu" or not (device.memory_stats() or {}).get("peak_bytes_in_use"):
        print(f"error: {device.platform} device reports no peak memory; run this on a GPU or TPU", file=sys.stderr)
        return 2
    folder = args.model
    if folder == "smollm2":
        from medusa_jax.real_model import prepare_smollm2
        folder = str(prepare_smollm2())
    plan_cmd = [sys.executable, str(Path(__file__).with_name("plan.py")), "--model", folder, "--job", "decode",
                "--lm-head", "shared", "--batch", str(args.batch), "--seq", str(args.seq), "--cache",
                str(args.cache), "--tree", args.tree, "--heads", str(args.heads), "--dtype", args.dtype, "--json"]
    proc = subprocess.run(plan_cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    plan = json.loads(proc.stdout)

    import numpy as np

    from medusa_jax.inference.sharded import load_sharded
    from medusa_jax.tree import load_tree

    model = load_sharded(folder, dtype=args.dtype, random_heads=args.heads)
    tree = load_tree(args.tree, num_heads=args.heads)
    before = device.memory_stats()["bytes_in_use"]
    prompts = np.ones((args.batch, args.seq), np.int32)
    model.medusa_decode(prompts, np.full((args.batch,), args.seq, np.int32), tree=tree, cache_size=args.cache,
                        max_new_tokens=args.cache - args.seq - tree.num_tokens)
    peak = device.memory_stats()["peak_bytes_in_use"]
    mib = 2**20
    print(f"{device.device_kind}: weights resident before the call {before / mib:.1f} MiB, peak {peak / mib:.1f} MiB")
    print(f"plan (CPU compile): total {plan['device_bytes'] / mib:.1f} MiB (parameters "
          f"{plan['arguments']['params'] / mib:.1f}, KV cache {plan['arguments']['kv_cache'] / mib:.1f}, "
          f"temporaries {plan['device_temp_bytes'] / mib:.1f}); analytic {plan['analytic']['total'] / mib:.1f} MiB")
    print(f"plan / measured peak = {plan['device_bytes'] / peak:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
