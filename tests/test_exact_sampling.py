"""Exact (lossless) Medusa sampling: the first 3 emitted tokens have the plain sampler's law, checked against the
law enumerated from the model's own probabilities; the check is shown to reject wrong samplers.

Setup. A 1-layer model with a 16-token vocabulary, weights scaled up so its next-token distributions are sharp
(top token ~0.5-0.9), sampled at temperature 0.9 with top_k 12 and top_p 0.97 (every filter is active). The
proposer is planted: for the root token x1 of each row, head 0 proposes the top-3 tokens of q(x2 | prompt, x1)
and head 1 the top-2 of q(x3 | prompt, x1, argmax x2), so candidates are often, not always, accepted, at both
depths and at ranks > 0, and the tree below has a depth-1 leaf (its bonus token comes from its full q).
The enumeration runs a plain forward on every prompt + (x1) and prompt + (x1, x2) and applies the shared
`sampling.target_logits`: P(x1, x2, x3) = q1(x1) q2(x2 | x1) q3(x3 | x1, x2), V^3 = 4096 cells per prompt.

Samples: medusa_decode vmapped over PRNG keys, jitted once per (batch, acceptance): 20,000 runs of one row
(batch 1), and 5,000 runs of 4 ragged prompts (batch 4, 20,000 rows in all). The same check runs on a dynamic tree
(EAGLE-2 style, `DYNAMIC`): the planted candidates, scored by the log of their q, grow each row's tree per step,
so the tree's shape changes with the root token.

The check (`law_check`). n samples, split in strata b (prompt rows) of n_b samples each with known law p_b
over the V^3 cells x (the outcomes (x1, x2, x3), flattened).
  chi-square: cells with expected count n_b p_bx >= 5 are kept, the rest of each stratum pooled into one
  cell; the statistic summed over strata has sum(cells - 1) degrees of freedom; require p-value > 1e-3.
  Any sample in a cell of probability 0 fails at once.
  total variation: TV = 1/(2n) sum_bx |count_bx - n_b p_bx|. Since E|count - n_b p| <= sd =
  sqrt(n_b p (1 - p)), E[TV] <= 1/(2n) sum_bx sqrt(n_b p_bx (1 - p_bx)) =: m. Changing one sample moves TV
  by at most 1/n, so McDiarmid's inequality gives P(TV > m + t) <= exp(-2 n t^2); with t =
  sqrt(ln(1/delta) / (2n)) and delta = 1e-4 the bound m + t fails a correct sampler with probability <=
  1e-4. For these laws and n = 20,000: m ~ 0.05, t = 0.015.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.trees.dynamic_tree import grow_from_candidates
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.trees.tree import DynamicTree, build_tree
from medusa_jax.inference import exact_acceptance
from medusa_jax.inference.acceptance import GREEDY, AcceptanceConfig, DecodeConfig
from medusa_jax.inference.autoregressive import prefill
from medusa_jax.inference.exact_acceptance import exact_accept, trial_outcomes
from medusa_jax.inference.medusa import decode_states, medusa_decode
from medusa_jax.inference.row_acceptance import RowAcceptance
from medusa_jax.inference.row_sampling import RowSampling
from medusa_jax.inference.sampling import SamplingConfig, sample_tokens, target_logits

V, N_OUT, WIDTH = 16, 3, 5
SAMPLING = SamplingConfig(temperature=0.9, top_p=0.97, top_k=12)
TREE = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)], name="stat")  # node [2] is a depth-1 leaf
DYNAMIC = DynamicTree(nodes=6, top_k=3, depth=2)  # the 6 best of 3 + 9 drafted nodes, per row and step
PROMPTS = [[3, 7, 1, 12, 5], [9, 2], [14, 14, 6, 0], [1, 10, 4]]  # ragged
DELTA = 1e-4


@pytest.fixture(scope="module")
def setup():
    config = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16)
    base = CausalLM(config, nnx.Rngs(0))
    rng = np.random.RandomState(0)
    for path, var in nnx.iter_graph(base):
        if isinstance(var, nnx.Param) and var[...].ndim == 2:  # sharp, context-dependent distributions
            var[...] = jnp.asarray(rng.normal(0, 0.5, var[...].shape), jnp.float32)
    heads = init_heads(HeadsConfig(32, V, num_heads=2), base)  # unused by the planted proposer
    graphdef, params = nnx.split(MedusaModel(base, heads))
    q1_bv, q2_bvv, q3_bvvv = enumerate_laws(graphdef, params, PROMPTS)
    return graphdef, params, (q1_bv, q2_bvv, q3_bvvv), planted_table(q2_bvv, q3_bvvv)


@partial(jax.jit, static_argnames="graphdef")
def target_probs(graphdef, params, tokens_xt, lengths_x):
    """The plain sampler's next-token law after each of N right-padded sequences (one plain prefill)."""
    base = nnx.merge(graphdef, params).base
    cache = KVCache.zeros(base.config, tokens_xt.shape[0], tokens_xt.shape[1])
    last_xd, _ = prefill(base, tokens_xt, lengths_x, cache)
    return jax.nn.softmax(target_logits(base.logits(last_xd), SAMPLING), axis=-1)


