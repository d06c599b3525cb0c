"""Export Medusa heads to the folder layouts PyTorch serving systems read: `medusa` (FasterDecoding, TGI,
TensorRT-LLM) and `vllm`; tensor names in docs/interop.md and docs/modules.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np

from medusa_jax.atomic import atomic_folder
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import resolve_dtype
from medusa_jax.hf.tensor_files import write_safetensors
from medusa_jax.heads.layouts import MEDUSA, MEDUSA_WEIGHTS, VLLM, VLLM_WEIGHTS
from medusa_jax.heads.medusa import MedusaHeads

FORMATS = ("medusa", "vllm")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The heads cannot be written in the requested layout with the given options."""


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def check_token_map(token_map: np.ndarray, truncated_vocab_size: int, vocab_size: int, origin: str) -> None:
    """A token map must list truncated_vocab_size distinct full-vocab ids."""
    if token_map.ndim != 1 or token_map.shape[0] != truncated_vocab_size:
        raise ExportError(f"{origin}: token_map has shape {token_map.shape}, expected ({truncated_vocab_size},)")
    if not np.issubdtype(token_map.dtype, np.integer):
        raise ExportError(f"{origin}: token_map has dtype {token_map.dtype}, expected an integer type")
    if token_map.size and (token_map.min() < 0 or token_map.max() >= vocab_size):
        raise ExportError(f"{origin}: token_map ids must lie in [0, {vocab_size}), "
                          f"found [{token_map.min()}, {token_map.max()}]")
    if np.unique(token_map).size != token_map.size:
        raise ExportError(f"{origin}: token_map repeats token ids")


def _torch_layout(heads: MedusaHeads):
    """Per head: ([(weight [D,D] out-in, bias [D]) per layer], lm_head [V_head, D] or None), plus token_map."""
    out = []
    for head in heads.heads:
        blocks = [(_np(b.linear.kernel[...]).T, _np(b.linear.bias[...])) for b in head.blocks]
        lm = None if head.lm_head is None else _np(head.lm_head.kernel[...]).T
        out.append((blocks, lm))
    token_map = None if heads.token_map is None else _np(heads.token_map[...])
    return out, token_map


def _base_lm_head_vd(base: CausalLM, heads: MedusaHeads) -> np.ndarray:
    cfg = heads.config
    if base.config.hidden_size != cfg.hidden_size or base.config.vocab_size != cfg.vocab_size:
        raise ExportError(f"base model (hidden {base.config.hidden_size}, vocab {base.config.vocab_size}) does "
                          f"not match the heads (hidden {cfg.hidden_size}, vocab {cfg.vocab_size})")
    return _np(base.lm_head_weight()).T


def export_tensors(heads: MedusaHeads, *, format: str = "medusa", dtype: str = "float32",
                   base: CausalLM | None = None, materialize_lm_head: bool = False,
                   base_model_name_or_path: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors and config.json dict of the `format` layout (docs/interop.md, docs/modules.md)."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; expected one of {FORMATS}")
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; expected one of {EXPORT_DTYPES}")
    cfg = heads.config
    if format not in heads.export_formats:
        raise ExportError(f"these are {cfg.head_type} heads and the PyTorch layouts (FasterDecoding/TGI/TensorRT-LLM, "
                          f"vLLM) only describe Medusa heads, so they cannot be exported. Use them with medusa-jax's "
                          f"own format (medusa_jax.heads.folder); the shipped Medusa heads export as "
                          f"--heads default-medusa")
    np_dtype = np.dtype(resolve_dtype(dtype))
    # own/truncated heads already carry an lm_head per head: materialize_lm_head is a no-op for them
    materialize_lm_head = materialize_lm_head and cfg.lm_head == "shared"
    base_vd = None
    if cfg.lm_head == "shared" and (materialize_lm_head or format == "vllm"):
        if base is None:
            why = ("copying the base lm_head into each head" if materialize_lm_head else
                   "vLLM reads the shared lm_head from the heads checkpoint (original_lm_head)")
            raise ExportError(f"{why} needs the base model (pass base= / --model)")
        base_vd = _base_lm_head_vd(base, heads).astype(np_dtype)
    per_head, token_map = _torch_layout(heads)
    if token_map is not None:
        check_token_map(token_map, cfg.truncated_vocab_size, cfg.vocab_size, "heads")

    def cast(x):
        return np.ascontiguousarray(np.asarray(x, np.float32).astype(np_dtype))

    name = base_model_name_or_path if base_model_name_or_path is not None else cfg.base_model_name_or_path
    tensors: dict[str, np.ndarray] = {}
    layout = MEDUSA if format == "medusa" else VLLM
    for h, (blocks, _) in enumerate(per_head):
        for l, (w, b) in enumerate(blocks):
            tensors[layout.weight(h, l)] = cast(w)
            tensors[layout.bias(h, l)] = cast(b)
    if format == "medusa":
        for h, (_, lm) in enumerate(per_head):
            if cfg.lm_head == "truncated":
                full = np.zeros((cfg.vocab_size, cfg.hidden_size), np_dtype)
                full[token_map] = cast(lm)
                tensors[MEDUSA.lm(h, cfg.num_layers)] = full
            elif lm is not None:
                tensors[MEDUSA.lm(h, cfg.num_layers)] = cast(lm)
            elif materialize_lm_head:
                tensors[MEDUSA.lm(h, cfg.num_layers)] = base_vd
        config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
                  "base_model_name_or_path": name, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
        if cfg.lm_head == "shared" and not materialize_lm_head:
            config["version"] = "2"  # informational; readers tell v1 from v2 by the keys
    else:
        original_lm_head = cfg.lm_head == "shared" and not materialize_lm_head
        for h, (_, lm) in enumerate(per_head):
            if lm is not None:
                tensors[VLLM.lm(h)] = cast(lm)
            elif materialize_lm_head or h == 0:
                tensors[VLLM.lm(h)] = base_vd
        if token_map is not None:
            tensors[VLLM.token_map] = token_map.astype(np.int64)
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": cfg.num_heads,
                  "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.head_vocab_size,
                  "medusa_fc_bias": True, "original_lm_head": original_lm_head,
                  "base_model_name_or_path": name}
    config["exported_by"] = "medusa-jax"
    return tensors, config


