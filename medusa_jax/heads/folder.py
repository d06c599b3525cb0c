"""Save and load heads in medusa-jax's own folder format: `config.json` + `heads.safetensors`, the tensors named by
their NNX parameter paths (`heads.0.blocks.0.linear.kernel`, kernels [in, out]; `token_map` for truncated heads).
Only Medusa heads write the `medusa_num_*` fields (`folder_fields`), so Medusa tools take no other kind. Writes are
atomic. Other projects' layouts: `medusa_jax.heads.export`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from medusa_jax.atomic import atomic_folder, write_text_atomic
from medusa_jax.model.config import resolve_dtype
from medusa_jax.model.param_paths import fill_state, param_paths
from medusa_jax.hf.tensor_files import CheckpointError, SafetensorsFile, write_safetensors
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.kinds import heads_class
from medusa_jax.heads.medusa import MedusaHeads

FORMAT = "medusa-jax"
WEIGHTS = "heads.safetensors"


def heads_tensors(heads: MedusaHeads) -> dict[str, np.ndarray]:
    """All head arrays by dotted path, as NumPy."""
    _, state = nnx.split(heads)
    return {".".join(path): np.asarray(jax.device_get(leaf)) for path, leaf in param_paths(state)}


def save_heads(heads: MedusaHeads, folder: str | os.PathLike, extra_config: dict | None = None,
               storage_dtype: str | None = None) -> Path:
    """Writes the heads folder `folder` (replaced as a whole). `storage_dtype` ('float16', 'bfloat16'): store
    floating tensors in it; loading casts them back to the config's dtype (a half-size file, computed as
    before)."""
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        write_heads_files(heads, tmp, extra_config, storage_dtype)
    return folder


def write_heads_files(heads: MedusaHeads, folder: str | os.PathLike, extra_config: dict | None = None,
                      storage_dtype: str | None = None) -> None:
    """Writes config.json and heads.safetensors into the existing `folder`, each file atomically, the weights
    first (a training output folder also holds the run's log and checkpoints, so it is not replaced whole)."""
    cfg = heads.config
    config = {"format": FORMAT, "medusa_jax": cfg.to_dict(),
              **heads.folder_fields(),  # the fields other tools read (Medusa heads: medusa_num_*), for orientation
              "base_model_name_or_path": cfg.base_model_name_or_path, "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, **(extra_config or {})}
    tensors = heads_tensors(heads)
    if storage_dtype is not None:
        store = np.dtype(resolve_dtype(storage_dtype))
        tensors = {k: v.astype(store) if np.issubdtype(v.dtype, np.floating) else v for k, v in tensors.items()}
    folder = Path(folder)
    write_safetensors(folder / WEIGHTS, tensors, metadata={"format": FORMAT})
    write_text_atomic(folder / "config.json", json.dumps(config, indent=2) + "\n")


def heads_from_tensors(config: HeadsConfig, tensors: dict[str, np.ndarray], origin: str) -> MedusaHeads:
    """Builds the drafter of config.head_type (MedusaHeads, HydraHeads, ...) from dotted-path tensors; every key
    must match, with the right shape."""
    abstract = nnx.eval_shape(lambda: heads_class(config.head_type)(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {".".join(p): leaf for p, leaf in param_paths(state)}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{origin}: heads tensors do not match the config: missing {missing}; "
                              f"unexpected {unexpected}")
    for name, leaf in expected.items():
        if tuple(tensors[name].shape) != tuple(leaf.shape):
            raise CheckpointError(f"{origin}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                  f"expected {tuple(leaf.shape)}")

    def value(path, leaf):
        return jax.numpy.asarray(np.asarray(tensors[".".join(path)]).astype(leaf.dtype))

    return nnx.merge(graphdef, fill_state(state, value))


def load_native_heads(folder: str | os.PathLike) -> MedusaHeads:
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder}: not a heads folder (no config.json)")
    raw = json.loads(config_path.read_text())
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: config.json is not in the {FORMAT} format")
    config = HeadsConfig.from_dict(raw["medusa_jax"])
    st = SafetensorsFile(folder / WEIGHTS)
    return heads_from_tensors(config, {n: st.array(n) for n in st.names}, str(folder / WEIGHTS))
