"""Attention windows (`KVCache.window`): a forward that attends over the first slots of a larger cache, and the
generation engine's chunks that choose the smallest window their rows can reach (`row_decode.SlotReach`)."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.kv_cache import KVCache, attention_mask, attention_window, attention_windows, causal_block
from medusa_jax.inference.api import generate
from medusa_jax.inference.autoregressive import prefill
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import RequestParams
from medusa_jax.inference.row_decode import SlotReach
from decode_helpers import prompts_of
from medusa_jax.trees.tree import load_tree
from test_engine_drafts import drafter_of
from test_generation_engine import random_drafter

N = 40


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.1))


def test_the_windows_double_from_the_smallest_up_to_the_cache():
    """Windows of 256, 1024, 4096, ... slots, each at most a quarter of the cache (its slots are copied before the
    dots), then the whole cache."""
    assert attention_windows(16384) == (256, 1024, 4096, 16384)
    assert attention_windows(4096) == (256, 1024, 4096) and attention_windows(4095) == (256, 4095)
    assert attention_windows(1024) == (256, 1024) and attention_windows(1023) == (1023,)
    assert attention_windows(256) == (256,) and attention_windows(100) == (100,)
    assert attention_window(1, 4096) == 256 and attention_window(256, 4096) == 256
    assert attention_window(257, 4096) == 1024 and attention_window(1024, 4096) == 1024
    assert attention_window(1025, 4096) is None and attention_window(9000, 4096) is None  # the whole cache
    assert attention_window(10, 100) is None


def test_a_chunks_window_holds_what_its_rows_with_tokens_left_can_reach():
    reach = SlotReach(rows=3, cache_size=4096, scratch=7, per_step=4)
    reach.admitted(np.array([0, 1, 5]), np.array([200, 900, 50]))  # row 5: a filler, dropped
    assert reach.length_b.tolist() == [200, 900, 0]
    # row 1 is done (no tokens left): only row 0 counts; 8 steps of 4 slots, then its scratch and a step's margin
    assert reach.window(8, np.array([100, 0, 0])) == 256  # 200 + 32 + 7 + 4 = 243
    assert reach.window(8, np.array([100, 0, 3])) == 256
    assert reach.window(16, np.array([100, 0, 0])) == 1024  # 200 + 64 + 11 = 275
    assert reach.window(16, np.array([20, 0, 0])) == 256  # the row's budget caps its growth: 200 + 20 + 11
    assert reach.window(1, np.array([1, 1, 0])) == 1024  # 912 slots
    reach.admitted(np.array([2]), np.array([1100]))
    assert reach.window(1, np.array([0, 0, 1])) is None  # past the largest window (1024): the whole cache
    assert reach.window(1, np.array([0, 0, 0])) == 256
    reach.emitted(np.array([60, 0, 0]))
    assert reach.window(1, np.array([1, 0, 0])) == 1024  # 260 + 1 + 11
    assert reach.window(1, np.zeros(3, int)) == 256  # nothing to decode
    assert SlotReach(3, 4096, 7, 4, enabled=False).window(1, np.array([1, 0, 0])) is None


@pytest.mark.parametrize("kind", ["llama", "mistral", "llama-stacked"])
def test_a_forward_over_a_window_equals_the_forward_over_the_whole_cache(tiny_model_dir, kind):
    """A tree block of 5 tokens after prompts of 90 and 200 tokens in a cache of 500 slots: with a window of 256
    the logits and every K/V buffer equal those of the forward over all 500 slots (Mistral: its sliding window
    too; stacked layers: the scanned forward), and the slots past the window are still written."""
    execution = LayerExecution(scan=True) if kind.endswith("stacked") else LayerExecution()
    base = load_pretrained(tiny_model_dir(kind.split("-")[0], initializer_range=0.1), layers=execution)
    prompts = prompts_of((90, 200), seed=4)
    prompt_bt = jnp.asarray([p + [0] * (200 - len(p)) for p in prompts], jnp.int32)
    lens_b = jnp.asarray([len(p) for p in prompts], jnp.int32)
    _, cache = prefill(base, prompt_bt, lens_b, KVCache.zeros(base.config, 2, 500))
    block = np.tril(np.ones((5, 5), bool))
    block[3, :3] = [True, False, False]  # a tree: node 3 under the root only
    tokens_bt = jnp.asarray(prompts_of((5, 5), seed=5), jnp.int32)
    positions_bt = lens_b[:, None] + jnp.asarray([0, 1, 2, 1, 2])[None, :]
    mask_bts = attention_mask(lens_b, jnp.asarray(block), cache.cache_size)

    @jax.jit
    def forward(cache):
        hidden, cache = base(tokens_bt, positions_bt, mask_bts, cache)
        return base.logits(hidden), cache

    full_logits, full = forward(cache)
    window_logits, windowed = forward(cache.replace(window=256))
    assert windowed.window == 256 and windowed.cache_size == 500
    np.testing.assert_allclose(window_logits, full_logits, rtol=1e-5, atol=1e-5 * float(jnp.abs(full_logits).max()))
    for a, b in zip(jax.tree.leaves((full.k_bkhs, full.v_bksh)), jax.tree.leaves((windowed.k_bkhs, windowed.v_bksh))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))
    # a block written past the window lands in the buffers all the same
    far = jnp.asarray([300, 300], jnp.int32)
    _, written = base(tokens_bt, far[:, None] + jnp.arange(5)[None, :], attention_mask(far, causal_block(5), 500),
                      cache.replace(lengths_b=far, window=256))
    assert float(jnp.abs(written.k_bkhs[0][..., 300:305]).sum()) > 0


def windows_seen(engine, monkeypatch) -> list:
    seen = []
    reach = engine._decoder.reach
    original = reach.window

    def record(steps, remaining_b):
        seen.append(original(steps, remaining_b))
        return seen[-1]

    monkeypatch.setattr(reach, "window", record)
    return seen


def drafted_of(model, parts: str) -> dict:
    """The engine's drafter arguments: none (plain rows), an EAGLE drafter (its own cache per row) and its tree,
    or a mix of drafters (`test_engine_drafts.drafter_of`)."""
    if parts == "plain":
        return {}
    if parts == "eagle":
        return {"heads": random_drafter(model, "eagle"), "tree": load_tree("mc_sim_7b_8", num_heads=3)}
    return dict(zip(("heads", "tree"), drafter_of(model, parts)))


@pytest.mark.parametrize("parts", ["plain", "medusa+recycle+lookup", "eagle"])
def test_the_engine_decodes_plain_greedy_tokens_across_its_windows(model, parts, monkeypatch):
    """Ragged prompts of 3 to 230 tokens through 3 rows of a 1024-token context (rows refilled mid-run): replies that
    cross from the 256-slot window to the whole cache mid-request equal plain greedy decoding's, for plain rows, a
    mix of drafters and an EAGLE drafter; the chunks chose both; `warm_up` had compiled the chunk of each."""
    prompts = prompts_of((3, 120, 17, 230, 200, 225), seed=6)  # short ones first: a stretch in the smallest window
    want = [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids for p in prompts]
    drafted = drafted_of(model, parts)
    engine = GenerationEngine(model, EngineConfig(rows=3, context=1024, chunk_steps=4), eos_ids=(), **drafted)
    seen = windows_seen(engine, monkeypatch)
    engine.warm_up()
    with CompileCounter() as compiles:
        assert engine.generate_all(prompts, RequestParams(max_tokens=N)) == want
    assert compiles.requests == 0
    assert 256 in seen and None in seen, seen  # the smallest window, and the whole cache
    if drafted:
        assert engine.metrics.step_tokens > engine.metrics.row_steps  # drafted tokens were accepted
    off = GenerationEngine(model, EngineConfig(rows=3, context=1024, chunk_steps=4, attention_windows=False),
                           eos_ids=(), **drafted)
    seen_off = windows_seen(off, monkeypatch)
    assert off.generate_all(prompts, RequestParams(max_tokens=N)) == want
    assert set(seen_off) == {None}
