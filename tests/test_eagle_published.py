"""EAGLE drafts as their authors publish them, checked against the authors' own code from PyPI (installed with
--no-deps by scripts/setup.sh): eagle-llm (SafeAILab's package; eagle/model/cnets.py is its EAGLE-1 drafter, with
the rotary base fixed at 10000, hence the tiny bases here keep rope_theta 10000) and speculators (vLLM's library of
draft formats; its Eagle3DraftModel and the converter's Eagle3Speculator hold the EAGLE-3 layer).

Each side builds a drafter with random weights there, saves it as its authors do (pytorch_model.bin and their
config.json; EAGLE-3 with the published midlayer.* keys), loads it here and compares draft logits (fp32, rtol 1e-4)
and the tree drafted in a first decode step; our exports load strictly into their modules and give our logits."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.heads.eagle3_layout import export_eagle3
from medusa_jax.heads.eagle_layout import export_eagle
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import detect_layout, load_heads
from medusa_jax.trees.tree import load_tree
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.autoregressive import prefill_states
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.training.data import segment_mask

torch = pytest.importorskip("torch")
LAYERS3 = (0, 1, 2)  # the fused base layers of the EAGLE-3 drafters (the tiny bases have 2 layers)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.3))  # rope_theta 10000


@pytest.fixture(scope="module")
def qwen2_base(tiny_model_dir):
    return load_pretrained(tiny_model_dir("qwen2", initializer_range=0.3))


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def randomise_torch(module, seed: int) -> None:
    """normal(0, 0.3) weights and biases, norms in [0.5, 1.5]: drafts that differ from node to node."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def randomise_ours(d, seed: int) -> None:
    """Random kernels, biases and norms for one of our drafters (as randomise_torch)."""
    rng = np.random.RandomState(seed)
    for path, var in nnx.iter_graph(d):
        if isinstance(var, nnx.Param):
            name = ".".join(str(p) for p in path)
            low = name.endswith("norm.weight")
            var[...] = jnp.asarray(0.5 + rng.rand(*var.shape) if low else rng.normal(0, 0.3, var.shape), jnp.float32)


def our_outputs(d, base, feats_td, tokens_t):
    """The drafter's outputs over one sequence of pairs, no cache (causal)."""
    t = len(tokens_t)
    out, _ = d(jnp.asarray(feats_td)[None], jnp.asarray(tokens_t, jnp.int32)[None],
               jnp.arange(t, dtype=jnp.int32)[None], segment_mask(np.ones((1, t), np.int32)), None, base)
    return out[0]


def first_step_tree(d, base, prompt, tree, taps=()):
    """The tree our drafter proposes in the first decode step after `prompt` (root = the base's greedy token),
    with the prompt's features (final hidden states, or the fused taps)."""
    n = len(prompt)
    p = jnp.asarray([prompt], jnp.int32)
    last, _, feats = prefill_states(base, p, jnp.asarray([n]), KVCache.zeros(base.config, 1, 64), taps)
    root = int(jnp.argmax(base.logits(last)[0]))
    draft = d.init_draft(base, p, jnp.asarray([n]), feats, 64, tree.depth)
    tokens, _ = d.propose(last, jnp.asarray([root]), base, tree, draft, jnp.asarray([True]))
    return np.asarray(tokens[0]), root, _np(feats[0])


def reference_tree(children_logits, tree, root) -> np.ndarray:
    """Tree tokens from `children_logits(path tokens) -> full-vocabulary logits` of the node on that path."""
    tokens = {0: root}
    paths = {0: []}
    for node in range(1, tree.num_tokens):
        paths[node] = paths[int(tree.parent_t[node])] + [node]
    for node in range(tree.num_tokens):
        children = np.nonzero(tree.parent_t == node)[0]
        children = children[children > 0]
        if not len(children):
            continue
        order = np.argsort(-children_logits([tokens[u] for u in paths[node]]), kind="stable")
        for c in children:
            tokens[int(c)] = int(order[tree.rank_t[c]])
    return np.asarray([tokens[n] for n in range(tree.num_tokens)])


