"""The EAGLE-3 drafter in the decode loop: the base's taps (the residual stream entering chosen layers, from the
same forward) equal transformers' hidden states, greedy decoding with the drafter is lossless (static and dynamic
trees, ragged rows, Qwen2, a draft vocabulary), and after a real verify step the drafter's next tree equals the
one drafted by plain forwards over the committed text. (Against the authors' code: test_eagle_published.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle3 import Eagle3Drafter, default_feature_layers
from medusa_jax.heads.folder import load_native_heads, save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.trees.search.head_accuracy import _top_k_along
from medusa_jax.trees.tree import build_tree
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.autoregressive import prefill_states
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.training.data import segment_mask

from decode_helpers import planted_drafter_step

LAYERS = (0, 1, 2)  # every tap the tiny 2-layer bases have: the embeddings, after layer 0, after layer 1


def drafter(base, seed=0, **kw) -> Eagle3Drafter:
    """A drafter with random weights, varied enough that its drafts differ from node to node."""
    d = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, head_type="eagle3",
                               feature_layers=LAYERS, **kw), base, seed=seed)
    rng = np.random.RandomState(seed)
    for path, var in nnx.iter_graph(d):
        if isinstance(var, nnx.Param) and ".".join(map(str, path)) != "lm_head.kernel":
            norm = str(path[-2]).endswith("norm")
            var[...] = jnp.asarray(0.5 + rng.rand(*var.shape) if norm else rng.normal(0, 0.3, var.shape), jnp.float32)
    return d


@pytest.fixture(scope="module")
def bases(tiny_model_dir):
    return {kind: load_pretrained(tiny_model_dir(kind, initializer_range=0.3)) for kind in ("llama", "qwen2")}


def test_taps_are_the_hidden_states_entering_each_layer(tiny_hf_model):
    torch = pytest.importorskip("torch")
    folder, hf = tiny_hf_model("llama", initializer_range=0.3)
    base = load_pretrained(folder)
    tokens = np.asarray([[5, 9, 2, 17, 33, 4, 61, 8]])
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens), output_hidden_states=True).hidden_states  # [i]: entering layer i
    t = tokens.shape[1]
    mask = segment_mask(np.ones((1, t), np.int32))
    final, _, taps = base.forward_taps(jnp.asarray(tokens), jnp.arange(t)[None], mask, None, (1, 0))
    d = base.config.hidden_size

    def close(got, want):  # float32 paths of two libraries: rtol, and an atol that follows the magnitude
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-4, atol=1e-5 * float(want.abs().max()))

    close(taps[0, :, :d], want[1][0])
    close(taps[0, :, d:], want[0][0])
    close(final[0], want[-1][0])  # after the final norm
    assert default_feature_layers(32) == (2, 16, 29)  # Llama-3.1-8B's published drafts


@pytest.mark.parametrize("kind, tree, lm_head", [
    ("llama", "mc_sim_7b_16", "own"), ("llama", "dynamic:6,k=2,d=3", "own"), ("qwen2", "mc_sim_7b_8", "truncated"),
    ("llama", "dynamic:6,k=2,d=3", "truncated")])
def test_greedy_with_the_drafter_equals_plain_greedy(bases, kind, tree, lm_head):
    base = bases[kind]
    trunc = dict(truncated_vocab_size=48) if lm_head == "truncated" else {}
    d = drafter(base, seed=1, lm_head=lm_head, **trunc)
    prompts = [[11, 3, 8, 21, 7, 2], [40, 41, 9, 13, 5, 77, 61, 2, 19, 30, 8, 4, 99], [6, 1, 3]]
    want = [r.token_ids for r in generate(base, prompts, max_new_tokens=24, eos_ids=())]
    got = generate_medusa(base, d, prompts, tree=tree, max_new_tokens=24, eos_ids=())
    assert [r.token_ids for r in got] == want
    assert all(r.steps == 1 + len(r.accept_lengths) for r in got)


def test_native_folder_round_trip(bases, tmp_path):
    d = drafter(bases["llama"], seed=2, lm_head="truncated", truncated_vocab_size=40)
    save_heads(d, tmp_path / "h")
    back = load_native_heads(tmp_path / "h")
    assert isinstance(back, Eagle3Drafter) and back.config == d.config and back.config.feature_layers == LAYERS
    h = jnp.ones((3, bases["llama"].config.hidden_size))
    np.testing.assert_allclose(np.asarray(back.logits(h, bases["llama"])), np.asarray(d.logits(h, bases["llama"])),
                               atol=1e-6)


def plain_tree(d, base, committed, tree):
    """The tree drafted from `committed` (its last token the root) by plain forwards of the drafter: the pairs
    (fc(fused feature_i), x_{i+1}) of the committed text, then (the parent's output, the node's token)."""
    n = len(committed) - 1
    t = jnp.arange(n)[None]
    _, _, fused = base.forward_taps(jnp.asarray([committed[:-1]]), t, segment_mask(np.ones((1, n), np.int32)), None,
                                    d.feature_layers)
    h = list(np.asarray(d.project(fused[0])))
    tokens, paths, outs = {0: committed[-1]}, {0: []}, {}
    for node in range(1, tree.num_tokens):
        paths[node] = paths[int(tree.parent_t[node])] + [node]
    for node in range(tree.num_tokens):
        children = np.nonzero(tree.parent_t == node)[0]
        children = children[children > 0]
        if not len(children):
            continue
        hs = h + [outs[int(tree.parent_t[u])] for u in paths[node]]
        xs = committed[1:] + [tokens[u] for u in paths[node]]
        m = len(xs)
        out, _ = d(jnp.asarray(np.stack(hs))[None], jnp.asarray([xs]), jnp.arange(m)[None],
                   segment_mask(np.ones((1, m), np.int32)), None, base)
        outs[node] = np.asarray(out[0, -1])
        ids = np.asarray(d.top_k(out[0, -1], base, int(tree.rank_t[children].max()) + 1))
        for c in children:
            tokens[int(c)] = int(ids[tree.rank_t[c]])
    return np.asarray([tokens[i] for i in range(tree.num_tokens)])


@pytest.mark.parametrize("accept", [0, 2])
def test_drafts_after_an_accepted_path_equal_plain_forwards(bases, accept):
    """One real tree step (planted drafts of a known accept length), then the next step's tree: the catch-up
    pairs carry fc of the verify's own fused features, the root pair the last accepted node's."""
    base = bases["llama"]
    d = drafter(base, seed=3)
    tree = build_tree([[0], [0, 0], [0, 0, 0], [1]])
    prompt = [7, 3, 12, 40, 2]
    truth = prompt + generate(base, [prompt], max_new_tokens=8, eos_ids=())[0].token_ids
    n, size = len(prompt), 64
    p = jnp.asarray([prompt], jnp.int32)
    last, cache, fused = prefill_states(base, p, jnp.asarray([n]), KVCache.zeros(base.config, 1, size), LAYERS)
    draft = d.init_draft(base, p, jnp.asarray([n]), fused, size, tree.depth)
    state = planted_drafter_step(base, d, tree, truth, n, accept, cache, last, draft)
    assert int(state.accept_bo[0, 0]) == accept
    committed = truth[: n + accept + 2]
    tokens, _ = d.propose(state.hidden_bd, state.root_b, base, tree, state.draft, jnp.asarray([True]))
    want = plain_tree(d, base, committed, tree)
    np.testing.assert_array_equal(np.asarray(tokens[0]), want)
    assert len(set(want.tolist())) > 2


def test_export_script_writes_the_published_layout_and_it_decodes_the_same(bases, tiny_model_dir, tmp_path, capsys):
    """scripts/export_heads.py --format eagle3 (a draft vocabulary kept as lm_head + d2t/t2d); the folder loads as
    it is (`--heads FOLDER` reads it through load_heads) and decodes what the drafter decodes: plain greedy."""
    import importlib.util
    from pathlib import Path

    from medusa_jax.heads.load import detect_layout, load_heads

    spec = importlib.util.spec_from_file_location("export_heads_script",
                                                  Path(__file__).parents[1] / "scripts/export_heads.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    base = bases["llama"]
    d = drafter(base, seed=4, lm_head="truncated", truncated_vocab_size=40)
    save_heads(d, tmp_path / "native")
    folder = str(tiny_model_dir("llama", initializer_range=0.3))
    assert cli.main(["--heads", str(tmp_path / "native"), "--out", str(tmp_path / "out"), "--format", "eagle3",
                     "--model", folder]) == 0
    assert "eagle_aux_hidden_state_layer_ids" in capsys.readouterr().out
    assert detect_layout(tmp_path / "out") == "eagle3"
    assert cli.main(["--heads", str(tmp_path / "native"), "--out", str(tmp_path / "bad"), "--format", "eagle",
                     "--model", folder]) == 2
    assert "EAGLE-3 drafters with eagle3" in capsys.readouterr().err
    back = load_heads(tmp_path / "out", base=base)
    prompts = [[11, 3, 8, 21, 7, 2], [6, 1, 3]]
    want = [r.token_ids for r in generate(base, prompts, max_new_tokens=16, eos_ids=())]
    got = generate_medusa(base, back, prompts, tree="mc_sim_7b_8", max_new_tokens=16, eos_ids=())
    mine = generate_medusa(base, d, prompts, tree="mc_sim_7b_8", max_new_tokens=16, eos_ids=())
    assert [r.token_ids for r in got] == want
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in mine]  # the same drafts, step by step


def test_training_time_test_lowers_the_loss_and_the_drafter_decodes_losslessly(tmp_path, monkeypatch, capsys):
    """train_heads.py --head-type eagle3 on packed chat rows: three unrolled depths, cross-entropy only, the loss
    falls; the saved drafter reads the trained base layers and decodes what plain greedy decodes."""
    import importlib.util
    import json
    from pathlib import Path

    from training_helpers import build_tiny_chat_model, chat_records, write_json

    model = build_tiny_chat_model(tmp_path / "model", initializer_range=0.5)  # a peaked teacher to learn
    data = write_json(tmp_path / "chat.json", chat_records(40, seed=3))
    spec = importlib.util.spec_from_file_location("train_heads_script",
                                                  Path(__file__).parents[1] / "scripts/train_heads.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    common = ["--model", str(model), "--data", str(data), "--batch-size", "2", "--seq-len", "128",
              "--heldout-fraction", "0.2", "--log-every", "1", "--no-progress", "--head-type", "eagle3",
              "--num-heads", "4", "--lm-head", "truncated:64", "--learning-rate", "1e-2", "--warmup-steps", "2"]
    assert cli.main([*common, "--output", str(tmp_path / "bad"), "--cache-hidden"]) == 2
    assert "--head-type eagle3 trains on packed rows" in capsys.readouterr().err
    assert cli.main([*common, "--output", str(tmp_path / "out"), "--max-steps", "12", "--eval-every", "12",
                     "--eagle-train-depth", "3"]) == 0
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in log if r["kind"] == "train"]
    losses = [r["loss"] for r in train]
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses
    assert all(len(r["top1"]) == 3 and "ce_loss" in r and "feature_loss" not in r for r in train)
    d = load_native_heads(tmp_path / "out")
    base = load_pretrained(model)
    assert isinstance(d, Eagle3Drafter) and d.config.feature_layers == default_feature_layers(base.config.num_layers)
    prompts = [[5, 9, 2, 17, 33, 4], [6, 1, 3]]
    want = [r.token_ids for r in generate(base, prompts, max_new_tokens=16, eos_ids=())]
    assert [r.token_ids for r in generate_medusa(base, d, prompts, tree="mc_sim_7b_8", max_new_tokens=16,
                                                 eos_ids=())] == want

    # exported in the published layout, the folder goes to `generate.py --heads` as it is
    def script(name):
        spec = importlib.util.spec_from_file_location(f"{name}_script",
                                                      Path(__file__).parents[1] / f"scripts/{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main

    capsys.readouterr()
    assert script("export_heads")(["--heads", str(tmp_path / "out"), "--out", str(tmp_path / "published"),
                                   "--format", "eagle3", "--model", str(model), "--dtype", "float32"]) == 0
    rows = []
    for extra in ([], ["--heads", str(tmp_path / "published"), "--tree", "mc_sim_7b_8"]):
        capsys.readouterr()
        assert script("generate")(["--model", str(model), "--prompt", "user assistant", "--max-new-tokens", "12",
                                   "--json", *extra]) == 0
        rows.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert rows[1]["token_ids"] == rows[0]["token_ids"] and rows[1]["steps"] <= rows[0]["steps"]


def test_step_cost_times_the_drafter_static_and_dynamic(bases):
    """medusa_jax/trees/policy/step_cost.py builds the drafter's state from a prefill's fused features (len(feature_layers) x
    wider than the hidden state) and times whole tree steps."""
    from medusa_jax.trees.tree import load_tree
    from medusa_jax.trees.policy import step_cost

    d = drafter(bases["llama"], seed=5)
    for tree in ("mc_sim_7b_8", "dynamic:6,k=2,d=3"):
        assert step_cost.medusa_step_seconds(bases["llama"], d, load_tree(tree), 2, 32, 96, repeats=2) > 0


def test_teacher_forced_guesses_start_from_the_fused_taps(bases):
    """The tree search's held-out guesses (trees.search.head_accuracy) of an EAGLE-3 drafter: depth 1 at t reads
    the pairs (fc(fused tap_i), x_{i+1}), i <= t; depth 2 adds (its own depth-1 output, the true x_{t+2}); each
    equals a plain forward of the drafter over those pairs."""
    base = bases["llama"]
    d = drafter(base, seed=4)
    seq = np.random.RandomState(5).randint(0, base.config.vocab_size, 12).tolist()
    top_mbtr = np.asarray(_top_k_along(*nnx.split((base, d)), jnp.asarray([seq], jnp.int32), top_k=3))
    assert top_mbtr.shape == (4, 1, 12, 3)
    for t in (2, 6, 9):
        _, _, fused = base.forward_taps(jnp.asarray([seq[: t + 1]]), jnp.arange(t + 1)[None],
                                        segment_mask(np.ones((1, t + 1), np.int32)), None, d.feature_layers)
        hs = list(np.asarray(d.project(fused[0])))
        for depth in (1, 2):
            m = t + depth
            out, _ = d(jnp.asarray(np.stack(hs))[None], jnp.asarray([seq[1: m + 1]]), jnp.arange(m)[None],
                       segment_mask(np.ones((1, m), np.int32)), None, base)
            np.testing.assert_array_equal(top_mbtr[depth - 1, 0, t], np.asarray(d.top_k(out[0, -1], base, 3)))
            hs.append(np.asarray(out[0, -1]))
