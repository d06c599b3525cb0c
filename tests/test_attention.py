"""Cache attention (medusa_jax/model/attention.py) against a NumPy reference, and long caches against transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from medusa_jax.model.attention import grouped_attention
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block, move_slots, write_layer
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate


def _reference(q_btkgh, k_bskh, v_bskh, mask_bts):
    """Plain per-head attention in float64: every query head n = (k, g) reads KV head k."""
    b, t, kv, g, h = q_btkgh.shape
    out = np.zeros(q_btkgh.shape)
    for row in range(b):
        for head in range(kv):
            for group in range(g):
                scores_ts = q_btkgh[row, :, head, group] @ k_bskh[row, :, head].T / np.sqrt(h)
                scores_ts = np.where(mask_bts[row], scores_ts, -np.inf)
                probs = np.exp(scores_ts - scores_ts.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                out[row, :, head, group] = probs @ v_bskh[row, :, head]
    return out


@pytest.mark.parametrize("tokens", [1, 5])
def test_grouped_attention_matches_numpy(tokens):
    b, s, kv, g, h = 3, 40, 2, 3, 8
    rs = np.random.RandomState(tokens)
    q = rs.randn(b, tokens, kv, g, h)
    k_bskh, v_bskh = rs.randn(b, s, kv, h), rs.randn(b, s, kv, h)
    mask = rs.rand(b, tokens, s) < 0.6
    mask[:, :, 0] = True  # every query sees at least one slot
    mask[1, :, 20:] = False  # a short row: its tail slots are never read into the result
    k_bkhs = jnp.asarray(k_bskh.transpose(0, 2, 3, 1), jnp.float32)
    v_bksh = jnp.asarray(v_bskh.transpose(0, 2, 1, 3), jnp.float32)
    ours = jax.jit(grouped_attention)(jnp.asarray(q, jnp.float32), k_bkhs, v_bksh, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(ours), _reference(q, k_bskh, v_bskh, mask), atol=2e-5, rtol=2e-5)
    garbage = v_bksh.at[1, :, 20:].set(1e6)  # masked slots contribute exactly nothing
    again = grouped_attention(jnp.asarray(q, jnp.float32), k_bkhs, garbage, jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(ours[1]))


def test_write_and_move_slots_touch_only_their_slots():
    b, kv, h, s = 2, 2, 3, 10
    rs = np.random.RandomState(0)
    k0 = jnp.asarray(rs.randn(b, kv, h, s), jnp.float32)
    v0 = jnp.asarray(rs.randn(b, kv, s, h), jnp.float32)
    new_k, new_v = jnp.asarray(rs.randn(b, 2, kv, h), jnp.float32), jnp.asarray(rs.randn(b, 2, kv, h), jnp.float32)
    k1, v1 = write_layer(k0, v0, new_k, new_v, jnp.asarray([3, 9]))  # row 1's second token falls off the end
    expect_k, expect_v = np.asarray(k0).copy(), np.asarray(v0).copy()
    for row, start in ((0, 3), (1, 9)):
        for i in range(2):
            if start + i < s:
                expect_k[row, :, :, start + i] = new_k[row, i]
                expect_v[row, :, start + i] = new_v[row, i]
    np.testing.assert_array_equal(np.asarray(k1), expect_k)
    np.testing.assert_array_equal(np.asarray(v1), expect_v)
    cache = KVCache((k1, k1 + 1), (v1, v1 - 1), jnp.asarray([3, 5], jnp.int32))
    moved = move_slots(cache, jnp.asarray([[5, 7], [1, 2]]), jnp.asarray([[3, 4], [2, 3]]))
    for layer, shift in ((0, 0.0), (1, 1.0)):
        ek, ev = expect_k.copy() + shift, expect_v.copy() - shift
        ek[0, :, :, [3, 4]] = ek[0, :, :, [5, 7]]
        ek[1, :, :, [2, 3]] = ek[1, :, :, [1, 2]]  # reads happen before writes: slot 3 gets slot 2's old entry
        ev[0, :, [3, 4]] = ev[0, :, [5, 7]]
        ev[1, :, [2, 3]] = ev[1, :, [1, 2]]
        np.testing.assert_array_equal(np.asarray(moved.k_bkhs[layer]), ek)
        np.testing.assert_array_equal(np.asarray(moved.v_bksh[layer]), ev)
    assert moved.lengths_b.tolist() == [3, 5]


def test_cache_of_another_model_is_refused(tiny_model_dir):
    folder = tiny_model_dir("llama")
    model = load_pretrained(folder)
    cache = KVCache.zeros(model.config, 1, 8)
    short = cache.replace(k_bkhs=cache.k_bkhs[:-1], v_bksh=cache.v_bksh[:-1])
    with pytest.raises(ValueError, match="layers"):
        model(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 8), bool), short)


def test_long_cache_decode_matches_transformers(tiny_hf_model):
    """A 1024-slot cache, mostly empty: a 300-token prompt, then three decode steps."""
    folder, hf = tiny_hf_model("llama")
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
                                   rtol=1e-4, err_msg=f"step {step}")
        token = int(out.logits[0, -1].argmax())


def test_long_generation_equals_transformers(tiny_hf_model):
    """260 greedy tokens from a 9-token prompt, the whole loop on device, match transformers token for token."""
    folder, hf = tiny_hf_model("qwen2")
    prompt = np.random.RandomState(12).randint(1, 128, size=9).tolist()
    ours = generate(load_pretrained(folder), [prompt], max_new_tokens=260, eos_ids=())[0].token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                             do_sample=False, max_new_tokens=260, min_new_tokens=260, eos_token_id=None,
                             pad_token_id=0)[0, 9:].tolist()
    assert ours == theirs


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cache_free_forward_equals_the_cached_forward(tiny_model_dir, kind):
    """`model(tokens, positions, mask_btt)` without a cache (training's forward) gives the hidden states of the
    cached forward from an empty cache; packed conversations each get what they get alone (Mistral's 16-token
    window, shorter than the rows, applies by each conversation's own positions)."""
    folder = tiny_model_dir(kind)
    model = load_pretrained(folder)
    b, t = 2, 40
    tokens_bt = jnp.asarray(np.random.RandomState(0).randint(0, 128, (b, t)), jnp.int32)
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = KVCache.zeros(model.config, b, t)
    cached_btd, _ = model(tokens_bt, positions_bt, attention_mask(cache.lengths_b, causal_block(t), t), cache)
    free_btd, no_cache = model(tokens_bt, positions_bt, jnp.broadcast_to(jnp.asarray(causal_block(t)), (b, t, t)))
    assert no_cache is None
    np.testing.assert_allclose(np.asarray(free_btd), np.asarray(cached_btd), atol=1e-5, rtol=1e-5)

    split = 17  # row 0 packs tokens [0, 17) and [17, 40) as two conversations
    segments_t = np.where(np.arange(t) < split, 1, 2)
    packed_positions = jnp.asarray(np.where(np.arange(t) < split, np.arange(t), np.arange(t) - split)[None])
    same_tt = (segments_t[:, None] == segments_t[None, :]) & causal_block(t)
    packed_1td, _ = model(tokens_bt[:1], packed_positions, jnp.asarray(same_tt)[None])
    for lo, hi in ((0, split), (split, t)):
        alone_1td, _ = model(tokens_bt[:1, lo:hi], positions_bt[:1, : hi - lo],
                             jnp.asarray(causal_block(hi - lo))[None])
        np.testing.assert_allclose(np.asarray(packed_1td[:, lo:hi]), np.asarray(alone_1td), atol=1e-5, rtol=1e-5)