def enumerate_laws(graphdef, params, prompts):
    """Per prompt b: q1 [V], q2 [V, V] (given x1), q3 [V, V, V] (given x1, x2), from plain forwards."""
    seqs = []
    for p in prompts:
        seqs += [p] + [p + [x1] for x1 in range(V)] + [p + [x1, x2] for x1 in range(V) for x2 in range(V)]
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = jnp.asarray([len(s) for s in seqs], jnp.int32)
    q_xv = np.asarray(target_probs(graphdef, params, jnp.asarray(tokens), lengths), np.float64)
    q_by_context = q_xv.reshape(len(prompts), 1 + V + V * V, V)
    return q_by_context[:, 0], q_by_context[:, 1: 1 + V], q_by_context[:, 1 + V:].reshape(len(prompts), V, V, V)


def planted_table(q2_bvv, q3_bvvv) -> tuple[jnp.ndarray, jnp.ndarray]:
    """[B, V, M=2, R=3] candidates per (row, root token): head 0 the top-3 of q2, head 1 the top-3 of q3 after
    the most likely x2 (rank 2 of head 1 is unused by the static tree); and their log q (the draft scores of a
    dynamic tree)."""
    top2_bvr = np.argsort(-q2_bvv, axis=-1, kind="stable")[..., :3]
    best_bv = top2_bvr[..., 0]
    b_idx, v_idx = np.meshgrid(np.arange(q2_bvv.shape[0]), np.arange(V), indexing="ij")
    q3_bvv = q3_bvvv[b_idx, v_idx, best_bv]
    top3_bvr = np.argsort(-q3_bvv, axis=-1, kind="stable")[..., :3]
    q_bvmr = np.stack([np.take_along_axis(q2_bvv, top2_bvr, -1), np.take_along_axis(q3_bvv, top3_bvr, -1)], 2)
    return (jnp.asarray(np.stack([top2_bvr, top3_bvr], axis=2), jnp.int32),
            jnp.asarray(np.log(q_bvmr + 1e-6), jnp.float32))


def table_proposer(inputs):
    ids_bvmr, logq_bvmr = inputs.data
    rows_b = jnp.arange(inputs.root_b.shape[0])
    ids_bmr = ids_bvmr[rows_b, inputs.root_b]
    if isinstance(inputs.tree, DynamicTree):
        logq_bmr = logq_bvmr[rows_b, inputs.root_b]
        return grow_from_candidates(inputs.tree, inputs.root_b, ids_bmr, logq_bmr), inputs.draft
    return ids_bmr, inputs.draft


