"""Training's memory levers (medusa_jax/model/layer_stack.py, attention.self_attention): every attention kind,
the scan over stacked layers and every rematerialisation policy give the losses and gradients of the plain
unrolled forward with `grouped_attention` (the path before them); chunked attention keeps no [B, heads, T, T]
tensor for the backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from medusa_jax.model.attention import chunked_attention, grouped_attention, self_attention
from medusa_jax.model.backbone import CausalLM, with_layer_execution
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.training.data import segment_mask

CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=6, num_kv_heads=2, head_dim=16)
B, T, K, G, H = 2, 40, 2, 3, 16


def _inputs(dtype, t=T):
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.randn(B, t, K, G, H), dtype)
    k, v = (jnp.asarray(rs.randn(B, t, K, H), dtype) for _ in range(2))
    segments = np.asarray([[1] * 25 + [2] * (t - 25), [1] * t])  # two packed conversations in row 0
    return q, k, v, segment_mask(jnp.asarray(segments, jnp.int32))


def _today(q, k, v, mask):
    """The cache-free attention before this change: grouped_attention over the call's own K/V."""
    return grouped_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)


def _value_and_grads(fn, q, k, v, mask):
    weights = jnp.asarray(np.random.RandomState(1).randn(*q.shape), jnp.float32)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask).astype(jnp.float32) * weights)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _close(ours, ref, rtol, atol_frac):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * np.abs(b).max())


@pytest.mark.parametrize("dtype, rtol, atol_frac", [(jnp.float32, 2e-5, 1e-6), (jnp.bfloat16, 2e-2, 2e-2)])
@pytest.mark.parametrize("kind", ["chunked", "chunked-16", "xla"])
def test_self_attention_equals_todays_path(kind, dtype, rtol, atol_frac):
    q, k, v, mask = _inputs(dtype)
    if kind == "chunked-16":  # three blocks of 16 queries, the last one padded
        fn = lambda q, k, v, m: chunked_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), m, chunk=16)
    else:
        fn = lambda q, k, v, m: self_attention(q, k, v, m, kind)
    ours, ref = _value_and_grads(jax.jit(fn), q, k, v, mask), _value_and_grads(jax.jit(_today), q, k, v, mask)
    _close(ours, ref, rtol, atol_frac)


def test_chunked_attention_keeps_no_scores_for_the_backward():
    t = 200
    q, k, v, mask = _inputs(jnp.float32, t)
    scores = B * K * G * t * t

    def largest_residual(fn):
        return max(int(np.prod(aval.shape)) for aval, _ in saved_residuals(lambda q: jnp.sum(fn(q, k, v, mask)), q))

    assert largest_residual(_today) >= scores  # the probabilities [B, K, T*G, T] are kept
    chunked = lambda q, k, v, m: chunked_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), m, chunk=16)
    # q, K, V and the [B, T, T] mask (padded to whole blocks) only: nothing [T, T] per head
    mask_size = B * t * t
    assert largest_residual(chunked) <= 1.1 * mask_size < scores / 5
    assert largest_residual(lambda *a: self_attention(*a, "chunked")) <= 1.1 * mask_size


def _model_loss(state, execution, tokens_bt, dtype):
    """The loss of the per-layer model `state` run as `execution` (its layers stacked for a scan)."""
    config = CFG.replace(dtype=dtype)
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0)))),
                      jax.tree.map(lambda x: x.astype(dtype), state))
    model = with_layer_execution(model, execution)
    positions_bt = jnp.broadcast_to(jnp.arange(T), tokens_bt.shape)
    hidden_btd, _ = model(tokens_bt, positions_bt, segment_mask(jnp.ones_like(tokens_bt)))
    logits = model.logits(hidden_btd)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


@pytest.mark.parametrize("dtype, rtol, atol_frac", [("float32", 1e-5, 1e-5), ("bfloat16", 3e-2, 3e-2)])
@pytest.mark.parametrize("execution", [LayerExecution(scan=True), LayerExecution(remat="full"),
                                       LayerExecution(scan=True, remat="full"),
                                       LayerExecution(scan=True, remat="dots", attention="xla")],
                         ids=["scan", "remat-full", "scan-remat-full", "scan-dots-xla"])
def test_scan_and_remat_give_the_unrolled_losses_and_gradients(execution, dtype, rtol, atol_frac):
    state = nnx.state(CausalLM(CFG, nnx.Rngs(0)))
    tokens_bt = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    grad = jax.jit(jax.value_and_grad(_model_loss), static_argnums=(1, 3))
    ours = grad(state, execution, tokens_bt, dtype)
    ref = grad(state, LayerExecution(), tokens_bt, dtype)
    _close(ours, ref, rtol, atol_frac)
    if dtype == "float32":  # the default (unrolled, chunked attention) against the attention before it
        with_today = grad(state, LayerExecution(attention="xla"), tokens_bt, dtype)
        _close(ref, with_today, rtol, atol_frac)


def test_stacked_layers_round_trip_and_decode():
    """Stacking and unstacking give back the same parameters; a stacked model's cache path (prefill + a step)
    gives the per-layer model's hidden states and cache."""
    model = CausalLM(CFG, nnx.Rngs(0))
    scanned = with_layer_execution(model, LayerExecution(scan=True))
    assert scanned.layers.mlp.down_proj.kernel[...].shape == (CFG.num_layers, CFG.intermediate_size, CFG.hidden_size)
    back = with_layer_execution(scanned, LayerExecution())
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cache = KVCache.zeros(CFG, B, 64)
    tokens_bt = jax.random.randint(jax.random.key(2), (B, 8), 0, CFG.vocab_size)
    positions_bt = jnp.broadcast_to(jnp.arange(8), (B, 8))
    mask_bts = attention_mask(cache.lengths_b, causal_block(8), 64)
    (ours, our_cache), (ref, ref_cache) = (m(tokens_bt, positions_bt, mask_bts, cache) for m in (scanned, model))
    _close((ours, our_cache.k_bkhs, our_cache.v_bksh), (ref, ref_cache.k_bkhs, ref_cache.v_bksh), 1e-5, 1e-6)


def test_scan_traces_one_layer():
    """The scanned forward's program holds one layer body, whatever the depth (unrolled: one per layer)."""
    def count_dots(execution, layers):
        model = CausalLM(CFG.replace(num_layers=layers, execution=execution), nnx.Rngs(0))
        tokens_bt = jnp.zeros((1, 8), jnp.int32)
        mask = segment_mask(jnp.ones_like(tokens_bt))
        text = str(jax.make_jaxpr(lambda t: model(t, jnp.broadcast_to(jnp.arange(8), t.shape), mask)[0])(tokens_bt))
        return text.count("dot_general")

    assert count_dots(LayerExecution(scan=True), 2) == count_dots(LayerExecution(scan=True), 6)
    assert count_dots(LayerExecution(), 6) > count_dots(LayerExecution(), 2)


def test_bad_execution_is_refused():
    with pytest.raises(ValueError, match="remat must be one of"):
        LayerExecution(remat="some")
    with pytest.raises(ValueError, match="attention must be one of"):
        LayerExecution(attention="flash")
