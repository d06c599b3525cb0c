"""`api.generate_batch`'s sorted batches through the generation engine (inference/engine_batches.py) against one
direct decode call per prompt (`ShardedModel.medusa_decode`: prefill and one jitted `while_loop`), for mixed
drafts (the engine's rows carry the size choice and its backoff, `size_choice.SizeChoiceState`, one per engine)
and Token Recycling's table kept warm in the model from call to call (the engine starts from the model's table
and hands it back). A call of one prompt is one chunk of a fresh engine (a fresh size choice, as a direct call's),
so the engine takes the direct call's steps: the same tokens AND the same accept length at every step. (Within
one call the engine's size choice carries on from batch to batch.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.lookup import LookupConfig
from medusa_jax.heads.mixed import make_mix, template_spec
from medusa_jax.heads.recycle import RANK_ACCEPTANCE, RecycleConfig, RecycleDrafter, template_tree
from medusa_jax.trees.dynamic_tree import scratch_slots
from medusa_jax.inference.api import generate, generate_batch
from medusa_jax.inference.batch_run import BatchSettings
from medusa_jax.inference.engine import PROMPT_BUCKET, cache_size_for, pad_prompts
from medusa_jax.inference.sharded import ShardedModel
from decode_helpers import prompts_of

N = 24
SIZES = (0, 2, 6, 12)
CHEAP, DEAR = (1.0, 1.05, 1.1, 1.2), (1.0, 1.9, 2.4, 3.0)  # dear: most drafted steps do not pay (the backoff)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    # a narrow init (as tests/test_mixed_drafts.py): greedy continuations fall into loops that lookup and the
    # recycling table find
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.1))


def mix_of(base, recycle: bool):
    config = base.config
    template = (RecycleDrafter(RecycleConfig(config.hidden_size, config.vocab_size)),
                template_spec(template_tree("recycle_8"), RANK_ACCEPTANCE)) if recycle else None
    return make_mix(config.hidden_size, config.vocab_size, lookup=LookupConfig(length=6, branches=2),
                    template=template)


def both_paths(sharded_engine: ShardedModel, sharded_direct: ShardedModel, prompt, settings: BatchSettings):
    """(the engine's result, the direct call's (tokens, accept lengths, steps)) for one prompt."""
    (by_engine,) = generate_batch(sharded_engine, [prompt], settings, progress=False).results
    batch = pad_prompts([prompt], settings.pad_id, 1, settings.bucket)
    cache = cache_size_for(batch.tokens_bt.shape[1], N, scratch_slots(settings.tree), settings.bucket)
    tokens_bo, num_b, steps_b, accept_bo = sharded_direct.medusa_decode(
        batch.tokens_bt, batch.lengths_b, tree=settings.tree, cache_size=cache, max_new_tokens=N,
        acceptance=settings.decode, eos_ids=(), pad_id=settings.pad_id)
    return by_engine, (tokens_bo[0, : num_b[0]].tolist(), accept_bo[0, : steps_b[0]].tolist(), 1 + int(steps_b[0]))


@pytest.mark.parametrize("costs", [CHEAP, DEAR], ids=["cheap", "dear"])
def test_a_mix_through_the_engine_takes_the_direct_calls_steps(model, costs):
    """Lookup + recycling at cheap and at dear step costs, one call per prompt on one model per path (the
    recycling table warm from call to call): tokens equal plain greedy's on both paths, and every accept length is
    the direct call's (so the engine's size choice and backoff, and its table, are the decode loop's); the dear
    costs change the steps (the backoff skips drafting)."""
    prompts = prompts_of((7, 30, 12), seed=3)
    want = [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids for p in prompts]
    accepts = {}
    for name, c in (("cheap", CHEAP), ("given", costs)):
        mix = mix_of(model, recycle=True)
        settings = BatchSettings(batch_size=1, max_new_tokens=N, tree=DraftSizes(SIZES, c, depth=mix.depth),
                                 eos_ids=(), bucket=PROMPT_BUCKET)
        models = ShardedModel(model, mix, MeshConfig()), ShardedModel(model, mix_of(model, True), MeshConfig())
        accepts[name] = []
        for prompt, tokens in zip(prompts, want):
            by_engine, (direct_ids, direct_accepts, direct_steps) = both_paths(*models, prompt, settings)
            assert by_engine.token_ids == direct_ids == tokens
            assert by_engine.accept_lengths == direct_accepts
            assert by_engine.steps == direct_steps
            accepts[name].append(by_engine.accept_lengths)
    if costs == DEAR:
        assert accepts["given"] != accepts["cheap"]
    assert any(max(a) >= 2 for a in accepts["cheap"])  # lookup and recycling find the loops


def test_a_mix_at_batch_3_equals_plain_greedy_through_the_engine(model):
    """Ragged prompts in batches of 3 rows (two batches, the second admitted after the first's rows are free, one
    size choice for the engine): plain greedy's tokens."""
    prompts = prompts_of((7, 30, 12, 3, 40), seed=4)
    mix = mix_of(model, recycle=False)
    settings = BatchSettings(batch_size=3, max_new_tokens=N, tree=DraftSizes(SIZES, DEAR, depth=mix.depth),
                             eos_ids=(), bucket=PROMPT_BUCKET)
    run = generate_batch(ShardedModel(model, mix, MeshConfig()), prompts, settings, progress=False)
    assert [r.token_ids for r in run.results] == [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids
                                                  for p in prompts]
    assert run.num_batches == 2


