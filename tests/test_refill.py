"""Continuous batching (`generate_batch` on refilled slots, a client of the generation engine): refilled slots
make the tokens length-sorted batches make, and generate_batch takes them where they measured faster."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.api import BatchSettings, generate_batch, uses_refill
from medusa_jax.inference.generation_engine import EngineConfig
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.sharded import ShardedModel


def test_refill_generation_matches_length_sorted_batches(tiny_model_dir):
    """Continuous batching (the generation engine's fifo admission) admits prompts into rows freed mid-run and
    still makes every prompt's greedy tokens, EOS included, as length-sorted batches do; a sampled prompt's
    tokens depend on its seed only, not on the rows beside it; bad prompts are one clear error."""
    folder = tiny_model_dir("llama", seed=1)
    model = load_pretrained(folder)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 128, size=n).tolist() for n in (5, 70, 9, 2, 33, 17, 4)]
    sharded = ShardedModel(model)

    def run(eos_ids, **settings):
        return generate_batch(sharded, prompts, BatchSettings(**{**dict(
            batch_size=1, max_new_tokens=11, eos_ids=eos_ids, pad_id=0, engine="batches"), **settings}),
            progress=False)

    eos = (run(()).results[0].token_ids[4],)  # a token the first answer makes: it ends there, others may run to 11
    want = [r.token_ids for r in run(eos).results]
    assert any(t[-1] in eos and len(t) < 11 for t in want) and any(len(t) == 11 for t in want)  # both endings
    refilled = run(eos, batch_size=3, engine="refill")
    assert refilled.engine == "refill" and [r.token_ids for r in refilled.results] == want
    assert refilled.new_tokens == sum(map(len, want)) and refilled.num_batches >= 3  # 7 prompts in 3 rows
    assert [r.finish_reason for r in refilled.results] == ["eos" if t[-1] in eos else "length" for t in want]
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    sampled = [[r.token_ids for r in run(eos, batch_size=b, engine="refill", sampling=sampling, seed=5).results]
               for b in (2, 4)]
    assert sampled[0] == sampled[1] and sampled[0] != want
    with pytest.raises(ValueError, match="prompt 1 is empty"):  # engine.check_prompts, as every path
        generate_batch(sharded, [[1, 2], []], BatchSettings(batch_size=2, engine="refill"), progress=False)


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


def test_sorted_batches_run_through_the_engines_sorted_admission(tiny_model_dir):
    """engine="batches" is the generation engine's sorted admission: batches of batch_size prompts, longest
    first, each admitted when every row is free, with `generate`'s greedy tokens and per-batch stats; a
    sorted_batch larger than the rows, or without sorted admission, is refused."""
    folder = tiny_model_dir("llama", seed=1)
    model = load_pretrained(folder)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 128, size=n).tolist() for n in (9, 70, 3, 40, 21)]
    run = generate_batch(ShardedModel(model), prompts, BatchSettings(batch_size=2, max_new_tokens=6, pad_id=0,
                                                                     engine="batches"), progress=False)
    want = [r.token_ids for r in generate_batch(ShardedModel(model), prompts, BatchSettings(
        batch_size=1, max_new_tokens=6, pad_id=0, engine="batches"), progress=False).results]
    assert run.engine == "batches" and run.num_batches == 3
    assert [r.token_ids for r in run.results] == want
    assert [r.batch for r in run.results] == [1, 0, 2, 0, 1]  # by length: 70, 40 | 21, 9 | 3
    assert all(r.steps == len(r.token_ids) and r.batch_seconds > 0 for r in run.results)
    for bad in (dict(rows=2, sorted_batch=3, admission="sorted"), dict(rows=2, sorted_batch=1)):
        with pytest.raises(ValueError, match="sorted_batch"):
            EngineConfig(**bad)
