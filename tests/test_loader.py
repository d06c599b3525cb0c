"""The HF loader and the backbone against transformers on tiny random models of every supported family:
prefill logits, every cached decode step, greedy generation, ragged batches, the config round trip, bf16,
and one test per loader error."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from medusa_jax.model.config import ModelConfig, UnsupportedModelError
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.model.param_paths import param_paths
from medusa_jax.hf.load import load_pretrained
from medusa_jax.hf.save import save_pretrained
from medusa_jax.hf.tensor_files import CheckpointError, SafetensorsFile, write_safetensors
from medusa_jax.inference.api import generate
from medusa_jax.inference.engine import check_fits, pad_prompts

KINDS = ["llama", "llama3", "mistral", "qwen2"]  # mistral: sliding window 16 < prompt + steps
PROMPT_LEN, STEPS = 12, 14


def prompt_ids(seed: int, length: int, vocab: int = 128) -> list[int]:
    return np.random.RandomState(seed).randint(1, vocab, size=length).tolist()


def hf_step_logits(hf, prompt: list[int], steps: int) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    """transformers: prefill logits [T, V], then `steps` cached greedy steps (logits [V] each) and their tokens."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        prefill_tv = out.logits[0].numpy()
        past, token = out.cache, int(out.logits[0, -1].argmax())
        step_logits, tokens = [], []
        for _ in range(steps):
            tokens.append(token)
            out = hf(torch.tensor([[token]]), cache=past, use_cache=True)
            past = out.cache
            step_logits.append(out.logits[0, -1].numpy())
            token = int(out.logits[0, -1].argmax())
    return prefill_tv, step_logits, tokens


def our_step_logits(model, prompt: list[int], tokens: list[int], cache_size: int = 64):
    """Ours: prefill logits [T, V] and the logits after feeding each of `tokens` through the cached forward."""
    cache = KVCache.zeros(model.config, 1, cache_size)
    p = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    hidden, cache = model(p, positions, attention_mask(jnp.zeros((1,), jnp.int32), causal_block(len(prompt)),
                                                       cache_size), cache)
    prefill_tv = np.asarray(model.logits(hidden)[0])
    cache = cache.replace(lengths_b=jnp.asarray([len(prompt)], jnp.int32))
    steps = []
    for token in tokens:
        lengths = cache.lengths_b
        hidden, cache = model(jnp.asarray([[token]], jnp.int32), lengths[:, None],
                              attention_mask(lengths, causal_block(1), cache_size), cache)
        steps.append(np.asarray(model.logits(hidden)[0, 0]))
        cache = cache.replace(lengths_b=lengths + 1)
    return prefill_tv, steps


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_every_cached_step_match_transformers(tiny_hf_model, kind):
    folder, hf = tiny_hf_model(kind)
    model = load_pretrained(folder)
    prompt = prompt_ids(1, PROMPT_LEN)
    hf_prefill, hf_steps, tokens = hf_step_logits(hf, prompt, STEPS)
    ours_prefill, ours_steps = our_step_logits(model, prompt, tokens)
    np.testing.assert_allclose(ours_prefill, hf_prefill, atol=1e-4, rtol=0)
    for i, (ours, theirs) in enumerate(zip(ours_steps, hf_steps)):
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0, err_msg=f"cached step {i}")


