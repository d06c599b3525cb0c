"""SmolLM2 train steps and plain decoding on this CPU, one revision per call: run it in two checkouts, alternating,
and compare the JSON lines (bench/cpu_speed/README.md has the commands)."""

from __future__ import annotations

import json
import sys

import numpy as np

from medusa_jax.demo_model import resolve_model_dir


def train(rev: str) -> None:
    from medusa_jax.bench.scan_benchmark import demo_model_and_heads, train_case

    base, heads = demo_model_and_heads()
    for medusa2 in (False, True):
        seconds = train_case(base, heads, medusa2, "unrolled", 2, 128, 3)
        print(json.dumps({"code": rev, "case": f"train-m{2 if medusa2 else 1}", "seconds": round(seconds, 3)}),
              flush=True)


def decode(rev: str) -> None:
    from medusa_jax.bench.bench_inputs import fastest
    from medusa_jax.inference.api import BatchSettings, generate_batch
    from medusa_jax.inference.sharded import load_sharded

    model = load_sharded(resolve_model_dir("default"))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 40000, size=n).tolist() for n in (90, 110, 70, 100)]
    for batch in (1, 4):
        settings = BatchSettings(batch_size=batch, max_new_tokens=64, eos_ids=())
        best = fastest(lambda: generate_batch(model, prompts, settings, progress=False), 3)[1]  # after compiling
        print(json.dumps({"code": rev, "batch": batch, "tokens_per_s": round(len(prompts) * 64 / best, 2)}),
              flush=True)


if __name__ == "__main__":
    {"train": train, "decode": decode}[sys.argv[1]](sys.argv[2])
