"""The train step's memory options: the vocabulary-wide losses in token chunks (training/chunked_loss.py) give the
losses, statistics and gradients of whole rows (float32); a bfloat16 frozen backbone gives the bfloat16 step;
Adam's moments in bfloat16 follow the float32 losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training import chunked_loss
from medusa_jax.training.trainer import TrainConfig, Trainer

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
B, T = 2, 40  # chunks of 16 tokens: the last one padded


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    seg = np.repeat([[1] * 15 + [2] * (T - 15)], B, axis=0).astype(np.int32)
    return {"tokens": jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32),
            "segment_ids": jnp.asarray(seg),
            "positions": jnp.asarray(np.where(seg == 1, np.arange(T), np.arange(T) - 15), jnp.int32),
            "loss_mask": jnp.asarray(rng.random((B, T)) < 0.7)}


def _models(lm_head: str, head_type: str = "medusa"):
    base = CausalLM(CFG, nnx.Rngs(0))
    trunc = 24 if lm_head == "truncated" else None
    heads = init_heads(HeadsConfig(CFG.hidden_size, CFG.vocab_size, num_heads=3, lm_head=lm_head,
                                   truncated_vocab_size=trunc, head_type=head_type), base, seed=0,
                       token_map=np.arange(0, 48, 2) if trunc else None)
    # ResBlocks start at identity (zero weights): give them weights, so their gradients are not trivial
    params = nnx.state(heads, nnx.Param)
    noise = jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
    nnx.update(heads, jax.tree.map(jnp.add, params, noise))
    return base, heads


def _value_and_grads(base, heads, **train):
    trainer = Trainer(base, heads, TrainConfig(warmup_steps=0, **train), MeshConfig().make_mesh())
    fn = jax.jit(jax.value_and_grad(trainer._objective, has_aux=True))
    (loss, (stats, extras)), grads = fn(trainer.params, trainer.frozen, _batch())
    return loss, stats, extras, grads


def _close(ours, ref, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6 * max(np.abs(b).max(), 1.0))


@pytest.mark.parametrize("lm_head", ["own", "shared", "truncated"])
@pytest.mark.parametrize("train", [dict(), dict(medusa2=True), dict(medusa2=True, distill_kl=True),
                                   dict(head_loss="ce+kl")], ids=["m1", "m2", "m2-kl", "ce+kl"])
def test_chunked_losses_equal_the_whole_row_step(lm_head, train):
    base, heads = _models(lm_head)
    ref = _value_and_grads(base, heads, **train)
    assert float(ref[0]) > 0 and any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(ref[3]))
    _close(_value_and_grads(base, heads, **train, loss_chunk=16), ref)


def test_hydra_heads_in_chunks_equal_whole_rows():
    base, heads = _models("own", head_type="hydra")
    ref = _value_and_grads(base, heads, head_loss="ce+kl")
    _close(_value_and_grads(base, heads, head_loss="ce+kl", loss_chunk=16), ref)


def test_chunks_keep_one_chunk_of_logits_for_the_backward():
    """The largest value the backward keeps is far below one head's [B, T, V] logits with chunks."""
    from jax._src.ad_checkpoint import saved_residuals

    base, heads = _models("own")
    head = heads.heads[0]
    hidden = jax.random.normal(jax.random.key(0), (B, T, CFG.hidden_size))
    targets = _batch()["tokens"]

    def loss(state, chunk):
        graphdef = nnx.graphdef(head)
        return chunked_loss.head_sums(graphdef, state, (hidden,), None, targets, None, None, None, chunk)[0]

    def largest_residual(chunk):
        saved = saved_residuals(lambda s: loss(s, chunk), nnx.state(head))
        return max(int(np.prod(aval.shape)) for aval, _ in saved)

    whole_logits = B * T * CFG.vocab_size
    assert largest_residual(0) >= whole_logits
    assert largest_residual(16) < whole_logits / 2


def test_negative_chunk_is_refused():
    with pytest.raises(ValueError, match="loss_chunk"):
        TrainConfig(loss_chunk=-1)


def _stored_dtypes(tree) -> set:
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bfloat16_backbone_gives_the_bfloat16_step_of_the_float32_one():
    """Medusa-1 with --backbone-dtype bfloat16: the frozen backbone is stored as the bf16 step computes it, so
    the loss and the heads' gradients equal those of a float32 backbone cast in the step."""
    base, heads = _models("own")
    bf16_base = nnx.merge(nnx.graphdef(CausalLM(CFG.replace(dtype="bfloat16"), nnx.Rngs(0))),
                          jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(base)))
    ref = _value_and_grads(base, heads, compute_dtype="bfloat16")
    ours = _value_and_grads(bf16_base, heads, compute_dtype="bfloat16")
    trainer = Trainer(bf16_base, heads, TrainConfig(), MeshConfig().make_mesh())
    assert _stored_dtypes(trainer.frozen["base"]) == {"bfloat16"}
    assert _stored_dtypes(trainer.params) == {"float32"}
    _close(ours, ref, rtol=1e-6)


def test_bfloat16_optimizer_state_halves_it_and_follows_the_float32_losses():
    base, heads = _models("own")
    batch = _batch(seed=3)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(base, heads, TrainConfig(warmup_steps=0, learning_rate=1e-2, medusa2=True,
                                                   optimizer_dtype=dtype), MeshConfig().make_mesh())
        moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim > 0]
        assert _stored_dtypes(moments) == {dtype}
        runs[dtype] = np.asarray([float(trainer.train_step(batch)["loss"]) for _ in range(12)])
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    assert fp32[-1] < 0.8 * fp32[0]
    np.testing.assert_allclose(bf16, fp32, rtol=0.02)