# ---- EAGLE-1: eagle-llm's cnets.Model ---------------------------------------------------------------------------

def authors_eagle1(base, bias: bool, seed: int, layers: int = 1):
    pytest.importorskip("eagle.model.cnets")
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    cfg = base.config
    config = EConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                     max_position_embeddings=512, rms_norm_eps=cfg.rms_norm_eps)
    config.rope_scaling = None  # transformers 5 fills a default rope dict that eagle-llm 1.2.1 takes for a scaling
    model = Model(config, bias=bias).eval()
    randomise_torch(model, seed)
    with torch.no_grad():  # the authors load the base's embedding into the drafter (load_emb)
        model.embed_tokens.weight.copy_(torch.from_numpy(_np(base.embed_tokens.embedding[...]).copy()))
    return model, config


def authors_logits(model, base, feats_td, tokens_t) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(feats_td, np.float32))[None],
                    torch.from_numpy(np.asarray(tokens_t, np.int64))[None])[0].numpy()
    return out @ _np(base.lm_head_weight())


def save_as_authors(model, config, folder, bias: bool):
    """config.json (the drafter's Llama config; "bias" left out when true, the authors' default) and
    pytorch_model.bin, as the authors publish EAGLE-1 drafts."""
    folder.mkdir()
    raw = json.loads(config.to_json_string())
    raw["architectures"] = ["LlamaForCausalLM"]
    if not bias:
        raw["bias"] = False
    (folder / "config.json").write_text(json.dumps(raw))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


@pytest.mark.parametrize("bias", [True, False])
def test_authors_eagle1_draft_loads_and_drafts_the_same(base, tmp_path, bias):
    model, config = authors_eagle1(base, bias, seed=1)
    save_as_authors(model, config, tmp_path / "draft", bias)
    assert detect_layout(tmp_path / "draft") == "eagle"
    d = load_heads(tmp_path / "draft", base=base)
    assert isinstance(d, EagleDrafter) and d.config.fc_bias is bias and d.config.lm_head == "shared"
    rng = np.random.RandomState(0)
    feats = rng.normal(size=(11, base.config.hidden_size)).astype(np.float32)
    toks = rng.randint(0, base.config.vocab_size, 11)
    theirs = authors_logits(model, base, feats, toks)
    np.testing.assert_allclose(_np(d.logits(our_outputs(d, base, feats, toks), base)), theirs, rtol=1e-4,
                               atol=1e-4 * np.abs(theirs).max())

    tree = load_tree("mc_sim_7b_16")
    prompt = [5, 9, 2, 17, 33, 4, 61]
    ours, root, hidden = first_step_tree(d, base, prompt, tree)
    pairs_tokens = prompt[1:] + [root]

    def children(path):  # the committed pairs, then the drafter's own outputs along the path
        f, x = list(hidden), list(pairs_tokens)
        for tok in path:
            with torch.no_grad():
                g = model(torch.from_numpy(np.stack(f))[None], torch.tensor([x]))[0, -1].numpy()
            f, x = f + [g], x + [tok]
        return authors_logits(model, base, np.stack(f), x)[-1]

    np.testing.assert_array_equal(ours, reference_tree(children, tree, root))
    assert len(set(ours.tolist())) > 4  # varied drafts: the comparison means something


