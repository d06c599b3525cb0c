"""Subprocess side of tests/test_plan.py (8 forced CPU devices, fixed before JAX starts).

    python tests/plan_worker.py small OUT.json   compiled vs analytic vs real Trainer on a scaled-down Llama
    python tests/plan_worker.py llama8b OUT.json  the Llama-3-8B Medusa-1 train step on (data=2, fsdp=4) and the
                                                  8B Medusa decode loop on (data=2, tensor=4)
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from medusa_jax.model.backbone import CausalLM  # noqa: E402
from medusa_jax.model.config import LayerExecution, ModelConfig  # noqa: E402
from medusa_jax.model.sharding import MeshConfig  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.training.plan import (PRESETS, PlanConfig, compile_plan, largest_batch, model_config,  # noqa: E402
                                      train_config)
from medusa_jax.training.memory_plan import estimate_per_device as estimate  # noqa: E402
from medusa_jax.training.trainer import Trainer  # noqa: E402

# Llama-3's architecture (GQA 4:1, untied lm_head, llama3 RoPE) at a size that compiles in seconds
SMALL = ModelConfig.from_hf_config({**PRESETS["llama3-8b"], "vocab_size": 512, "hidden_size": 128,
                                    "intermediate_size": 448, "num_hidden_layers": 2, "num_attention_heads": 16,
                                    "num_key_value_heads": 4}, dtype="float32")


def entry(plan, est) -> dict:
    return {"plan": plan.to_dict(), "estimate": dataclasses.asdict(est) | {"total": est.total}}


def real_trainer_bytes(config: PlanConfig) -> int:
    """Bytes device 0 holds of a real Trainer's params, frozen state and optimiser state (tiny model)."""
    base = CausalLM(config.model, nnx.Rngs(0))
    heads = init_heads(config.heads_config(), base)
    mesh = config.mesh.make_mesh(jax.devices()[: config.mesh.size])
    trainer = Trainer(base, heads, train_config(config), mesh)
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves((trainer.params, trainer.frozen, trainer.opt_state)):
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def main_small(out: str) -> None:
    report = {}
    cases = {
        "train_m1": PlanConfig(SMALL, MeshConfig(data=2, fsdp=4), job="train", batch=8, seq=128,
                               compute_dtype="float32"),
        "train_m2": PlanConfig(SMALL, MeshConfig(data=2, fsdp=2, tensor=2), job="train", batch=8, seq=128,
                               medusa2=True, compute_dtype="float32"),
        # the memory options: losses in token chunks, Adam's moments in bfloat16
        "train_m2_lean": PlanConfig(SMALL, MeshConfig(data=2, fsdp=4), job="train", batch=8, seq=128, medusa2=True,
                                    compute_dtype="float32", loss_chunk=32, optimizer_dtype="bfloat16"),
        "decode": PlanConfig(SMALL.replace(dtype="float32"), MeshConfig(data=2, tensor=4), job="decode", batch=8,
                             seq=64, cache=256, tree="mc_sim_7b_63"),
    }
    # the stacked model over a stacked KV cache (plan.py --job decode --scan-layers)
    cases["decode_stacked"] = cases["decode"].replace(layers=LayerExecution(scan=True))
    for name, config in cases.items():
        plan = compile_plan(config)
        report[name] = entry(plan, estimate(config))
        if config.job == "train":
            report[name]["real_state_bytes"] = real_trainer_bytes(config)
    decode = cases["decode"]
    first = compile_plan(decode)
    capacity = 3 * first.device_bytes
    best, plans = largest_batch(decode, capacity, 0.0, first=first)
    report["search"] = {"capacity": capacity, "best": best, "step": 2,
                        "plans": {p.config.batch: p.device_bytes for p in plans}}
    with open(out, "w") as f:
        json.dump(report, f)


def main_llama8b(out: str) -> None:
    report = {}
    for name, config in (
            ("train", PlanConfig(model_config("llama3-8b", "float32"), MeshConfig(data=2, fsdp=4), job="train",
                                 batch=8, seq=1024)),
            ("decode", PlanConfig(model_config("llama3-8b", "bfloat16"), MeshConfig(data=2, tensor=4),
                                  job="decode", batch=8, seq=512, cache=1024))):
        report[name] = entry(compile_plan(config), estimate(config))
    report["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    {"small": main_small, "llama8b": main_llama8b}[sys.argv[1]](sys.argv[2])
