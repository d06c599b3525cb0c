"""Prompt lookup and mixed drafts (medusa_jax/heads/lookup.py, draft_merge.py, mixed.py): the on-device match
equals a brute-force search, the merged tree is deduplicated and ancestor-closed with parents first, the size
choice follows predicted tokens per unit of time, and whole decodes are greedy token-identical to plain greedy
(lookup alone and mixed with Medusa or Hydra heads; batch 1 and a ragged batch with a mid-run EOS; tiny
Llama/Qwen2/Mistral; prompts that repeat, so that lookup hits and long chains are accepted). Exact sampling's law
with lookup in the tree: tests/test_exact_sampling.py's check, here; meshes: tests/test_sharded_decode.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.model.kv_cache import KVCache
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.folder import save_heads
from medusa_jax.heads.draft_merge import DraftSizes, SpanCosts, expected_accepts, keep_best, merge_proposals
from medusa_jax.trees.dynamic_tree import TreeProposal
from medusa_jax.heads.lookup import LookupConfig, init_lookup, lookup_matches, lookup_proposal
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.heads.mixed import make_mix, template_spec
from medusa_jax.heads.recycle import RANK_ACCEPTANCE, RecycleConfig, RecycleDrafter, template_tree
from medusa_jax.trees.tree import DynamicTree
from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.medusa import medusa_decode
from medusa_jax.inference.mixed_decoding import MixError, build_mix, is_mix, parse_mix, sizes_for
from medusa_jax.inference import draft_size
from medusa_jax.trees.policy import step_cost
from medusa_jax.inference.draft_size_cache import size_costs
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.size_choice import (DECAY, MAX_SKIP, RATIO_PRIOR, SizeChoiceState, accepted_per_size, choose,
                                             lookup_pays, predicted_accepts)

import test_exact_sampling as exact_sampling
from test_exact_sampling import setup  # noqa: F401 (the fixture of the law check's model)
from test_medusa import pick_eos, random_heads

N = 40
REPEATING = [5, 9, 2, 17, 33, 4, 8, 5, 9, 2, 17, 33, 4, 8, 5, 9, 2]
PROMPTS = {
    "batch1": [REPEATING],
    "ragged4": [REPEATING[:11], [11, 3, 8, 21, 7, 2], [6, 1, 6, 1, 6, 1, 6] + REPEATING, [50, 22, 16, 90, 4, 3]],
}
SIZES = (0, 2, 8)
COSTS = (1.0, 1.1, 1.3)  # cheap drafts: the chosen size varies between steps


def brute_matches(tokens, config: LookupConfig):
    """Every known position c whose n tokens before it equal the last n (n_min..n_max, its longest n; the end
    itself excluded): [(c, n)] by n, then c, descending; at most `branches`."""
    found = []
    for c in range(len(tokens) - 1, 0, -1):
        ns = [n for n in range(config.n_min, config.n_max + 1) if n <= c and tokens[c - n: c] == tokens[-n:]]
        if ns:
            found.append((c, max(ns)))
    return sorted(found, key=lambda x: (x[1], x[0]), reverse=True)[: config.branches]


def test_lookup_matches_equal_a_brute_force_search():
    config = LookupConfig(n_max=3, n_min=1, length=4, branches=3)
    rng = np.random.default_rng(0)
    s = 40
    rows = [rng.integers(0, 4, n).tolist() for n in (1, 2, 5, 17, 30, 39)]
    tokens_bs = np.zeros((len(rows), s), np.int32)
    for b, r in enumerate(rows):
        tokens_bs[b, : len(r)] = r
    next_bw, n_bw = lookup_matches(config, jnp.asarray(tokens_bs), jnp.asarray([len(r) for r in rows]))
    for b, r in enumerate(rows):
        want = brute_matches(r, config)
        got = [(int(j), int(n)) for j, n in zip(next_bw[b], n_bw[b]) if n > 0]
        assert got == want, (b, r)


def test_lookup_proposal_drafts_what_followed_the_latest_longest_match():
    config = LookupConfig(n_max=3, n_min=1, length=6, branches=2)
    prompt = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2]  # root 3: "1 2 3" matched twice, the later is followed by 4 5 1 2 3
    state = init_lookup(jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]), 32)
    p = lookup_proposal(config, state, jnp.asarray([3]))
    tokens, score = np.asarray(p.tokens_bt[0]), np.asarray(p.score_bt[0])
    assert tokens[1:6].tolist() == [4, 5, 1, 2, 3] and np.isfinite(score[1:6]).all()
    assert score[6] == -np.inf  # the chain stops where the known tokens end (the root is the last)
    assert tokens[7:13].tolist() == [9, 1, 2, 3, 4, 5] and np.isfinite(score[7:13]).all()  # the earlier match
    assert (np.diff(score[1:6]) < 0).all() and score[7] < score[1]
    assert np.asarray(p.parent_bt[0]).tolist() == [0, 0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11]
    none = lookup_proposal(config, init_lookup(jnp.asarray([[1, 2, 3]]), jnp.asarray([3]), 8), jnp.asarray([4]))
    assert (np.asarray(none.score_bt[0, 1:]) == -np.inf).all()  # no match: no candidate


def paths_of(p: TreeProposal, b: int, finite_only: bool = True) -> dict:
    """{path (tokens from depth 1): score} of row b's nodes."""
    tokens, parents, scores = (np.asarray(x[b]).tolist() for x in (p.tokens_bt, p.parent_bt, p.score_bt))
    out = {}
    for t in range(1, len(tokens)):
        if finite_only and not np.isfinite(scores[t]):
            continue
        path, u = [], t
        while u != 0:
            path.append(tokens[u])
            u = parents[u]
        out.setdefault(tuple(reversed(path)), []).append(scores[t])
    return out


