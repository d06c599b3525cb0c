"""Dynamic draft trees (EAGLE-2 style): the on-device growth equals a brute-force NumPy reference that expands the
same frontier, the kept tree is ancestor-closed with parents before children (ties included), scores are the
log of the product of the draft probabilities along each path, the per-row tables equal a static tree's of the
same paths (verification mask, greedy/typical acceptance), the EAGLE drafter's dynamic drafts equal plain
forwards, and the spec's text, JSON and CLI forms. Greedy losslessness of whole decodes on dynamic trees (every
head type, batch 1 and ragged batches with a mid-run EOS, tiny Llama/Qwen2/Mistral) is parametrised into
tests/test_medusa.py, exact sampling's law into tests/test_exact_sampling.py, meshes into
tests/test_sharded_decode.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.kv_cache import KVCache, attention_mask
from medusa_jax.trees.dynamic_tree import grow_from_candidates, grow_tree, row_tree, scratch_slots, top_k_log_probs
from medusa_jax.trees.tree import DynamicTree, TreeError, build_tree, load_tree, parse_dynamic_tree
from medusa_jax.inference.acceptance import GREEDY, AcceptanceConfig, DecodeConfig, accept_tree
from medusa_jax.inference.autoregressive import prefill_states
from medusa_jax.inference.sampling import SamplingConfig

from test_eagle import base_features, drafter, plain_outputs, propose

V = 32
RNG = np.random.RandomState(0)
TABLE_A = RNG.normal(0, 1.5, (V, V)).astype(np.float32)  # logits by the path's last token
TABLE_B = RNG.normal(0, 1.5, (8, V)).astype(np.float32)  # ... by its length
TABLE_C = RNG.normal(0, 1.5, (7, V)).astype(np.float32)  # ... by the sum of its tokens mod 7


def path_logits_np(path) -> np.ndarray:
    return TABLE_A[path[-1]] + TABLE_B[len(path) - 1] + TABLE_C[sum(path) % 7]


def path_logits_jnp(path_xe):
    e = path_xe.shape[-1]
    return (jnp.asarray(TABLE_A)[path_xe[..., -1]] + jnp.asarray(TABLE_B)[e - 1]
            + jnp.asarray(TABLE_C)[jnp.sum(path_xe, axis=-1) % 7])


def log_softmax_np(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def reference_tree(spec: DynamicTree, root: int, logp_of):
    """EAGLE-2's growth by brute force: logp_of(path, root first) -> [V] log-probs. Returns (tokens, parents,
    depths, scores), root first, in the kept order (candidate order)."""
    k = spec.top_k
    cands = []  # (index, token, score, parent index or -1, depth, path)
    frontier = [(-1, 0.0, (root,))]
    for depth in range(1, spec.depth + 1):
        this = []
        for index, score, path in frontier:
            logp = logp_of(path)
            for token in np.argsort(-logp, kind="stable")[:k]:  # ties: the lower id first
                this.append((len(cands) + len(this), int(token), score + logp[token], index, depth, path + (token,)))
        cands += this
        best = sorted(this, key=lambda c: (-c[2], c[0]))[:k]
        frontier = [(c[0], c[2], c[5]) for c in best]
    kept = sorted(sorted(cands, key=lambda c: (-c[2], c[0]))[: spec.nodes], key=lambda c: c[0])
    node_of = {c[0]: i + 1 for i, c in enumerate(kept)}
    return ([root] + [c[1] for c in kept], [0] + [node_of.get(c[3], 0) for c in kept], [0] + [c[4] for c in kept],
            [0.0] + [c[2] for c in kept])


def check_well_formed(tokens, parents, depths):
    """Ancestor-closed, parents before children, depth = parent's + 1, distinct siblings."""
    assert parents[0] == 0 and depths[0] == 0
    for t in range(1, len(tokens)):
        assert parents[t] < t and depths[t] == depths[parents[t]] + 1
    siblings = {}
    for t in range(1, len(tokens)):
        siblings.setdefault(parents[t], []).append(tokens[t])
    assert all(len(s) == len(set(s)) for s in siblings.values())


