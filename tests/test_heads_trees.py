"""The trees a heads folder carries (trees.json): resolution rules, clear errors, decoding with them (a "no tree"
entry decodes plainly, exactly like plain greedy; a dynamic tree entry decodes with it), build_tree's per-batch
pick and the shipped file."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from medusa_jax.assets import SHIPPED_HEADS, shipped_heads_dir
from medusa_jax.trees import trees_file as heads_trees
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.folder import save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.trees.tree import DEFAULT_TREE, DynamicTree
from medusa_jax.trees.trees_file import TreesFileError, parse_trees, read_trees, resolve_tree
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import HEADS_TREE, BatchSettings, generate, generate_batch, generate_medusa
from medusa_jax.trees.policy.calibration import Accuracy, pick_for_batch
from medusa_jax.trees.policy.choose import choose_tree
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.trees.policy.step_cost import StepCostTable
from medusa_jax.trees.policy.tree_choice import batch_tokens_per_step

T3 = [[0], [1], [0, 0]]
T1 = [[0]]
DYN = {"dynamic": {"nodes": 4, "top_k": 2, "depth": 2}}


def doc(trees: dict) -> dict:
    return {"format": heads_trees.FORMAT, "version": heads_trees.VERSION, "trees": trees}


def table(trees: dict):
    return parse_trees(doc(trees), "test/trees.json")


# ---- resolution rules --------------------------------------------------------------------------------------

def test_each_batch_size_gets_its_own_tree_else_the_nearest_smaller_one():
    t = table({"cpu": {"1": T3, "4": T1, "8": []}})
    assert resolve_tree(t, "cpu", 1).paths == ((0,), (1,), (0, 0))
    assert resolve_tree(t, "cpu", 4).paths == ((0,),)
    assert resolve_tree(t, "cpu", 8).plain  # [] = no tree pays: decode plainly
    for batch, used in [(2, 1), (3, 1), (5, 4), (7, 4), (9, 8), (64, 8)]:
        r = resolve_tree(t, "cpu", batch)
        assert r.batch == used and f"used for batch {batch}" in r.note
    below = resolve_tree(table({"cpu": {"4": T1}}), "cpu", 1)  # below every measured batch: the smallest
    assert below.batch == 4 and below.paths == ((0,),)


def test_backend_fallback():
    cpu_only = table({"cpu": {"1": T3}})
    r = resolve_tree(cpu_only, "gpu", 1)
    assert r.backend == "cpu" and r.paths and "used for gpu" in r.note  # a CPU tree pays on an accelerator
    assert resolve_tree(table({"tpu": {"1": T1}, "cpu": {"1": T3}}), "gpu", 1).backend == "tpu"
    assert resolve_tree(table({"gpu": {"1": T1}, "cpu": {"1": T3}}), "gpu", 1).backend == "gpu"
    gpu_only = resolve_tree(table({"gpu": {"1": T3}}), "cpu", 1)  # a GPU's tree may be far too big for a CPU
    assert gpu_only.plain and "no tree for cpu" in gpu_only.note


def test_heads_without_trees_use_the_default_preset():
    r = resolve_tree(None, "cpu", 8)
    assert r.preset == DEFAULT_TREE and not r.plain and "trees.json" in r.note


def test_an_explicit_tree_always_wins():
    cfg = HeadsConfig(64, 128, num_heads=3, lm_head="own")
    plain_everywhere = table({"cpu": {"1": []}, "gpu": {"1": []}})
    chosen = choose_tree(cfg, plain_everywhere, 1, "mc_sim_7b_8")
    assert chosen.tree is not None and chosen.tree.name == "mc_sim_7b_8" and "given" in chosen.note
    assert choose_tree(cfg, plain_everywhere, 1).tree is None
    heads_tree = choose_tree(cfg, table({"cpu": {"1": T3}, "gpu": {"1": T3}, "tpu": {"1": T3}}), 1)
    assert heads_tree.tree.paths == ((0,), (1,), (0, 0))


def test_dynamic_tree_entries_resolve_and_round_trip():
    """{"dynamic": {...}} entries sit beside lists of paths and []; old files stay valid."""
    t = table({"cpu": {"1": DYN, "4": T1, "8": []}, "gpu": {"1": {"dynamic": {"nodes": 64}}}})
    r = resolve_tree(t, "cpu", 2)
    assert r.dynamic == DynamicTree(4, 2, 2) and r.paths is None and not r.plain and "dynamic:4,k=2,d=2" in r.note
    assert resolve_tree(t, "cpu", 4).paths == ((0,),) and resolve_tree(t, "cpu", 8).plain
    assert resolve_tree(t, "gpu", 1).dynamic == DynamicTree(64, 5, 4)  # top_k and depth default
    cfg = HeadsConfig(64, 128, num_heads=3, lm_head="own")
    assert choose_tree(cfg, t, 1).tree == DynamicTree(4, 2, 2)
    assert choose_tree(cfg, t, 1, "dynamic:8,k=2,d=3").tree == DynamicTree(8, 2, 3)
    new = heads_trees.trees_document(t, "cpu", {1: DynamicTree(16, 4, 4), 2: T3}, {})
    assert new["trees"]["cpu"] == {"1": {"dynamic": {"nodes": 16, "top_k": 4, "depth": 4}}, "2": T3}
    assert parse_trees(new, "new").batches("cpu")[1] == DynamicTree(16, 4, 4)
    with pytest.raises(TreesFileError, match="only 3 Medusa heads"):
        t.check_heads(3, 128)  # the gpu entry drafts 4 depths


# ---- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"trees": {"cpu": {"1": T3}}}), "not a trees file"),
    (json.dumps({**doc({"cpu": {"1": T3}}), "version": 7}), "version 7"),
    (json.dumps(doc({})), "must map backends"),
    (json.dumps(doc({"cpu": {"0": T3}})), "batch size '0'"),
    (json.dumps(doc({"cpu": {"one": T3}})), "batch size 'one'"),
    (json.dumps(doc({"cpu": {"1": "fast"}})), "must be a list of paths"),
    (json.dumps(doc({"cpu": {"1": [[0, 0]]}})), "has no parent"),
    (json.dumps(doc({"cpu": {"1": [[-1]]}})), "negative rank"),
    (json.dumps(doc({"cpu": {"1": {"dynamic": {"top_k": 4}}}})), "dynamic tree entry"),
    (json.dumps(doc({"cpu": {"1": {"dynamic": {"nodes": 40, "top_k": 2, "depth": 3}}}})), "drafts only 10"),
])
def test_a_bad_trees_file_is_a_clear_error(tmp_path, content, message):
    (tmp_path / "trees.json").write_text(content)
    with pytest.raises(TreesFileError, match=message) as e:
        read_trees(tmp_path)
    assert "trees.json" in str(e.value)


def test_trees_that_do_not_fit_the_heads_fail_at_load(tmp_path, tiny_model_dir):
    base = load_pretrained(tiny_model_dir("llama"))
    save_heads(init_heads(HeadsConfig(64, 128, num_heads=2, lm_head="own"), base, seed=1), tmp_path)
    (tmp_path / "trees.json").write_text(json.dumps(doc({"cpu": {"1": [[0], [0, 0], [0, 0, 0]]}})))
    with pytest.raises(TreesFileError, match="only 2 Medusa heads"):
        load_heads(tmp_path, base=base)
    (tmp_path / "trees.json").write_text(json.dumps(doc({"cpu": {"1": T3}})))
    assert load_heads(tmp_path, base=base).trees.batches("cpu") == {1: ((0,), (1,), (0, 0))}


def test_trees_document_keeps_other_backends_and_refuses_bad_trees():
    existing = parse_trees({**doc({"gpu": {"1": T3}}), "built": {"gpu": {"date": "x"}}}, "old")
    new = heads_trees.trees_document(existing, "cpu", {1: T1, 8: []}, {"date": "y"})
    assert new["trees"] == {"gpu": {"1": T3}, "cpu": {"1": T1, "8": []}}
    assert new["built"] == {"gpu": {"date": "x"}, "cpu": {"date": "y"}}
    with pytest.raises(TreesFileError, match="no parent"):
        heads_trees.trees_document(None, "cpu", {1: [[1, 1]]}, {})


# ---- decoding with the heads' trees ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_heads(tiny_model_dir, tmp_path_factory):
    """(base, heads folder) with random heads (3 heads, own lm_heads); tests write its trees.json."""
    base = load_pretrained(tiny_model_dir("llama", initializer_range=0.3))
    folder = tmp_path_factory.mktemp("heads")
    save_heads(init_heads(HeadsConfig(64, 128, num_heads=3, lm_head="own"), base, seed=3), folder)
    return base, folder


def test_no_tree_decodes_plainly_and_a_batchs_tree_is_used(tiny_heads):
    base, folder = tiny_heads
    backend = jax.default_backend()
    (folder / "trees.json").write_text(json.dumps(doc({backend: {"1": T3, "2": []}})))
    heads = load_heads(folder, base=base)
    prompts = [[5, 9, 17, 3], [40, 2]]
    plain = generate(base, prompts, max_new_tokens=12, batch_size=2)
    timings = {}
    got = generate_medusa(base, heads, prompts, max_new_tokens=12, batch_size=2, timings=timings)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]  # plain greedy, token for token
    assert all(r.accept_lengths is None and r.steps == len(r.token_ids) for r in got)  # no verify steps
    assert timings["tree"].startswith("plain decoding") and f"{backend} batch 2" in timings["tree"]
    one = generate_medusa(base, heads, prompts[:1], max_new_tokens=12, timings=timings)  # batch 1: the tree
    assert one[0].token_ids == generate(base, prompts[:1], max_new_tokens=12)[0].token_ids
    assert one[0].accept_lengths is not None and "3 nodes" in timings["tree"]


def test_the_heads_dynamic_tree_decodes_like_plain_greedy(tiny_heads):
    base, folder = tiny_heads
    (folder / "trees.json").write_text(json.dumps(doc({jax.default_backend(): {"1": DYN}})))
    heads = load_heads(folder, base=base)
    timings = {}
    got = generate_medusa(base, heads, [[5, 9, 17, 3]], max_new_tokens=12, timings=timings)
    assert got[0].token_ids == generate(base, [[5, 9, 17, 3]], max_new_tokens=12)[0].token_ids
    assert got[0].accept_lengths and "dynamic tree dynamic:4,k=2,d=2" in timings["tree"]


def test_generate_batch_resolves_the_heads_tree_per_batch_size(tiny_heads, tiny_model_dir):
    base, folder = tiny_heads
    (folder / "trees.json").write_text(json.dumps(doc({jax.default_backend(): {"1": T3, "2": []}})))
    model = ShardedModel(base, load_heads(folder, base=base))
    prompts = [[5, 9, 17, 3], [40, 2]]
    run = generate_batch(model, prompts, BatchSettings(batch_size=2, max_new_tokens=8, tree=HEADS_TREE),
                         progress=False)
    assert run.tree_choice.tree is None and "no tree pays" in run.tree_choice.note
    assert [r.token_ids for r in run.results] == [r.token_ids for r in generate(base, prompts, max_new_tokens=8)]
    with pytest.raises(ValueError, match="TreeBuffers, None"):
        BatchSettings(tree="fastest")


# ---- build_tree's per-batch pick and the shipped trees -------------------------------------------------

def test_pick_for_batch_keeps_the_best_tree_only_when_it_beats_plain():
    acc = np.array([[0.6, 0.2], [0.4, 0.1]])
    cheap = StepCostTable(1, 64, 128, 1.0, (2, 4, 8), (1.05, 1.1, 1.6))
    paths, record = pick_for_batch(acc, cheap, 7, 1.05)
    assert paths and record["num_nodes"] == len(paths) and record["predicted_speedup_vs_plain"] >= 1.05
    assert record["step_seconds"]["measured"] == [1.05, 1.1, 1.6]
    dear = StepCostTable(8, 64, 128, 1.0, (2, 4, 8), (1.9, 2.5, 4.0))  # a big batch: verify costs much more
    paths, record = pick_for_batch(acc, dear, 7, 1.05)
    assert paths == () and record["num_nodes"] == 0 and record["best_tree_predicted_speedup"] < 1


def test_batch_tokens_per_step_waits_for_the_slowest_row():
    easy, hard = [[0.8, 0.1], [0.5, 0.1]], [[0.2, 0.1], [0.5, 0.1]]
    order = [(0,), (0, 0)]
    tau = {"easy": np.array([1.8, 2.2]), "hard": np.array([1.2, 1.3])}  # 1 + cumulative path values
    one = batch_tokens_per_step(order, [easy, hard], 1)
    np.testing.assert_allclose(one, 2 / (1 / tau["easy"] + 1 / tau["hard"]))  # batch 1: harmonic mean
    # batch 8 from two equally likely sequences: the max of 8 draws is the hard one unless all 8 are easy
    p_all_easy = 0.5 ** 8
    np.testing.assert_allclose(batch_tokens_per_step(order, [easy, hard], 8),
                               1 / ((1 - p_all_easy) / tau["hard"] + p_all_easy / tau["easy"]))
    np.testing.assert_allclose(batch_tokens_per_step(order, [easy, easy], 64), tau["easy"])  # no spread, no loss
    sizes = [batch_tokens_per_step(order, [easy, hard, easy], b)[0] for b in (1, 2, 4, 8, 64)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] >= tau["hard"][0] - 1e-9
    with pytest.raises(ValueError, match="per-sequence"):
        batch_tokens_per_step(order, easy, 1)


def test_pick_for_batch_sizes_a_batch_on_its_slowest_rows():
    """Two held-out sequences, one easy and one hard: at batch 1 the tree pays, at batch 8 the same pooled
    accuracy and the same step cost ratio predict no gain, since each batch waits for a hard row."""
    per_sequence = np.array([[[0.95, 0.0], [0.9, 0.0]], [[0.05, 0.0], [0.1, 0.0]]])
    pooled = per_sequence.mean(axis=0)
    times = (1.15, 1.25, 1.6)
    paths, record = pick_for_batch(pooled, StepCostTable(1, 64, 128, 1.0, (2, 4, 8), times), 3, 1.05, per_sequence)
    assert paths and record["predicted_speedup_vs_plain"] >= 1.05
    paths8, record8 = pick_for_batch(pooled, StepCostTable(8, 64, 128, 1.0, (2, 4, 8), times), 3, 1.05,
                                     per_sequence)
    assert paths8 == () and record8["best_tree_predicted_speedup"] < 1.0
    assert pick_for_batch(pooled, StepCostTable(8, 64, 128, 1.0, (2, 4, 8), times), 3, 1.05)[0]  # pooled: a tree


@pytest.mark.parametrize("name", ["default", "default-medusa"])
def test_the_shipped_trees_fit_the_shipped_heads(name):
    folder = shipped_heads_dir(SHIPPED_HEADS[name])
    trees = read_trees(folder)
    config = HeadsConfig.from_dict(json.loads((folder / "config.json").read_text())["medusa_jax"])
    trees.check_heads(config.num_heads, config.head_vocab_size)
    assert "cpu" in trees.backends() and 1 in trees.batches("cpu")
    text = (folder / "trees.json").read_text()
    assert "/root" not in text and "/work" not in text and "/home" not in text  # no local paths
    # the record calibration re-sizes trees from on the user's machine, with each held-out sequence's own table:
    # without it a batch's prediction ignores its slowest row (batch 8 predicted 1.57 tokens/step, measured 1.30)
    accuracy = Accuracy.from_built(trees.built("cpu"))
    assert accuracy is not None and accuracy.per_sequence_smr is not None
    assert accuracy.per_sequence_smr.shape[1:] == accuracy.scaled_mr.shape and accuracy.per_sequence_smr.shape[0] >= 16