def chain(tokens, logp, root=0):
    t = len(tokens)
    return TreeProposal(jnp.asarray([[root] + tokens], jnp.int32), jnp.asarray([[0] + list(range(t))], jnp.int32),
                        jnp.asarray([list(range(t + 1))], jnp.int32),
                        jnp.asarray([[0.0] + [logp * (i + 1) for i in range(t)]], jnp.float32))


def test_merge_dedups_shared_prefixes_and_keeps_ancestor_closed_best_nodes():
    a = chain([4, 5, 6, 7], -0.5)  # 4 5 6 7
    b = chain([4, 5, 9], -0.2)  # shares the prefix 4 5: one copy, wrong only if both copies are (noisy-or)
    c = chain([8], -3.0)
    bad = chain([4, 5, 6], -np.inf)  # no candidates at all
    merged = merge_proposals([a, b, c, bad], depth=4)
    paths = paths_of(merged, 0)
    assert all(len(v) == 1 for v in paths.values())  # every path once
    assert set(paths) == {(4,), (4, 5), (4, 5, 6), (4, 5, 6, 7), (4, 5, 9), (8,)}
    both = np.log(1 - (1 - np.exp(-0.5)) * (1 - np.exp(-0.2)))  # each shared node's conditional
    assert paths[(4,)] == [pytest.approx(both)] and paths[(4, 5)] == [pytest.approx(2 * both)]
    assert paths[(4, 5, 9)] == [pytest.approx(2 * both - 0.2)] and paths[(4, 5, 6, 7)] == [pytest.approx(2 * both - 1)]
    for nodes in (1, 2, 3, 5, 6, 9):
        kept = keep_best(merged, nodes)
        parent = np.asarray(kept.parent_bt[0])
        assert (parent[1:] < np.arange(1, nodes + 1)).all()  # parents first
        real = paths_of(kept, 0)
        assert all(p[:-1] in real for p in real if len(p) > 1)  # ancestor-closed
        best = sorted((s[0] for s in paths.values()), reverse=True)[:nodes]
        assert sorted((s[0] for s in real.values()), reverse=True) == pytest.approx(best)
        siblings = {}
        for t in range(1, nodes + 1):  # padding repeats a sibling; real siblings are distinct
            siblings.setdefault(int(parent[t]), []).append(int(kept.tokens_bt[0, t]))
        assert len(set(siblings[0])) == len({p[0] for p in real})
    padded = keep_best(merged, 9)
    assert np.asarray(padded.depth_bt[0, 7:]).tolist() == [1, 1, 1] and (padded.parent_bt[0, 7:] == 0).all()
    np.testing.assert_allclose(np.asarray(expected_accepts(merged, (0, 1, 3))[0]),
                               [0, np.exp(both), np.exp(both) + np.exp(2 * both) + np.exp(2 * both - 0.2)],
                               rtol=1e-5)


def size_of(proposal, sizes, active):
    """The size index chosen for a proposal of 8 candidates per row (`kept`)."""
    return int(choose(predicted_accepts(proposal, sizes, active), sizes, jnp.sum(active).astype(jnp.float32)))


def kept(*chains):
    """The rows' chains, each merged and cut to 8 nodes, as one batch."""
    return jax.tree.map(lambda *rows: jnp.concatenate(rows), *(keep_best(merge_proposals([c], 8), 8) for c in chains))


def test_choose_size_follows_predicted_tokens_per_unit_of_time():
    sizes = DraftSizes((0, 2, 8), (1.0, 1.3, 2.0), depth=8)
    sure = chain([1] * 8, -0.01)  # a confident lookup hit: 1 + ~8 tokens for 2x the time
    weak = chain([1] * 8, -3.0)  # unlikely drafts: plain
    middling = chain([1, 2], -0.3)  # ~1.3 tokens more for 1.3x: two nodes
    active = jnp.asarray([True])
    for p, want in ((sure, 2), (weak, 0), (middling, 1)):
        assert size_of(kept(p), sizes, active) == want
    assert size_of(kept(sure), sizes, jnp.asarray([False])) == 0
    # batch 2: one size for both rows, by their summed tokens: a sure row beside a weak one still drafts 8 nodes
    # (2 + ~8 tokens for 2x); where 2 nodes cost 1.75x, a middling row alone drafts them (1 + 1.29 tokens > 1.75)
    # but not beside a weak row (2 + 1.34 tokens < 2 x 1.75)
    both = jnp.asarray([True, True])
    assert size_of(kept(sure, weak), sizes, both) == 2 and size_of(kept(weak, weak), sizes, both) == 0
    dearer = DraftSizes((0, 2, 8), (1.0, 1.75, 2.5), depth=8)
    assert size_of(kept(middling), dearer, active) == 1 and size_of(kept(middling, weak), dearer, both) == 0
    with pytest.raises(ValueError, match="distinct ascending"):
        DraftSizes((4, 2), (1.0, 1.0), depth=2)


