"""Typical acceptance row by row (inference/row_acceptance.py, the generation engine's drafted rows) against the
batch path's (inference/acceptance.py `accept_tree` / `sample_next` with one `DecodeConfig`), which generate_batch
used before typical requests moved to the engine.

The walk is deterministic given the tree and the logits: every row's accept length and accepted nodes equal the
batch path's with that row's temperature, threshold and alpha, whatever its neighbours use. The bonus token and
the first token are draws: over many seeds (per-row keys) and many keys (the batch path's), both land in the
same typical set with the same law (a two-sample chi-square on the drawn tokens, p > 1e-3). End to end,
generate_batch's typical rows through the engine accept what the batch path accepts: a threshold nothing reaches
gives plain greedy's tokens, and any run is seeded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.trees.tree import build_tree, load_tree
from medusa_jax.inference.acceptance import AcceptanceConfig, DecodeConfig, accept_tree, sample_next
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.row_acceptance import first_row_tokens, typical_rows
from medusa_jax.inference.row_sampling import RowSampling
from medusa_jax.inference.sampling import SamplingConfig
from decode_helpers import prompts_of, randomise_kernels

V = 12
TREE = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], name="typical-rows")
# (temperature, posterior threshold, posterior alpha): loose to strict typical sets
SETTINGS = [(0.7, 0.09, 0.3), (1.0, 0.3, 0.5), (0.4, 0.05, 0.1), (1.3, 0.2, 1.0)]
DRAWS = 4000


def tree_case(seed: int, rows: int):
    """Random tree tokens [b, t] and sharp-ish logits [b, t, V] over a 12-token vocabulary."""
    rng = np.random.RandomState(seed)
    tokens_bt = rng.randint(0, V, (rows, TREE.num_tokens)).astype(np.int32)
    logits_btv = (rng.normal(0, 2.0, (rows, TREE.num_tokens, V))).astype(np.float32)
    # plant each node's argmax as its first child's token now and then, so some paths are accepted deep
    for b in range(rows):
        for node, parent in enumerate(TREE.parent_t):
            if node and rng.rand() < 0.6:
                logits_btv[b, parent, tokens_bt[b, node]] += 4.0
    return jnp.asarray(tokens_bt), jnp.asarray(logits_btv)


def decode_config(temperature, threshold, alpha) -> DecodeConfig:
    return DecodeConfig(SamplingConfig(temperature), AcceptanceConfig("typical", threshold, alpha))


def row_sampling(settings, seeds) -> RowSampling:
    return jax.tree.map(jnp.asarray, RowSampling.of([SamplingConfig(t) for t, _, _ in settings], seeds,
                                                    [AcceptanceConfig("typical", e, a) for _, e, a in settings]))


def test_each_rows_typical_walk_is_the_batch_paths_with_its_settings():
    """Rows with four different settings in one call: accept lengths and accepted nodes are, row by row, what the
    batch path gives that row alone with its settings; some paths are accepted at depth >= 2."""
    tokens_bt, logits_btv = tree_case(0, 8)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(8)]
    lengths_b = jnp.arange(8, dtype=jnp.int32) + 5
    length_b, nodes_be, _ = typical_rows(TREE, tokens_bt, logits_btv, lengths_b, row_sampling(settings, range(8)))
    for b, s in enumerate(settings):
        want_len, want_nodes, _ = accept_tree(TREE, tokens_bt[b:b + 1], logits_btv[b:b + 1], jax.random.key(0),
                                              decode_config(*s))
        assert int(length_b[b]) == int(want_len[0]), (b, s)
        np.testing.assert_array_equal(nodes_be[b], want_nodes[0])
    assert int(jnp.max(length_b)) >= 2


def same_law(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square p-value of two samples of tokens (cells seen in either)."""
    cells = np.union1d(a, b)
    table = np.stack([[np.sum(a == c) for c in cells], [np.sum(b == c) for c in cells]])
    return 1.0 if len(cells) == 1 else stats.chi2_contingency(table)[1]


@pytest.mark.parametrize("setting", SETTINGS[:2])
def test_bonus_and_first_tokens_have_the_batch_paths_law(setting):
    """One row's bonus token (at its accepted path's end) and first token (after a flat distribution): DRAWS per-row
    draws (one seed each) and DRAWS batch-path draws (one key each) fall in the same set with the same law."""
    tokens_bt, logits_btv = tree_case(1, 1)
    config = decode_config(*setting)
    seeds = np.arange(DRAWS)
    sampling = row_sampling([setting] * DRAWS, seeds)
    tokens_xt, logits_xtv = jnp.repeat(tokens_bt, DRAWS, 0), jnp.repeat(logits_btv, DRAWS, 0)
    _, _, bonus_x = typical_rows(TREE, tokens_xt, logits_xtv, jnp.full((DRAWS,), 9, jnp.int32), sampling)
    keys = jax.random.split(jax.random.key(7), DRAWS)
    batch_bonus_x = jax.vmap(lambda k: accept_tree(TREE, tokens_bt, logits_btv, k, config)[2][0])(keys)
    bonus, batch_bonus = np.asarray(bonus_x), np.asarray(batch_bonus_x)
    assert set(bonus) == set(batch_bonus)
    assert same_law(bonus, batch_bonus) > 1e-3
    prompt_end_1v = jax.random.normal(jax.random.key(3), (1, V))  # a flat distribution: a typical set of several
    first = np.asarray(first_row_tokens(jnp.repeat(prompt_end_1v, DRAWS, 0), sampling))
    batch_first = np.asarray(jax.vmap(lambda k: sample_next(prompt_end_1v, k, config)[0])(keys))
    assert set(first) == set(batch_first) and len(set(first)) > 1
    assert same_law(first, batch_first) > 1e-3


@pytest.fixture(scope="module")
def drafted(tiny_model_dir):
    base = load_pretrained(tiny_model_dir("llama", initializer_range=0.1))
    heads = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=3), base, seed=0)
    randomise_kernels([block.linear for head in heads.heads for block in head.blocks], 0)
    return base, heads


def test_generate_batch_typical_rows_through_the_engine(drafted):
    """generate_medusa with typical acceptance (sorted batches through the engine): a threshold no probability
    reaches accepts nothing and gives plain greedy's tokens; a usual one runs to the budget, is seeded (the same
    seed, the same tokens) and accepts within the tree's depth."""
    base, heads = drafted
    prompts, n = prompts_of((5, 17, 9), seed=2), 12
    tree = load_tree("mc_sim_7b_16", num_heads=3, max_top_k=heads.config.head_vocab_size)
    nothing = AcceptanceConfig("typical", posterior_threshold=1.0, posterior_alpha=1e9)
    got = generate_medusa(base, heads, prompts, tree=tree, max_new_tokens=n, eos_ids=(), sampling=SamplingConfig(0.9),
                          acceptance=nothing, seed=1)
    assert [r.token_ids for r in got] == [r.token_ids for r in generate(base, prompts, max_new_tokens=n, eos_ids=())]
    typical = dict(tree=tree, max_new_tokens=n, eos_ids=(), sampling=SamplingConfig(0.7),
                   acceptance=AcceptanceConfig("typical"), seed=3)
    runs = [generate_medusa(base, heads, prompts, **typical) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert all(len(r.token_ids) == n and all(0 <= a <= tree.depth for a in r.accept_lengths) for r in runs[0])