def write_heads_folder(out: str | os.PathLike, weights_name: str, tensors: dict[str, np.ndarray], config: dict,
                       overwrite: bool = False) -> Path:
    """Writes config.json + weights into a temp folder and renames it to `out` (all or nothing). `overwrite`
    replaces only a folder that holds nothing but an earlier export (config.json with exported_by medusa-jax and
    its weights file); any other file in it is never deleted."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ExportError(f"{out} already exists and is not an empty folder (pass overwrite=True / --overwrite)")
        foreign = not_an_export(out)
        if foreign:
            raise ExportError(f"{out} holds files that are not an earlier export ({', '.join(foreign[:5])}); "
                              f"--overwrite replaces only an earlier export: choose another --out")
    with atomic_folder(out) as tmp:
        write_safetensors(tmp / weights_name, tensors, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def not_an_export(folder: Path) -> list[str]:
    """Names in `folder` that an export by this module did not write (all of them for a non-export)."""
    if not folder.is_dir():
        return [folder.name]
    names = sorted(p.name for p in folder.iterdir())
    try:
        ours = json.loads((folder / "config.json").read_text()).get("exported_by") == "medusa-jax"
    except (OSError, ValueError, AttributeError):
        ours = False
    allowed = {"config.json", MEDUSA_WEIGHTS, VLLM_WEIGHTS} if ours else set()
    return [n for n in names if n not in allowed or (folder / n).is_dir()]


def export_heads(heads: MedusaHeads, out: str | os.PathLike, *, format: str = "medusa", dtype: str = "float32",
                 base: CausalLM | None = None, materialize_lm_head: bool = False,
                 base_model_name_or_path: str | None = None, overwrite: bool = False) -> Path:
    """Writes `heads` to the folder `out` in the `format` layout; returns the folder."""
    tensors, config = export_tensors(heads, format=format, dtype=dtype, base=base,
                                     materialize_lm_head=materialize_lm_head,
                                     base_model_name_or_path=base_model_name_or_path)
    weights = MEDUSA_WEIGHTS if format == "medusa" else VLLM_WEIGHTS
    return write_heads_folder(out, weights, tensors, config, overwrite=overwrite)


def serving_notes(heads: MedusaHeads, format: str, materialize_lm_head: bool = False,
                  base_model_name_or_path: str | None = None) -> list[str]:
    """Which serving systems can read the exported folder, and what to watch for."""
    cfg = heads.config
    name = base_model_name_or_path if base_model_name_or_path is not None else cfg.base_model_name_or_path
    if format == "vllm":
        notes = [f"vLLM: speculative_config={{'method': 'medusa', 'model': <out>, "
                 f"'num_speculative_tokens': {cfg.num_heads}}} (vLLM proposes each head's top-1 token, no tree)"]
        if cfg.lm_head == "shared" and not materialize_lm_head:
            notes.append("original_lm_head: the base lm_head is stored once as lm_heads.0.weight")
        return notes
    notes = []
    if cfg.lm_head == "shared" and not materialize_lm_head:
        notes.append("ResBlock-only 'v2' layout: TGI only (MedusaHeadV2 reuses the base lm_head); the official "
                     "Medusa code and TensorRT-LLM need --materialize-lm-head")
        if cfg.num_layers != 1:
            notes.append(f"TGI's v2 loader requires medusa_num_layers == 1; these heads have {cfg.num_layers}: "
                         f"use --materialize-lm-head")
    else:
        notes.append("v1 layout: TGI, TensorRT-LLM (examples/medusa/convert_checkpoint.py --medusa_model_dir) and "
                     "the official Medusa code (which reads medusa_lm_head.pt: see the README for the one-line "
                     "conversion)")
        if cfg.num_layers > 1:
            notes.append("the official Medusa code builds a head's ResBlocks from one shared module "
                         "([ResBlock] * n), so heads with medusa_num_layers > 1 load wrongly there")
    if cfg.lm_head == "truncated":
        notes.append(f"truncated heads expanded to the full vocabulary: the {cfg.vocab_size - cfg.head_vocab_size} "
                     f"tokens outside the token map have zero rows (logit exactly 0)")
    notes.append("TGI and the official code load the base model from config.json's base_model_name_or_path "
                 f"(here {name!r}): it must name the base model on the serving machine")
    return notes