@partial(jax.jit, static_argnames=("graphdef", "acceptance", "pad_id", "tree"))
def draw(graphdef, params, prompt_bt, lens_b, keys_x, table, *, acceptance, pad_id=0, tree=TREE):
    """[X, B, N_OUT] tokens and [X, B] first-step accept lengths of X independent runs (one per key)."""
    def one(key):
        cache = KVCache.zeros(graphdef_config(graphdef, params), prompt_bt.shape[0], 16)
        out_bo, _, _, accept_bo, _ = medusa_decode(
            graphdef, params, cache, prompt_bt, lens_b, key, table, tree=tree, max_new_tokens=N_OUT,
            acceptance=acceptance, eos_ids=(), pad_id=pad_id, proposer=table_proposer)
        return out_bo, accept_bo[:, 0]

    return jax.vmap(one)(keys_x)


def graphdef_config(graphdef, params) -> ModelConfig:
    return nnx.merge(graphdef, params).base.config


def run(setup, prompts, runs, acceptance, seed=0, pad_id=0, tree=TREE):
    graphdef, params, _, table = setup
    rows = [PROMPTS.index(p) for p in prompts]
    prompt_bt = np.zeros((len(prompts), WIDTH), np.int32)
    for i, p in enumerate(prompts):
        prompt_bt[i, : len(p)] = p
    keys_x = jax.random.split(jax.random.key(seed), runs)
    out_xbo, accept_xb = draw(graphdef, params, jnp.asarray(prompt_bt), jnp.asarray([len(p) for p in prompts]),
                              keys_x, tuple(x[jnp.asarray(rows)] for x in table), acceptance=acceptance,
                              pad_id=pad_id, tree=tree)
    return np.asarray(out_xbo), np.asarray(accept_xb), rows


def law_check(out_xbo: np.ndarray, rows, laws) -> dict:
    """chi-square p-value, TV and its bound (module docstring) of samples [X, B, 3] against the laws of rows."""
    q1_bv, q2_bvv, q3_bvvv = laws
    n = out_xbo.shape[0] * out_xbo.shape[1]
    chi2, dof, tv, mean_bound, impossible = 0.0, 0, 0.0, 0.0, 0
    for col, row in enumerate(rows):
        p_x = (q1_bv[row][:, None, None] * q2_bvv[row][:, :, None] * q3_bvvv[row]).ravel()
        cells = out_xbo[:, col, 0] * V * V + out_xbo[:, col, 1] * V + out_xbo[:, col, 2]
        count_x = np.bincount(cells, minlength=V ** 3).astype(np.float64)
        n_b = out_xbo.shape[0]
        impossible += int(count_x[p_x == 0].sum())
        tv += 0.5 * np.abs(count_x - n_b * p_x).sum() / n
        mean_bound += 0.5 * np.sqrt(n_b * p_x * (1 - p_x)).sum() / n
        big = n_b * p_x >= 5
        observed = np.append(count_x[big], count_x[~big].sum())
        expected = np.append(n_b * p_x[big], n_b * p_x[~big].sum())
        if expected[-1] < 5:  # pool a too small rest into the smallest kept cell
            smallest = np.argmin(expected[:-1])
            observed[smallest] += observed[-1]
            expected[smallest] += expected[-1]
            observed, expected = observed[:-1], expected[:-1]
        chi2 += float(((observed - expected) ** 2 / expected).sum())
        dof += len(expected) - 1
    bound = mean_bound + math.sqrt(math.log(1 / DELTA) / (2 * n))
    p_value = 0.0 if impossible else float(stats.chi2.sf(chi2, dof))
    return {"p_value": p_value, "tv": tv, "tv_bound": bound, "impossible": impossible, "n": n}


def passes(check: dict) -> bool:
    return check["p_value"] > 1e-3 and check["tv"] < check["tv_bound"]


EXACT = DecodeConfig(SAMPLING, AcceptanceConfig("exact"))


