"""The generation engine with drafters that are not one state per request (inference/row_drafts.py): Token
Recycling's table (one for all rows, the engine's, warm across requests), prompt lookup's token buffer (one row per
request, set from the prompt at admission) and mixes of them with trained heads (`draft_merge.DraftSizes`: a draft
size per step); and typical acceptance as a per-row setting beside greedy and exact rows."""

from __future__ import annotations

import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.lookup import LookupConfig
from medusa_jax.heads.mixed import make_mix, template_spec
from medusa_jax.heads.recycle import RANK_ACCEPTANCE, RecycleConfig, RecycleDrafter, empty_table, template_tree
from medusa_jax.trees.tree import DynamicTree, load_tree
from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import RequestParams
from medusa_jax.inference.sampling import SamplingConfig
from decode_helpers import prompts_of, randomise_kernels

SIZES, COSTS = (0, 2, 6, 12), (1.0, 1.05, 1.1, 1.2)  # cheap larger steps: the mix drafts most steps
N = 14


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    # a narrow init (as tests/test_mixed_drafts.py): greedy continuations fall into loops that lookup and the
    # recycling table find
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.1))


def random_heads(model, head_type: str):
    heads = init_heads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3,
                                   head_type=head_type), model, seed=0)
    randomise_kernels([linear for head in heads.heads
                       for linear in [block.linear for block in head.blocks] + [getattr(head, "input_proj", None)]
                       if linear is not None], 0)
    return heads


def recycler(model) -> RecycleDrafter:
    return RecycleDrafter(RecycleConfig(model.config.hidden_size, model.config.vocab_size))


def drafter_of(model, parts: str):
    """(drafter, tree) for '+'-joined parts: 'recycle' alone decodes its static template; otherwise a mix of
    random 'medusa' or 'hydra' heads, 'recycle' (a fresh table) and 'lookup', with DraftSizes."""
    names = parts.split("+")
    if names == ["recycle"]:
        return recycler(model), template_tree("recycle_8")
    trained = next((random_heads(model, n) for n in names if n in ("medusa", "hydra")), None)
    template = (recycler(model), template_spec(template_tree("recycle_8"), RANK_ACCEPTANCE)) \
        if "recycle" in names else None
    mix = make_mix(model.config.hidden_size, model.config.vocab_size, trained=trained,
                   trained_tree=DynamicTree(6, top_k=2, depth=3) if trained is not None else None,
                   lookup=LookupConfig(length=6, branches=2) if "lookup" in names else None, template=template)
    return mix, DraftSizes(SIZES, COSTS, depth=mix.depth)


