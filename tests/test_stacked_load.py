"""Loading straight into the stacked layout (`load_pretrained(..., layers=LayerExecution(scan=True))`,
`--scan-layers`): the same parameters as loading per layer and stacking afterwards, without the per-layer form;
saving a stacked model writes the per-layer HF files; on a mesh each device reads its own slice of every stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.hf import load as hf_load
from medusa_jax.hf.load import hf_layer_names, load_pretrained
from medusa_jax.hf.save import save_pretrained
from medusa_jax.hf.tensor_files import CheckpointError, SafetensorsFile
from medusa_jax.model.backbone import with_layer_execution
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.model.param_paths import param_paths

STACKED = LayerExecution(scan=True)
WORKER = Path(__file__).with_name("stacked_load_worker.py")


def _state(model) -> dict:
    return {path: np.asarray(leaf) for path, leaf in param_paths(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases and tied embeddings
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_load_equals_stacking_the_per_layer_model(tiny_model_dir, kind, dtype):
    folder = tiny_model_dir(kind)
    direct = load_pretrained(folder, dtype=dtype, layers=STACKED)
    converted = with_layer_execution(load_pretrained(folder, dtype=dtype), STACKED)
    assert direct.config == converted.config and direct.config.execution.scan
    ours, ref = _state(direct), _state(converted)
    assert ours.keys() == ref.keys()
    assert not any(p[0] == "layers" and p[1].isdigit() for p in ours)  # no per-layer parameter was built
    for path in ours:
        assert ours[path].dtype == ref[path].dtype and ours[path].shape == ref[path].shape, path
        np.testing.assert_array_equal(ours[path], ref[path], err_msg=str(path))


def test_stacked_load_decodes_like_the_per_layer_model(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompt_bt = jnp.asarray(np.random.RandomState(0).randint(1, 128, size=(2, 9)), jnp.int32)
    positions_bt = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    mask_bts = attention_mask(jnp.zeros((2,), jnp.int32), causal_block(9), 16)
    logits = []
    for layers in (LayerExecution(), STACKED):
        model = load_pretrained(folder, layers=layers)
        cache = KVCache.zeros(model.config, 2, 16)
        assert cache.stacked == layers.scan
        hidden_btd, _ = model(prompt_bt, positions_bt, mask_bts, cache)
        logits.append(np.asarray(model.logits(hidden_btd)))
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5 * np.abs(logits[0]).max())


def test_stacked_load_reads_each_layer_tensor_once(tiny_model_dir, monkeypatch):
    """One device: each stack is built by one read of every layer's tensor (no whole-model copy in between)."""
    folder = tiny_model_dir("llama")
    reads: list[str] = []
    real = hf_load.TensorSource.array
    monkeypatch.setattr(hf_load.TensorSource, "array", lambda self, name: reads.append(name) or real(self, name))
    model = load_pretrained(folder, layers=STACKED)
    names = [name for path, _ in param_paths(nnx.state(model, nnx.Param))
             for name, _ in hf_layer_names(path, model.config.num_layers)]
    assert sorted(reads[-len(names):]) == sorted(names) and len(set(names)) == len(names)


def test_saving_a_stacked_model_writes_the_per_layer_files(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    save_pretrained(load_pretrained(folder, layers=STACKED), tmp_path / "stacked", folder)
    save_pretrained(load_pretrained(folder), tmp_path / "per_layer", folder)
    ours, ref = (SafetensorsFile(tmp_path / d / "model.safetensors") for d in ("stacked", "per_layer"))
    assert sorted(ours.names) == sorted(ref.names)
    assert any(".layers.1." in name for name in ours.names)
    for name in ref.names:
        np.testing.assert_array_equal(ours.array(name), ref.array(name), err_msg=name)


def test_a_missing_layer_tensor_is_named(tiny_model_dir, tmp_path):
    import shutil

    from medusa_jax.hf.tensor_files import write_safetensors
    folder = tmp_path / "copy"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = SafetensorsFile(folder / "model.safetensors")
    tensors = {n: np.array(weights.array(n)) for n in weights.names if n != "model.layers.1.mlp.up_proj.weight"}
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(folder, layers=STACKED)


def test_stacked_load_on_a_mesh_reads_each_devices_slice(tiny_model_dir):
    """fsdp=2 x tensor=4 of 8 forced CPU devices: every stack has the stacked layout's sharding (layers whole,
    then the per-layer rule) and each device's shard equals that slice of the stacked per-layer model."""
    folder = tiny_model_dir("llama", num_attention_heads=8, num_key_value_heads=8)
    proc = subprocess.run([sys.executable, str(WORKER), str(folder)], capture_output=True, text=True, timeout=600,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines()[-1] == "ok"