def test_span_costs_price_a_step_at_the_slots_it_attends_over():
    """`draft_merge.SpanCosts`: a size's cost (its step over a plain step of the same span) is linear in the span
    between the timed spans and along the last piece past them, the first span's below it, never below the least
    timed cost nor a smaller size's. `DraftSizes.at_span` prices the sizes so."""
    spans = SpanCosts((100, 300), ((1.1, 1.2, 1.5), (1.3, 1.4, 2.5)))
    assert spans.at(100) == (1.1, 1.2, 1.5) and spans.at(50) == spans.at(100) and spans.at(300) == (1.3, 1.4, 2.5)
    assert spans.at(200) == pytest.approx((1.2, 1.3, 2.0)) and spans.at(500) == pytest.approx((1.5, 1.6, 3.5))
    falling = SpanCosts((100, 300), ((1.5, 1.6, 2.0), (1.1, 1.2, 1.5)))  # noise: dearer over fewer slots
    assert falling.at(900) == (1.1, 1.2, 1.5)  # never below the least timed cost
    assert SpanCosts((100,), ((3.0, 2.5),)).at(900) == (3.0, 3.0)  # one span; never cheaper with more nodes
    sizes = DraftSizes.timed((0, 2, 8), spans, depth=8)
    assert sizes.costs == spans.at(100) and sizes.by_span == spans
    assert sizes.at_span(500) == DraftSizes((0, 2, 8), spans.at(500), depth=8)
    assert DraftSizes.timed((0, 2, 8), SpanCosts((100,), ((1.1, 1.2, 1.5),)), 8).by_span is None
    assert DraftSizes((0, 2), (1.0, 1.2), depth=2).at_span(10_000).costs == (1.0, 1.2)
    assert sizes.record() == {"sizes": [0, 2, 8], "costs": [1.1, 1.2, 1.5], "depth": 8,
                              "costs_by_span": {"100": [1.1, 1.2, 1.5], "300": [1.3, 1.4, 2.5]}}
    assert DraftSizes((0, 2), (1.0, 1.2), depth=2).record()["costs_by_span"] is None
    for bad, match in ((((300, 100), ((1,), (1,))), "ascending"), (((100,), ((),)), "one row"),
                       (((100, 300), ((1, 1), (1,))), "one length"), (((100, 300), ((1, 1), (1, 0))), "costs > 0")):
        with pytest.raises(ValueError, match=match):
            SpanCosts(*bad)
    with pytest.raises(ValueError, match="one cost per size"):
        DraftSizes((0, 2), (1.0, 1.2), depth=2, by_span=spans)


def test_the_decode_prices_its_sizes_at_its_cache_or_attention_window(tiny):
    """A mix's sizes timed cheap over 256 slots and dear (50 plain steps) over 1,024: a decode over a 128-slot
    cache drafts and accepts lookup's chains, one over 1,000 slots (no window: `kv_cache.attention_windows`) backs
    off to plain steps, and one over a 1,100-slot cache drafts as the first, its short row attending over a 256-slot
    window. Every run's greedy tokens are plain greedy's."""
    base, refs = tiny("llama")
    eos_ids, reference = refs["batch1"]
    mix = mix_of(base, "lookup")
    sizes = DraftSizes.timed(SIZES, SpanCosts((256, 1024), (COSTS, (50.0, 50.0, 50.0))), mix.depth)
    accepted = {}
    for cache_size in (128, 1000, 1100):
        got = generate_medusa(base, mix, PROMPTS["batch1"], tree=sizes, max_new_tokens=N, eos_ids=eos_ids,
                              cache_size=cache_size)
        assert [r.token_ids for r in got] == reference
        accepted[cache_size] = sum(got[0].accept_lengths)
    assert accepted[128] == accepted[1100] >= N // 5 and accepted[1000] < accepted[128] // 2, accepted


def test_forced_sizes_make_every_step_verify_the_size_timed(tiny):
    """`draft_size.forced_sizes`, what the step costs are timed with: size 0 is a drafted step that verifies the root
    alone even for a sure chain (every step accepts 0 and the greedy tokens are plain's); a size n alone is chosen
    whatever the prediction."""
    sure, weak = chain([1] * 8, -0.01), chain([1] * 8, -3.0)
    active = jnp.asarray([True])
    zero, four = draft_size.forced_sizes((0, 4), depth=8)
    assert zero.sizes == (0, 1) and four.sizes == (4,)
    assert size_of(kept(sure), zero, active) == 0 and size_of(kept(weak), four, active) == 0
    base, refs = tiny("llama")
    eos_ids, reference = refs["ragged4"]
    mix = mix_of(base, "recycle+lookup")
    got = generate_medusa(base, mix, PROMPTS["ragged4"], tree=draft_size.forced_sizes((0,), mix.depth)[0],
                          max_new_tokens=N, eos_ids=eos_ids)
    assert [r.token_ids for r in got] == reference
    assert all(a == 0 for r in got for a in r.accept_lengths)