@pytest.mark.parametrize("parts", ["recycle", "lookup", "medusa+recycle+lookup", "hydra+recycle+lookup"])
def test_engine_with_shared_and_per_row_drafter_states_makes_plain_greedy_tokens(model, parts):
    """7 ragged prompts through 3 rows (fifo: rows refilled mid-run, each admitted into a running batch), an EOS that
    ends some replies early, then budgets and a stop id: every reply equals plain greedy decoding's, and drafted
    tokens were accepted."""
    drafter, tree = drafter_of(model, parts)
    prompts = prompts_of((5, 70, 9, 2, 33, 17, 4))
    eos = (generate(model, prompts[:1], max_new_tokens=N, eos_ids=())[0].token_ids[5],)
    want = [generate(model, [p], max_new_tokens=N, eos_ids=eos)[0].token_ids for p in prompts]
    assert any(t[-1] in eos and len(t) < N for t in want) and any(len(t) == N for t in want)
    engine = GenerationEngine(model, EngineConfig(rows=3, context=128, chunk_steps=3), eos_ids=eos, heads=drafter,
                              tree=tree)
    assert engine.generate_all(prompts, RequestParams(max_tokens=N)) == want
    assert engine.metrics.step_tokens > engine.metrics.row_steps  # some drafted tokens were accepted
    assert engine.metrics.finished["stop"] == sum(t[-1] in eos for t in want)
    assert engine.generate_all(prompts[:2], RequestParams(max_tokens=4)) == [w[:4] for w in want[:2]]
    full = next(i for i, t in enumerate(want) if len(t) == N)
    stop_at = want[full][N // 2]
    assert engine.generate_all([prompts[full]], RequestParams(max_tokens=N, stop_ids=(stop_at,)))[0] == \
        want[full][: want[full].index(stop_at) + 1]


@pytest.mark.parametrize("parts", ["recycle", "medusa+recycle+lookup"])
def test_the_recycling_table_is_the_engines_and_stays_warm_across_requests(model, parts):
    """One table for all rows, kept from request to request (never reset at admission): after a request it is no
    longer the fresh one, a later request's greedy tokens still equal plain decoding's, and the same prompt decoded
    again drafts from a table that saw its continuation: fewer verify steps. The drafter object's own table is
    untouched (the engine's state is its copy)."""
    drafter, tree = drafter_of(model, parts)
    fresh = empty_table(model.config.vocab_size)
    table_of = (lambda state: state) if parts == "recycle" else (lambda state: state[0])
    engine = GenerationEngine(model, EngineConfig(rows=2, context=128, chunk_steps=4), eos_ids=(), heads=drafter,
                              tree=tree)
    np.testing.assert_array_equal(table_of(engine.drafter_state()), fresh)
    prompt, other = prompts_of((9, 20), seed=5)
    want = generate(model, [prompt], max_new_tokens=2 * N, eos_ids=())[0].token_ids
    steps = []
    for _ in range(2):
        before = engine.metrics.row_steps
        assert engine.generate_all([prompt], RequestParams(max_tokens=2 * N)) == [want]
        steps.append(engine.metrics.row_steps - before)
        assert not np.array_equal(table_of(engine.drafter_state()), fresh)
    assert steps[1] < steps[0], steps
    warm = table_of(engine.drafter_state())
    assert engine.generate_all([other], RequestParams(max_tokens=N)) == \
        [generate(model, [other], max_new_tokens=N, eos_ids=())[0].token_ids]
    assert not np.array_equal(table_of(engine.drafter_state()), warm)  # updated by the next request, not reset
    member = drafter if parts == "recycle" else drafter.drafters[0]
    np.testing.assert_array_equal(member.table, fresh)


def test_a_mix_shares_its_steps_between_greedy_and_sampled_rows(model):
    """Sampled requests in a mix accept exactly, row by row, beside greedy ones: greedy rows still equal plain
    decoding, sampled rows run to their budget, and a near-zero temperature gives greedy's tokens."""
    drafter, tree = drafter_of(model, "medusa+recycle+lookup")
    prompts = prompts_of((6, 12, 3, 20, 8))
    greedy = RequestParams(max_tokens=N)
    sampled = RequestParams(max_tokens=N, sampling=SamplingConfig(0.8, 0.95, 20), seed=5)
    engine = GenerationEngine(model, EngineConfig(rows=4, context=64, chunk_steps=3), eos_ids=(), heads=drafter,
                              tree=tree)
    mixed = [engine.submit(p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)]
    while any(r.finish_reason is None for r in mixed):
        engine.run_once()
    assert [r.tokens for r in mixed[1::2]] == [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids
                                               for p in prompts[1::2]]
    assert all(len(r.tokens) == N for r in mixed[::2])
    cold = RequestParams(N, SamplingConfig(1e-4), seed=3)
    assert engine.generate_all(prompts[:3], cold) == [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids
                                                      for p in prompts[:3]]


def test_the_size_choice_counts_the_longest_rows_only_where_the_rows_end_together(model):
    """The engine tells its drafted chunks whether the busy rows end together (`_rows_end_together`): a batch
    client's chunks while prompts still wait for a row do not (finished rows are refilled: every row's tokens
    count), its last ones do, and so does every chunk of sorted admission; a server's (requests submitted one by
    one) never do. The tokens stay plain greedy's either way."""
    drafter, tree = drafter_of(model, "recycle+lookup")
    prompts = prompts_of((6, 12, 3, 20, 8))
    plain = [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids for p in prompts]
    for admission, want in (("fifo", {False, True}), ("sorted", {True})):
        engine = GenerationEngine(model, EngineConfig(rows=2, context=64, chunk_steps=3, max_queue=2,
                                                      admission=admission), eos_ids=(), heads=drafter, tree=tree)
        told, chunk = [], engine._decoder.chunk

        def spy(steps, remaining_b, together=False):
            told.append((together, engine._client_waiting, len(engine._pending)))
            return chunk(steps, remaining_b, together)

        engine._decoder.chunk = spy
        assert engine.generate_all(prompts, RequestParams(max_tokens=N)) == plain
        assert {t for t, _, _ in told} == want
        if admission == "fifo":  # together exactly when nothing waits
            assert all(t == (waiting == 0 and pending == 0) for t, waiting, pending in told)
            assert told[-1][0]
        told.clear()
        served = [engine.submit(p, RequestParams(max_tokens=N)) for p in prompts[:2]]
        while any(r.finish_reason is None for r in served):
            engine.run_once()
        assert [r.tokens for r in served] == plain[:2]
        assert {t for t, _, _ in told} == {admission == "sorted"}


NOTHING = AcceptanceConfig("typical", posterior_threshold=1.0, posterior_alpha=1e9)  # no p exceeds 1


def test_a_typical_row_that_accepts_nothing_is_the_batch_paths_and_plain_greedy(model):
    """Typical acceptance whose threshold no probability passes accepts no candidate (one token per step), and its
    typical set is the argmax alone: the row's tokens are plain greedy decoding's, and the batch path's typical
    acceptance with the same thresholds gives the same, beside greedy rows that still accept drafts."""
    heads = random_heads(model, "medusa")
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=heads.config.head_vocab_size)
    prompts = prompts_of((6, 12, 3, 20))
    plain = [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids for p in prompts]
    batch = generate_medusa(model, heads, prompts, tree=tree, max_new_tokens=N, eos_ids=(),
                            sampling=SamplingConfig(0.9), acceptance=NOTHING, seed=4)
    assert [r.token_ids for r in batch] == plain
    engine = GenerationEngine(model, EngineConfig(rows=4, context=64, chunk_steps=3), eos_ids=(), heads=heads,
                              tree=tree)
    typical = RequestParams(N, SamplingConfig(0.9), seed=4, acceptance=NOTHING)
    assert engine.generate_all(prompts, typical) == plain
    assert engine.metrics.step_tokens == engine.metrics.row_steps  # one token per step
    rows = [engine.submit(p, typical if i % 2 else RequestParams(N)) for i, p in enumerate(prompts)]
    while any(r.finish_reason is None for r in rows):
        engine.run_once()
    assert [r.tokens for r in rows] == plain
    assert engine.metrics.step_tokens > engine.metrics.row_steps  # the greedy rows accepted drafts


