"""SmolLM2 on this CPU: train steps and decoding with the backbone's layers unrolled or scanned (issue 41), one
JSON line per case; run the same command on two checkouts to compare them (cases and command: docs/modules.md)."""

from __future__ import annotations

import argparse
import json

import jax

from medusa_jax.bench.bench_inputs import fastest
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training.plan import random_packed_batch
from medusa_jax.training.trainer import TrainConfig, Trainer
from medusa_jax.demo_model import resolve_model_dir
from medusa_jax.hf.load import load_pretrained

try:  # absent on the code before issue 41: that code is the baseline
    from medusa_jax.model.config import LayerExecution
except ImportError:
    LayerExecution = None

SETTINGS = {"unrolled": dict(), "scan": dict(scan=True), "scan-remat-full": dict(scan=True, remat="full"),
            "unrolled-remat-full": dict(remat="full"), "unrolled-xla": dict(attention="xla")}


def demo_model_and_heads(lm_head: str = "shared"):
    """SmolLM2 (prepared once) and four fresh one-layer heads over it: what these CPU benchmarks time."""
    base = load_pretrained(resolve_model_dir("default"))
    return base, init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, num_layers=1,
                                        lm_head=lm_head), base)


def train_case(base, heads, medusa2: bool, setting: str, rows: int, seq: int, repeats: int) -> float:
    extra = {} if LayerExecution is None else {"layers": LayerExecution(**SETTINGS[setting])}
    trainer = Trainer(base, heads, TrainConfig(medusa2=medusa2, warmup_steps=0, **extra), MeshConfig().make_mesh())
    batch = random_packed_batch(base.config.vocab_size, rows, seq)
    return fastest(lambda: jax.block_until_ready(trainer.train_step(batch)["loss"]), repeats)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4, help="packed rows per train step")
    p.add_argument("--seq", type=int, default=256, help="tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case (the fastest counts)")
    p.add_argument("--settings", default="unrolled,scan,scan-remat-full", help=f"from {list(SETTINGS)}")
    args = p.parse_args()
    base, heads = demo_model_and_heads()
    code = "baseline" if LayerExecution is None else "issue-41"
    settings = ["default"] if LayerExecution is None else args.settings.split(",")
    for setting in settings:
        for medusa2 in (False, True):
            seconds = train_case(base, heads, medusa2, setting if LayerExecution else "", args.rows, args.seq,
                                 args.repeats)
            print(json.dumps({"code": code, "case": f"train-m{2 if medusa2 else 1}", "layers": setting,
                              "rows": args.rows, "seq": args.seq, "seconds": round(seconds, 4)}), flush=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4] * 4
    for case, call in (("decode", lambda: generate(base, prompts, max_new_tokens=32)),
                       ("medusa", lambda: generate_medusa(base, heads, prompts, tree="mc_sim_7b_16",
                                                          max_new_tokens=32))):
        print(json.dumps({"code": code, "case": case, "layers": "cache path", "rows": 4,
                          "seconds": round(fastest(call, args.repeats)[1], 4)}), flush=True)


if __name__ == "__main__":
    main()
