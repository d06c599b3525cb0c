"""Tree buffers: the official mc_sim_7b_63 facts, the presets, JSON loading and every invalid-tree error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from medusa_jax.trees.tree import MC_SIM_7B_63, PRESETS, TreeError, build_tree, load_tree


def _is_prefix(a, b) -> bool:
    return len(a) <= len(b) and tuple(b[: len(a)]) == tuple(a)


def _check_consistent(tree):
    """Every buffer agrees with a brute-force reading of the paths (node 0 = root = the empty path)."""
    nodes = [()] + list(tree.paths)
    t = len(nodes)
    assert tree.ancestor_mask_tt.shape == (t, t)
    for i, p in enumerate(nodes):
        for j, q in enumerate(nodes):
            assert tree.ancestor_mask_tt[i, j] == _is_prefix(q, p), (p, q)
        assert tree.depth_t[i] == len(p)
        if p:
            assert nodes[tree.parent_t[i]] == p[:-1]
            assert (tree.head_t[i], tree.rank_t[i]) == (len(p) - 1, p[-1])
            assert tree.candidate_index_t[i] == 1 + (len(p) - 1) * tree.top_k + p[-1]
    assert tree.candidate_index_t[0] == 0
    leaves = {p for p in tree.paths if not any(len(q) > len(p) and _is_prefix(p, q) for q in tree.paths)}
    got = set()
    for row, valid in zip(tree.retrieve_ce, tree.retrieve_valid_ce):
        chain = [nodes[n] for n, v in zip(row, valid) if v]
        assert chain[0] == () and all(len(c) == k for k, c in enumerate(chain))
        assert all(_is_prefix(a, b) for a, b in zip(chain, chain[1:]))
        assert not valid[len(chain):].any() and (row[len(chain):] == 0).all()
        got.add(chain[-1])
    assert got == leaves and len(tree.retrieve_ce) == len(leaves)


def test_mc_sim_7b_63_buffers_match_known_facts():
    tree = load_tree("mc_sim_7b_63")
    assert tree.num_tokens == 64
    assert tree.nodes_per_depth() == [10, 28, 23, 2]
    assert tree.num_leaves == 42
    assert (tree.depth, tree.top_k) == (4, 10)
    assert tree.ancestor_mask_tt[:, 0].all() and np.diag(tree.ancestor_mask_tt).all()
    assert tree.paths == tuple(sorted(MC_SIM_7B_63, key=lambda p: (len(p), p)))
    _check_consistent(tree)


@pytest.mark.parametrize("name,nodes", [("mc_sim_7b_8", 8), ("mc_sim_7b_16", 16), ("mc_sim_7b_32", 32)])
def test_small_presets(name, nodes):
    tree = load_tree(name)
    assert tree.num_tokens == nodes + 1
    assert set(tree.paths) <= set(MC_SIM_7B_63)
    _check_consistent(tree)


def test_tree_is_hashable_by_paths():
    a, b = load_tree("mc_sim_7b_8"), build_tree([list(p) for p in reversed(PRESETS["mc_sim_7b_8"])])
    assert a == b and hash(a) == hash(b)
    assert a != load_tree("mc_sim_7b_16")


def test_load_tree_from_json_list_and_object(tmp_path):
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    (tmp_path / "list.json").write_text(json.dumps(choices))
    (tmp_path / "obj.json").write_text(json.dumps({"medusa_choices": choices}))
    a, b = load_tree(tmp_path / "list.json"), load_tree(str(tmp_path / "obj.json"))
    assert a == b and a.num_tokens == 6 and a.depth == 3 and a.top_k == 2
    assert a.nodes_per_depth() == [2, 2, 1]
    _check_consistent(a)


def test_load_tree_errors(tmp_path):
    with pytest.raises(TreeError, match="unknown tree 'nope'.*mc_sim_7b_63"):
        load_tree("nope")
    (tmp_path / "bad.json").write_text("[[0], [1")
    with pytest.raises(TreeError, match="not valid JSON"):
        load_tree(tmp_path / "bad.json")
    (tmp_path / "obj.json").write_text(json.dumps({"choices": [[0]]}))
    with pytest.raises(TreeError, match="'medusa_choices'"):
        load_tree(tmp_path / "obj.json")


def test_missing_prefix_is_an_error():
    with pytest.raises(TreeError, match=r"path \[1, 0\] has no parent: its prefix \[1\] is missing"):
        build_tree([[0], [1, 0]])


def test_depth_beyond_heads_is_an_error():
    with pytest.raises(TreeError, match=r"depth 4 but there are only 3 Medusa heads"):
        load_tree("mc_sim_7b_63", num_heads=3)
    assert load_tree("mc_sim_7b_32", num_heads=3).depth == 3


def test_rank_beyond_top_k_is_an_error():
    with pytest.raises(TreeError, match=r"uses rank 9 but top-k is at most 9"):
        load_tree("mc_sim_7b_63", max_top_k=9)


def test_duplicate_path_is_an_error():
    with pytest.raises(TreeError, match=r"path \[0, 0\] appears more than once"):
        build_tree([[0], [0, 0], [1], [0, 0]])


@pytest.mark.parametrize("choices,match", [
    ([], "non-empty list of paths"),
    ("[[0]]", "non-empty list of paths"),
    ([[0], []], "non-empty list of ranks"),
    ([[0], [-1]], "negative rank -1"),
    ([[0], [0.5]], "ranks must be integers"),
])
def test_malformed_trees_are_errors(choices, match):
    with pytest.raises(TreeError, match=match):
        build_tree(choices)
