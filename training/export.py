"""Write a (Medusa-2 trained) backbone back as a HF folder: model.safetensors + the source's config/tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from medusa_jax.atomic import atomic_folder
from medusa_jax.backbone import CausalLM
from medusa_jax.hf_import import hf_param_name, param_paths
from medusa_jax.tensor_files import write_safetensors

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def save_backbone(base: CausalLM, source_folder: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """HF tensor names, PyTorch [out, in] layout; config and tokenizer files copied from `source_folder`."""
    folder, source = Path(folder), Path(source_folder)
    tensors = {}
    for path, leaf in param_paths(nnx.state(base, nnx.Param)):
        name, transpose = hf_param_name(path)
        arr = np.asarray(jax.device_get(leaf))
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    with atomic_folder(folder) as tmp:
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        for name in _COPIED:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
    return folder
