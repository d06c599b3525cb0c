"""Heads interop: exported folders read by an independent PyTorch Medusa implementation written here
(nn.Linear, SiLU, the layouts' own key names) give our JAX heads' logits; import/export round trips are exact;
bad folders raise errors that name the problem."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa_jax.hf.load import load_pretrained
from medusa_jax.hf.tensor_files import CheckpointError
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.export import ExportError, export_heads, serving_notes
from medusa_jax.heads.folder import heads_tensors, save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import detect_layout, load_heads
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block

VT = 40  # truncated vocabulary (tiny models have 128 tokens)


# ---- an independent PyTorch Medusa, built from the layouts' key names ---------------------------------------
class ResBlock(nn.Module):  # FasterDecoding / TGI / TensorRT-LLM: `{h}.{l}.linear`
    def __init__(self, d):
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def torch_medusa_logits(folder, x, base_lm_head: nn.Module | None = None) -> torch.Tensor:
    """[K, ..., V] logits of a `medusa` layout folder (v1: own lm_heads; v2: the base lm_head)."""
    cfg = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "medusa_lm_head.safetensors"))
    k, n, d, v = cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["hidden_size"], cfg["vocab_size"]
    v1 = f"0.{n}.weight" in sd
    heads = nn.ModuleList([nn.Sequential(*[ResBlock(d) for _ in range(n)],
                                         *([nn.Linear(d, v, bias=False)] if v1 else [])) for _ in range(k)])
    heads.load_state_dict({name: t.float() for name, t in sd.items()}, strict=True)
    with torch.no_grad():
        return torch.stack([head(x) if v1 else base_lm_head(head(x)) for head in heads])


class VllmResidualBlock(nn.Module):  # vLLM: `blocks.{h}.layers.{l}`
    def __init__(self, d, n, bias):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=bias) for _ in range(n)])
        self.act = nn.SiLU()

    def forward(self, x):
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


def torch_vllm_logits(folder, x) -> tuple[torch.Tensor, torch.Tensor]:
    """([K, ..., V_head] head-vocab logits, [K, ..., V] full-vocab logits with -inf outside the token map)."""
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    sd = load_file(str(folder / "model.safetensors"))
    k, n, d = cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"]
    v, vt = cfg["vocab_size"], cfg["truncated_vocab_size"]
    model = nn.Module()
    model.blocks = nn.ModuleList([VllmResidualBlock(d, n, cfg["medusa_fc_bias"]) for _ in range(k)])
    model.lm_heads = nn.ModuleList([nn.Linear(d, vt, bias=False) for _ in range(1 if cfg["original_lm_head"] else k)])
    if vt < v:
        model.register_buffer("token_map", torch.zeros(vt, dtype=torch.int64))
    model.load_state_dict({name: (t if name == "token_map" else t.float()) for name, t in sd.items()}, strict=True)
    head_logits, full_logits = [], []
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            logits = model.lm_heads[0 if cfg["original_lm_head"] else i](block(x))
            head_logits.append(logits)
            if vt < v:
                full = torch.full((*logits.shape[:-1], v), -torch.inf)
                full[..., model.token_map] = logits
                logits = full
            full_logits.append(logits)
    return torch.stack(head_logits), torch.stack(full_logits)


# ---- fixtures --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tiny_hf_model):
    """{'untied': llama, 'tied': qwen2 with tied embeddings} -> (folder, torch model, our CausalLM)."""
    out = {}
    for key, kind in (("untied", "llama"), ("tied", "qwen2")):
        folder, torch_model = tiny_hf_model(kind)
        out[key] = (folder, torch_model, load_pretrained(folder))
    return out


def make_heads(base, mode: str, num_layers: int = 2, num_heads: int = 3, seed: int = 0):
    """Heads with random (non-identity) ResBlocks and perturbed lm_heads, so every tensor matters."""
    rng = np.random.default_rng(seed)
    cfg = base.config
    token_map = np.sort(rng.choice(cfg.vocab_size, VT, replace=False)) if mode == "truncated" else None
    heads = init_heads(HeadsConfig(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers, lm_head=mode,
                                   truncated_vocab_size=VT if mode == "truncated" else None,
                                   base_model_name_or_path="tiny-base"), base, seed, token_map=token_map)
    for head in heads.heads:
        for block in head.blocks:
            block.linear.kernel[...] = jnp.asarray(rng.normal(0, 0.2, block.linear.kernel[...].shape), jnp.float32)
            block.linear.bias[...] = jnp.asarray(rng.normal(0, 0.2, block.linear.bias[...].shape), jnp.float32)
        if head.lm_head is not None:
            w = head.lm_head.kernel[...]
            head.lm_head.kernel[...] = w + jnp.asarray(rng.normal(0, 0.05, w.shape), jnp.float32)
    return heads


def hidden_states(d: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (2, 5, d)).astype(np.float32)  # [B, T, D]


def folder_tensors(folder):
    name = "medusa_lm_head.safetensors" if (folder / "medusa_lm_head.safetensors").exists() else "model.safetensors"
    return load_file(str(folder / name))


# ---- export -> independent PyTorch reference ---------------------------------------------------------------------
CASES = [  # (format, lm_head mode, materialize, base)
    ("medusa", "own", False, "untied"),
    ("medusa", "shared", False, "tied"),
    ("medusa", "shared", True, "tied"),
    ("vllm", "own", False, "untied"),
    ("vllm", "shared", False, "tied"),
    ("vllm", "shared", True, "untied"),
    ("vllm", "truncated", False, "untied"),
]


@pytest.mark.parametrize("fmt,mode,materialize,which", CASES)
def test_export_matches_torch_reference(bases, tmp_path, fmt, mode, materialize, which):
    _, torch_model, base = bases[which]
    num_layers = 1 if (fmt, mode, materialize) == ("medusa", "shared", False) else 2  # TGI v2 needs 1 layer
    heads = make_heads(base, mode, num_layers)
    out = export_heads(heads, tmp_path / "out", format=fmt, base=base, materialize_lm_head=materialize)
    x = hidden_states(base.config.hidden_size)
    ours = np.asarray(heads.logits(jnp.asarray(x), base))  # [K, B, T, V_head]
    if fmt == "medusa":
        ref = torch_medusa_logits(out, torch.from_numpy(x), torch_model.get_output_embeddings()).numpy()
        assert (f"0.{num_layers}.weight" in folder_tensors(out)) == (mode != "shared" or materialize)
        np.testing.assert_allclose(ref, ours, atol=1e-5, rtol=0)
    else:
        ref_head, ref_full = (t.numpy() for t in torch_vllm_logits(out, torch.from_numpy(x)))
        np.testing.assert_allclose(ref_head, ours, atol=1e-5, rtol=0)
        ours_top = np.asarray(heads.top_k(jnp.asarray(x), base, 3))  # full-vocab ids
        np.testing.assert_array_equal(np.argsort(-ref_full, axis=-1, kind="stable")[..., :3], ours_top)
    cfg = json.loads((out / "config.json").read_text())
    if fmt == "medusa":
        assert "architectures" not in cfg  # TGI disables Medusa when the speculator config has one
        assert cfg["medusa_num_heads"] == 3 and cfg["base_model_name_or_path"] == "tiny-base"
    else:
        assert cfg["original_lm_head"] == (mode == "shared" and not materialize)
        assert cfg["truncated_vocab_size"] == (VT if mode == "truncated" else base.config.vocab_size)


def test_truncated_heads_expand_to_full_vocab_with_zero_rows(bases, tmp_path):
    _, _, base = bases["untied"]
    heads = make_heads(base, "truncated")
    out = export_heads(heads, tmp_path / "out", format="medusa")
    x = hidden_states(base.config.hidden_size, seed=3)
    ref = torch_medusa_logits(out, torch.from_numpy(x)).numpy()  # [K, B, T, V]
    ours = np.asarray(heads.logits(jnp.asarray(x), base))  # [K, B, T, VT]
    token_map = np.asarray(heads.token_map[...])
    np.testing.assert_allclose(ref[..., token_map], ours, atol=1e-5, rtol=0)
    outside = np.setdiff1d(np.arange(base.config.vocab_size), token_map)
    assert np.all(ref[..., outside] == 0.0)  # exactly 0: tokens outside the map are never above a positive logit
    # The documented consequence: top-k agrees wherever the k-th best truncated logit is > 0.
    k = VT // 2  # around the median, so some positions have a negative k-th logit
    kth = np.sort(ours, axis=-1)[..., -k]
    ours_top = np.asarray(heads.top_k(jnp.asarray(x), base, k))
    ref_top = np.argsort(-ref, axis=-1, kind="stable")[..., :k]
    positive = kth > 0
    assert positive.any() and (~positive).any(), "hidden states should exercise both cases"
    np.testing.assert_array_equal(ref_top[positive], ours_top[positive])
    assert np.all(np.isin(ref_top[~positive], outside).any(axis=-1))


# ---- import -> export round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,mode,materialize,which", CASES + [("medusa", "truncated", False, "untied")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_export_round_trip_is_exact(bases, tmp_path, fmt, mode, materialize, which, dtype):
    _, _, base = bases[which]
    num_layers = 1 if (fmt, mode, materialize) == ("medusa", "shared", False) else 2
    heads = make_heads(base, mode, num_layers)
    first = export_heads(heads, tmp_path / "a", format=fmt, dtype=dtype, base=base, materialize_lm_head=materialize)
    loaded = load_heads(first, base=base)
    expected_mode = "own" if (fmt, mode) == ("medusa", "truncated") else mode  # expansion is one-way
    assert loaded.config.lm_head == expected_mode
    second = export_heads(loaded, tmp_path / "b", format=fmt, dtype=dtype, base=base,
                          materialize_lm_head=materialize and expected_mode == "shared")
    a, b = folder_tensors(first), folder_tensors(second)
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())
    if dtype == "float32" and mode != "truncated":
        x = jnp.asarray(hidden_states(base.config.hidden_size))
        np.testing.assert_array_equal(np.asarray(loaded.logits(x, base)), np.asarray(heads.logits(x, base)))


def test_shared_lm_head_without_base_loads_as_own_copies(bases, tmp_path):
    _, _, base = bases["tied"]
    heads = make_heads(base, "shared", num_layers=1)
    out = export_heads(heads, tmp_path / "out", format="vllm", base=base)  # original_lm_head: stored once
    loaded = load_heads(out)  # no base given: nothing to compare against, so keep the stored matrix per head
    assert loaded.config.lm_head == "own"
    x = jnp.asarray(hidden_states(base.config.hidden_size))
    np.testing.assert_allclose(np.asarray(loaded.logits(x, base)), np.asarray(heads.logits(x, base)),
                               rtol=1e-4, atol=1e-5)


def test_native_folder_and_dtype(bases, tmp_path):
    _, _, base = bases["untied"]
    heads = make_heads(base, "truncated")
    save_heads(heads, tmp_path / "native")
    assert detect_layout(tmp_path / "native") == "medusa-jax"
    loaded = load_heads(tmp_path / "native", base.config)
    for name, value in heads_tensors(heads).items():
        np.testing.assert_array_equal(heads_tensors(loaded)[name], value)
    assert load_heads(tmp_path / "native", dtype="bfloat16").config.dtype == "bfloat16"
    with pytest.raises(CheckpointError, match="holds 3 heads, num_heads=4"):
        load_heads(tmp_path / "native", num_heads=4)


def test_pt_import_uses_weights_only(bases, tmp_path):
    _, _, base = bases["untied"]
    heads = make_heads(base, "own")
    src = export_heads(heads, tmp_path / "st", format="medusa")
    pt_dir = tmp_path / "pt"
    pt_dir.mkdir()
    shutil.copy(src / "config.json", pt_dir / "config.json")
    torch.save(load_file(str(src / "medusa_lm_head.safetensors")), pt_dir / "medusa_lm_head.pt")
    loaded = load_heads(pt_dir, base.config)
    x = jnp.asarray(hidden_states(base.config.hidden_size))
    np.testing.assert_array_equal(np.asarray(loaded.logits(x, base)), np.asarray(heads.logits(x, base)))
    torch.save({"0.0.linear.weight": torch.zeros(2), "payload": _NotATensor()}, pt_dir / "medusa_lm_head.pt")
    with pytest.raises(CheckpointError, match="cannot read PyTorch weights"):
        load_heads(pt_dir)


class _NotATensor:  # torch.load(weights_only=True) must refuse to unpickle this
    pass


# ---- clear errors -----------------------------------------------------------------------------------------------
@pytest.fixture
def medusa_folder(bases, tmp_path):
    _, _, base = bases["untied"]
    return export_heads(make_heads(base, "own"), tmp_path / "medusa", format="medusa"), base


def _rewrite(folder, edit, config_edit=None):
    path = folder / "medusa_lm_head.safetensors"
    sd = load_file(str(path))
    edit(sd)
    save_file(sd, str(path))
    if config_edit:
        cfg = json.loads((folder / "config.json").read_text())
        config_edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_and_unexpected_keys_are_listed(medusa_folder):
    folder, _ = medusa_folder
    _rewrite(folder, lambda sd: (sd.pop("1.1.linear.bias"), sd.update({"extra.weight": torch.zeros(1)})))
    with pytest.raises(CheckpointError, match=r"missing \['1\.1\.linear\.bias'\]; unexpected \['extra\.weight'\]"):
        load_heads(folder)


def test_wrong_shape(medusa_folder):
    folder, _ = medusa_folder
    _rewrite(folder, lambda sd: sd.update({"2.0.linear.weight": torch.zeros(64, 63)}))
    with pytest.raises(CheckpointError, match=r"'2\.0\.linear\.weight' has shape \(64, 63\), expected \(64, 64\)"):
        load_heads(folder)


def test_wrong_vocabulary_and_hidden_size(medusa_folder):
    folder, base = medusa_folder
    with pytest.raises(CheckpointError, match="vocabulary size 128 but the base model config says 256"):
        load_heads(folder, base.config.replace(vocab_size=256))
    with pytest.raises(CheckpointError, match="hidden size 64 but the base model config says 96"):
        load_heads(folder, base.config.replace(hidden_size=96))
    _rewrite(folder, lambda sd: None, lambda cfg: cfg.update(vocab_size=100))
    with pytest.raises(CheckpointError, match="vocabulary size 128 but config.json says 100"):
        load_heads(folder)


def test_wrong_head_count_names_the_fix(medusa_folder):
    folder, base = medusa_folder
    _rewrite(folder, lambda sd: None, lambda cfg: cfg.update(medusa_num_heads=2))  # like medusa-vicuna-7b-v1.3
    with pytest.raises(CheckpointError, match=r"unexpected \['2\.0\.linear\.bias'.*pass num_heads=3"):
        load_heads(folder)
    assert load_heads(folder, base.config, num_heads=3).config.num_heads == 3
    with pytest.raises(CheckpointError, match=r"missing \['3\.0\.linear\.bias'"):
        load_heads(folder, num_heads=4)


def test_vllm_folder_errors(bases, tmp_path):
    _, _, base = bases["untied"]
    out = export_heads(make_heads(base, "truncated"), tmp_path / "v", format="vllm")
    sd = load_file(str(out / "model.safetensors"))
    sd["token_map"] = sd["token_map"].clone()
    sd["token_map"][1] = sd["token_map"][0]
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="token_map repeats token ids"):
        load_heads(out)
    del sd["token_map"]
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="needs a token_map tensor, which is missing"):
        load_heads(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a Medusa heads folder"):
        load_heads(tmp_path / "empty")


def test_export_refuses_bad_options_and_leaves_nothing(bases, tmp_path):
    _, _, base = bases["untied"]
    own, shared = make_heads(base, "own"), make_heads(base, "shared", num_layers=1)
    with pytest.raises(ExportError, match="vLLM reads the shared lm_head .* needs the base model"):
        export_heads(shared, tmp_path / "x", format="vllm")
    with pytest.raises(ExportError, match="needs the base model"):
        export_heads(shared, tmp_path / "x", materialize_lm_head=True)
    assert list(tmp_path.iterdir()) == []
    export_heads(own, tmp_path / "x")
    with pytest.raises(ExportError, match="already exists"):
        export_heads(own, tmp_path / "x")
    export_heads(shared, tmp_path / "x", overwrite=True)
    assert load_heads(tmp_path / "x").config.lm_head == "shared"
    (tmp_path / "x" / "notes.txt").write_text("mine")  # --overwrite never deletes a file it did not write
    with pytest.raises(ExportError, match="not an earlier export .*notes.txt"):
        export_heads(own, tmp_path / "x", overwrite=True)
    assert (tmp_path / "x" / "notes.txt").read_text() == "mine"
    assert any("TGI" in note for note in serving_notes(shared, "medusa"))


def test_export_script(bases, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("export_heads_script",
                                                  Path(__file__).parents[1] / "scripts/export_heads.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    folder, _, base = bases["tied"]
    save_heads(make_heads(base, "shared", num_layers=1), tmp_path / "native")
    assert cli.main(["--heads", str(tmp_path / "native"), "--out", str(tmp_path / "out"), "--format", "medusa",
                     "--materialize-lm-head", "--model", str(folder), "--dtype", "float16"]) == 0
    assert "v1 layout" in capsys.readouterr().out
    assert folder_tensors(tmp_path / "out")["0.1.weight"].dtype == torch.float16
    assert cli.main(["--heads", str(tmp_path / "native"), "--out", str(tmp_path / "vllm"), "--format", "vllm"]) == 2
    assert "needs the base model" in capsys.readouterr().err


# ---- SmolLM2: exported heads in plain PyTorch on transformers' hidden states --------------------------------------
def _smollm2_heads(source: str, base):
    if source == "shipped":
        assets = pytest.importorskip("medusa_jax.assets", reason="shipped heads not built yet")
        return load_heads(assets.resolve_heads_dir("default-medusa"), base.config)  # the exportable shipped heads
    heads = make_heads(base, "shared", num_layers=1, num_heads=4)  # tiny tensors; exercises the tied lm_head
    for head in heads.heads:  # ResBlocks scaled to the real hidden states' size
        head.blocks[0].linear.kernel[...] = head.blocks[0].linear.kernel[...] * 0.1
    return heads


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """SmolLM2 as our CausalLM and as transformers' model, with both backbones' hidden states on one prompt."""
    import transformers

    base = load_pretrained(smollm2_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Explain what a hash table is."}],
                                         tokenize=False, add_generation_prompt=True) + "A hash table is a data"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hf_hidden_1pd = hf.model(torch.tensor([ids])).last_hidden_state  # after the final norm
    p = len(ids)
    jax_hidden_1pd, _ = base(jnp.asarray([ids], jnp.int32), jnp.arange(p, dtype=jnp.int32)[None],
                             attention_mask(jnp.zeros((1,), jnp.int32), causal_block(p), p),
                             KVCache.zeros(base.config, 1, p))
    return base, hf, hf_hidden_1pd, jax_hidden_1pd


@pytest.mark.slow
@pytest.mark.parametrize("source", ["shipped", "random-shared"])
def test_smollm2_exported_heads_predict_like_jax(smollm2, tmp_path, source):
    base, hf, hf_hidden, jax_hidden = smollm2
    heads = _smollm2_heads(source, base)
    ours_same = np.asarray(heads.logits(jnp.asarray(hf_hidden.numpy()), base))  # our heads on HF's hidden states
    ours_e2e = np.asarray(heads.top_k(jax_hidden, base, 1))[..., 0]  # our backbone + heads, full-vocab ids
    materialize = heads.config.lm_head == "shared" and source == "shipped"  # the official-code / TRT-LLM layout
    for fmt in ("medusa", "vllm"):
        out = export_heads(heads, tmp_path / fmt, format=fmt, base=base, materialize_lm_head=materialize)
        if fmt == "medusa":
            ref = torch_medusa_logits(out, hf_hidden, hf.get_output_embeddings()).numpy()
            if heads.config.lm_head == "truncated":
                ref = ref[..., np.asarray(heads.token_map[...])]
        else:
            ref = torch_vllm_logits(out, hf_hidden)[0].numpy()
        np.testing.assert_allclose(ref, ours_same, atol=2e-4, rtol=1e-5)
        ref_top1 = np.asarray(heads.to_full_vocab(jnp.asarray(ref.argmax(-1))))
        np.testing.assert_array_equal(ref_top1, np.asarray(heads.to_full_vocab(jnp.asarray(ours_same.argmax(-1)))))
        # End to end (transformers backbone + PyTorch heads vs our backbone + JAX heads): the same top-1
        # wherever the winner is not a near tie.
        top2 = np.sort(ref, axis=-1)[..., -2:]
        clear = (top2[..., 1] - top2[..., 0]) > 1e-2
        assert clear.mean() > 0.9
        np.testing.assert_array_equal(ref_top1[clear], ours_e2e[clear])
