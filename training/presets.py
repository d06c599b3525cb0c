"""Shapes of well-known Llama-family models from their public HF config.json files, for the memory planner."""

from __future__ import annotations

import os
from pathlib import Path

from medusa_jax.model.config import ModelConfig
from medusa_jax.hf.load import read_hf_config

# Only the fields ModelConfig.from_hf_config reads; values as published by the model authors.
PRESETS: dict[str, dict] = {
    "llama3-8b": {  # meta-llama/Meta-Llama-3-8B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001},
    "llama3-70b": {  # meta-llama/Meta-Llama-3-70B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001},
    "mistral-7b": {  # mistralai/Mistral-7B-v0.1
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 32768, "sliding_window": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2-7b": {  # Qwen/Qwen2-7B
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 131072, "use_sliding_window": False,
        "sliding_window": 131072, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643},
}


def model_config(name_or_folder: str | os.PathLike, dtype: str = "bfloat16") -> ModelConfig:
    """A preset name (see PRESETS) or a folder holding a HF config.json -> ModelConfig in `dtype`."""
    if str(name_or_folder) in PRESETS:
        return ModelConfig.from_hf_config(PRESETS[str(name_or_folder)], dtype=dtype)
    folder = Path(name_or_folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {str(name_or_folder)!r} is neither a preset ({', '.join(PRESETS)}) nor a folder "
                         f"with a config.json")

    return ModelConfig.from_hf_config(read_hf_config(folder), dtype=dtype)
