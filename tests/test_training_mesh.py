"""One Medusa-2 train step with distilled head targets (a Medusa-1 step of Hydra heads) and one Medusa-1 step on
cached hidden states with their teacher states, on 8 forced CPU devices, on several meshes, equal the 1-device
steps.

XLA's host device count is fixed when jax first initialises, so the step runs in a subprocess that sets
XLA_FLAGS before importing jax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from training_helpers import build_tiny_chat_model

CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from flax import nnx
    from medusa_jax.hf.load import load_pretrained
    from medusa_jax.heads.config import HeadsConfig
    from medusa_jax.heads.init import init_heads
    from medusa_jax.model.sharding import MeshConfig
    from medusa_jax.training.trainer import TrainConfig, Trainer

    assert len(jax.devices()) == 8, jax.devices()
    base = load_pretrained(sys.argv[1])
    cfg = base.config
    head_type = sys.argv[3]
    heads = init_heads(HeadsConfig(cfg.hidden_size, cfg.vocab_size, num_heads=2, lm_head=sys.argv[2],
                                   head_type=head_type), base, seed=0)
    rng = np.random.default_rng(0)
    seg = np.repeat([[1] * 10 + [2] * 14], 8, axis=0).astype(np.int32)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (8, 24)).astype(np.int32), "segment_ids": seg,
             "positions": np.where(seg == 1, np.arange(24), np.arange(24) - 10).astype(np.int32),
             "loss_mask": rng.random((8, 24)) < 0.7}
    head_loss = sys.argv[4]
    train = TrainConfig(medusa2=head_type == "medusa", learning_rate=1e-4, head_lr_multiplier=4.0, warmup_steps=0,
                        max_steps=100, head_loss=head_loss)
    cached = {"hidden": rng.normal(size=(16, cfg.hidden_size)).astype(np.float16),
              "targets": rng.integers(-1, cfg.vocab_size, (16, 2)).astype(np.int32),
              "teacher_hidden": rng.normal(size=(16, 2, cfg.hidden_size)).astype(np.float16)}
    if head_type == "hydra":
        cached["path"] = rng.integers(0, cfg.vocab_size, (16, 2)).astype(np.int32)
    medusa1 = TrainConfig(learning_rate=1e-3, warmup_steps=0, max_steps=100, head_loss=head_loss)
    out = {}
    ref = None
    for shape in [(1, 1, 1), (8, 1, 1), (2, 2, 2)]:  # one device; data only; data x fsdp x tensor
        mesh = MeshConfig(*shape).make_mesh(jax.devices()[: int(np.prod(shape))])
        m1 = Trainer(base, heads, medusa1, mesh).train_step(cached)
        out.setdefault("medusa1", []).append((float(m1["loss"]), np.asarray(m1["stats"].kl_sum).tolist()))
        trainer = Trainer(base, heads, train, mesh)
        metrics = trainer.train_step(batch)
        leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.params))]
        if ref is None:
            ref = (float(metrics["loss"]), leaves, float(metrics["grad_norm"]))
            before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(
                {"heads": nnx.state(heads, nnx.Param), **({"base": nnx.state(base)} if train.medusa2 else {})}))]
            out["max_update"] = max(float(np.abs(a - b).max()) for a, b in zip(leaves, before))
            continue
        out[str(shape)] = {"loss_diff": abs(float(metrics["loss"]) - ref[0]),
                           "param_diff": max(float(np.abs(a - b).max()) for a, b in zip(leaves, ref[1])),
                           "grad_norm_diff": abs(float(metrics["grad_norm"]) - ref[2]),
                           "sharded": str(jax.tree.leaves(trainer.params)[0].sharding.spec)}
    print("RESULT" + json.dumps(out))
""")


def test_train_step_is_the_same_on_every_mesh(tmp_path):
    folder = build_tiny_chat_model(tmp_path / "m")
    for lm_head, head_type, head_loss in (("own", "medusa", "ce+kl"), ("own", "hydra", "ce+kl")):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), lm_head, head_type, head_loss],
                              capture_output=True, text=True, env=env, timeout=600, cwd=str(Path(__file__).parent))
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.split("RESULT", 1)[1])
        # the step really moves the parameters (Adam's first step moves each by about its LR, 4e-4 for heads); the
        # LR is small because Adam's first update is g/|g|, which amplifies float rounding of near-zero gradients
        assert result["max_update"] > 3e-4
        for shape in ("(8, 1, 1)", "(2, 2, 2)"):
            assert result[shape]["loss_diff"] < 1e-5, result
            assert result[shape]["param_diff"] < 1e-5, result
            assert result[shape]["grad_norm_diff"] < 1e-5, result
        (loss0, kl0), *others = result["medusa1"]
        assert min(kl0) > 0
        for loss, kl in others:
            assert abs(loss - loss0) < 1e-5 and np.allclose(kl, kl0, rtol=1e-5), result["medusa1"]