def test_recycling_stays_warm_from_call_to_call_as_on_the_direct_path(model):
    """Token Recycling alone, three calls on one ShardedModel per path: the engine starts from the model's table
    and hands its table back, so each call's steps are the direct call's, the model's table after each call is
    the direct calls', and a repeated prompt takes fewer steps the second time."""
    config = model.config
    sharded = [ShardedModel(model, RecycleDrafter(RecycleConfig(config.hidden_size, config.vocab_size)),
                            MeshConfig()) for _ in range(2)]
    settings = BatchSettings(batch_size=1, max_new_tokens=N, tree=template_tree("recycle_8"), eos_ids=(),
                             bucket=PROMPT_BUCKET)
    prompt, other = prompts_of((9, 20), seed=5)
    steps = []
    for one in (prompt, other, prompt):
        by_engine, (direct_ids, direct_accepts, _) = both_paths(*sharded, one, settings)
        assert by_engine.token_ids == direct_ids
        assert by_engine.accept_lengths == direct_accepts
        np.testing.assert_array_equal(sharded[0].heads.table, sharded[1].heads.table)
        steps.append(by_engine.steps)
    assert steps[2] < steps[0], steps


def test_a_call_of_the_same_shapes_restarts_the_last_calls_engine(model):
    """`engine_batches.LastEngine`: a call whose engine would be built alike runs on the last call's engine, restarted
    (a fresh size choice, the model's table, the call's proposer data), so each call still takes the direct call's
    steps; a call of fewer tokens runs on it too (one chunk still holds it), a call of more builds its own; a
    restored table is the one the restarted engine drafts from; a call that fails leaves no engine behind."""
    prompt, other = prompts_of((9, 11), seed=6)  # one padded width: one cache size
    mix = mix_of(model, recycle=True)
    settings = BatchSettings(batch_size=1, max_new_tokens=N, tree=DraftSizes(SIZES, DEAR, depth=mix.depth),
                             eos_ids=(), bucket=PROMPT_BUCKET)
    sharded = ShardedModel(model, mix, MeshConfig()), ShardedModel(model, mix_of(model, True), MeshConfig())
    snapshot = sharded[0].draft_snapshot()
    engines, accepts = [], []
    for one in (prompt, other, prompt):
        by_engine, (direct_ids, direct_accepts, _) = both_paths(*sharded, one, settings)
        assert by_engine.token_ids == direct_ids and by_engine.accept_lengths == direct_accepts
        engines.append(sharded[0].last_engine.engine)
        accepts.append(by_engine.accept_lengths)
    assert engines[0] is engines[1] is engines[2]
    assert accepts[2] != accepts[0]  # the warm table drafts otherwise
    sharded[0].restore_draft(snapshot)
    (again,) = generate_batch(sharded[0], [prompt], settings, progress=False).results
    assert sharded[0].last_engine.engine is engines[0] and again.accept_lengths == accepts[0]
    for tokens in (1, N // 2, 2 * N):  # fewer tokens (one cache size): the same engine; more: longer chunks
        (reply,) = generate_batch(sharded[0], [prompt], dataclasses.replace(settings, max_new_tokens=tokens),
                                  progress=False).results
        assert reply.token_ids[:N] == again.token_ids[:tokens]
        assert (sharded[0].last_engine.engine is engines[0]) == (tokens < N)

    def fail(results):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_batch(sharded[0], [prompt], settings, progress=False, on_batch=fail)
    assert sharded[0].last_engine is None
    (after,) = generate_batch(sharded[0], [other], settings, progress=False).results
    assert after.token_ids == generate(model, [other], max_new_tokens=N, eos_ids=())[0].token_ids