@pytest.mark.parametrize("batch", [1, 4])
def test_exact_medusa_has_the_plain_samplers_law(setup, batch):
    prompts = PROMPTS[:batch]
    out_xbo, accept_xb, rows = run(setup, prompts, 20_000 // batch, EXACT, seed=batch)
    check = law_check(out_xbo, rows, setup[2])
    assert check["n"] >= 20_000
    assert passes(check), check
    # the tree really is exercised: the first step accepts 0, 1 and 2 candidates, each often
    share = np.bincount(accept_xb.ravel(), minlength=3) / accept_xb.size
    assert (share > 0.05).all(), share


@partial(jax.jit, static_argnames=("graphdef", "graphdef_config"))
def draw_with_heads(graphdef, params, prompt_bt, lens_b, keys_x, *, graphdef_config):
    """draw() with the heads' own proposal (an EAGLE drafter here) instead of the planted table."""
    def one(key):
        cache = KVCache.zeros(graphdef_config, prompt_bt.shape[0], 24)
        out_bo, _, _, accept_bo, _ = medusa_decode(graphdef, params, cache, prompt_bt, lens_b, key, tree=TREE,
                                                   max_new_tokens=N_OUT, acceptance=EXACT, eos_ids=(), pad_id=0)
        return out_bo, accept_bo[:, 0]

    return jax.vmap(one)(keys_x)


def test_exact_sampling_with_the_eagle_drafter_has_the_plain_samplers_law(setup):
    """The drafter's own drafts (its state carried through the loop) on the same statistical check."""
    graphdef, params, laws, _ = setup
    base = nnx.merge(graphdef, params).base
    drafter = init_heads(HeadsConfig(32, V, num_heads=2, head_type="eagle", lm_head="shared"), base, seed=3)
    rng = np.random.RandomState(5)
    for lin in (drafter.fc, drafter.layers[0].mlp.down_proj):  # drafts that vary with the context
        lin.kernel[...] = jnp.asarray(rng.normal(0, 1.0, lin.kernel.shape), jnp.float32)
    g, p = nnx.split(MedusaModel(base, drafter))
    prompts = PROMPTS[:2]
    prompt_bt = np.zeros((len(prompts), WIDTH), np.int32)
    for i, q in enumerate(prompts):
        prompt_bt[i, : len(q)] = q
    keys_x = jax.random.split(jax.random.key(11), 10_000)
    out_xbo, accept_xb = draw_with_heads(g, p, jnp.asarray(prompt_bt), jnp.asarray([len(q) for q in prompts]),
                                         keys_x, graphdef_config=base.config)
    check = law_check(np.asarray(out_xbo), [0, 1], laws)
    assert check["n"] >= 20_000 and passes(check), check
    share = np.bincount(np.asarray(accept_xb).ravel(), minlength=3) / accept_xb.size
    assert share[1:].sum() > 0.05, share  # the drafts are accepted, so the tree walk is exercised


def test_exact_medusa_on_a_dynamic_tree_has_the_plain_samplers_law(setup):
    """Ragged batch of 4, each row's tree grown per step from the planted candidates' log q."""
    out_xbo, accept_xb, rows = run(setup, PROMPTS, 5_000, EXACT, seed=11, tree=DYNAMIC)
    check = law_check(out_xbo, rows, setup[2])
    assert check["n"] >= 20_000
    assert passes(check), check
    share = np.bincount(accept_xb.ravel(), minlength=3) / accept_xb.size
    assert (share > 0.05).all(), share


@partial(jax.jit, static_argnames=("graphdef", "graphdef_config"))
def draw_rows(graphdef, params, prompt_bt, lens_b, temperature_b, seeds_xb, table, *, graphdef_config):
    """draw() with each row's own settings (`RowAcceptance`, the generation engine's): run x's row b has
    temperature_b[b] (0: greedy) and the seed seeds_xb[x, b]; the coins come from the seeds alone."""
    def one(seed_b):
        sampling = RowSampling(temperature_b, jnp.full(temperature_b.shape, SAMPLING.top_p),
                               jnp.full(temperature_b.shape, SAMPLING.top_k), seed_b)
        cache = KVCache.zeros(graphdef_config, prompt_bt.shape[0], 16)
        state = decode_states(graphdef, params, cache, prompt_bt, lens_b, jax.random.key(0), table, tree=TREE,
                              max_new_tokens=N_OUT, acceptance=RowAcceptance(sampling), eos_ids=(), pad_id=0,
                              proposer=table_proposer)
        return state.out_bo, state.accept_bo[:, 0]

    return jax.vmap(one)(seeds_xb)


def test_per_row_exact_sampling_beside_greedy_rows_has_the_plain_samplers_law(setup):
    """The engine's per-row acceptance: sampled rows (0 and 2) beside greedy rows (1 and 3) in one batch; the
    sampled rows pass the law check, the greedy rows always give the argmax chain, and the same seeds give the
    same samples."""
    graphdef, params, laws, table = setup
    prompt_bt = np.zeros((len(PROMPTS), WIDTH), np.int32)
    for i, p in enumerate(PROMPTS):
        prompt_bt[i, : len(p)] = p
    temperature_b = jnp.asarray([SAMPLING.temperature, 0.0, SAMPLING.temperature, 0.0], jnp.float32)
    seeds_xb = jnp.asarray(np.arange(10_000 * 4, dtype=np.uint32).reshape(10_000, 4))
    args = (graphdef, params, jnp.asarray(prompt_bt), jnp.asarray([len(p) for p in PROMPTS]), temperature_b)
    out_xbo, accept_xb = draw_rows(*args, seeds_xb, table, graphdef_config=graphdef_config(graphdef, params))
    out_xbo, accept_xb = np.asarray(out_xbo), np.asarray(accept_xb)
    check = law_check(out_xbo[:, [0, 2]], [0, 2], laws)
    assert check["n"] >= 20_000 and passes(check), check
    share = np.bincount(accept_xb[:, [0, 2]].ravel(), minlength=3) / (2 * accept_xb.shape[0])
    assert (share > 0.05).all(), share  # the tree walk is exercised
    greedy = graphdef, params, jnp.asarray(prompt_bt[1::2]), jnp.asarray([len(p) for p in PROMPTS[1::2]])
    argmax_bo = np.asarray(medusa_decode(*greedy[:2], KVCache.zeros(graphdef_config(graphdef, params), 2, 16),
                                         *greedy[2:], jax.random.key(0), tree=TREE, max_new_tokens=N_OUT,
                                         acceptance=GREEDY, eos_ids=(), pad_id=0)[0])
    assert (out_xbo[:, 1::2] == argmax_bo[None]).all()
    again, _ = draw_rows(*args, seeds_xb[:500], table, graphdef_config=graphdef_config(graphdef, params))
    assert (np.asarray(again) == out_xbo[:500]).all()


def test_the_check_rejects_typical_acceptance(setup):
    """Typical acceptance (a real, deliberately different sampler) on the same run: the check must fail."""
    typical = DecodeConfig(SamplingConfig(SAMPLING.temperature), AcceptanceConfig("typical"))
    out_xbo, _, rows = run(setup, PROMPTS[:1], 4_000, typical, seed=4)
    check = law_check(out_xbo, rows, setup[2])
    assert not passes(check), check


def test_the_check_rejects_exact_acceptance_without_renormalisation(setup, monkeypatch):
    """The subtle bug: accept x_i with probability q(x_i) instead of q(x_i) / (1 - mass of rejected siblings).
    pad_id=1 (no effect on these outputs) makes jit trace the loop again with the broken rule."""
    def no_renormalisation(tokens_bt, node_prob_bt, uniform_bt, tree):
        return uniform_bt < node_prob_bt

    monkeypatch.setattr(exact_acceptance, "trial_outcomes", no_renormalisation)
    out_xbo, _, rows = run(setup, PROMPTS[:1], 20_000, EXACT, seed=1, pad_id=1)
    check = law_check(out_xbo, rows, setup[2])
    assert not passes(check), check


def test_same_seed_same_samples(setup):
    # 1,000 runs of the 4 rows tell two seeds apart (the law tests' 5,000 took ~4 s a run here)
    a, _, _ = run(setup, PROMPTS, 1_000, EXACT, seed=7)
    b, _, _ = run(setup, PROMPTS, 1_000, EXACT, seed=7)
    c, _, _ = run(setup, PROMPTS, 1_000, EXACT, seed=8)
    assert (a == b).all() and not (a == c).all()


def test_target_logits_applies_temperature_then_top_k_then_top_p():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    probs = np.asarray(jax.nn.softmax(target_logits(logits, SamplingConfig(1.0, top_p=0.8, top_k=4)), axis=-1))
    # top-4 drops 0.05; renormalised 0.4/.95, 0.3/.95, 0.15/.95 reach 0.8 -> 0.1 is cut too
    np.testing.assert_allclose(probs, [[0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85]], atol=1e-6)
    hot = np.asarray(jax.nn.softmax(target_logits(logits, SamplingConfig(2.0)), axis=-1))
    ref = np.asarray([0.05, 0.4, 0.1, 0.3, 0.15]) ** 0.5
    np.testing.assert_allclose(hot[0], ref / ref.sum(), atol=1e-6)
    sample = jax.jit(sample_tokens, static_argnums=2)
    draws = sample(jnp.tile(logits, (4000, 1)), jax.random.key(0), SamplingConfig(1.0, top_p=0.8, top_k=4))
    assert set(np.unique(np.asarray(draws)).tolist()) == {1, 3, 4}  # plain sampling uses the same filter


def test_repeated_sibling_is_never_accepted_and_does_not_count_twice():
    tree = build_tree([(0,), (1,), (2,)])
    tokens_bt = jnp.asarray([[0, 5, 5, 6]])  # node 2 repeats node 1's token
    prob_bt = jnp.asarray([[0.0, 0.5, 0.5, 0.25]])
    # coins: node 1 rejected (0.9 > 0.5); node 2 has probability 0; node 3: 0.45 * (1 - 0.5) < 0.25 -> accepted
    accept = trial_outcomes(tokens_bt, prob_bt, jnp.asarray([[0.0, 0.9, 0.0, 0.45]]), tree)
    assert accept.tolist() == [[False, False, False, True]]
    logits = jnp.zeros((1, 4, 8)).at[0, 0, 5].set(5.0)
    accept = jax.jit(exact_accept, static_argnums=(0, 4))
    length_b, nodes_be, bonus_b = accept(tree, tokens_bt, logits, jax.random.key(0), SamplingConfig(1.0))
    assert int(length_b[0]) in (0, 1) and int(nodes_be[0, 0]) == 0
    if int(length_b[0]) == 0:
        assert int(bonus_b[0]) not in (5, 6)  # the rejected children's tokens are excluded from the bonus


def test_decode_config_resolves_the_kind_and_refuses_conflicts():
    """One decode config: the sampling settings once, the acceptance beside them (kind None: greedy at
    temperature 0, exact otherwise)."""
    assert DecodeConfig(SamplingConfig(0.7, top_k=5)).kind == "exact"
    assert DecodeConfig().kind == "greedy" and GREEDY.kind == "greedy"
    with pytest.raises(ValueError, match="typical"):
        DecodeConfig(SamplingConfig(0.7, top_p=0.9), AcceptanceConfig("typical"))
    with pytest.raises(ValueError, match="temperature"):
        DecodeConfig(SamplingConfig(), AcceptanceConfig("exact"))
    with pytest.raises(ValueError, match="temperature 0"):
        DecodeConfig(SamplingConfig(0.7), AcceptanceConfig("greedy"))
    with pytest.raises(ValueError, match="kind"):
        AcceptanceConfig("sampled")
