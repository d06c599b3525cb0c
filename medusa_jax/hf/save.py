"""Write a backbone back as a local HF folder, atomically: the inverse of `medusa_jax.hf.load.load_pretrained`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from medusa_jax.atomic import atomic_folder
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.param_paths import param_paths
from medusa_jax.hf.load import hf_layer_names, stacked_param
from medusa_jax.hf.tensor_files import write_safetensors

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def save_pretrained(model: CausalLM, folder: str | os.PathLike, source_folder: str | os.PathLike) -> Path:
    """Writes `model`'s weights as `folder`/model.safetensors plus COPIED_FILES found in `source_folder`."""
    folder, source = Path(folder), Path(source_folder)
    tensors = {}
    for path, leaf in param_paths(nnx.state(model, nnx.Param)):
        arr = np.asarray(jax.device_get(leaf))
        names = hf_layer_names(path, model.config.num_layers)
        parts = list(arr) if stacked_param(path) else [arr]
        for (name, transpose), part in zip(names, parts, strict=True):
            tensors[name] = np.ascontiguousarray(part.T if transpose else part)
    with atomic_folder(folder) as tmp:
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        for name in COPIED_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
    return folder
