"""A base model, its heads and its tokenizer loaded from the folders the commands name (`--model smollm2`:
`demo_model.prepare_smollm2`; `--heads default`: `assets.resolve_heads_dir`): what the tree search and the
benchmarks decode with."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.demo_model import resolve_model_dir
from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.model.backbone import CausalLM
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.medusa import MedusaHeads


@dataclasses.dataclass
class LoadedModel:
    folder: Path
    base: CausalLM
    heads: MedusaHeads | None
    heads_folder: Path | None
    tokenizer: object
    eos_ids: tuple[int, ...]
    pad_id: int

    def encode_chat(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as a user message with the chat template and the assistant header."""
        return [encode_prompt(self.tokenizer, t, chat=True) for t in texts]


def load_model(model: str | os.PathLike, heads: str | os.PathLike | None, dtype: str = "float32") -> LoadedModel:
    folder = resolve_model_dir(model)
    base = load_pretrained(folder, dtype=dtype)
    heads_folder = resolve_heads_dir(heads) if heads is not None else None
    loaded_heads = load_heads(heads_folder, base=base, dtype=dtype) if heads_folder is not None else None
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(folder, tokenizer)
    return LoadedModel(folder, base, loaded_heads, heads_folder, tokenizer, eos, pad_token_id(tokenizer, eos))
