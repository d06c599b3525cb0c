"""Load Medusa heads from any folder layout we know (medusa-jax, medusa, vllm, eagle, eagle3), every tensor
checked by name and shape; the layouts are in docs/modules.md."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax
import numpy as np

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig
from medusa_jax.hf.load import read_hf_config
from medusa_jax.hf.tensor_files import CheckpointError, TensorSource, find_model_weights
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle_layout import equals_base, is_eagle_folder, load_eagle
from medusa_jax.heads.eagle3_layout import is_eagle3_folder, load_eagle3
from medusa_jax.heads.export import ExportError, check_token_map
from medusa_jax.heads.folder import FORMAT, heads_from_tensors, heads_tensors, load_native_heads
from medusa_jax.heads.layouts import MEDUSA, MEDUSA_WEIGHTS, MEDUSA_WEIGHTS_PT, NATIVE, VLLM, VLLM_SHARED_LM_HEAD
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.trees_file import attach_trees, read_trees

LAYOUTS = ("medusa-jax", "medusa", "vllm", "eagle", "eagle3")


def _read_config(folder: Path) -> dict | None:
    return read_hf_config(folder) if (folder / "config.json").exists() else None


def detect_layout(folder: str | os.PathLike) -> str:
    """One of LAYOUTS, or CheckpointError saying what a heads folder should contain."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: heads folder does not exist")
    raw = _read_config(folder)
    if raw is not None and raw.get("format") == FORMAT:
        return "medusa-jax"
    if (folder / MEDUSA_WEIGHTS).exists() or (folder / MEDUSA_WEIGHTS_PT).exists():
        return "medusa"
    if raw is not None and raw.get("model_type") == "medusa":
        return "vllm"
    if is_eagle3_folder(folder, raw):
        return "eagle3"
    if is_eagle_folder(folder, raw):
        return "eagle"
    raise CheckpointError(
        f"{folder}: not a Medusa heads folder: expected config.json with \"format\": \"{FORMAT}\" (medusa-jax), "
        f"{MEDUSA_WEIGHTS} or {MEDUSA_WEIGHTS_PT} (FasterDecoding/TGI/TensorRT-LLM), or config.json with "
        f"model_type \"medusa\" (vLLM), or an EAGLE drafter (config.json and weights with fc.weight, or "
        f"midlayer.* for EAGLE-3)")


def _field(raw: dict | None, origin: str, *names: str) -> int:
    for name in names:
        if raw is not None and name in raw:
            return int(raw[name])
    raise CheckpointError(f"{origin}: config.json lacks {' / '.join(names)}")


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _check_names(origin: str, present, expected: dict[str, tuple], head_re: str, num_heads: int,
                 count_field: str) -> None:
    """Exact key match (listing missing and unexpected names), then shapes."""
    missing = sorted(set(expected) - set(present), key=_natural)
    unexpected = sorted(set(present) - set(expected), key=_natural)
    if missing or unexpected:
        heads_in_file = {int(m.group(1)) for n in present if (m := re.match(head_re, n))}
        hint = ""
        if heads_in_file and max(heads_in_file) + 1 != num_heads:
            hint = (f" (the file holds heads 0..{max(heads_in_file)} but {count_field} is {num_heads}; if "
                    f"config.json is wrong, pass num_heads={max(heads_in_file) + 1})")
        raise CheckpointError(f"{origin}: tensors do not match the heads config: missing {missing}; "
                              f"unexpected {unexpected}{hint}")
    for name, shape in expected.items():
        got = tuple(present[name].shape)
        if got != shape:
            raise CheckpointError(f"{origin}: tensor {name!r} has shape {got}, expected {shape}")


def _check_sizes(origin: str, hidden: int, vocab: int, raw: dict | None, base_config: ModelConfig | None):
    for source, cfg in (("config.json", raw or {}), ("the base model config", dataclasses.asdict(base_config)
                                                      if base_config is not None else {})):
        for field, what, size in (("hidden_size", "hidden size", hidden), ("vocab_size", "vocabulary size", vocab)):
            if cfg.get(field) is not None and int(cfg[field]) != size:
                raise CheckpointError(f"{origin}: the heads have {what} {size} but {source} says {cfg[field]}")


def _base_lm_head_vd(base: CausalLM | None) -> np.ndarray | None:
    return None if base is None else np.asarray(jax.device_get(base.lm_head_weight())).T