def drafted_steps(state, sizes, index, accepted_k, steps, predicted_k=None):
    """`steps` drafted steps of size index `index` on one row, each size up to it accepting `accepted_k` and
    predicted `predicted_k` (default: nothing)."""
    predicted_k = jnp.zeros(len(sizes.sizes)) if predicted_k is None else jnp.asarray(predicted_k, jnp.float32)
    for _ in range(steps):
        state = state.drafted(sizes, jnp.int32(index), jnp.asarray(accepted_k, jnp.float32), jnp.float32(1),
                              predicted_k)
    return state


def test_size_choice_scales_each_sizes_prediction_by_what_the_steps_that_showed_it_accepted():
    """`SizeChoiceState.choose`: before any drafted step the prediction picks the size among those that verify
    nodes; a step verifying n nodes shows every size up to n, and each size's prediction is then scaled by its own
    ratio of accepted to predicted tokens (prior: the run-wide ratio, RATIO_PRIOR predicted tokens); a size no
    step shows any more decays back to the run-wide ratio; the step's own prediction still moves the choice; prompt
    lookup's chains are a floor."""
    sizes = DraftSizes((0, 2, 8), (1.1, 1.5, 2.0), depth=8)
    one, predicted_k, no_lookup = jnp.float32(1), jnp.asarray([0.0, 0.6, 2.0]), jnp.zeros(3)
    state = SizeChoiceState.start(sizes)
    np.testing.assert_allclose(np.asarray(state.ratios), [1.0, 1.0, 1.0])
    assert bool(state.drafts) and int(state.choose(predicted_k, no_lookup, sizes, one)) == 2  # 3 / 2.0 > 1.6 / 1.5
    # a drafted step never verifies the root alone (it would cost more than skipping and show nothing), unless every
    # other size is priced out (could not beat it even if all its nodes were accepted)
    assert int(state.choose(jnp.zeros(3), no_lookup, sizes, one)) == 1
    dear = DraftSizes((0, 2, 8), (1.0, 5.0, 20.0), depth=8)
    assert int(SizeChoiceState.start(dear).choose(jnp.asarray([0.0, 2.0, 8.0]), no_lookup, dear, one)) == 0
    # eight nodes predicted to accept 2 tokens accept 1; two nodes, predicted 0.6, accept 1 too
    state = drafted_steps(state, sizes, 2, [0.0, 1.0, 1.0], 6, predicted_k)
    seen = sum(DECAY ** i for i in range(6))
    np.testing.assert_allclose(np.asarray(state.seen_k), [seen] * 3, rtol=1e-6)
    run_ratio = (seen + RATIO_PRIOR) / (2 * seen + RATIO_PRIOR)
    assert float(state.correction) == pytest.approx(run_ratio, rel=1e-5)
    ratio_k = (seen + RATIO_PRIOR * run_ratio) / (np.asarray([0.0, 0.6, 2.0]) * seen + RATIO_PRIOR)
    np.testing.assert_allclose(np.asarray(state.ratios)[1:], ratio_k[1:], rtol=1e-5)  # 1.17 and 0.52
    assert int(state.choose(predicted_k, no_lookup, sizes, one)) == 1  # (1 + 0.70) / 1.5 beats (1 + 1.05) / 2.0
    # a confident prediction for this step still wins the large size: 4 * 0.52 = 2.09 tokens at 2.0
    assert int(state.choose(jnp.asarray([0.0, 0.6, 4.0]), no_lookup, sizes, one)) == 2
    # a long lookup chain (7 tokens at eight nodes) lifts the large size for this step
    assert int(state.choose(predicted_k, jnp.asarray([0.0, 2.0, 7.0]), sizes, one)) == 2
    # steps of two nodes show nothing of eight: its weight decays, and its ratio moves back to the run-wide one
    state = drafted_steps(state, sizes, 1, [0.0, 1.0, 0.0], 30, [0.0, 0.6, 0.0])
    assert float(state.seen_k[2]) == pytest.approx(seen * DECAY ** 30, rel=1e-4) and float(state.seen_k[1]) > 20
    assert float(state.correction) > 1.2 and 0.52 < float(state.ratios[2]) < float(state.correction)
    assert int(state.choose(jnp.asarray([0.0, 0.6, 0.8]), no_lookup, sizes, one)) == 1
    assert int(state.choose(jnp.asarray([0.0, 0.6, 3.0]), no_lookup, sizes, one)) == 2


