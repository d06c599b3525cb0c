"""The optimiser's update of stacked layers one layer at a time (training/trainer.py, layer_by_layer) and the scanned,
rematerialised Medusa-2 step it belongs to (with 16-bit moments): the same updates, states and trained weights as
the unrolled step with optax's whole-tree AdamW, with the global-norm clip active."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training.trainer import layer_by_layer
from medusa_jax.training.trainer import TrainConfig, Trainer, stored_in

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
B, T = 2, 24


def _close(ours, ref, rtol, atol_frac=1e-6):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * max(np.abs(b).max(), 1.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_by_layer_equals_the_whole_tree_update(dtype):
    """Two steps of clipped AdamW on stacked [L, ...] leaves: the same updates and state as optax's clip and AdamW
    over the whole tree (the clip active: the gradients' norm is above max_norm)."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(keys[0], (3, 4, 5)), "b": jax.random.normal(keys[1], (3, 5))}
    adamw = stored_in(optax.adamw(1e-2, weight_decay=0.1), dtype)
    whole = optax.chain(optax.clip_by_global_norm(0.5), adamw)
    ours = layer_by_layer(adamw, 0.5)
    whole_state, our_state = whole.init(params), ours.init(params)
    for key in keys[2:]:
        grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
        ref_updates, whole_state = whole.update(grads, whole_state, params)
        updates, our_state = jax.jit(lambda g, s, p: ours.update(g, s, p, grad_norm=optax.tree.norm(g)))(
            grads, our_state, params)
        _close(updates, ref_updates, rtol=1e-6)
        _close(our_state, whole_state[1], rtol=1e-6)
        params = optax.apply_updates(params, updates)
    assert int(our_state[0].count) == 2  # the step count advanced once per step, not once per layer


@pytest.mark.parametrize("optimizer_dtype", ["float32", "bfloat16"])
def test_scanned_medusa2_steps_equal_the_unrolled_ones(optimizer_dtype):
    """Three float32 Medusa-2 steps with the layers scanned and rematerialised (bfloat16 moments: updated layer
    by layer) against the unrolled step (optax over whole leaves): losses, gradient norms and the trained backbone
    and heads."""
    base = CausalLM(CFG, nnx.Rngs(0))
    heads = init_heads(HeadsConfig(CFG.hidden_size, CFG.vocab_size, num_heads=2, lm_head="own"), base, seed=0)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
             "segment_ids": np.ones((B, T), np.int32),
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
             "loss_mask": rng.random((B, T)) < 0.8}
    runs = {}
    for name, layers in (("unrolled", LayerExecution()), ("scanned", LayerExecution(scan=True, remat="full"))):
        config = TrainConfig(warmup_steps=0, learning_rate=1e-2, medusa2=True, clip_norm=0.05, layers=layers,
                             optimizer_dtype=optimizer_dtype, compute_dtype="float32")
        trainer = Trainer(base, heads, config, MeshConfig().make_mesh())
        assert ("layers" in trainer.opt_state.inner_states) == (name == "scanned" and optimizer_dtype == "bfloat16")
        metrics = [trainer.train_step(batch) for _ in range(3)]
        runs[name] = ([float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics],
                      nnx.state(trainer.base()), nnx.state(trainer.heads()))
    (loss, norm, trained_base, trained_heads), ref = runs["scanned"], runs["unrolled"]
    assert min(norm) > 0.05  # the clip was active in every step
    np.testing.assert_allclose(loss, ref[0], rtol=1e-5)
    np.testing.assert_allclose(norm, ref[1], rtol=1e-4)
    rtol = 1e-4 if optimizer_dtype == "float32" else 1e-3
    _close(trained_base, ref[2], rtol, atol_frac=1e-4)
    _close(trained_heads, ref[3], rtol, atol_frac=1e-4)
    assert not np.allclose(jax.tree.leaves(trained_base)[-1], jax.tree.leaves(nnx.state(base))[-1])