def _assemble(blocks, lms, token_map, *, hidden, vocab, base_vd, raw, dtype, origin) -> MedusaHeads:
    """blocks[h][l] = (W [D,D] out-in, b [D]); lms[h] = [V_head, D] or None for the shared base lm_head."""
    if token_map is not None:
        mode = "truncated"
    elif lms[0] is None or all(equals_base(lm, base_vd) for lm in lms):
        mode = "shared"
    else:
        mode = "own"
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=len(blocks), num_layers=len(blocks[0]),
                         lm_head=mode, truncated_vocab_size=None if token_map is None else int(token_map.shape[0]),
                         dtype=dtype, base_model_name_or_path=str((raw or {}).get("base_model_name_or_path", "")))
    native: dict[str, np.ndarray] = {}
    for h, (head_blocks, lm) in enumerate(zip(blocks, lms)):
        for l, (w, b) in enumerate(head_blocks):
            native[NATIVE.weight(h, l)] = np.asarray(w).T
            native[NATIVE.bias(h, l)] = np.asarray(b)
        if mode != "shared":
            native[NATIVE.lm(h)] = np.asarray(lm).T
    if token_map is not None:
        native[NATIVE.token_map] = token_map.astype(np.int32)
    return heads_from_tensors(config, native, origin)


def _load_medusa(folder: Path, raw, base_config, base_vd, dtype, num_heads) -> MedusaHeads:
    name = MEDUSA_WEIGHTS if (folder / MEDUSA_WEIGHTS).exists() else MEDUSA_WEIGHTS_PT
    source = TensorSource.from_files([folder / name])
    tensors, origin = {n: source.array(n) for n in source.names}, source.origin
    heads = num_heads if num_heads is not None else _field(raw, origin, "medusa_num_heads")
    layers = _field(raw, origin, "medusa_num_layers")
    lm_keys = sorted((n for n in tensors if re.fullmatch(MEDUSA.lm_re(layers), n)), key=_natural)
    v1 = bool(lm_keys)
    if layers == 0 and not v1:
        raise CheckpointError(f"{origin}: medusa_num_layers is 0 and there is no lm_head tensor: nothing to load")
    first = MEDUSA.weight(0, 0) if layers else MEDUSA.lm(0, layers)
    some_w = tensors.get(first)
    if some_w is None:
        raise CheckpointError(f"{origin}: missing tensor {first}")
    hidden = int(some_w.shape[-1])
    if v1:
        vocab = int(tensors[lm_keys[0]].shape[0])
    else:
        vocab = (raw or {}).get("vocab_size") or (base_config.vocab_size if base_config is not None else None)
    if vocab is None:
        raise CheckpointError(f"{origin}: cannot tell the vocabulary size (no lm_head tensor "
                              f"{MEDUSA.lm(0, layers)}, no vocab_size in config.json, no base model config given)")
    vocab = int(vocab)
    if str((raw or {}).get("version", "")) == "2" and v1:
        raise CheckpointError(f"{origin}: config.json says version 2 (no per-head lm_head) but the file holds "
                              f"per-head lm_head tensors {{h}}.{layers}.weight")
    expected = {}
    for h in range(heads):
        for l in range(layers):
            expected[MEDUSA.weight(h, l)] = (hidden, hidden)
            expected[MEDUSA.bias(h, l)] = (hidden,)
        if v1:
            expected[MEDUSA.lm(h, layers)] = (vocab, hidden)
    _check_names(origin, tensors, expected, MEDUSA.head_index_re, heads, "medusa_num_heads")
    _check_sizes(origin, hidden, vocab, raw, base_config)
    blocks = [[(tensors[MEDUSA.weight(h, l)], tensors[MEDUSA.bias(h, l)]) for l in range(layers)]
              for h in range(heads)]
    lms = [tensors[MEDUSA.lm(h, layers)] if v1 else None for h in range(heads)]
    return _assemble(blocks, lms, None, hidden=hidden, vocab=vocab, base_vd=base_vd, raw=raw, dtype=dtype,
                     origin=origin)


