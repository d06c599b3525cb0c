"""Continuous batching (inference/refill.py): refilled slots make the tokens length-sorted batches make, and
generate_batch takes them where they measured faster."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.api import BatchSettings, generate_batch, uses_refill
from medusa_jax.inference.refill import refill_generate
from medusa_jax.inference.sharded import ShardedModel


def test_refill_generation_matches_length_sorted_batches(tiny_model_dir):
    """Continuous batching admits prompts into rows freed mid-run and still makes every prompt's greedy tokens,
    EOS included, as length-sorted batches do; bad settings are one clear error."""
    folder = tiny_model_dir("llama", seed=1)
    model = load_pretrained(folder)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 128, size=n).tolist() for n in (5, 70, 9, 2, 33, 17, 4)]
    sharded = ShardedModel(model)

    def plain(eos_ids):
        return [r.token_ids for r in generate_batch(sharded, prompts, BatchSettings(
            batch_size=1, max_new_tokens=11, eos_ids=eos_ids, pad_id=0, engine="batches"), progress=False).results]

    eos = (plain(())[0][4],)  # a token the first answer makes: it ends early there, others may run to 11
    want = plain(eos)
    assert any(t[-1] in eos and len(t) < 11 for t in want) and any(len(t) == 11 for t in want)  # both endings
    run = refill_generate(model, prompts, batch_size=3, max_new_tokens=11, eos_ids=eos, pad_id=0, chunk_steps=4)
    assert run.token_ids == want
    assert run.new_tokens == sum(map(len, want)) and run.chunks >= 3
    assert 0 < run.slot_use <= 1.0 + len(prompts) / run.slot_steps  # prefill tokens are the only excess
    for bad in (dict(batch_size=0), dict(chunk_steps=0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            refill_generate(model, prompts, **{**dict(batch_size=2, max_new_tokens=4, eos_ids=eos, pad_id=0), **bad})
    with pytest.raises(ValueError, match="prompt 1 is empty"):  # engine.check_prompts, as every path
        refill_generate(model, [[1, 2], []], batch_size=2, max_new_tokens=4, eos_ids=eos, pad_id=0)


def test_generate_batch_refills_slots_at_large_batches_with_the_same_greedy_tokens(tiny_model_dir):
    """engine="auto" refills plain decoding at batch >= 64 with as many prompts (the measured case); outputs,
    steps and finish reasons equal the sorted batches'. Smaller batches, fewer prompts, a fixed cache size and
    Medusa trees keep sorted batches; engine="refill" with a tree is refused."""
    folder = tiny_model_dir("llama", seed=1)
    model = ShardedModel(load_pretrained(folder))
    rng = np.random.RandomState(4)
    prompts = [rng.randint(3, 128, size=n).tolist() for n in rng.randint(1, 90, size=70)]
    settings = BatchSettings(batch_size=64, max_new_tokens=9, pad_id=0, engine="batches")
    eos = (generate_batch(model, prompts[:1], settings, progress=False).results[0].token_ids[3],)
    settings = dataclasses.replace(settings, eos_ids=eos)
    sorted_run = generate_batch(model, prompts, settings, progress=False)
    auto = generate_batch(model, prompts, dataclasses.replace(settings, engine="auto"), progress=False)
    assert sorted_run.engine == "batches" and auto.engine == "refill"
    assert [r.token_ids for r in auto.results] == [r.token_ids for r in sorted_run.results]
    assert [(r.index, r.steps, r.finish_reason) for r in auto.results] == \
        [(r.index, r.steps, r.finish_reason) for r in sorted_run.results]
    assert {r.finish_reason for r in auto.results} == {"eos", "length"}
    auto_settings = dataclasses.replace(settings, engine="auto")
    for other, count in ((dataclasses.replace(auto_settings, batch_size=32), 70), (auto_settings, 63),
                         (dataclasses.replace(auto_settings, cache_size=512), 70)):
        assert not uses_refill(model, other, count)
    tree = load_tree("mc_sim_7b_8")
    assert not uses_refill(model, dataclasses.replace(auto_settings, tree=tree), 70)
    with pytest.raises(ValueError, match="engine='refill' decodes plainly"):
        uses_refill(model, dataclasses.replace(settings, tree=tree, engine="refill"), 70)
