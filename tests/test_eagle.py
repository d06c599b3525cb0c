"""The EAGLE drafter: what the tree step drafts equals the drafter run plainly over the committed text (first step
and after accepted paths), its EAGLE-layout export loads back and matches an independent PyTorch forward, the
feature store holds the base's hidden states and resumes, and training lowers the loss and resumes.
(Greedy losslessness with the drafter: the head_type-parametrised tests in test_medusa.py.)"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from medusa_jax import generate
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle_layout import export_eagle
from medusa_jax.heads.folder import load_native_heads, save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.trees.tree import DynamicTree, build_tree, load_tree
from medusa_jax.training import hidden_store as fs
from medusa_jax.training import trainer as trainer_mod
from medusa_jax.training.data import segment_mask
from medusa_jax.trees.policy import step_cost
from medusa_jax.inference.autoregressive import prefill_states

from decode_helpers import planted_drafter_step, randomise_kernels
from training_helpers import build_tiny_chat_model, chat_records, write_json


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.3))


def drafter(base, seed=0, **kw) -> EagleDrafter:
    """A drafter with weights varied enough that its drafts differ from node to node."""
    d = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, head_type="eagle",
                               **kw), base, seed=seed)
    linears = [d.fc] + [lin for layer in d.layers for lin in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    randomise_kernels(linears, seed)
    return d


# The reference forwards run jitted on sequences padded at the end to this length (causal attention: the padding
# changes no earlier output), so that one compile per drafter serves every prefix (op by op, the first-step test
# took 21.6 s, now 5.6 s). The drafter's proposals run compiled too, as inside the decode loop.
REF_WIDTH = 32


@jax.jit
def _causal_outputs(d, base, feats_td, tokens_t, mask):
    width = tokens_t.shape[0]
    out, _ = d(feats_td[None], tokens_t[None], jnp.arange(width, dtype=jnp.int32)[None], mask, None, base)
    return out[0]


@jax.jit
def _base_features(base, tokens_t, mask):
    return base(tokens_t[None], jnp.arange(tokens_t.shape[0], dtype=jnp.int32)[None], mask, None)[0][0]


def _padded(rows, width=REF_WIDTH, dtype=np.float32):
    rows = np.asarray(rows, dtype)
    assert len(rows) <= width, (len(rows), width)
    return np.concatenate([rows, np.zeros((width - len(rows),) + rows.shape[1:], dtype)])


def plain_outputs(d: EagleDrafter, base, feats_td, tokens_t):
    """The drafter's outputs over one sequence of pairs, without a cache (causal)."""
    mask = segment_mask(np.ones((1, REF_WIDTH), np.int32))
    return _causal_outputs(d, base, _padded(feats_td), _padded(tokens_t, dtype=np.int32), mask)[: len(tokens_t)]


def base_features(base, tokens_t):
    """The base's last hidden states over `tokens_t` (one sequence, causal)."""
    mask = segment_mask(np.ones((1, REF_WIDTH), np.int32))
    return np.asarray(_base_features(base, _padded(tokens_t, dtype=np.int32), mask))[: len(tokens_t)]


@functools.partial(jax.jit, static_argnames="tree")
def propose(d, last, root, base, tree, draft, active):
    """The drafter's tree proposals (`EagleDrafter.propose`), compiled."""
    return d.propose(last, root, base, tree, draft, active)


def reference_tree(d, base, tokens, tree):
    """Tree tokens drafted from the committed `tokens` (the last one is the root) by plain forwards."""
    feats = base_features(base, tokens[:-1])
    out = {0: None}
    node_tokens = {0: tokens[-1]}
    paths = {0: []}
    for node in range(1, tree.num_tokens):
        parent = int(tree.parent_t[node])
        paths[node] = paths[parent] + [node]
    for node in range(tree.num_tokens):
        if node not in np.asarray(tree.parent_t[1:]):
            continue  # a leaf: its output is never read
        # pairs: committed (f_i, x_{i+1}), then along the node's path (the parent entry's output, the node's token)
        f_list = list(feats) + [np.asarray(out[int(tree.parent_t[u])]) for u in paths[node]]
        x_list = list(tokens[1:]) + [node_tokens[u] for u in paths[node]]
        outs = plain_outputs(d, base, np.stack(f_list), x_list)
        out[node] = outs[-1]
        children = np.nonzero(tree.parent_t == node)[0]
        children = children[children > 0]
        ids = np.asarray(d.top_k(outs[-1], base, int(tree.rank_t[children].max()) + 1))
        for c in children:
            node_tokens[int(c)] = int(ids[tree.rank_t[c]])
    return np.asarray([node_tokens[n] for n in range(tree.num_tokens)])


