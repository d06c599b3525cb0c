"""Subprocess side of tests/test_scan_fsdp.py (8 forced CPU devices, fixed before JAX starts).

    python tests/scan_fsdp_worker.py OUT.json

For a small Llama (5 layers) under fsdp=8, Medusa-2 with remat=full: the all-gathers of the compiled train step,
inside `while` loops and outside them, element counts per gather, for the scanned and the unrolled layers; and the
loss and gradient norm of one real step on one device (unrolled) and on fsdp=8 (scanned).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from medusa_jax.model.backbone import CausalLM  # noqa: E402
from medusa_jax.model.config import LayerExecution, ModelConfig  # noqa: E402
from medusa_jax.model.sharding import MeshConfig  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.training.trainer import TrainConfig, Trainer  # noqa: E402
from medusa_jax.training import hlo_collectives as hc  # noqa: E402
from medusa_jax.training.plan import PRESETS, PlanConfig, lower_train  # noqa: E402

# q/o projections [128, 256], k/v [128, 64], MLP [128, 448] / [448, 128]: sizes no head or embedding shares
SMALL = ModelConfig.from_hf_config({**PRESETS["llama3-8b"], "vocab_size": 512, "hidden_size": 128,
                                    "intermediate_size": 448, "num_hidden_layers": 5, "num_attention_heads": 16,
                                    "num_key_value_heads": 4, "head_dim": 16}, dtype="float32")
SCANNED = LayerExecution(scan=True, remat="full")


def gathers(layers: LayerExecution) -> dict:
    config = PlanConfig(SMALL, MeshConfig(fsdp=8), job="train", batch=8, seq=64, medusa2=True,
                        compute_dtype="float32", layers=layers)
    lowered, _ = lower_train(config)
    hlo = lowered.compile().as_text()
    in_loops = [c for c in hc.loop_collectives(hlo) if c.op == "all-gather"]
    loop_computations = {c.computation for c in hc.loop_collectives(hlo)}
    outside = [c for c in hc.module_collectives(hlo) if c.op == "all-gather" and c.computation not in loop_computations]
    size = lambda c: int(np.prod(c.dims))
    return {"in_loops": sorted(map(size, in_loops)), "outside": sorted(map(size, outside))}


def step_metrics(mesh_config: MeshConfig, layers: LayerExecution) -> list[float]:
    base = CausalLM(SMALL, nnx.Rngs(0))
    heads = init_heads(PlanConfig(SMALL, mesh_config, job="train").heads_config(), base, seed=0)
    rng = np.random.default_rng(0)
    seg = np.repeat([[1] * 20 + [2] * 44], 8, axis=0).astype(np.int32)
    batch = {"tokens": rng.integers(0, SMALL.vocab_size, (8, 64)).astype(np.int32), "segment_ids": seg,
             "positions": np.where(seg == 1, np.arange(64), np.arange(64) - 20).astype(np.int32),
             "loss_mask": rng.random((8, 64)) < 0.7}
    mesh = mesh_config.make_mesh(jax.devices()[: mesh_config.size])
    trainer = Trainer(base, heads, TrainConfig(medusa2=True, learning_rate=1e-4, warmup_steps=0, layers=layers), mesh)
    first = trainer.train_step(batch)
    second = trainer.train_step(batch)  # after one update of the backbone and heads
    return [float(first["loss"]), float(first["grad_norm"]), float(second["loss"])]


def main(out: str) -> None:
    report = {"scanned": gathers(SCANNED), "unrolled": gathers(LayerExecution(remat="full")),
              "one_device": step_metrics(MeshConfig(), LayerExecution()),
              "fsdp_scanned": step_metrics(MeshConfig(fsdp=8), SCANNED)}
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
