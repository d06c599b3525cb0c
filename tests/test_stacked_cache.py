"""A stacked model (`LayerExecution(scan=True)`) decodes over a stacked KV cache ([L, ...] buffers, one scan over the
layers: model/layer_stack.run_cached_layers) as the per-layer model decodes over its per-layer cache: the same
hidden states, logits, K/V and drafter taps of a prefill and a tree verify; the same greedy tokens for plain
decoding, a static and a dynamic tree; the accepted path's K/V move; and the stacked cache's shardings on a
mesh of 8 forced CPU devices (a subprocess: the device count is fixed before JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.autoregressive import prefill
from medusa_jax.inference.medusa import compact_accepted
from medusa_jax.model.backbone import CausalLM, with_layer_execution
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.kv_cache import KVCache, attention_mask
from medusa_jax.trees.tree import load_tree

from decode_helpers import randomise_kernels

CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)
STACKED = LayerExecution(scan=True)
WORKER = Path(__file__).with_name("stacked_cache_worker.py")


def _close(ours, ref, rtol=1e-5):
    """fp32 agreement relative to the magnitudes: rtol plus a small atol scaled by the largest reference value."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=1e-6 * max(np.abs(ref).max(), 1.0))


def test_zeros_follows_the_model_and_converts():
    assert not KVCache.zeros(CFG, 2, 16).stacked
    cache = KVCache.zeros(CFG.replace(execution=STACKED), 2, 16)
    assert cache.stacked and cache.k_bkhs.shape == (3, 2, 2, 16, 16) and cache.v_bksh.shape == (3, 2, 2, 16, 16)
    assert (cache.num_layers, cache.batch_size, cache.cache_size) == (3, 2, 16)


def test_prefill_and_tree_verify_equal_the_per_layer_path():
    """Prefill of ragged rows, then a verify forward of a static tree (its ancestor mask, depth positions), with
    the taps an EAGLE-3 drafter reads: hidden states, logits, every layer's K/V and the taps agree."""
    model = CausalLM(CFG, nnx.Rngs(0))
    scanned = with_layer_execution(model, STACKED)
    tree = load_tree("mc_sim_7b_8")
    rng = np.random.default_rng(0)
    prompt_bt = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 10)), jnp.int32)
    lengths_b = jnp.asarray([10, 6], jnp.int32)
    size = 40
    t = len(tree.ancestor_mask_tt)
    tokens_bt = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, t)), jnp.int32)
    positions_bt = lengths_b[:, None] + jnp.asarray(tree.depth_t)[None, :]
    mask_bts = attention_mask(lengths_b, jnp.asarray(tree.ancestor_mask_tt), size)
    results = {}
    for name, m in (("per_layer", model), ("stacked", scanned)):
        cache = KVCache.zeros(m.config, 2, size)
        hidden_btd, cache = prefill(m, prompt_bt, lengths_b, cache)
        cache = cache.replace(lengths_b=lengths_b)
        out_btd, cache, taps_btf = m.forward_taps(tokens_bt, positions_bt, mask_bts, cache, taps=(0, 2, 3))
        results[name] = (hidden_btd, m.logits(out_btd), taps_btf, cache)
    (h, logits, taps, cache), (h_ref, logits_ref, taps_ref, cache_ref) = results["stacked"], results["per_layer"]
    assert cache.stacked and not cache_ref.stacked
    _close(h, h_ref)
    _close(logits, logits_ref)
    _close(taps, taps_ref)
    _close(cache.k_bkhs, jnp.stack(cache_ref.k_bkhs))
    _close(cache.v_bksh, jnp.stack(cache_ref.v_bksh))


def test_a_per_layer_model_refuses_a_stacked_cache():
    model = CausalLM(CFG, nnx.Rngs(0))
    cache = KVCache.zeros(CFG, 1, 8, stacked=True)
    with pytest.raises(ValueError, match="stacked KV cache needs stacked layers"):
        model(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 8), bool), cache)