@pytest.mark.parametrize("bias", [True, False])
def test_our_eagle1_export_loads_strictly_in_the_authors_code(base, tmp_path, bias):
    Model = pytest.importorskip("eagle.model.cnets").Model
    EConfig = pytest.importorskip("eagle.model.configs").EConfig

    d = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, num_layers=2,
                               head_type="eagle", lm_head="shared", fc_bias=bias), base)
    randomise_ours(d, seed=3)
    out = export_eagle(d, base, tmp_path / "eagle", dtype="float32")
    raw = json.loads((out / "config.json").read_text())
    assert raw["bias"] is bias and raw["num_hidden_layers"] == 2 and raw["rope_theta"] == 10000.0
    config = EConfig.from_pretrained(str(out))
    config.rope_scaling = None
    model = Model(config, bias=raw["bias"]).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(str(out / "model.safetensors")).items()},
                          strict=True)
    rng = np.random.RandomState(1)
    feats = rng.normal(size=(9, base.config.hidden_size)).astype(np.float32)
    toks = rng.randint(0, base.config.vocab_size, 9)
    ours = _np(d.logits(our_outputs(d, base, feats, toks), base))
    np.testing.assert_allclose(authors_logits(model, base, feats, toks), ours, rtol=1e-4,
                               atol=1e-4 * np.abs(ours).max())


def test_qwen2_drafter_keeps_its_qkv_biases_under_the_authors_keys(qwen2_base, tmp_path):
    base = qwen2_base
    d = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, head_type="eagle",
                               lm_head="shared", fc_bias=True), base)
    randomise_ours(d, seed=4)
    out = export_eagle(d, base, tmp_path / "eagle", dtype="float32")
    raw = json.loads((out / "config.json").read_text())
    # SafeAILab/EAGLE cnets1.py builds q/k/v with bias=config.qkv_bias; vLLM and transformers read attention_bias
    assert raw["qkv_bias"] is True and raw["attention_bias"] is True and raw["model_type"] == "llama"
    w = load_file(str(out / "model.safetensors"))
    assert {f"layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= set(w) and "fc.bias" in w
    back = load_heads(out, base=base)
    assert back.decoder.attention_bias and back.config.fc_bias
    rng = np.random.RandomState(2)
    feats = rng.normal(size=(7, base.config.hidden_size)).astype(np.float32)
    toks = rng.randint(0, base.config.vocab_size, 7)
    np.testing.assert_allclose(_np(back.logits(our_outputs(back, base, feats, toks), base)),
                               _np(d.logits(our_outputs(d, base, feats, toks), base)), rtol=1e-5, atol=1e-5)


def test_a_trained_draft_vocabulary_survives_the_eagle1_export(base, tmp_path):
    """A truncated lm_head (ids in any order) is written as lm_head.weight + d2t/t2d, sorted, and reads back as
    the same drafter (same full-vocabulary logits), not the base's lm_head."""
    ids = np.random.RandomState(5).permutation(base.config.vocab_size)[:40]
    d = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, head_type="eagle",
                               lm_head="truncated", truncated_vocab_size=40), base, token_map=ids)
    randomise_ours(d, seed=6)
    out = export_eagle(d, base, tmp_path / "eagle", dtype="float32")
    w = load_file(str(out / "model.safetensors"))
    assert w["lm_head.weight"].shape == (40, base.config.hidden_size)
    np.testing.assert_array_equal(w["d2t"] + np.arange(40), np.sort(ids))
    assert w["t2d"].sum() == 40 and json.loads((out / "config.json").read_text())["draft_vocab_size"] == 40
    back = load_heads(out, base=base)
    assert back.config.lm_head == "truncated"
    h = jnp.asarray(np.random.RandomState(7).normal(size=(5, base.config.hidden_size)), jnp.float32)

    def full(drafter):
        logits = _np(drafter.logits(h, base))
        out = np.full((5, base.config.vocab_size), -np.inf, np.float32)
        out[:, _np(drafter.token_map[...])] = logits
        return out

    np.testing.assert_allclose(full(back), full(d), rtol=1e-6, atol=1e-6)


# ---- EAGLE-3: speculators' Eagle3DraftModel and Eagle3Speculator --------------------------------------------------