def test_first_step_drafts_equal_plain_forwards(base):
    d = drafter(base)
    tree = load_tree("mc_sim_7b_16")
    prompt = [5, 9, 2, 17, 33, 4, 61]
    p = jnp.asarray([prompt + [0]], jnp.int32)
    last, cache, hidden = prefill_states(base, p, jnp.asarray([len(prompt)]), KVCache.zeros(base.config, 1, 64))
    root = int(jnp.argmax(base.logits(last)[0]))
    draft = d.init_draft(base, p, jnp.asarray([len(prompt)]), hidden, 64, tree.depth)
    tokens, draft = propose(d, last, jnp.asarray([root]), base, tree, draft, jnp.asarray([True]))
    assert int(draft.cache.lengths_b[0]) == len(prompt)  # the root pair is committed
    np.testing.assert_array_equal(np.asarray(tokens[0]), reference_tree(d, base, prompt + [root], tree))
    assert len(set(np.asarray(tokens[0]).tolist())) > 4  # varied drafts: the comparison means something


@pytest.mark.parametrize("accept", [0, 1, 3])
def test_drafts_after_an_accepted_path_equal_plain_forwards(base, accept):
    """One real tree step (verify + accept with planted drafts of a known accept length), then the next step's
    drafts: the catch-up entries use the verify's true features."""
    d = drafter(base, seed=1)
    tree = build_tree([[0], [0, 0], [0, 0, 0], [1]])
    prompt = [7, 3, 12, 40, 2]
    truth = prompt + generate(base, [prompt], max_new_tokens=8, eos_ids=())[0].token_ids
    n, size = len(prompt), 64
    p = jnp.asarray([prompt], jnp.int32)
    last, cache, hidden = prefill_states(base, p, jnp.asarray([n]), KVCache.zeros(base.config, 1, size))
    draft = d.init_draft(base, p, jnp.asarray([n]), hidden, size, tree.depth)
    # the chain [0], [0, 0], [0, 0, 0] holds the true tokens up to `accept`; node [1] a wrong one
    state = planted_drafter_step(base, d, tree, truth, n, accept, cache, last, draft)
    assert int(state.accept_bo[0, 0]) == accept
    committed = truth[: n + accept + 2]  # prompt, root, the accepted drafts, then the bonus (the new root)
    assert int(state.root_b[0]) == committed[-1]
    tokens, _ = propose(d, state.hidden_bd, state.root_b, base, tree, state.draft, jnp.asarray([True]))
    np.testing.assert_array_equal(np.asarray(tokens[0]), reference_tree(d, base, committed, tree))


def test_unrolled_chains_equal_plain_forwards(base):
    d = drafter(base, seed=4)
    rng = np.random.RandomState(1)
    tokens = rng.randint(0, base.config.vocab_size, size=12)
    n = len(tokens)
    feats = base_features(base, tokens)
    outs = np.asarray(d.unrolled(jnp.asarray(feats)[None], jnp.asarray(tokens, jnp.int32)[None], base, 3)[:, 0])
    for t in (0, 4, 8):
        f_list, x_list = list(feats[: t + 1]), list(tokens[1: t + 2])
        for k in range(1, 4):  # depth k: the chain's pairs (previous output, the true token x_{t+k})
            got = plain_outputs(d, base, np.stack(f_list), x_list)[-1]
            np.testing.assert_allclose(outs[k - 1, t], np.asarray(got), atol=2e-4, rtol=1e-4)
            f_list.append(np.asarray(got))
            x_list.append(tokens[min(t + k + 1, n - 1)])