def test_compact_accepted_moves_the_path_in_every_layer_of_the_stack():
    k_bkhs = tuple(jnp.asarray(np.random.default_rng(i).normal(size=(2, 2, 4, 16)), jnp.float32) for i in range(3))
    v_bksh = tuple(x.transpose(0, 1, 3, 2) * 2 for x in k_bkhs)
    lengths_b = jnp.asarray([3, 5], jnp.int32)
    nodes_be = jnp.asarray([[0, 4, 6], [0, 1, 2]])
    per_layer = compact_accepted(KVCache(k_bkhs, v_bksh, lengths_b), nodes_be)
    stacked = compact_accepted(KVCache(jnp.stack(k_bkhs), jnp.stack(v_bksh), lengths_b), nodes_be)
    assert stacked.stacked
    np.testing.assert_array_equal(stacked.k_bkhs, jnp.stack(per_layer.k_bkhs))
    np.testing.assert_array_equal(stacked.v_bksh, jnp.stack(per_layer.v_bksh))
    assert not np.array_equal(stacked.k_bkhs, jnp.stack(k_bkhs))  # the path did move


def test_put_rows_on_a_stacked_cache():
    cache = KVCache.zeros(CFG, 3, 16, stacked=True)
    fresh = KVCache(jnp.ones((3, 2, 2, 16, 8)), 2 * jnp.ones((3, 2, 2, 8, 16)), jnp.asarray([5, 7], jnp.int32))
    out = cache.put_rows(jnp.asarray([2, 0]), fresh)
    assert out.lengths_b.tolist() == [7, 0, 5]
    assert float(out.k_bkhs[:, 2, ..., :8].min()) == 1 and float(out.k_bkhs[:, 1].max()) == 0
    assert float(out.v_bksh[:, 0, :, :8].min()) == 2 and float(out.k_bkhs[..., 8:].max()) == 0


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    base = load_pretrained(tiny_model_dir("llama", initializer_range=0.3))
    heads = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=3), base, seed=0)
    randomise_kernels([block.linear for head in heads.heads for block in head.blocks], 0)
    return base, with_layer_execution(base, STACKED), heads


PROMPTS = [[11, 3, 8, 21, 7, 2], [40, 41, 9, 13, 5, 77, 61, 2, 19, 30, 8, 4, 99], [6, 1, 3]]


@pytest.mark.parametrize("tree_name", [None, "mc_sim_7b_8", "dynamic:6,k=2,d=3"], ids=["plain", "static", "dynamic"])
def test_stacked_decoding_gives_the_per_layer_tokens(tiny_pair, tree_name):
    base, scanned, heads = tiny_pair
    if tree_name is None:
        ours, ref = (generate(m, PROMPTS, max_new_tokens=24, eos_ids=()) for m in (scanned, base))
    else:
        tree = load_tree(tree_name)
        ours, ref = (generate_medusa(m, heads, PROMPTS, tree=tree, max_new_tokens=24, eos_ids=())
                     for m in (scanned, base))
        assert [r.accept_lengths for r in ours] == [r.accept_lengths for r in ref]
    assert [r.token_ids for r in ours] == [r.token_ids for r in ref]
    assert len({tuple(r.token_ids) for r in ref}) == len(PROMPTS)  # varied continuations, not one constant


def test_stacked_cache_shardings_on_a_mesh(tiny_model_dir):
    """On data=2 x tensor=4: the stacked cache's rows over data, KV heads over tensor, layers whole; plain and
    Medusa greedy decoding of the stacked model give the one-device per-layer tokens."""
    folder = tiny_model_dir("llama", num_attention_heads=8, num_key_value_heads=8)
    proc = subprocess.run([sys.executable, str(WORKER), str(folder)], capture_output=True, text=True, timeout=600,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ok" in proc.stdout.splitlines()[-1]