def test_size_choice_backs_off_while_the_runs_best_size_does_not_pay():
    """`SizeChoiceState.drafted`: while even the best size's running estimate (break-even prior) loses to plain
    steps, the next 1, 2, 4, ... (at most MAX_SKIP) steps skip the drafting; drafted steps that lift the estimate
    above break-even end it. One unlucky step in a paying run does not start a backoff."""
    sizes = DraftSizes((0, 2, 8), (1.1, 1.5, 2.0), depth=8)
    state, skips = SizeChoiceState.start(sizes), []
    for _ in range(6):  # nothing accepted at any size
        state = drafted_steps(state, sizes, 2, [0.0, 0.0, 0.0], 1)
        skips.append(int(state.skip_left))
    assert skips == [1, 2, 4, 8, 8, 8] == [min(2 ** i, MAX_SKIP) for i in range(6)] and not bool(state.drafts)
    for _ in range(MAX_SKIP - 1):
        state = state.skipped()
    assert not bool(state.drafts) and bool(state.skipped().drafts)
    recovered = drafted_steps(state, sizes, 2, [0.0, 1.0, 3.0], 3)  # 1 + 3 tokens for 2.0: the average recovers
    assert bool(recovered.drafts) and int(recovered.misses) == 0
    paying = drafted_steps(SizeChoiceState.start(sizes), sizes, 2, [0.0, 1.0, 2.0], 8)
    unlucky = drafted_steps(paying, sizes, 2, [0.0, 0.0, 0.0], 1)
    assert bool(unlucky.drafts) and int(unlucky.misses) == 0
    # a single size n >= 1 that costs what a plain step does always pays
    alone = DraftSizes((4,), (1.0,), depth=8)
    after = drafted_steps(SizeChoiceState.start(alone), alone, 0, [0.0], 5, [0.5])
    assert bool(after.drafts) and int(after.misses) == 0 and float(after.predicted) > 0


def test_accepted_per_size_reads_the_path_within_each_sizes_best_nodes():
    """`size_choice.accepted_per_size`: the best m of the verified nodes hold the accepted path's nodes ranked below
    m, and a size's path ends at the first node it lacks; ties rank the earlier node first; sizes above the verified
    one and inactive rows count nothing."""
    sizes = DraftSizes((0, 1, 2, 4, 8), (1.0,) * 5, depth=4)
    # nodes 1..4 scored -0.1, -0.5, -0.2, -1.0 (ranks 0, 2, 1, 3); the path 0 -> 1 -> 3 -> 4 accepted 3 nodes
    score_bn = jnp.asarray([[-0.1, -0.5, -0.2, -1.0], [-0.1, -0.5, -0.2, -1.0]])
    path_be = jnp.asarray([[0, 1, 3, 4, 4], [0, 2, 2, 3, 4]])
    accept_b = jnp.asarray([3, 1])
    got = accepted_per_size(score_bn, path_be, accept_b, jnp.asarray([True, False]), sizes, 4)
    np.testing.assert_array_equal(np.asarray(got), [0, 1, 2, 3, 0])
    both = accepted_per_size(score_bn, path_be, accept_b, jnp.asarray([True, True]), sizes, 4)
    np.testing.assert_array_equal(np.asarray(both), [0, 1, 2 + 0, 3 + 1, 0])  # node 2 (rank 2) is only in size 4
    ties = accepted_per_size(jnp.asarray([[-0.3, -0.3]]), jnp.asarray([[0, 2, 0]]), jnp.asarray([1]),
                             jnp.asarray([True]), DraftSizes((1, 2), (1.0, 1.0), depth=2), 2)
    np.testing.assert_array_equal(np.asarray(ties), [0, 1])  # node 2 ties node 1 and ranks after it


def test_lookup_pays_reads_the_lookup_chains_alone():
    """`size_choice.lookup_pays`: a long match (a repeat) promises a paying step at batch 1, no match does not, a
    mix without prompt lookup never overrides the backoff, and the drafted sizes are weighed against a plain step
    (cost 1), not against costs[0], a drafted step that verifies the root alone."""
    config = LookupConfig(length=6)
    sizes = DraftSizes((0, 2, 6), (1.1, 1.5, 2.0), depth=6)
    repeat = init_lookup(jnp.asarray([REPEATING]), jnp.asarray([len(REPEATING)]), 64)
    fresh = init_lookup(jnp.asarray([list(range(10, 27))]), jnp.asarray([17]), 64)
    active = jnp.asarray([True])
    hit = lookup_proposal(config, repeat, jnp.asarray([17]))  # ... 9 2 17 -> 33 4 8 ...
    assert bool(lookup_pays([hit], sizes, active))
    assert not bool(lookup_pays([lookup_proposal(config, fresh, jnp.asarray([99]))], sizes, active))
    assert not bool(lookup_pays([], sizes, active))
    # a one-token match (0.377 + 0.377^2 + ... = 0.60 predicted tokens at 6 nodes): at cost 1.65 it beats costs[0]
    # = 1.25 (1.60 / 1.65 > 1 / 1.25) but not a plain step; at 1.55 it beats a plain step too
    one = lookup_proposal(config, init_lookup(jnp.asarray([[7, 8, 1, 2, 3, 4, 5, 6, 9]]), jnp.asarray([9]), 64),
                          jnp.asarray([7]))
    assert not bool(lookup_pays([one], DraftSizes((0, 6), (1.25, 1.65), depth=6), active))
    assert bool(lookup_pays([one], DraftSizes((0, 6), (1.25, 1.55), depth=6), active))


