"""Text <-> token ids with the model folder's transformers tokenizer: loading, chat-template prompts, EOS ids."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class TokenizerError(ValueError):
    """The folder has no usable tokenizer, or a prompt cannot be encoded."""


def load_tokenizer(folder: str | os.PathLike):
    """The transformers tokenizer saved in a model folder (offline; nothing is downloaded)."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerError(f"{folder}: no tokenizer files (expected one of {list(_TOKENIZER_FILES)})")
    import transformers  # lazy: seconds to import, and `import medusa_jax` must stay cheap

    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (KeyError, ValueError, TypeError, AttributeError, OSError) as e:  # a corrupt or foreign tokenizer file
        raise TokenizerError(f"{folder}: the tokenizer does not load ({type(e).__name__}: {e}); check its "
                             f"tokenizer files") from None


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of one prompt. chat=True wraps it as a user message with the tokenizer's chat template and
    appends the assistant header (add_generation_prompt=True); chat=False encodes the raw text."""
    if not text:
        raise TokenizerError("empty prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError("--chat needs a tokenizer with a chat template, and this one has none")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        # the template already spells the special tokens out; do not add a second BOS
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise TokenizerError(f"prompt {text[:40]!r} encodes to no tokens")
    return [int(i) for i in ids]


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a whole conversation (`[{"role", "content"}, ...]`) with the chat template and the
    assistant generation prompt: the prompt of the reply that comes next."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def decode_tokens(tokenizer, token_ids: Iterable[int]) -> str:
    """Text of generated ids, special tokens (EOS) dropped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _ids(value: Any) -> list[int]:
    return [] if value is None else [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def eos_token_ids(folder: str | os.PathLike, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends a reply: config.json's and generation_config.json's eos_token_id plus the
    tokenizer's eos token, in that order, without duplicates."""
    folder = Path(folder)
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            found += _ids(json.loads(path.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        found += _ids(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(found))


def pad_token_id(tokenizer, eos_ids: tuple[int, ...]) -> int:
    """The id used to pad prompts and finished rows (never attended to)."""
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return eos_ids[0] if eos_ids else 0