def test_typical_rows_are_seeded_and_leave_their_neighbours_alone(model):
    """Typical rows (the official thresholds) beside greedy and exact rows in one step: the greedy rows equal plain
    decoding; a typical request's tokens depend on its seed only (the same alone), another seed draws another
    reply; the engine's own acceptance makes sampled requests typical; an acceptance the sampling cannot use is
    refused before it queues."""
    heads = random_heads(model, "medusa")
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=heads.config.head_vocab_size)
    prompts = prompts_of((6, 12, 3, 20, 9, 4))
    typical = RequestParams(N, SamplingConfig(0.7), seed=2, acceptance=AcceptanceConfig("typical"))
    exact = RequestParams(N, SamplingConfig(0.7), seed=2)
    kinds = [typical, RequestParams(N), exact] * 2
    engine = GenerationEngine(model, EngineConfig(rows=4, context=64, chunk_steps=3), eos_ids=(), heads=heads,
                              tree=tree)
    mixed = [engine.submit(p, kind) for p, kind in zip(prompts, kinds)]
    while any(r.finish_reason is None for r in mixed):
        engine.run_once()
    assert [r.tokens for r in mixed[1::3]] == [generate(model, [p], max_new_tokens=N, eos_ids=())[0].token_ids
                                               for p in prompts[1::3]]
    alone = [engine.generate_all([p], typical)[0] for p in prompts[::3]]
    assert [r.tokens for r in mixed[::3]] == alone and all(len(t) == N for t in alone)
    assert engine.generate_all(prompts[:1], RequestParams(N, typical.sampling, 9, acceptance=typical.acceptance)) \
        != alone[:1]
    assert [r.tokens for r in mixed[2::3]] != alone  # exact rows draw otherwise than typical ones
    by_default = GenerationEngine(model, EngineConfig(rows=4, context=64, chunk_steps=3,
                                                      acceptance=AcceptanceConfig("typical")),
                                  eos_ids=(), heads=heads, tree=tree)
    assert by_default.generate_all(prompts[::3], exact) == alone
    assert by_default.generate_all(prompts[1:2], RequestParams(N))[0] == mixed[1].tokens
    for bad, match in ((RequestParams(N, acceptance=AcceptanceConfig("typical")), "give a temperature"),
                       (RequestParams(N, SamplingConfig(0.7, top_p=0.9)), "top-p and top-k do not apply")):
        with pytest.raises(ValueError, match=match):
            by_default.submit(prompts[0], bad)


def test_a_new_engine_of_the_same_model_does_not_trace_the_prefill_again(model, monkeypatch):
    """`row_drafts.empty_draft` takes the drafter state's shapes from jit's trace cache: the engines that every
    `generate_batch` call makes for the same model and shapes trace the base's prefill once (it cost 0.4-0.8 s of
    host time per call on SmolLM2), and the states are equal."""
    import jax
    from medusa_jax.heads.medusa import MedusaModel
    from medusa_jax.inference import row_drafts

    traced, prefill = [], row_drafts.prompt_prefill
    monkeypatch.setattr(row_drafts, "prompt_prefill", lambda *a, **k: traced.append(1) or prefill(*a, **k))
    mix, _ = drafter_of(model, "hydra+recycle+lookup")
    first = row_drafts.empty_draft(MedusaModel(model, mix), 3, 40, mix.depth)
    again = row_drafts.empty_draft(MedusaModel(model, mix), 3, 40, mix.depth)
    assert len(traced) == 1
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), first, again))
    row_drafts.empty_draft(MedusaModel(model, mix), 4, 40, mix.depth)  # other shapes: traced for them
    assert len(traced) == 2