def test_rows_that_end_together_count_only_those_with_the_most_tokens_left():
    """`SizeChoiceState.counted_rows`: rows that end together (a batch call's) end with the row that has the most
    tokens left, so only that row (and rows tied with it) counts in the choice; rows that do not (a server's) all
    count; an inactive row never counts, however much budget it has left; one row counts itself either way."""
    sizes = DraftSizes((0, 2, 6), (1.1, 1.5, 2.0), depth=6)
    active = jnp.asarray([True, True, False, True])
    left = jnp.asarray([40, 90, 120, 90])
    together, apart = SizeChoiceState.start(sizes), SizeChoiceState.start(sizes, together=False)
    np.testing.assert_array_equal(np.asarray(together.counted_rows(active, left)), [False, True, False, True])
    np.testing.assert_array_equal(np.asarray(apart.counted_rows(active, left)), [True, True, False, True])
    for state in (together, apart):
        np.testing.assert_array_equal(np.asarray(state.counted_rows(jnp.asarray([True]), jnp.asarray([7]))), [True])
        assert not np.any(np.asarray(state.counted_rows(jnp.zeros(2, bool), jnp.asarray([3, 5]))))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """kind -> (base, {case: (eos_ids, plain greedy token ids per row)}).

    One plain greedy run of all five prompts gives every reference (rows decode independently): greedy decoding
    with an EOS is the run without it cut after the row's first EOS (test_loader checks that `generate` does
    exactly that), so one compile per model serves both cases (as test_recycle's fixture)."""
    made = {}

    def get(kind):
        if kind not in made:
            # a narrower init than test_medusa's 0.3: greedy continuations that fall into loops, which lookup finds
            base = load_pretrained(tiny_model_dir(kind, initializer_range=0.1))
            first, *free = [r.token_ids for r in generate(base, PROMPTS["batch1"] + PROMPTS["ragged4"],
                                                          max_new_tokens=N, eos_ids=())]
            eos = pick_eos(free[2], lo=N // 3)
            cut = [row[: row.index(eos) + 1] if eos in row else row for row in free]
            refs = {"batch1": ((), [first]), "ragged4": ((eos,), cut)}
            assert any(len(row) < N for row in cut)  # a row stops at the EOS, mid-generation
            made[kind] = (base, refs)
        return made[kind]

    return get


def mix_of(base, parts: str):
    """A mix of the '+'-joined parts: 'medusa' or 'hydra' (random heads), 'recycle' (a fresh table), 'lookup'."""
    config, names = base.config, parts.split("+")
    trained = next((random_heads(base, head_type=n) for n in names if n in ("medusa", "hydra")), None)
    template = None
    if "recycle" in names:
        recycler = RecycleDrafter(RecycleConfig(config.hidden_size, config.vocab_size))
        template = (recycler, template_spec(template_tree("recycle_8"), RANK_ACCEPTANCE))
    return make_mix(config.hidden_size, config.vocab_size, trained=trained,
                    trained_tree=DynamicTree(6, top_k=2, depth=3) if trained is not None else None,
                    lookup=LookupConfig(length=6, branches=2) if "lookup" in names else None, template=template)


CASES = [("llama", "lookup", "batch1"), ("llama", "lookup", "ragged4"), ("llama", "medusa+lookup", "ragged4"),
         ("qwen2", "hydra+lookup", "batch1"), ("qwen2", "medusa+lookup", "ragged4"),
         ("mistral", "lookup", "ragged4"), ("llama", "medusa+recycle+lookup", "ragged4"),
         ("qwen2", "recycle+lookup", "batch1"), ("mistral", "hydra+recycle+lookup", "batch1")]


@pytest.mark.parametrize("kind, parts, case", CASES)
def test_mixed_drafts_greedy_equals_plain_greedy(tiny, kind, parts, case):
    base, refs = tiny(kind)
    eos_ids, reference = refs[case]
    mix = mix_of(base, parts)
    sizes = DraftSizes(SIZES, COSTS, depth=mix.depth)
    got = generate_medusa(base, mix, PROMPTS[case], tree=sizes, max_new_tokens=N, eos_ids=eos_ids)
    assert [r.token_ids for r in got] == reference
    accepts = [a for r in got for a in r.accept_lengths]
    assert all(0 <= a <= mix.depth for a in accepts)
    assert max(accepts) >= 2  # the repeats are found: chains of two or more tokens accepted


def test_recycling_refreshes_its_table_from_the_prompt_except_beside_prompt_lookup(tiny):
    """`mixed.prompt_readers`: Token Recycling's refresh from the prompt's logits (`recycle.prompt_update`) runs
    in a mix with trained heads but not in one with prompt lookup, which drafts from the prompt itself: the mix's
    `needs_prompt_hidden` (what the prefill computes) and the table its init_draft starts the decode from."""
    from medusa_jax.heads.recycle import prompt_update
    from medusa_jax.inference.autoregressive import prefill_states

    base, _ = tiny("llama")
    prompt_bt = jnp.asarray([[5, 9, 2, 17, 33, 4, 9, 2]], jnp.int32)
    lens_b = jnp.asarray([8], jnp.int32)
    _, _, hidden_btd = prefill_states(base, prompt_bt, lens_b, KVCache.zeros(base.config, 1, 8))
    starts = {}
    for parts in ("medusa+recycle", "recycle+lookup", "hydra+recycle+lookup"):
        mix = mix_of(base, parts)
        i, recycler = next((i, d) for i, d in enumerate(mix.drafters) if isinstance(d, RecycleDrafter))
        table = jnp.asarray(np.random.default_rng(0).integers(0, base.config.vocab_size, recycler.table.shape),
                            jnp.int32)
        recycler.keep_draft(table)
        draft = mix.init_draft(base, prompt_bt, lens_b, hidden_btd, 16, mix.depth)
        starts[parts] = (mix.needs_prompt_hidden, np.asarray(draft[i]))
        refreshed = np.asarray(prompt_update(table, base, prompt_bt, lens_b, hidden_btd))
        assert (refreshed != np.asarray(table)).any()  # the refresh changes rows here
    assert starts["medusa+recycle"][0] and (starts["medusa+recycle"][1] == refreshed).all()
    for parts in ("recycle+lookup", "hydra+recycle+lookup"):
        assert not starts[parts][0] and (starts[parts][1] == np.asarray(table)).all(), parts


def test_lookup_with_sampling_stays_seeded_and_typical_runs(tiny):
    base, refs = tiny("llama")
    mix = mix_of(base, "lookup")
    sizes = DraftSizes(SIZES, COSTS, depth=mix.depth)
    exact = dict(sampling=SamplingConfig(0.8), acceptance=AcceptanceConfig("exact"))
    runs = [generate_medusa(base, mix, PROMPTS["ragged4"], tree=sizes, max_new_tokens=N, eos_ids=(),
                            **exact, seed=3) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert all(len(r.token_ids) == N for r in runs[0])


def test_mixed_drafts_on_meshes_equal_plain_greedy_on_one_device(tiny_model_dir, tmp_path):
    """Lookup alone and mixed with Medusa heads on (8,1) and (2,4) meshes of 8 forced CPU devices
    (tests/mixed_sharded_worker.py): plain greedy's tokens on one device, and the same steps on both meshes."""
    folder = tiny_model_dir("llama", initializer_range=0.1, num_attention_heads=8, num_key_value_heads=8)
    out = tmp_path / "report.json"
    worker = Path(__file__).with_name("mixed_sharded_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(folder), str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    for name in ("lookup", "medusa+lookup"):
        runs = [report[f"{name} {mesh}"] for mesh in ("8,1", "2,4")]
        for run in runs:
            assert run["tokens"] == report["reference"], name
            assert run["accepts"] == runs[0]["accepts"], name
        assert max(a for row in runs[0]["accepts"] for a in row) >= 2  # lookup hits on the repeating rows


@partial(jax.jit, static_argnames=("graphdef", "sizes", "config"))
def draw_mixed(graphdef, params, prompt_bt, lens_b, keys_x, *, sizes, config):
    """[X, B, 3] tokens and [X, B, 3] accept lengths of X independent exact-sampling runs of a mix."""
    def one(key):
        cache = KVCache.zeros(config, prompt_bt.shape[0], 16)
        out_bo, _, _, accept_bo, _ = medusa_decode(graphdef, params, cache, prompt_bt, lens_b, key, tree=sizes,
                                                   max_new_tokens=exact_sampling.N_OUT, acceptance=exact_sampling.EXACT,
                                                   eos_ids=(), pad_id=0)
        return out_bo, accept_bo

    return jax.vmap(one)(keys_x)


def test_exact_sampling_with_lookup_drafts_has_the_plain_samplers_law(setup):
    """tests/test_exact_sampling.py's law check (chi-square and a total-variation bound over the first 3 tokens of
    4 ragged prompts, 20,000 rows) with prompt lookup's deterministic drafts, alone and mixed with Medusa heads,
    the draft size chosen per step."""
    graphdef, params, laws, _ = setup
    base = nnx.merge(graphdef, params).base
    heads = nnx.merge(graphdef, params).heads
    prompts = exact_sampling.PROMPTS
    prompt_bt = np.zeros((len(prompts), exact_sampling.WIDTH), np.int32)
    for i, q in enumerate(prompts):
        prompt_bt[i, : len(q)] = q
    for seed, trained in ((21, None), (22, heads)):
        mix = make_mix(32, exact_sampling.V, trained=trained, lookup=LookupConfig(n_max=2, length=2, branches=2),
                       trained_tree=DynamicTree(3, 2, 2) if trained is not None else None)
        g, p = nnx.split(MedusaModel(base, mix))
        sizes = DraftSizes((0, 1, 4), (1.0, 1.02, 1.05), depth=2)
        out_xbo, accept_xbo = draw_mixed(g, p, jnp.asarray(prompt_bt), jnp.asarray([len(q) for q in prompts]),
                                         jax.random.split(jax.random.key(seed), 5_000), sizes=sizes,
                                         config=base.config)
        check = exact_sampling.law_check(np.asarray(out_xbo), list(range(len(prompts))), laws)
        assert check["n"] >= 20_000 and exact_sampling.passes(check), check
        first = np.asarray(accept_xbo)[:, :, 0]
        assert (first >= 1).mean() > 0.05, np.bincount(first.ravel())  # lookup's drafts are accepted often


def test_generate_script_with_lookup_and_a_mix(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """scripts/generate.py --heads lookup and --heads HEADS+lookup --json: plain's tokens, the mix named in the row;
    --calibration with a mix: redo times the draft sizes' step costs and caches them, skip leaves the cache alone."""
    import transformers  # lazy, with tokenizers: only this test builds a tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama", initializer_range=0.1), folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(100)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>",
                                         pad_token="<unk>").save_pretrained(folder)
    save_heads(random_heads(load_pretrained(folder)), tmp_path / "heads")
    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parents[1] / "scripts/generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    common = ["--model", str(folder), "--prompt", "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2", "--max-new-tokens", "16", "--json"]
    assert script.main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    for heads in ("lookup", f"{tmp_path / 'heads'}+lookup"):
        assert script.main(common + ["--heads", heads]) == 0
        row = json.loads(capsys.readouterr().out)
        assert row["token_ids"] == plain["token_ids"] and row["decoder"] == "medusa"
        assert row["tree"].startswith("mixed drafts (mixed:0/")
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    for mode, cached in (("skip", 0), ("redo", 1)):
        assert script.main(common + ["--heads", "lookup", "--calibration", mode]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
        assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == cached


def test_build_mix_sizes_its_budget_and_measures_non_decreasing_costs(tiny):
    """`mixed_decoding.build_mix`: plain and three sizes up to the candidates within the budget; with timing
    skipped (the suite's calibration mode) the default costs, else measured ones (the real mixed step of each size
    over a plain step, `draft_size.measure_span_costs` at each span: a step of more nodes never costs less)."""
    base, _ = tiny("llama")
    mix, sizes = build_mix(base, ("lookup",), None, 16)
    assert mix.candidates == 40 and sizes.depth == 10  # 4 chains of 10 (LookupDrafter.mix_member at 16)
    assert sizes.sizes == sizes_for(16) == (0, 2, 5, 16) and sizes_for(10) == (0, 1, 3, 10)
    assert sizes_for(64) == (0, 8, 21, 64)
    assert sizes.costs == draft_size.default_costs(sizes.sizes)
    assert draft_size.default_costs((0, 1, 16, 64)) == tuple(c for n, c in draft_size.DEFAULT_COST_POINTS
                                                             if n in (0, 1, 16, 64))
    assert draft_size.default_costs((3, 100))[0] == pytest.approx((1.55 + 1.67) / 2)  # between points, past the last
    assert draft_size.default_costs((3, 100))[1] == pytest.approx(5.78 + 36 * (5.78 - 2.31) / 48)
    measured = draft_size.measure_span_costs(base, mix, sizes.sizes, depth=mix.depth)
    assert measured.spans == tuple(c + 16 + 2 + mix.depth for c in draft_size.SPAN_CONTEXTS)
    assert [len(row) for row in measured.costs] == [4, 4]
    for span in measured.spans + (5000,):
        costs = measured.at(span)
        assert len(costs) == 4 and all(b >= a for a, b in zip(costs, costs[1:]))
    # the timed steps' executables are let go (their kernels' memory mappings: compile_cache.MappingGuard)
    assert step_cost._plain_step._cache_size() == 0 and step_cost._medusa_step_jit(1)._cache_size() == 0
    with pytest.raises(MixError, match="empty part"):
        parse_mix("lookup++default")
    assert parse_mix("default+recycle+lookup") == (("recycle", "lookup"), "default")
    assert is_mix("lookup") and is_mix("default+lookup") and not is_mix("recycle") and not is_mix("default")


def test_a_second_build_reads_the_step_costs_cached_for_this_machine(tiny, tmp_path, monkeypatch):
    """`draft_size_cache.size_costs` under build_mix: auto measures once and caches under the cache folder (keyed by
    machine, model, batch, sizes and mix), a second build reads the file (timing would fail), redo times again,
    another batch size is another entry, skip times nothing (the default costs) and never touches the cache."""
    base, _ = tiny("llama")
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path))
    _, first = build_mix(base, ("lookup",), None, 16, calibration="auto")
    files = sorted((tmp_path / "calibration").glob("*.json"))
    doc = json.loads(files[0].read_text())
    assert len(files) == 1 and doc["spans"] == list(first.by_span.spans)
    assert doc["costs"] == [list(row) for row in first.by_span.costs]

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(draft_size, "measure_span_costs", no_timing)
    _, second = build_mix(base, ("lookup",), None, 16, calibration="auto")
    assert second == first
    assert size_costs(base, build_mix(base, ("lookup",), None, 16, costs=lambda s: (1.0,) * len(s))[0], first.sizes,
                      mode="auto") == (first.by_span, "cached")
    for mode, batch in (("redo", 1), ("auto", 2)):
        with pytest.raises(AssertionError, match="timed again"):
            build_mix(base, ("lookup",), None, 16, batch=batch, calibration=mode)
    _, skipped = build_mix(base, ("lookup",), None, 16, calibration="skip")  # times nothing, reads no cache
    assert skipped.costs == draft_size.default_costs(first.sizes) and skipped.by_span is None
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1  # nothing written by a failed timing or skip
