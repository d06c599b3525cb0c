"""SmolLM2 on this CPU: train steps with the vocabulary-wide losses on whole rows or in token chunks
(TrainConfig.loss_chunk), settings interleaved round by round; one JSON line per (round, case, setting)."""

from __future__ import annotations

import argparse
import json

import jax

from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training.plan import random_packed_batch
from medusa_jax.training.trainer import TrainConfig, Trainer
from medusa_jax.bench.bench_inputs import fastest
from medusa_jax.bench.scan_benchmark import demo_model_and_heads

SETTINGS = {"whole": dict(), "chunk-128": dict(loss_chunk=128), "chunk-256": dict(loss_chunk=256),
            "chunk-512": dict(loss_chunk=512)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2, help="packed rows per train step")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per case and round (the fastest counts)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the settings")
    p.add_argument("--lm-head", default="own", choices=("own", "shared"), help="the heads' lm_head")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"from {list(SETTINGS)}")
    args = p.parse_args()
    base, heads = demo_model_and_heads(args.lm_head)
    batch = random_packed_batch(base.config.vocab_size, args.rows, args.seq)
    for medusa2 in (False, True):  # the settings' trainers of one case at a time (memory), timed in turns
        trainers = {}
        for setting in args.settings.split(","):
            trainers[setting] = Trainer(base, heads, TrainConfig(medusa2=medusa2, warmup_steps=0, **SETTINGS[setting]),
                                        MeshConfig().make_mesh())
            trainers[setting].train_step(batch)  # compile
        for round_ in range(1, args.rounds + 1):
            for setting, trainer in trainers.items():
                _, seconds = fastest(lambda: jax.block_until_ready(trainer.train_step(batch)["loss"]), args.repeats,
                                     warm_up=False)  # compiled above
                print(json.dumps({"round": round_, "case": f"train-m{2 if medusa2 else 1}", "setting": setting,
                                  "lm_head": args.lm_head, "rows": args.rows, "seq": args.seq,
                                  "seconds": round(seconds, 4)}), flush=True)
        del trainers

if __name__ == "__main__":
    main()
