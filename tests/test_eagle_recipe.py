"""Pieces of the EAGLE-1 training recipe (issue 40): fc starting as an identity on the feature path with the
embedding at the feature's scale (folded into the published layout on export), and input noise on every data path
(packed rows included)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle_init import feature_to_embedding_rms, identity_feature_init
from medusa_jax.heads.eagle_layout import export_eagle
from medusa_jax.heads.folder import load_native_heads, save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.training.data import segment_mask
from medusa_jax.training.eagle_loss import content_seeds, eagle_stats


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.3))


def fresh(base, **kw):
    return init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=4, head_type="eagle",
                                  lm_head="shared", **kw), base, seed=0)


def test_identity_init_passes_the_feature_and_scales_the_embedding(base):
    d = identity_feature_init(fresh(base, fc_bias=True), base)
    norm_rms = np.sqrt(np.mean(np.asarray(base.norm.weight[...]) ** 2))
    emb_rms = np.sqrt(np.mean(np.asarray(base.embed_tokens.embedding[...]) ** 2))
    assert d.config.embed_scale == pytest.approx(norm_rms / emb_rms, rel=1e-6) == feature_to_embedding_rms(base)
    feats = jnp.asarray(np.random.RandomState(0).normal(size=(2, 5, base.config.hidden_size)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(d.pair_inputs(feats, jnp.ones((2, 5), jnp.int32), base)),
                                  np.asarray(feats))


def test_the_scale_is_kept_natively_and_folded_on_export(base, tmp_path):
    d = identity_feature_init(fresh(base), base)
    kernel = np.array(d.fc.kernel[...])
    kernel[: base.config.hidden_size] = np.random.RandomState(1).normal(0, 0.3, kernel[: base.config.hidden_size].shape)
    d.fc.kernel[...] = jnp.asarray(kernel)  # as after training: the embedding's columns learned
    t = 6
    feats = jnp.asarray(np.random.RandomState(2).normal(size=(1, t, base.config.hidden_size)), jnp.float32)
    toks = jnp.asarray([[3, 9, 27, 81, 5, 15]], jnp.int32)
    mask = segment_mask(np.ones((1, t), np.int32))

    def logits(drafter):
        out, _ = drafter(feats, toks, jnp.arange(t)[None], mask, None, base)
        return np.asarray(drafter.logits(out, base))

    save_heads(d, tmp_path / "native")
    native = load_native_heads(tmp_path / "native")
    assert native.config.embed_scale == d.config.embed_scale
    np.testing.assert_allclose(logits(native), logits(d), rtol=1e-6, atol=1e-6)
    out = export_eagle(d, base, tmp_path / "eagle", dtype="float32")
    assert "embed_scale" not in json.dumps(json.loads((out / "config.json").read_text()))  # the layout is unchanged
    w = load_file(str(out / "model.safetensors"))["fc.weight"]
    d_ = base.config.hidden_size
    np.testing.assert_allclose(w[:, :d_], kernel[:d_].T * d.config.embed_scale, rtol=1e-6)
    back = load_heads(out, base=base)
    assert back.config.embed_scale == 1.0
    ref = logits(d)
    np.testing.assert_allclose(logits(back), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_noise_reaches_packed_rows_and_is_drawn_again_the_same(base):
    d = fresh(base)
    rng = np.random.RandomState(3)
    b, t = 2, 12
    batch = {"feat": jnp.asarray(rng.normal(size=(b, t, base.config.hidden_size)), jnp.float32),
             "tokens": jnp.asarray(rng.randint(1, base.config.vocab_size, (b, t)), jnp.int32),
             "segment_ids": jnp.ones((b, t), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
             "loss_mask": jnp.ones((b, t), jnp.int32)}  # packed rows: no noise_seed

    def loss(noise):
        return float(eagle_stats(d, base, batch, noise=noise, feature_weight=1.0, ce_weight=0.1)[0])

    assert loss(0.5) != loss(0.0)
    assert loss(0.5) == loss(0.5)  # a resumed run draws the same noise
    seeds = np.asarray(content_seeds(batch["tokens"]))
    assert seeds[0] != seeds[1]


def test_train_heads_refuses_eagle_init_for_other_heads(tiny_model_dir, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_heads_script",
                                                  Path(__file__).parents[1] / "scripts/train_heads.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    code = cli.main(["--model", str(tiny_model_dir("llama", initializer_range=0.3)), "--output", str(tmp_path / "o"),
                     "--head-type", "medusa", "--eagle-init", "identity"])
    assert code == 2 and "--eagle-init" in capsys.readouterr().err and not (tmp_path / "o").exists()
