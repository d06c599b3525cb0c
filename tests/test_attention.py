"""Windowed cache attention (medusa_jax/attention.py): reading only the cache prefix the mask reaches gives the
full attention's result, and a long cache still matches transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from medusa_jax.attention import attention_windows, cached_attention, window_index
from medusa_jax.hf_import import load_pretrained
from medusa_jax.kv_cache import KVCache, attention_mask, causal_block


def test_windows_are_aligned_halvings_ending_at_the_cache():
    assert attention_windows(192) == (192,)
    assert attention_windows(1024) == (256, 512, 1024)
    assert attention_windows(640) == (192, 320, 640)
    for size in (64, 320, 768, 2048, 4160):
        w = attention_windows(size)
        assert w[-1] == size and list(w) == sorted(set(w)) and all(x % 64 == 0 for x in w[:-1])


@pytest.mark.parametrize("reach", [1, 200, 256, 257, 600, 1024])
def test_window_attention_equals_full_attention(reach):
    b, t, s, kv, g, d = 2, 3, 1024, 2, 2, 8
    rs = np.random.RandomState(reach)
    q = jnp.asarray(rs.randn(b, t, kv, g, d), jnp.float32)
    k_lbskh = jnp.asarray(rs.randn(2, b, s, kv, d), jnp.float32)
    v_lbskh = jnp.asarray(rs.randn(2, b, s, kv, d), jnp.float32)
    mask = np.zeros((b, t, s), bool)
    mask[0, :, :reach] = True
    mask[1, :, : max(1, reach // 3)] = True
    mask = jnp.asarray(mask)
    index = window_index(mask, attention_windows(s))
    assert attention_windows(s)[int(index)] >= reach
    assert int(index) == 0 or attention_windows(s)[int(index) - 1] < reach
    windowed = jax.jit(cached_attention, static_argnums=3)(q, k_lbskh, v_lbskh, 1, mask, index)
    full = cached_attention(q, k_lbskh, v_lbskh, 1, mask, None)
    np.testing.assert_allclose(windowed, full, atol=1e-6, rtol=1e-6)


def test_long_cache_decode_matches_transformers(tiny_model_dir):
    """A 1024-slot cache: the prompt (300 tokens) reaches the second window, the steps cross no boundary."""
    folder, hf = tiny_model_dir("llama")
    model = load_pretrained(folder)
    prompt = np.random.RandomState(11).randint(1, 128, size=300).tolist()
    size = 1024
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    cache = KVCache.zeros(model.config, 1, size)
    forward = jax.jit(lambda m, tok, pos, mask, c: m(tok, pos, mask, c))
    hidden, cache = forward(model, jnp.asarray([prompt], jnp.int32), jnp.arange(300, dtype=jnp.int32)[None],
                            attention_mask(cache.lengths_b, causal_block(300), size), cache)
    np.testing.assert_allclose(np.asarray(model.logits(hidden)[0]), out.logits[0].numpy(), atol=1e-4, rtol=0)
    cache = cache.replace(lengths_b=jnp.asarray([300], jnp.int32))
    token = int(out.logits[0, -1].argmax())
    for step in range(3):
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        lengths = cache.lengths_b
        hidden, cache = forward(model, jnp.asarray([[token]], jnp.int32), lengths[:, None],
                                attention_mask(lengths, causal_block(1), size), cache)
        cache = cache.replace(lengths_b=lengths + 1)
        np.testing.assert_allclose(np.asarray(model.logits(hidden)[0, 0]), out.logits[0, -1].numpy(), atol=1e-4,
                                   rtol=0, err_msg=f"step {step}")
        token = int(out.logits[0, -1].argmax())


def test_generation_crossing_a_window_boundary_equals_transformers(tiny_model_dir):
    """Cache 384 slots = windows (192, 384): the decode loop switches window after ~180 tokens."""
    from medusa_jax.inference.api import generate

    folder, hf = tiny_model_dir("qwen2")
    prompt = np.random.RandomState(12).randint(1, 128, size=9).tolist()
    ours = generate(load_pretrained(folder), [prompt], max_new_tokens=260, eos_ids=())[0].token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                             do_sample=False, max_new_tokens=260, min_new_tokens=260, eos_token_id=None,
                             pad_token_id=0)[0, 9:].tolist()
    assert ours == theirs