def speculators_eagle3(base, draft_ids, seed: int):
    pytest.importorskip("speculators")
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cfg = base.config
    layer = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                     intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                                     num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                     max_position_embeddings=512, rope_theta=cfg.rope_theta,
                                     rms_norm_eps=cfg.rms_norm_eps)
    layer._attn_implementation = "eager"  # noqa: SLF001 (flex attention needs a compiler on CPU)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=len(draft_ids),
        eagle_aux_hidden_state_layer_ids=list(LAYERS3),
        speculators_config=SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy",
                                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                             verifier=VerifierConfig(name_or_path=None,
                                                                     architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    randomise_torch(model, seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(_np(base.embed_tokens.embedding[...]).copy()))
        if model.d2t is not None:
            model.d2t.copy_(torch.from_numpy(np.asarray(draft_ids) - np.arange(len(draft_ids))))
            model.t2d.zero_()
            model.t2d[torch.from_numpy(np.asarray(draft_ids))] = True
    return model


def speculators_logits(model, feats_tf, ids_t, steps: int) -> list[np.ndarray]:
    """Draft-vocabulary logits [T, Vt] of each training-time-test step: step k pairs h (fc of the feature, then
    the previous step's output) at t with the true token ids_t[t + k]."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out[0].detach().numpy().copy()))
    t = len(ids_t)
    with torch.no_grad():
        model(torch.from_numpy(np.asarray(feats_tf, np.float32))[None], torch.tensor([list(ids_t)]),
              torch.zeros((1, t), dtype=torch.long), ttt_steps=steps)
    hook.remove()
    return seen


PUBLISHED_DROPPED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def save_eagle3_as_authors(model, folder, with_layer_ids: bool):
    """pytorch_model.bin with the published keys (midlayer.*, fc, norm, lm_head, d2t, t2d; no embedding) and the
    authors' config.json (a one-layer Llama config, LlamaForCausalLMEagle3, draft_vocab_size)."""
    folder.mkdir()
    state = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()
             if k not in PUBLISHED_DROPPED and v is not None}
    torch.save(state, folder / "pytorch_model.bin")
    layer = model.config.transformer_layer_config
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": layer.hidden_size,
           "intermediate_size": layer.intermediate_size, "num_attention_heads": layer.num_attention_heads,
           "num_key_value_heads": layer.num_key_value_heads, "num_hidden_layers": 1, "hidden_act": "silu",
           "rms_norm_eps": layer.rms_norm_eps, "rope_theta": 10000.0, "vocab_size": layer.vocab_size,
           "draft_vocab_size": model.config.draft_vocab_size, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    if with_layer_ids:
        raw["eagle_aux_hidden_state_layer_ids"] = list(LAYERS3)
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("draft_vocab", [48, None])  # None: the full vocabulary (no d2t/t2d)
def test_published_eagle3_draft_loads_and_drafts_the_same(base, tmp_path, draft_vocab):
    vocab = base.config.vocab_size
    ids = np.sort(np.random.RandomState(8).permutation(vocab)[:draft_vocab]) if draft_vocab else np.arange(vocab)
    model = speculators_eagle3(base, ids, seed=9)
    save_eagle3_as_authors(model, tmp_path / "draft", with_layer_ids=True)
    assert detect_layout(tmp_path / "draft") == "eagle3"
    d = load_heads(tmp_path / "draft", base=base)
    assert isinstance(d, Eagle3Drafter) and d.config.feature_layers == LAYERS3
    assert d.config.lm_head == ("truncated" if draft_vocab else "own")
    rng = np.random.RandomState(10)
    t, f = 10, 3 * base.config.hidden_size
    feats = rng.normal(size=(t, f)).astype(np.float32)
    ids_t = rng.randint(0, vocab, t)
    theirs = speculators_logits(model, feats, ids_t, steps=3)
    # ours: chains from every position (EagleDrafter.unrolled); tokens shifted by one (ours pairs f_t with x_{t+1})
    tokens = jnp.asarray(np.concatenate([[0], ids_t]), jnp.int32)[None]
    h = d.project(jnp.asarray(np.concatenate([feats, np.zeros((1, f), np.float32)]))[None])
    outs = d.unrolled(h, tokens, base, depth=3)
    for k in range(3):
        ours = _np(d.logits(outs[k, 0, :t], base))
        np.testing.assert_allclose(ours, theirs[k], rtol=1e-4, atol=1e-4 * np.abs(theirs[k]).max(), err_msg=f"{k}")

    tree = load_tree("mc_sim_7b_16")
    prompt = [5, 9, 2, 17, 33, 4, 61]
    ours, root, fused = first_step_tree(d, base, prompt, tree, taps=d.feature_layers)
    n = len(prompt)

    def children(path):  # one chain of training-time-test steps from the root pair at position n - 1
        x = prompt[1:] + [root] + list(path)
        feats_tf = np.concatenate([fused[:n], np.zeros((len(path), f), np.float32)])
        logits = speculators_logits(model, feats_tf, x, steps=len(path) + 1)[-1][n - 1]
        full = np.full(vocab, -np.inf, np.float32)
        full[ids] = logits
        return full

    np.testing.assert_array_equal(ours, reference_tree(children, tree, root))
    assert len(set(ours.tolist())) > 4


