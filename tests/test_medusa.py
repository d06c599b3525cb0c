"""Medusa decoding: lossless greedy (== plain greedy token for token), every accept length, per-row EOS and
max_new_tokens, typical acceptance, capacity errors; tiny Llama/Qwen2/Mistral (SmolLM2's is in test_smollm2). The
losslessness tests run for Medusa heads, Hydra heads and the EAGLE drafter (which draft the tree themselves).

The planted proposer (`medusa_jax/trees/search/oracle.py`) knows the true continuation (from a plain greedy run) and puts
it at chosen (head, rank) slots so that step i of row b accepts exactly accept_targets[b, i] candidates: every
accept length is exercised. Every losslessness test also runs on a dynamic tree (EAGLE-2 style, grown per step
from the drafter's probabilities; the planted proposer grows it from the planted candidates).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.model.kv_cache import KVCache, move_slots
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.folder import save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.trees.tree import PRESETS, TreeError, load_tree
from medusa_jax.inference.acceptance import GREEDY, AcceptanceConfig, accept_tree, greedy_accept, typical_accept
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.autoregressive import (grouped_prefill, narrow_prefill_states, prefill, prefill_groups,
                                                 prefill_states)
from medusa_jax.inference.medusa import compact_accepted, medusa_decode, move_cache_slots
from medusa_jax.trees.search.oracle import planted_data, planted_over_heads_proposer, planted_proposer

import decode_helpers
from decode_helpers import heads_or_planted, randomise_kernels

N = 40  # max_new_tokens of the tiny-model runs (one compile per model, tree, batch and proposer)
PROMPTS = {
    "batch1": [[5, 9, 2, 17, 33, 4]],
    "ragged4": [[11, 3, 8, 21, 7, 2], [40, 41, 9, 13, 5, 77, 61, 2, 19, 30, 8, 4, 99], [6, 1, 3],
                [50, 22, 16, 90, 4, 3, 8, 12, 70]],
}


def plant(tree, reference, accept_targets):
    return planted_data(tree, reference, accept_targets, N)


def cycling_targets(batch: int, depth: int) -> np.ndarray:
    return decode_helpers.cycling_targets(batch, depth, N)


def random_heads(base, seed=0, num_heads=4, **config):
    """init_heads plus random ResBlock (and Hydra input) weights, so the proposals differ from the base
    model's own and Hydra heads' depend on their path."""
    heads = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=num_heads,
                                   **config), base, seed=seed)
    randomise_kernels([linear for head in heads.heads
                       for linear in [block.linear for block in head.blocks] + [getattr(head, "input_proj", None)]
                       if linear is not None], seed)
    return heads


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(kind, head_type) -> (base, random heads, {case: (eos_ids, plain greedy token ids per row)}).

    One plain greedy run of all five prompts gives every reference (rows decode independently, as
    test_batches_with_grouped_prefill_are_lossless checks): greedy decoding with an EOS is the run without it cut
    after the row's first EOS (test_loader checks that `generate` does exactly that), so one compile per model
    serves both cases."""
    made, heads = {}, {}

    def get(kind, head_type="medusa"):
        if kind not in made:
            # a wider init than the default 0.02 gives varied (not constant) greedy continuations
            base = load_pretrained(tiny_model_dir(kind, initializer_range=0.3))
            first, *free = ids(generate(base, PROMPTS["batch1"] + PROMPTS["ragged4"], max_new_tokens=N, eos_ids=()))
            eos = pick_eos(free[1], lo=N // 3)
            refs = {"batch1": ((), [first]), "ragged4": ((eos,), [until_eos(row, eos) for row in free])}
            assert len(refs["ragged4"][1][1]) < N  # row 1 stops at the EOS, mid-generation
            made[kind] = (base, refs)
        base, refs = made[kind]
        if (kind, head_type) not in heads:
            heads[kind, head_type] = random_heads(base, head_type=head_type)
        return base, heads[kind, head_type], refs

    return get


def pick_eos(tokens, lo, avoid_multiple_of=None):
    """A token whose first occurrence in `tokens` is at a position >= lo (and not a multiple of the given)."""
    for p in range(lo, len(tokens) - 2):
        if tokens[p] not in tokens[:p] and (avoid_multiple_of is None or p % avoid_multiple_of):
            return int(tokens[p])
    raise AssertionError(f"no usable EOS token in {tokens}")


def ids(results):
    return [r.token_ids for r in results]


def until_eos(tokens, eos):
    """A free-running row's tokens up to and including its first `eos` (all of them when it has none)."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


HEAD_TYPES = ["medusa", "hydra", "eagle"]
DYNAMIC = "dynamic:10,k=3,d=4"  # 3 + 3 * 9 drafted candidates per step, the 10 best verified
DYNAMIC_3 = "dynamic:6,k=2,d=3"


# The presets are prefixes of one 63-node tree: the largest and the smallest run in the matrix (the 16- and
# 32-node ones run in the grouped-prefill, EOS, sampling, sliding-window and Hydra tests), with the dynamic tree.
MATRIX_TREES = ["mc_sim_7b_63", "mc_sim_7b_8", DYNAMIC]
assert set(MATRIX_TREES[:2]) <= set(PRESETS)
# Every tree with every head type on ragged Llama rows; one row alone and Qwen2 (biased QKV projections, tied
# embeddings) once per tree and per head type. Every pair of values of the four factors (model, tree, rows, head
# type) meets in some case: 16 of the 36 combinations, each a compile of its own.
MATRIX = [("llama", tree, "ragged4", head) for tree in MATRIX_TREES for head in HEAD_TYPES] + [
    ("llama", "mc_sim_7b_63", "batch1", "medusa"), ("llama", DYNAMIC, "batch1", "hydra"),
    ("llama", "mc_sim_7b_8", "batch1", "eagle"), ("qwen2", DYNAMIC, "ragged4", "medusa"),
    ("qwen2", "mc_sim_7b_8", "ragged4", "hydra"), ("qwen2", "mc_sim_7b_63", "ragged4", "eagle"),
    ("qwen2", "mc_sim_7b_63", "batch1", "hydra")]


def test_the_matrix_covers_every_pair_of_factor_values():
    levels = [("llama", "qwen2"), MATRIX_TREES, ("batch1", "ragged4"), HEAD_TYPES]
    for i, j in itertools.combinations(range(4), 2):
        assert {(case[i], case[j]) for case in MATRIX} == set(itertools.product(levels[i], levels[j])), (i, j)


@pytest.mark.parametrize("kind, tree_name, case, head_type", MATRIX)
def test_medusa_greedy_equals_plain_greedy(tiny, kind, tree_name, case, head_type):
    base, heads, refs = tiny(kind, head_type)
    eos_ids, reference = refs[case]
    tree = load_tree(tree_name)
    prompts = PROMPTS[case]
    accept_targets = cycling_targets(len(prompts), tree.depth)
    data = plant(tree, reference, accept_targets)
    run = lambda use_planted: generate_medusa(  # noqa: E731
        base, heads, prompts, tree=tree, max_new_tokens=N, eos_ids=eos_ids, proposer=heads_or_planted,
        proposer_data={**data, "use_planted": jnp.asarray(use_planted)})
    got = run(False)  # the heads' own proposals
    assert ids(got) == reference
    for r in got:
        assert r.steps == 1 + len(r.accept_lengths)
        assert all(0 <= a <= tree.depth for a in r.accept_lengths)

    got = run(True)
    assert ids(got) == reference
    histogram = np.zeros(tree.depth + 1, int)
    for b, r in enumerate(got):
        # every step but the last (which may run past the known continuation) accepts exactly its target
        assert r.accept_lengths[:-1] == accept_targets[b, : len(r.accept_lengths) - 1].tolist()
        histogram += r.accept_histogram(tree.depth)
    assert (histogram > 0).all(), histogram
    assert sum(r.new_tokens for r in got) / sum(r.steps for r in got) > 1.5


def test_grouped_prefill_equals_prefill_in_any_row_order(tiny):
    """Rows prefilled in length groups, each at its own width, get the K/V, hidden state and length the
    whole-batch prefill gives them (rows unsorted; the widths 64, 96 and 128 all used)."""
    base, _, _ = tiny("llama")
    lengths = [3, 120, 7, 64, 65, 1, 90, 30]
    prompt_bt = np.zeros((8, 128), np.int32)
    rng = np.random.default_rng(0)
    for b, n in enumerate(lengths):
        prompt_bt[b, :n] = rng.integers(1, base.config.vocab_size, n)
    assert prefill_groups(8) == 2 and prefill_groups(16) == 4 and prefill_groups(64) == 8
    assert prefill_groups(4) == 1 and prefill_groups(64, row_multiple=2) == 1
    args = (jnp.asarray(prompt_bt), jnp.asarray(lengths))
    want_bd, want = jax.jit(lambda p, n, c: prefill(base, p, n, c))(*args, KVCache.zeros(base.config, 8, 160))
    for groups in (2, 4, 8):
        got_bd, got = jax.jit(lambda p, n, c: grouped_prefill(base, p, n, c, groups))(
            *args, KVCache.zeros(base.config, 8, 160))
        np.testing.assert_allclose(np.asarray(got_bd), np.asarray(want_bd), rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(got.lengths_b), lengths)
        for b, n in enumerate(lengths):
            for layer in range(base.config.num_layers):
                np.testing.assert_allclose(np.asarray(got.k_bkhs[layer][b, :, :, :n]),
                                           np.asarray(want.k_bkhs[layer][b, :, :, :n]), rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(np.asarray(got.v_bksh[layer][b, :, :n]),
                                           np.asarray(want.v_bksh[layer][b, :, :n]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("longest, width", [(64, 64), (90, 96), (100, 128)])
def test_narrow_prefill_equals_the_padded_width(tiny, longest, width):
    """A small batch (one group) padded to t = 256 is prefilled at the narrowest width holding its longest
    prompt (64, 96, then 128): the same last hidden states, K/V of the prompt slots, lengths, every prompt position's
    hidden state and an EAGLE-3 style tap as the prefill at the whole width; positions past the width are zero."""
    base, _, _ = tiny("llama")
    lengths = [longest, 9, 1]
    prompt_bt = np.zeros((3, 256), np.int32)
    rng = np.random.default_rng(2)
    for b, n in enumerate(lengths):
        prompt_bt[b, :n] = rng.integers(1, base.config.vocab_size, n)
    args = (jnp.asarray(prompt_bt), jnp.asarray(lengths))
    for taps in ((), (1,)):
        want_bd, want, want_btd = jax.jit(lambda p, n, c: prefill_states(base, p, n, c, taps))(
            *args, KVCache.zeros(base.config, 3, 300))
        got_bd, got, got_btd = jax.jit(lambda p, n, c: narrow_prefill_states(base, p, n, c, True, taps))(
            *args, KVCache.zeros(base.config, 3, 300))
        close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # noqa
        close(got_bd, want_bd)
        np.testing.assert_array_equal(np.asarray(got.lengths_b), lengths)
        assert not np.asarray(got_btd[:, width:]).any()
        for b, n in enumerate(lengths):
            close(got_btd[b, :n], want_btd[b, :n])
            for layer in range(base.config.num_layers):
                close(got.k_bkhs[layer][b, :, :, :n], want.k_bkhs[layer][b, :, :, :n])
                close(got.v_bksh[layer][b, :, :n], want.v_bksh[layer][b, :, :n])
    _, _, none = jax.jit(lambda p, n, c: narrow_prefill_states(base, p, n, c))(*args, KVCache.zeros(base.config, 3, 300))
    assert none is None


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_batches_with_grouped_prefill_are_lossless(tiny, head_type):
    """A batch of 16 ragged prompts (prefilled in 4 length groups) decodes, plainly and with a tree, what
    each prompt decodes alone."""
    base, heads, _ = tiny("llama", head_type)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, base.config.vocab_size, n).tolist()
               for n in (9, 100, 3, 41, 70, 1, 12, 66, 5, 80, 20, 2, 33, 64, 7, 50)]
    alone = [generate(base, [p], max_new_tokens=12, eos_ids=())[0].token_ids for p in prompts]
    assert ids(generate(base, prompts, max_new_tokens=12, eos_ids=())) == alone
    assert ids(generate_medusa(base, heads, prompts, tree="mc_sim_7b_16", max_new_tokens=12, eos_ids=())) == alone


# the planted proposer drafts for every head type: each runs once, and the static and dynamic trees both
@pytest.mark.parametrize("head_type, tree_name", [("medusa", "mc_sim_7b_16"), ("medusa", DYNAMIC_3),
                                                  ("hydra", DYNAMIC_3), ("eagle", "mc_sim_7b_16")])
def test_eos_inside_an_accepted_path_and_max_new_tokens_cut_the_last_step(tiny, head_type, tree_name):
    base, heads, refs = tiny("llama", head_type)
    tree = load_tree(tree_name)  # depth 3: full acceptance emits 4 tokens per step
    reference = refs["batch1"][1]
    always_full = np.full((1, N), tree.depth)
    data = plant(tree, reference, always_full)
    got = generate_medusa(base, heads, PROMPTS["batch1"], tree=tree, max_new_tokens=N - 2,  # 1 + 4 * 9 + 1
                          proposer=planted_over_heads_proposer, proposer_data=data, eos_ids=())
    assert got[0].token_ids == reference[0][: N - 2]
    assert got[0].accept_lengths == [3] * 10 and got[0].steps == 11

    eos = pick_eos(reference[0], lo=N // 3, avoid_multiple_of=tree.depth + 1)
    stop = reference[0].index(eos)
    got = generate_medusa(base, heads, PROMPTS["batch1"], tree=tree, max_new_tokens=N - 2,
                          proposer=planted_over_heads_proposer, proposer_data=data, eos_ids=(eos,))
    assert got[0].token_ids == reference[0][: stop + 1]  # the path's tokens after the EOS dropped
    assert got[0].accept_lengths == [3] * (-(-stop // 4))


# the EAGLE drafter attends (with its own cache) under the window: both trees; the heads once each
@pytest.mark.parametrize("head_type, tree_name", [("medusa", "mc_sim_7b_32"), ("hydra", DYNAMIC),
                                                  ("eagle", "mc_sim_7b_32"), ("eagle", DYNAMIC)])
def test_sliding_window_model_is_lossless(tiny, head_type, tree_name):
    base, heads, refs = tiny("mistral", head_type)  # sliding_window 16 < prompt + 40 new tokens
    eos_ids, reference = refs["ragged4"]
    tree = load_tree(tree_name)
    data = plant(tree, reference, cycling_targets(4, tree.depth))
    for use_planted in (False, True):
        got = generate_medusa(base, heads, PROMPTS["ragged4"], tree=tree, max_new_tokens=N, eos_ids=eos_ids,
                              proposer=heads_or_planted,
                              proposer_data={**data, "use_planted": jnp.asarray(use_planted)})
        assert ids(got) == reference


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_16", DYNAMIC_3])
def test_typical_acceptance_near_zero_temperature_equals_greedy(tiny, tree_name):
    base, heads, refs = tiny("qwen2")
    eos_ids, reference = refs["ragged4"]
    got = generate_medusa(base, heads, PROMPTS["ragged4"], tree=tree_name, max_new_tokens=N,
                          eos_ids=eos_ids, sampling=SamplingConfig(1e-4), acceptance=AcceptanceConfig("typical"),
                          seed=3)
    assert ids(got) == reference


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_16", DYNAMIC_3])
def test_exact_acceptance_near_zero_temperature_equals_greedy(tiny, tree_name):
    """Ragged rows and a mid-run EOS through the exact sampler: at T -> 0 its law is the argmax's."""
    base, heads, refs = tiny("llama")
    eos_ids, reference = refs["ragged4"]
    got = generate_medusa(base, heads, PROMPTS["ragged4"], tree=tree_name, max_new_tokens=N,
                          eos_ids=eos_ids, sampling=SamplingConfig(1e-4), acceptance=AcceptanceConfig("exact"),
                          seed=3)
    assert ids(got) == reference


def test_typical_acceptance_is_seeded(tiny):
    base, heads, _ = tiny("qwen2")
    run = lambda seed: generate_medusa(base, heads, PROMPTS["ragged4"], tree="mc_sim_7b_16", max_new_tokens=N,
                                       eos_ids=(), sampling=SamplingConfig(1.0),
                                       acceptance=AcceptanceConfig("typical"),
                                       seed=seed)
    a, b, c = run(0), run(0), run(1)
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert all(len(r.token_ids) == N and 0 <= min(r.token_ids) and max(r.token_ids) < 128 for r in a)


# a dynamic tree grows from the heads' probabilities over their (shared or truncated) vocabulary: every head
# type on it; the static tree once
@pytest.mark.parametrize("head_type, tree_name", [("medusa", "mc_sim_7b_8"), ("medusa", DYNAMIC_3),
                                                  ("hydra", DYNAMIC_3), ("eagle", DYNAMIC_3)])
def test_other_lm_head_modes_are_lossless(tiny, head_type, tree_name):
    base, _, refs = tiny("llama")
    eos_ids, reference = refs["ragged4"]
    token_map = np.random.RandomState(1).permutation(base.config.vocab_size)[:48]
    for heads in (random_heads(base, seed=2, lm_head="shared", head_type=head_type),
                  random_heads(base, seed=3, lm_head="truncated", truncated_vocab_size=48, head_type=head_type)):
        if heads.token_map is not None:
            heads.token_map[...] = jnp.asarray(token_map, jnp.int32)
        got = generate_medusa(base, heads, PROMPTS["ragged4"], tree=tree_name, max_new_tokens=N,
                              eos_ids=eos_ids)
        assert ids(got) == reference


def test_prompt_plus_budget_over_capacity_is_a_clear_error(tiny):
    base, heads, _ = tiny("llama")
    with pytest.raises(ValueError, match=r"\+ 17 scratch slots needs 145 cache slots, but cache_size is 128"):
        generate_medusa(base, heads, PROMPTS["batch1"], tree="mc_sim_7b_16", max_new_tokens=64, cache_size=128)
    with pytest.raises(TreeError, match="only 2 Medusa heads"):
        generate_medusa(base, random_heads(base, num_heads=2), PROMPTS["batch1"], tree="mc_sim_7b_63")


def test_greedy_and_typical_accept_on_hand_made_paths():
    valid_ce = jnp.asarray([[True, True, True], [True, True, False]])
    cand_bce = jnp.asarray([[[1, 2, 3], [1, 5, 0]], [[4, 2, 3], [7, 8, 0]]])
    pred_bce = jnp.asarray([[[1, 2, 9], [1, 5, 0]], [[1, 2, 3], [7, 8, 0]]])
    length_b, path_b = greedy_accept(cand_bce, pred_bce, valid_ce)
    assert length_b.tolist() == [2, 2] and path_b.tolist() == [0, 1]  # padding never counts as a match

    prob_bce = jnp.asarray([[[0.5, 0.2, 0.01], [0.6, 0.3, 0.9]]])
    thr_bce = jnp.full((1, 2, 3), 0.09)
    length_b, path_b = typical_accept(prob_bce, thr_bce, valid_ce)
    assert length_b.tolist() == [2] and path_b.tolist() == [1]  # tie at 2: path 1 is more likely


def test_accept_tree_bonus_is_the_argmax_after_the_accepted_path():
    tree = load_tree("mc_sim_7b_8")  # nodes: root, [0], [1], [2], [0,0], [0,1], [0,2], [1,0], [0,0,0]
    tokens_bt = jnp.asarray([[10, 11, 12, 13, 14, 15, 16, 17, 18]])
    best = {0: 12, 2: 17, 7: 30}  # root -> 12 (node 2 = [1]), node 2 -> 17 (node 7 = [1, 0]), node 7 -> 30
    logits_btv = np.zeros((1, 9, 32), np.float32)
    for t in range(9):
        logits_btv[0, t, best.get(t, 31)] = 1.0
    length_b, nodes_be, bonus_b = accept_tree(tree, tokens_bt, jnp.asarray(logits_btv), jax.random.key(0),
                                              GREEDY)
    assert length_b.tolist() == [2] and nodes_be[0, :3].tolist() == [0, 2, 7] and bonus_b.tolist() == [30]


def test_compact_accepted_moves_only_the_path():
    k = jnp.arange(2 * 16, dtype=jnp.float32).reshape(2, 1, 1, 16)  # one layer, [B, K, H, S]
    cache = KVCache((k, 2 * k), (k.transpose(0, 1, 3, 2), -k.transpose(0, 1, 3, 2)), jnp.asarray([3, 5], jnp.int32))
    out = compact_accepted(cache, jnp.asarray([[0, 4, 6], [0, 1, 2]]))
    expect = np.asarray(k).copy()
    expect[0, ..., 4], expect[0, ..., 5] = expect[0, ..., 7], expect[0, ..., 9]
    np.testing.assert_array_equal(out.k_bkhs[0], expect)
    np.testing.assert_array_equal(out.k_bkhs[1], 2 * expect)
    np.testing.assert_array_equal(out.v_bksh[0], expect.transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(out.v_bksh[1], -expect.transpose(0, 1, 3, 2))
    assert out.lengths_b.tolist() == [3, 5]


def test_cache_move_is_skipped_only_when_every_move_is_a_no_op():
    """`move_cache_slots` (jitted, as in the loop) under its `run_if`: one row's real move is made, beside a row whose
    moves are all no-ops; a batch of no-op moves (a step that accepted nothing) leaves the cache as it was."""
    k = jnp.arange(2 * 16, dtype=jnp.float32).reshape(2, 1, 1, 16)
    cache = KVCache((k,), (k.transpose(0, 1, 3, 2),), jnp.asarray([3, 5], jnp.int32))
    move = jax.jit(move_cache_slots)
    out = move(cache, jnp.asarray([[3, 7], [5, 6]]), jnp.asarray([[3, 4], [5, 6]]))
    expect = np.asarray(k).copy()
    expect[0, ..., 4] = expect[0, ..., 7]
    np.testing.assert_array_equal(out.k_bkhs[0], expect)
    np.testing.assert_array_equal(out.v_bksh[0], expect.transpose(0, 1, 3, 2))
    same = move(cache, jnp.asarray([[3, 4], [5, 6]]), jnp.asarray([[3, 4], [5, 6]]))
    np.testing.assert_array_equal(same.k_bkhs[0], k)
    np.testing.assert_array_equal(same.v_bksh[0], k.transpose(0, 1, 3, 2))


@pytest.mark.parametrize("last", [1, 2, 3, 5, 6, 8])
def test_cache_move_at_each_width_is_the_whole_move(last):
    """`move_cache_slots` makes the move at the narrowest of `move_widths(e)` past the last entry any row moves:
    wherever that entry is (inside the first width, at a width's edge, past the last narrower one), the cache is
    what the whole move of all e entries (`kv_cache.move_slots`) leaves, the other row's later entries no-ops."""
    from medusa_jax.inference.medusa import move_widths

    e, s = 9, 40
    assert move_widths(e) == (3, 6, 9)
    k = jnp.arange(2 * s, dtype=jnp.float32).reshape(2, 1, 1, s) + 1
    cache = KVCache((k, -k), (k.transpose(0, 1, 3, 2), 2 * k.transpose(0, 1, 3, 2)), jnp.asarray([4, 10], jnp.int32))
    dst = np.asarray([[4], [10]]) + np.arange(e)[None, :]
    src = dst.copy()
    src[0, 1:last] += 11  # row 0 moves entries 1 .. last - 1 from past the tree block's end
    src[1, 1:min(last, 3)] += 3  # row 1 a shorter path
    src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
    got = jax.jit(move_cache_slots)(cache, src, dst)
    want = move_slots(cache, src, dst)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert (last > 1) == bool(np.any(np.asarray(got.k_bkhs[0]) != np.asarray(k)))


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_8", DYNAMIC_3])
def test_returned_cache_holds_the_emitted_tokens(tiny, tree_name):
    """The accepted path's K/V move is made at the start of the next step (and once after the loop): the cache
    medusa_decode returns holds, in each row's committed slots, the K/V a plain prefill of the prompt and the
    emitted tokens (all but the newest, the next root) computes. Ragged rows, every accept length, an EOS."""
    base, heads, refs = tiny("llama")
    eos_ids, reference = refs["ragged4"]
    prompts, tree = PROMPTS["ragged4"], load_tree(tree_name)
    targets = cycling_targets(len(prompts), tree.depth)
    width, size = 16, 80
    prompt_bt = np.zeros((len(prompts), width), np.int32)
    for i, prompt in enumerate(prompts):
        prompt_bt[i, : len(prompt)] = prompt
    graphdef, params = nnx.split(MedusaModel(base, heads))
    out_bo, num_b, _, accept_bo, cache = medusa_decode(
        graphdef, params, KVCache.zeros(base.config, len(prompts), size), jnp.asarray(prompt_bt),
        jnp.asarray([len(p) for p in prompts], jnp.int32), jax.random.key(0), plant(tree, reference, targets),
        tree=tree, max_new_tokens=N, acceptance=GREEDY, eos_ids=eos_ids, pad_id=0,
        proposer=planted_proposer)
    assert np.asarray(accept_bo).max() == tree.depth
    # the plain prefill, jitted (one compile per sequence length, not one per operation and length as eagerly)
    plain_prefill = jax.jit(lambda tokens_bt, lengths_b, cache: prefill(base, tokens_bt, lengths_b, cache))
    for b, prompt in enumerate(prompts):
        emitted = np.asarray(out_bo[b, : int(num_b[b])]).tolist()
        assert emitted == reference[b]
        length = int(cache.lengths_b[b])
        tokens = prompt + emitted[: length - len(prompt)]
        assert len(prompt) + len(emitted) - 1 <= length == len(tokens)
        fresh = KVCache.zeros(base.config, 1, size)
        _, expect = plain_prefill(jnp.asarray([tokens]), jnp.asarray([len(tokens)]), fresh)
        for got, want in zip(cache.k_bkhs, expect.k_bkhs):  # [B, K, H, S]
            np.testing.assert_allclose(got[b, ..., :length], want[0, ..., :length], rtol=1e-4, atol=1e-4)
        for got, want in zip(cache.v_bksh, expect.v_bksh):  # [B, K, S, H]
            np.testing.assert_allclose(got[b, :, :length], want[0, :, :length], rtol=1e-4, atol=1e-4)


def test_generate_script_medusa_flags(tiny, tiny_model_dir, tmp_path, capsys):
    """scripts/generate.py --heads --tree --json: Medusa output == plain output, with steps and tokens_per_step."""
    import transformers  # lazy, with tokenizers: seconds to import, and only this test builds a tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama", initializer_range=0.3), folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(100)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>",
                                         pad_token="<unk>").save_pretrained(folder)
    base, heads, _ = tiny("llama")
    save_heads(heads, tmp_path / "heads")
    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parents[1] / "scripts/generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    common = ["--model", str(folder), "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "12", "--json"]
    assert script.main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert script.main(common + ["--heads", str(tmp_path / "heads"), "--tree", "mc_sim_7b_8"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["token_ids"] == plain["token_ids"] and row["text"] == plain["text"]
    assert 1 <= row["steps"] <= row["new_tokens"]
    assert row["tokens_per_step"] == pytest.approx(row["new_tokens"] / row["steps"], abs=1e-3)
    assert script.main(common + ["--heads", str(tmp_path / "heads"), "--tree", "dynamic:6,k=2,d=3"]) == 0
    row = json.loads(capsys.readouterr().out)  # a dynamic tree: the same tokens
    assert row["token_ids"] == plain["token_ids"] and "dynamic tree dynamic:6,k=2,d=3" in row["tree"]
    with pytest.raises(SystemExit) as refused:  # refused by the command-line checks, before any loading
        script.main(common + ["--heads", str(tmp_path / "heads"), "--tree", "dynamic:99,k=2,d=2"])
    assert refused.value.code == 2 and "drafts only 6" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(common + ["--tree", "mc_sim_7b_8"])  # --tree without --heads
    assert "need --heads" in capsys.readouterr().err
    heads_dir = str(tmp_path / "heads")
    assert script.parse_args(common + ["--heads", heads_dir, "--temperature", "0.7"]).acceptance == "exact"
    assert script.parse_args(common + ["--heads", heads_dir]).acceptance == "greedy"
    with pytest.raises(SystemExit):
        script.parse_args(common + ["--heads", heads_dir, "--acceptance", "typical", "--temperature", "0.7",
                                    "--top-k", "5"])
    assert "typical" in capsys.readouterr().err