def test_export_loads_back_and_matches_a_pytorch_forward(base, tmp_path):
    torch = pytest.importorskip("torch")

    d = drafter(base, seed=2, lm_head="shared", num_layers=2)
    out = export_eagle(d, base, tmp_path / "eagle", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    assert config["bias"] is False
    w = load_file(str(out / "model.safetensors"))
    assert "layers.0.input_layernorm.weight" not in w and "layers.1.input_layernorm.weight" in w
    assert "lm_head.weight" not in w and "norm.weight" not in w and w["fc.weight"].shape == (64, 128)

    back = load_heads(out, base=base)
    assert isinstance(back, EagleDrafter) and back.config.lm_head == "shared"
    rng = np.random.RandomState(0)
    t = 9
    feats = rng.normal(size=(t, base.config.hidden_size)).astype(np.float32)
    toks = rng.randint(0, base.config.vocab_size, size=t)
    ours = np.asarray(d.logits(plain_outputs(d, base, feats, toks), base))
    np.testing.assert_allclose(np.asarray(back.logits(plain_outputs(back, base, feats, toks), base)), ours,
                               rtol=1e-4, atol=1e-5)

    # an independent PyTorch EAGLE-1 forward over the exported tensors (Llama layers, HF rotary convention)
    cfg = base.config
    T = {k: torch.from_numpy(v) for k, v in w.items()}
    emb = T["embed_tokens.weight"]
    x = torch.cat([emb[torch.from_numpy(toks)], torch.from_numpy(feats)], -1) @ T["fc.weight"].T
    h, n_h, n_kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, h, 2, dtype=torch.float32) / h))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(q):  # [heads, t, h]
        q1, q2 = q[..., : h // 2], q[..., h // 2:]
        return q * cos + torch.cat([-q2, q1], -1) * sin

    def rms(v, wt):
        return wt * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    for i in range(2):
        pre = f"layers.{i}."
        a = x if i == 0 else rms(x, T[pre + "input_layernorm.weight"])
        q = rope((a @ T[pre + "self_attn.q_proj.weight"].T).view(t, n_h, h).transpose(0, 1))
        k = rope((a @ T[pre + "self_attn.k_proj.weight"].T).view(t, n_kv, h).transpose(0, 1))
        v = (a @ T[pre + "self_attn.v_proj.weight"].T).view(t, n_kv, h).transpose(0, 1)
        k, v = k.repeat_interleave(n_h // n_kv, 0), v.repeat_interleave(n_h // n_kv, 0)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + att.transpose(0, 1).reshape(t, n_h * h) @ T[pre + "self_attn.o_proj.weight"].T
        m = rms(x, T[pre + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(m @ T[pre + "mlp.gate_proj.weight"].T) * (m @ T[pre + "mlp.up_proj.weight"].T)
                 ) @ T[pre + "mlp.down_proj.weight"].T
    lm = np.asarray(jax.device_get(base.lm_head_weight()))  # the base's lm_head [D, V]
    theirs = x.numpy() @ lm
    np.testing.assert_allclose(theirs, ours, atol=2e-3, rtol=1e-3)


def test_truncated_drafter_round_trips_in_our_format(base, tmp_path):
    d = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=6, head_type="eagle",
                               lm_head="truncated", truncated_vocab_size=40), base, token_map=np.arange(40, 80))
    save_heads(d, tmp_path / "h")
    back = load_native_heads(tmp_path / "h")
    assert isinstance(back, EagleDrafter) and back.config == d.config
    np.testing.assert_array_equal(np.asarray(back.token_map[...]), np.arange(40, 80))
    h = jnp.ones((3, base.config.hidden_size))
    np.testing.assert_allclose(np.asarray(back.logits(h, base)), np.asarray(d.logits(h, base)), atol=1e-6)
    assert (np.asarray(back.top_k(h, base, 3)) >= 40).all()  # ids come back in the full vocabulary


# ---- the feature store and training ---------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _scripts(monkeypatch):
    for name, file in (("scripts_train_heads", "train_heads.py"), ("scripts_build_features", "build_features.py")):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_run")
    return build_tiny_chat_model(root / "model"), write_json(root / "chat.json", chat_records(60, seed=2))


def _build(chat, store, monkeypatch, tmp_path, max_tokens, *extra):
    from scripts_build_features import main

    model, data = chat
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    return main(["--model", str(model), "--data", str(data), "--output", str(store), "--max-tokens", str(max_tokens),
                 "--seq-len", "128", "--chunk-tokens", "300", "--no-progress", *extra])


def test_feature_store_holds_the_base_hidden_states_and_grows(chat, tmp_path, monkeypatch):
    store = tmp_path / "store"
    assert _build(chat, store, monkeypatch, tmp_path, 700) == 0
    small = fs.open_store(store)
    shards = fs.listed_shards(store)
    assert small.num_tokens >= 700 and len(shards) >= 2
    assert _build(chat, store, monkeypatch, tmp_path, 2000) == 0  # grows: the first shards are kept as they were
    grown = fs.open_store(store)
    assert fs.listed_shards(store)[: len(shards)] == shards and grown.num_tokens >= 2000
    assert grown.ids[: len(small.ids)] == small.ids
    # the stored features are the base's final hidden states of each conversation
    base = load_pretrained(chat[0])
    for c in (0, len(grown.ids) - 1):
        lo, n = int(grown.starts_c[c]), int(grown.lengths_c[c])
        toks = grown.tokens_x[lo:lo + n]
        want = base(jnp.asarray(toks)[None], jnp.arange(n)[None], segment_mask(np.ones((1, n), np.int32)), None)[0][0]
        rows = np.concatenate(grown.hidden_chunks)[lo:lo + n].astype(np.float32)
        np.testing.assert_allclose(rows, np.asarray(want), atol=2e-2, rtol=1e-2)
        assert grown.loss_x[lo:lo + n].any() and not grown.loss_x[lo:lo + n].all()
    prefix = fs.open_store(store, max_tokens=700)
    assert prefix.ids == grown.ids[: len(prefix.ids)] and 700 <= prefix.num_tokens < grown.num_tokens
    # a store built with other settings is refused, and nothing is written to it
    before = sorted(p.name for p in store.iterdir())
    assert _build(chat, store, monkeypatch, tmp_path, 3000, "--seed", "7") == 2
    assert sorted(p.name for p in store.iterdir()) == before


def _train(chat, store, out, monkeypatch, tmp_path, *extra):
    from scripts_train_heads import main

    model, _ = chat
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    code = main(["--model", str(model), "--data", str(store), "--output", str(out), "--batch-size", "2",
                 "--seq-len", "128", "--heldout-fraction", "0.2", "--log-every", "1", "--no-progress",
                 "--head-type", "eagle", "--num-heads", "4", "--lm-head", "truncated:64", "--learning-rate", "1e-2",
                 "--warmup-steps", "2", *extra])
    assert code == 0
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def test_eagle_training_lowers_the_loss_and_resumes_exactly(chat, tmp_path, monkeypatch):
    store = tmp_path / "store"
    assert _build(chat, store, monkeypatch, tmp_path, 5000) == 0
    common = ["--max-steps", "14", "--save-every", "5", "--eval-every", "14"]
    log = _train(chat, store, tmp_path / "a", monkeypatch, tmp_path, *common)
    train = [r for r in log if r["kind"] == "train"]
    losses = [r["loss"] for r in train]
    assert len(losses) == 14 and np.mean(losses[-3:]) < 0.92 * np.mean(losses[:3]), losses
    assert all("feature_loss" in r and "ce_loss" in r for r in train)
    evals = [r for r in log if r["kind"] == "eval"]
    assert evals and 0 <= evals[-1]["top1"][0] <= 1
    heads = load_native_heads(tmp_path / "a")
    assert isinstance(heads, EagleDrafter) and heads.config.decoder is not None

    real_step = trainer_mod.Trainer.train_step

    def crash_at_seven(self, batch):
        if self.step == 7:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", crash_at_seven)
    with pytest.raises(KeyboardInterrupt):
        _train(chat, store, tmp_path / "b", monkeypatch, tmp_path, *common)
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", real_step)
    resumed = [r for r in _train(chat, store, tmp_path / "b", monkeypatch, tmp_path, *common, "--resume")
               if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == list(range(1, 15))
    for r in resumed[5:]:
        assert r["loss"] == pytest.approx(losses[r["step"] - 1], rel=1e-4), r["step"]


def test_training_depth_two_trains_and_scores_both_depths(chat, tmp_path, monkeypatch):
    store = tmp_path / "store"
    assert _build(chat, store, monkeypatch, tmp_path, 2000) == 0
    log = _train(chat, store, tmp_path / "a", monkeypatch, tmp_path, "--max-steps", "4", "--eval-every", "4",
                 "--eagle-train-depth", "2")
    train = [r for r in log if r["kind"] == "train"]
    assert all(len(r["top1"]) == 2 and np.isfinite(r["loss"]) for r in train)
    assert len([r for r in log if r["kind"] == "eval"][-1]["top1"]) == 2


def test_feature_store_examples_for_heads(chat, tmp_path, monkeypatch):
    """Medusa/Hydra heads on a feature store: head i at position j targets the assistant token j + 2 + i of the
    same conversation, with the stored hidden state at j + 1 + i as its teacher; Hydra's path is j + 1 .. j + M."""
    store_dir = tmp_path / "store"
    assert _build(chat, store_dir, monkeypatch, tmp_path, 1200) == 0
    store = fs.open_store(store_dir)
    ex = store.examples(num_heads=3, with_path=True)
    hidden = np.concatenate(store.hidden_chunks)
    for k in range(0, len(ex), max(1, len(ex) // 40)):
        g, c = int(ex.rows_x[k]), int(ex.groups_x[k])
        lo, n = int(store.starts_c[c]), int(store.lengths_c[c])
        assert lo <= g < lo + n
        for i in range(3):
            t = g + 2 + i
            ok = t < lo + n and store.loss_x[t]
            assert ex.targets_xm[k, i] == (store.tokens_x[t] if ok else -1)
            assert ex.teacher_rows_xm[k, i] == (g + 1 + i if ok else -1)
            p = g + 1 + i
            assert ex.path_xe[k, i] == (store.tokens_x[p] if p < lo + n else 0)
        np.testing.assert_array_equal(ex.hidden.take(ex.rows_x[k:k + 1])[0], hidden[g])
    assert (ex.targets_xm >= 0).any(axis=1).all() and len(set(ex.groups_x.tolist())) == len(store.ids)


def test_hydra_heads_train_on_a_feature_store(chat, tmp_path, monkeypatch):
    from scripts_train_heads import main

    store = tmp_path / "store"
    assert _build(chat, store, monkeypatch, tmp_path, 5000) == 0
    model, _ = chat
    out = tmp_path / "hydra"
    assert main(["--model", str(model), "--data", str(store), "--output", str(out), "--head-type", "hydra",
                 "--num-heads", "3", "--lm-head", "truncated:64", "--head-loss", "kl", "--cached-batch-size", "64",
                 "--max-steps", "12", "--eval-every", "12", "--log-every", "1", "--learning-rate", "1e-2",
                 "--warmup-steps", "2", "--seq-len", "128", "--no-progress"]) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def test_step_cost_times_drafter_steps_static_and_dynamic(base):
    """Calibration times the drafter's whole step (its state made by a prefill of the context) for static and
    dynamic trees alike."""
    d = drafter(base, seed=5)
    costs = step_cost.measure_step_costs(base, d, [load_tree("mc_sim_7b_8")], batch=2, context=12, repeats=1,
                                         dynamic=[DynamicTree(6, 2, 3)])
    assert costs.dynamic_trees == ("dynamic:6,k=2,d=3",) and costs.dynamic_seconds[0] > 0
    assert costs.plain_seconds > 0 and min(costs.medusa_seconds) > 0
    assert step_cost._plain_step._cache_size() == 0 and step_cost._medusa_step_jit(2)._cache_size() == 0  # let go