def test_eagle3_feature_layers_default_to_the_authors_choice(base, tmp_path):
    model = speculators_eagle3(base, np.arange(base.config.vocab_size), seed=11)
    save_eagle3_as_authors(model, tmp_path / "draft", with_layer_ids=False)
    d = load_heads(tmp_path / "draft", base=base)  # 2, L // 2, L - 3 of the base's L = 2 layers, kept in range
    assert d.config.feature_layers == (2, 1, 0)


@pytest.mark.parametrize("lm_head", ["truncated", "shared"])
def test_our_eagle3_export_loads_strictly_in_speculators(base, tmp_path, lm_head):
    Eagle3Speculator = pytest.importorskip("speculators.convert.eagle.eagle3_legacy_model").Eagle3Speculator

    vocab = base.config.vocab_size
    trunc = dict(truncated_vocab_size=40) if lm_head == "truncated" else {}
    ids = np.random.RandomState(12).permutation(vocab)[:40]
    d = init_heads(HeadsConfig(base.config.hidden_size, vocab, num_heads=4, head_type="eagle3", lm_head=lm_head,
                               feature_layers=LAYERS3, **trunc), base, token_map=ids if trunc else None)
    randomise_ours(d, seed=13)
    out = export_eagle3(d, base, tmp_path / "eagle3", dtype="float32")
    w = load_file(str(out / "model.safetensors"))
    state = {k.replace("midlayer.", "layers.0."): torch.from_numpy(v) for k, v in w.items()}
    draft_ids = np.sort(ids) if trunc else np.arange(vocab)
    model = speculators_eagle3(base, draft_ids, seed=0)
    legacy = Eagle3Speculator(model.config, verifier=None, verifier_attachment_mode="detached",
                              reduce_vocab_size=bool(trunc), has_drafter_embedding=False)
    legacy.load_state_dict(state, strict=True)  # exactly the published keys and shapes
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= set(PUBLISHED_DROPPED)  # the base's embedding and verifier head
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(_np(base.embed_tokens.embedding[...]).copy()))
    rng = np.random.RandomState(14)
    t, f = 8, 3 * base.config.hidden_size
    feats = rng.normal(size=(t, f)).astype(np.float32)
    ids_t = rng.randint(0, vocab, t)
    theirs = speculators_logits(model, feats, ids_t, steps=1)[0]
    ours = _np(d.logits(our_outputs(d, base, _np(d.project(jnp.asarray(feats))), ids_t), base))
    order = np.argsort(_np(d.token_map[...])) if trunc else np.arange(vocab)  # the export sorts the draft ids
    np.testing.assert_allclose(theirs, ours[:, order], rtol=1e-4, atol=1e-4 * np.abs(ours).max())