def _load_vllm(folder: Path, raw, base_config, base_vd, dtype, num_heads) -> MedusaHeads:
    source = TensorSource.from_files(find_model_weights(folder))
    tensors, origin = {n: source.array(n) for n in source.names}, source.origin
    heads = num_heads if num_heads is not None else _field(raw, origin, "num_heads", "medusa_num_heads")
    layers = _field(raw, origin, "num_hidden_layers", "medusa_num_layers")
    hidden, vocab = _field(raw, origin, "hidden_size"), _field(raw, origin, "vocab_size")
    head_vocab = int(raw.get("truncated_vocab_size") or vocab)
    bias, original = bool(raw.get("medusa_fc_bias", False)), bool(raw.get("original_lm_head", False))
    token_map = None
    if VLLM.token_map in tensors:
        if head_vocab == vocab:
            raise CheckpointError(f"{origin}: has a token_map but truncated_vocab_size == vocab_size ({vocab}); "
                                  f"vLLM ignores the map then: remove it or set truncated_vocab_size")
        token_map = np.asarray(tensors[VLLM.token_map])
        try:
            check_token_map(token_map, head_vocab, vocab, origin)
        except ExportError as e:
            raise CheckpointError(str(e)) from None
    elif head_vocab < vocab:
        raise CheckpointError(f"{origin}: truncated_vocab_size {head_vocab} < vocab_size {vocab} needs a "
                              f"token_map tensor, which is missing")
    lm_names = [VLLM.lm(h) for h in range(heads)]
    if original:  # vLLM reads the shared lm_head as `lm_heads.0.weight` (or directly as `lm_head.weight`)
        lm_names = [VLLM_SHARED_LM_HEAD if VLLM_SHARED_LM_HEAD in tensors else VLLM.lm(0)]
    lm_rows = {n: (vocab if token_map is not None and n in tensors and tensors[n].shape[0] == vocab
                   else head_vocab) for n in lm_names}  # vLLM slices full-vocab rows by token_map
    expected = {n: (lm_rows[n], hidden) for n in lm_names}
    for h in range(heads):
        for l in range(layers):
            expected[VLLM.weight(h, l)] = (hidden, hidden)
            if bias:
                expected[VLLM.bias(h, l)] = (hidden,)
    if token_map is not None:
        expected[VLLM.token_map] = (head_vocab,)
    _check_names(origin, tensors, expected, VLLM.head_index_re, heads, "num_heads")
    _check_sizes(origin, hidden, vocab, None, base_config)
    zeros = np.zeros((hidden,), np.float32)
    blocks = [[(tensors[VLLM.weight(h, l)], tensors[VLLM.bias(h, l)] if bias else zeros) for l in range(layers)]
              for h in range(heads)]
    lms = [tensors[lm_names[0 if original else h]] for h in range(heads)]
    if token_map is not None:
        lms = [lm[token_map] if lm.shape[0] == vocab else lm for lm in lms]
    return _assemble(blocks, lms, token_map, hidden=hidden, vocab=vocab, base_vd=base_vd, raw=raw, dtype=dtype,
                     origin=origin)


def load_heads(folder: str | os.PathLike, base_config: ModelConfig | None = None, *, base: CausalLM | None = None,
               dtype: str | None = None, num_heads: int | None = None) -> MedusaHeads:
    """Loads heads from a folder in any layout in LAYOUTS, checked against base_config (default: base.config).
    base: heads whose stored lm_heads all equal its lm_head load as lm_head="shared". dtype: as saved (medusa-jax),
    else float32. num_heads overrides config.json's count (published configs can be wrong; the tensors must agree).
    The folder's trees.json, if any, is checked and attached as `heads.trees`."""
    folder = Path(folder)
    trees = read_trees(folder)  # a bad trees.json fails before the weights are read
    layout = detect_layout(folder)
    if base_config is None and base is not None:
        base_config = base.config
    raw, dtype_or_f32 = _read_config(folder), dtype or "float32"
    if layout == "medusa-jax":
        heads = load_native_heads(folder)
        cfg = heads.config
        if num_heads is not None and num_heads != cfg.num_heads:
            raise CheckpointError(f"{folder}: holds {cfg.num_heads} heads, num_heads={num_heads} was asked for")
        _check_sizes(str(folder), cfg.hidden_size, cfg.vocab_size, None, base_config)
        if dtype is not None and dtype != cfg.dtype:
            heads = heads_from_tensors(dataclasses.replace(cfg, dtype=dtype), heads_tensors(heads), str(folder))
    elif layout == "eagle":
        heads = load_eagle(folder, raw, base_config, dtype_or_f32, num_heads, _base_lm_head_vd(base))
    elif layout == "eagle3":
        heads = load_eagle3(folder, raw, base_config, dtype_or_f32, num_heads)
    else:
        load = _load_medusa if layout == "medusa" else _load_vllm
        heads = load(folder, raw, base_config, _base_lm_head_vd(base), dtype_or_f32, num_heads)
    return attach_trees(heads, trees)