SPECS = [DynamicTree(10, 3, 3), DynamicTree(5, 2, 4), DynamicTree(1, 1, 1), DynamicTree(30, 3, 4),
         DynamicTree(16, 4, 4), DynamicTree(4, 4, 4), DynamicTree(6, 4, 4), DynamicTree(2, 2, 4)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_path_dependent_growth_equals_the_numpy_reference(spec):
    """Hydra / EAGLE-style children (they depend on the node's own path), three rows with other roots."""
    roots = jnp.asarray([3, 17, 30], jnp.int32)

    def expand(depth, frontier, carry):
        ids, logp = top_k_log_probs(path_logits_jnp(frontier.path_bwe), spec.top_k)
        return ids, logp, carry

    got = jax.jit(lambda r: grow_tree(spec, r, expand)[0])(roots)
    for b, root in enumerate(roots.tolist()):
        tokens, parents, depths, scores = reference_tree(spec, root, lambda p: log_softmax_np(path_logits_np(p)))
        assert np.asarray(got.tokens_bt[b]).tolist() == tokens
        assert np.asarray(got.parent_bt[b]).tolist() == parents
        assert np.asarray(got.depth_bt[b]).tolist() == depths
        np.testing.assert_allclose(np.asarray(got.score_bt[b]), scores, rtol=1e-5, atol=1e-5)
        check_well_formed(tokens, parents, depths)
        # a node's score is the log of the product of its path's draft probabilities
        for t in range(1, len(tokens)):
            path, u = [], t
            while u:
                path.append(u)
                u = parents[u]
            prefix, total = (root,), 0.0
            for u in reversed(path):
                total += log_softmax_np(path_logits_np(prefix))[tokens[u]]
                prefix += (tokens[u],)
            assert scores[t] == pytest.approx(total, abs=1e-5)


def test_small_trees_expand_narrower_frontiers():
    """Only the N - d best nodes of depth d can have kept children (`frontier_width`): a 4-node tree drafts
    1 + 3 + 2 + 1 frontier rows, not 1 + 4 + 4 + 4 (each row is a pass of the drafter's vocabulary projection);
    the kept tree still equals the full-frontier reference (test above, DynamicTree(4, 4, 4))."""
    widths = []

    def expand(depth, frontier, carry):
        widths.append(frontier.path_bwe.shape[1])
        ids, logp = top_k_log_probs(path_logits_jnp(frontier.path_bwe), 4)
        return ids, logp, carry

    jax.eval_shape(lambda r: grow_tree(DynamicTree(4, 4, 4), r, expand)[0], jnp.zeros((2,), jnp.int32))
    assert widths == [1, 3, 2, 1]
    widths.clear()
    jax.eval_shape(lambda r: grow_tree(DynamicTree(16, 4, 4), r, expand)[0], jnp.zeros((2,), jnp.int32))
    assert widths == [1, 4, 4, 4]


def test_medusa_growth_uses_head_d_for_depth_d_and_matches_the_reference():
    spec = DynamicTree(12, 3, 4)
    logits_bmv = jnp.asarray(RNG.normal(0, 2, (2, 4, V)), jnp.float32)
    ids_bmr, logp_bmr = top_k_log_probs(logits_bmv, spec.top_k)
    got = grow_from_candidates(spec, jnp.asarray([1, 2]), ids_bmr, logp_bmr)
    for b in range(2):
        heads = [log_softmax_np(logits_bmv[b, m]) for m in range(4)]
        want = reference_tree(spec, b + 1, lambda p: heads[len(p) - 1])
        assert np.asarray(got.tokens_bt[b]).tolist() == want[0] and np.asarray(got.parent_bt[b]).tolist() == want[1]
        for t in range(1, spec.num_tokens):  # depth d's tokens are head d - 1's top-K
            assert int(got.tokens_bt[b, t]) in np.asarray(ids_bmr[b, int(got.depth_bt[b, t]) - 1]).tolist()


def test_ties_keep_the_tree_ancestor_closed():
    """Draft probabilities of exactly 1 (log p = 0) and exactly uniform ones: children tie with their parents and
    siblings with each other; parents still rank first, so the kept set is a tree."""
    spec = DynamicTree(9, 3, 4)
    one_hot = jnp.full((1, 4, V), -1e4).at[:, :, 5].set(0.0)  # log p = 0 exactly for token 5 at every depth
    uniform = jnp.zeros((1, 4, V))
    for logits in (one_hot, uniform, jnp.concatenate([uniform[:, :2], one_hot[:, 2:]], axis=1)):
        ids, logp = top_k_log_probs(logits, spec.top_k)
        got = grow_from_candidates(spec, jnp.asarray([0]), ids, logp)
        tokens, parents, depths = (np.asarray(x[0]).tolist() for x in (got.tokens_bt, got.parent_bt, got.depth_bt))
        check_well_formed(tokens, parents, depths)
        want = reference_tree(spec, 0, lambda p: log_softmax_np(np.asarray(logits[0, len(p) - 1])))
        assert tokens == want[0] and parents == want[1]


def rank_paths(proposal, b: int, top_k: int, ids_bmr) -> list[tuple[int, ...]]:
    """A Medusa-grown tree's nodes as medusa_choices paths (each node's rank under its head), in node order."""
    paths = [()]
    for t in range(1, proposal.tokens_bt.shape[1]):
        d, token = int(proposal.depth_bt[b, t]), int(proposal.tokens_bt[b, t])
        rank = np.asarray(ids_bmr[b, d - 1]).tolist().index(token)
        paths.append(paths[int(proposal.parent_bt[b, t])] + (rank,))
    return paths


@pytest.mark.parametrize("kind", ["greedy", "typical"])
def test_per_row_tables_and_acceptance_equal_the_static_tree_of_the_same_paths(kind):
    """A dynamic tree grown from Medusa candidates is, row by row, a medusa_choices tree: its mask, positions,
    candidate paths and acceptance (accepted tokens, bonus) equal those of the static tree with the same paths."""
    spec, b = DynamicTree(10, 3, 3), 4
    rng = np.random.RandomState(1)
    logits_bmv = jnp.asarray(rng.normal(0, 1, (b, 3, V)), jnp.float32)
    ids_bmr, logp_bmr = top_k_log_probs(logits_bmv, spec.top_k)
    roots = jnp.asarray(rng.randint(0, V, b), jnp.int32)
    proposal = grow_from_candidates(spec, roots, ids_bmr, logp_bmr)
    rows = row_tree(proposal, spec)
    lengths_b = jnp.asarray([3, 0, 7, 5], jnp.int32)
    mask_bts = attention_mask(lengths_b, rows.ancestor_mask_btt, 24)
    config = DecodeConfig(SamplingConfig(1.0), AcceptanceConfig(kind)) if kind == "typical" else GREEDY
    # base logits peaked on the dynamic tree's own tokens, so that long paths get accepted
    base_btv = rng.normal(0, 1, (b, spec.num_tokens, V)).astype(np.float32)
    for row in range(b):
        for t in range(spec.num_tokens):
            kids = [u for u in range(1, spec.num_tokens) if int(proposal.parent_bt[row, u]) == t]
            if kids:
                base_btv[row, t, int(proposal.tokens_bt[row, kids[rng.randint(len(kids))]])] += 6.0
    length_b, nodes_be, bonus_b = accept_tree(rows, proposal.tokens_bt, jnp.asarray(base_btv), jax.random.key(0),
                                              config)
    assert int(length_b.max()) >= 2
    for row in range(b):
        paths = rank_paths(proposal, row, spec.top_k, ids_bmr)
        static = build_tree(paths[1:])
        order = [paths.index(p) for p in [()] + list(static.paths)]  # static node i = dynamic node order[i]
        np.testing.assert_array_equal(np.asarray(rows.ancestor_mask_btt[row])[np.ix_(order, order)],
                                      static.ancestor_mask_tt)
        np.testing.assert_array_equal(np.asarray(rows.depth_bt[row])[order], static.depth_t)
        static_mask_ts = attention_mask(lengths_b[row:row + 1], jnp.asarray(static.ancestor_mask_tt), 24)[0]
        slots_s = np.arange(24)  # static tree-block slot length + i holds dynamic node order[i]
        slots_s[int(lengths_b[row]) + np.arange(len(order))] = int(lengths_b[row]) + np.asarray(order)
        np.testing.assert_array_equal(np.asarray(mask_bts[row])[order][:, slots_s], np.asarray(static_mask_ts))
        tokens_t = np.asarray(proposal.tokens_bt[row])[order]
        s_len, s_nodes, s_bonus = accept_tree(static, jnp.asarray(tokens_t)[None],
                                              jnp.asarray(base_btv[row][order])[None], jax.random.key(0), config)
        assert int(s_len[0]) == int(length_b[row])
        accepted = np.asarray(proposal.tokens_bt[row])[np.asarray(nodes_be[row, : int(length_b[row]) + 1])]
        np.testing.assert_array_equal(accepted, tokens_t[np.asarray(s_nodes[0, : int(s_len[0]) + 1])])
        if kind == "greedy":
            assert int(s_bonus[0]) == int(bonus_b[row])


def test_spec_text_json_and_limits():
    assert parse_dynamic_tree("dynamic:16") == DynamicTree(16, 4, 4)
    assert parse_dynamic_tree("dynamic:64") == DynamicTree(64, 5, 4)  # K raised until 64 nodes can be drafted
    assert parse_dynamic_tree("dynamic:8,k=2,d=3") == DynamicTree(8, 2, 3)
    assert parse_dynamic_tree("dynamic:8,d=3,k=2").name == "dynamic:8,k=2,d=3"
    assert load_tree("dynamic:16", num_heads=2) == DynamicTree(16, 4, 2)  # D defaults to at most the heads
    assert load_tree(DynamicTree(3, 1, 3)) == DynamicTree(3, 1, 3)
    assert DynamicTree.from_json(DynamicTree(16, 4, 4).to_json()) == DynamicTree(16, 4, 4)
    assert hash(DynamicTree(16)) == hash(DynamicTree(16, 4, 4))
    for text, match in [("dynamic:x", "dynamic:N"), ("dynamic:4,q=1", "dynamic:N"), ("dynamic:0", "nodes"),
                        ("dynamic:40,k=2,d=3", "drafts only 10")]:
        with pytest.raises(TreeError, match=match):
            parse_dynamic_tree(text)
    with pytest.raises(TreeError, match="only 3 Medusa heads"):
        load_tree("dynamic:8,d=4", num_heads=3)
    with pytest.raises(TreeError, match="top-k is at most 8"):
        load_tree("dynamic:64,k=10,d=2", max_top_k=8)
    assert scratch_slots(DynamicTree(4, 8, 4)) == 24 and scratch_slots(DynamicTree(14, 2, 4)) == 15
    assert scratch_slots(load_tree("mc_sim_7b_16")) == 17


def test_eagle_drafter_dynamic_drafts_equal_plain_forwards(tiny_model_dir):
    """The EAGLE drafter's first-step dynamic tree equals the growth by plain forwards: each frontier node's
    outputs from the committed pairs plus its path's pairs (parent's output, node token), without a cache."""
    base = load_pretrained(tiny_model_dir("llama", initializer_range=0.3))
    d = drafter(base, seed=3)
    spec = DynamicTree(9, 3, 3)
    prompt = [5, 9, 2, 17, 33, 4, 61]
    n = len(prompt)
    p = jnp.asarray([prompt + [0]], jnp.int32)
    last, cache, hidden = prefill_states(base, p, jnp.asarray([n]), KVCache.zeros(base.config, 1, 64))
    root = int(jnp.argmax(base.logits(last)[0]))
    draft = d.init_draft(base, p, jnp.asarray([n]), hidden, 64, spec.depth)
    got, draft = propose(d, last, jnp.asarray([root]), base, spec, draft, jnp.asarray([True]))
    assert int(draft.cache.lengths_b[0]) == n

    feats = base_features(base, prompt)
    outputs = {}

    def output_of(path):  # the drafter's output for the last pair of `path` (root first)
        if path not in outputs:
            f_list = list(feats) + [output_of(path[:i]) for i in range(1, len(path))]
            x_list = prompt[1:] + list(path)
            outputs[path] = np.asarray(plain_outputs(d, base, np.stack(f_list), x_list)[-1])
        return outputs[path]

    want = reference_tree(spec, root, lambda path: log_softmax_np(d.logits(jnp.asarray(output_of(tuple(path))),
                                                                           base)))
    assert np.asarray(got.tokens_bt[0]).tolist() == want[0]
    assert np.asarray(got.parent_bt[0]).tolist() == want[1] and np.asarray(got.depth_bt[0]).tolist() == want[2]
    np.testing.assert_allclose(np.asarray(got.score_bt[0]), want[3], rtol=1e-4, atol=1e-5)
    assert len(set(want[0])) > 4 and max(want[2]) == 3  # varied drafts, three depths