def test_mistral_sliding_window_changes_the_result(tiny_model_dir):
    """The mistral case above only proves the window if it matters at these lengths."""
    folder = tiny_model_dir("mistral")
    windowed = load_pretrained(folder)
    unwindowed = load_pretrained(folder)
    unwindowed.config = unwindowed.config.replace(sliding_window=None)
    prompt = prompt_ids(1, PROMPT_LEN + STEPS)
    a, _ = our_step_logits(windowed, prompt, [])
    b, _ = our_step_logits(unwindowed, prompt, [])
    assert np.abs(a[:16] - b[:16]).max() < 1e-6 and np.abs(a[16:] - b[16:]).max() > 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_equals_transformers(tiny_hf_model, kind):
    folder, hf = tiny_hf_model(kind)
    model = load_pretrained(folder)
    for prompt in (prompt_ids(2, 9), prompt_ids(6, 70)):  # padded to 64 and to 96 (engine.width_ladder)
        ours = generate(model, [prompt], max_new_tokens=24, eos_ids=())[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=24, min_new_tokens=24, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert ours.token_ids == theirs
        assert ours.new_tokens == 24


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ragged_batch_equals_each_row_alone(tiny_model_dir, kind):
    folder = tiny_model_dir(kind)
    model = load_pretrained(folder)
    prompts = [prompt_ids(3, 5), prompt_ids(4, 17), prompt_ids(5, 70)]  # two prompt buckets apart
    alone = [generate(model, [p], max_new_tokens=12, eos_ids=())[0].token_ids for p in prompts]
    # an EOS that row 0 makes early, so rows stop at different steps
    eos = alone[0][3]
    batched = generate(model, prompts, max_new_tokens=12, eos_ids=(eos,))
    for row, solo in zip(batched, alone):
        cut = solo.index(eos) + 1 if eos in solo else len(solo)
        assert row.token_ids == solo[:cut]
    assert batched[0].new_tokens == alone[0].index(eos) + 1 <= 4


@pytest.mark.parametrize("kind", KINDS)
def test_config_round_trip(tiny_hf_model, kind):
    folder, hf = tiny_hf_model(kind)
    ours = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert ModelConfig.from_hf_config(ours.to_hf_config()) == ours
    # transformers builds the same model from our dict
    rebuilt = type(hf.config)(**ours.to_hf_config())
    assert ModelConfig.from_hf_config(rebuilt.to_dict()) == ours
    assert ours.tie_word_embeddings == (kind == "qwen2")
    assert (ours.sliding_window is not None) == (kind == "mistral")
    assert ours.rope_scaling.rope_type == ("llama3" if kind == "llama3" else "default")


def test_bfloat16_load_runs_and_is_close(tiny_hf_model):
    folder, hf = tiny_hf_model("llama")
    model = load_pretrained(folder, dtype="bfloat16")
    assert model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    prompt = prompt_ids(6, PROMPT_LEN)
    ours, _ = our_step_logits(model, prompt, [])
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() < 0.05 * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75


# ---- loader errors ----------------------------------------------------------------------------------------

@pytest.fixture
def tiny_copy(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def rewrite_weights(folder, edit):
    st = SafetensorsFile(folder / "model.safetensors")
    tensors = {name: np.array(st.array(name)) for name in st.names}
    write_safetensors(folder / "model.safetensors", edit(tensors))


def test_unsupported_model_type(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    (tiny_copy / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_pretrained(tiny_copy)


def test_missing_tensors_are_listed(tiny_copy):
    gone = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    rewrite_weights(tiny_copy, lambda t: {k: v for k, v in t.items() if k not in gone})
    with pytest.raises(CheckpointError, match="missing tensors") as e:
        load_pretrained(tiny_copy)
    assert all(name in str(e.value) for name in gone)


def test_unexpected_tensors_are_listed(tiny_copy):
    rewrite_weights(tiny_copy, lambda t: {**t, "model.layers.0.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model.layers.0.extra.weight'\]"):
        load_pretrained(tiny_copy)


def test_shape_mismatch_names_the_tensor(tiny_copy):
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite_weights(tiny_copy, lambda t: {**t, name: np.zeros((64, 32), np.float32)})
    with pytest.raises(CheckpointError, match=rf"{name}.*\(64, 32\).*\(64, 64\)"):
        load_pretrained(tiny_copy)


def test_truncated_safetensors(tiny_copy):
    path = tiny_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pretrained(tiny_copy)


def test_corrupt_safetensors_header(tiny_copy):
    path = tiny_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_pretrained(tiny_copy)


def test_missing_config_json(tiny_copy):
    (tiny_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tiny_copy)


def _prefill_logits(model, prompt):
    ours, _ = our_step_logits(model, prompt, [])
    return ours


def test_sharded_safetensors_index_loads(tiny_hf_model, tmp_path):
    folder, hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    prompt = prompt_ids(7, 8)
    np.testing.assert_array_equal(_prefill_logits(load_pretrained(tmp_path), prompt),
                                  _prefill_logits(load_pretrained(folder), prompt))


def test_pytorch_model_bin_loads(tiny_hf_model, tmp_path):
    folder, hf = tiny_hf_model("qwen2")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    prompt = prompt_ids(8, 8)
    np.testing.assert_array_equal(_prefill_logits(load_pretrained(tmp_path), prompt),
                                  _prefill_logits(load_pretrained(folder), prompt))


def test_prompt_plus_budget_over_cache_capacity_is_a_clear_error(tiny_model_dir):
    folder = tiny_model_dir("llama")
    model = load_pretrained(folder)
    batch = pad_prompts([prompt_ids(9, 40)], pad_id=0)
    with pytest.raises(ValueError, match="needs 96 cache slots, but cache_size is 80"):
        check_fits(batch, max_new_tokens=32, extra=0, cache_size=80)
    with pytest.raises(ValueError, match="cache_size is 80"):
        generate(model, [prompt_ids(9, 40)], max_new_tokens=32, cache_size=80)
    assert check_fits(batch, max_new_tokens=16, extra=0, cache_size=80) == 80


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied and tied lm_head
def test_save_pretrained_round_trips_through_our_loader_and_transformers(tiny_hf_model, tmp_path, kind):
    import transformers

    folder, hf = tiny_hf_model(kind)
    model = load_pretrained(folder)
    out = save_pretrained(model, tmp_path / "saved", folder)
    assert (out / "config.json").read_text() == (folder / "config.json").read_text()
    again = load_pretrained(out)
    saved = dict(param_paths(nnx.state(model, nnx.Param)))
    loaded = dict(param_paths(nnx.state(again, nnx.Param)))
    assert saved.keys() == loaded.keys() and ("layers", "0", "mlp", "down_proj", "kernel") in saved
    for path, value in saved.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(loaded[path]), err_msg=str(path))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(3, PROMPT_LEN)])
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(ids).logits.numpy(), hf(ids).logits.numpy(), atol=1e-6)
