"""The EAGLE drafter in the layout of the EAGLE authors' published EAGLE-1 drafts (read by vLLM and SGLang),
and back; tensor names in docs/interop.md and docs/modules.md."""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig, resolve_dtype
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.draft_vocab import draft_vocab_tensors, token_map_from
from medusa_jax.heads.export import write_heads_folder
from medusa_jax.heads.folder import heads_from_tensors, heads_tensors
from medusa_jax.model.param_paths import param_paths
from medusa_jax.hf.tensor_files import CheckpointError, TensorSource, find_model_weights

EAGLE_WEIGHTS = "model.safetensors"
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM",
                       "MistralForCausalLM", "Qwen2ForCausalLM")
_LINEAR = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(kernel|bias)$")
_NORM = re.compile(r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")


def native_to_eagle(name: str) -> str | None:
    """A drafter parameter path -> its EAGLE tensor name (None: not a tensor of its own in the layout)."""
    if name in ("fc.kernel", "fc.bias", "lm_head.kernel"):
        return name.replace("kernel", "weight")
    m = _LINEAR.match(name)
    if m:
        return f"layers.{m.group(1)}.{m.group(2)}.{'weight' if m.group(4) == 'kernel' else 'bias'}"
    return name if _NORM.match(name) else None


def lm_head_tensors(drafter, store: np.dtype) -> tuple[dict[str, np.ndarray], int | None]:
    """A drafter's own lm_head as lm_head.weight [V_head, D] (+ d2t/t2d for a draft vocabulary, its ids sorted
    ascending as the maps need), and the draft vocabulary's size (None: the full vocabulary or the base's head)."""
    if drafter.lm_head is None:
        return {}, None
    lm_vd = np.asarray(jax.device_get(drafter.lm_head.kernel[...])).T
    if drafter.token_map is None:
        return {"lm_head.weight": lm_vd.astype(store)}, None
    ids_u = np.asarray(jax.device_get(drafter.token_map[...]))
    order = np.argsort(ids_u, kind="stable")
    maps = draft_vocab_tensors(ids_u[order], drafter.config.vocab_size)
    return {"lm_head.weight": lm_vd[order].astype(store), **maps}, int(ids_u.shape[0])


def eagle_tensors(drafter: EagleDrafter, base: CausalLM, dtype: str = "float16",
                  sglang: bool = False) -> tuple[dict[str, np.ndarray], dict]:
    """The drafter's tensors and config.json in the EAGLE-1 layout."""
    store = np.dtype(resolve_dtype(dtype))
    tensors = {}
    for name, value in heads_tensors(drafter).items():
        eagle = native_to_eagle(name)
        if eagle is not None and not eagle.startswith("lm_head"):
            if name == "fc.kernel":  # fold embed_scale into the embedding's rows: the layout has no scale
                value = np.concatenate([value[:drafter.config.hidden_size] * drafter.config.embed_scale,
                                        value[drafter.config.hidden_size:]])
            tensors[eagle] = (value.T if name.endswith("kernel") else value).astype(store)
    head, draft_vocab = lm_head_tensors(drafter, store)
    tensors.update(head)
    tensors["embed_tokens.weight"] = np.asarray(jax.device_get(base.embed_tokens.embedding[...])).astype(store)
    if sglang and "fc.bias" not in tensors:  # SGLang's LlamaForCausalLMEagle builds fc with a bias
        tensors["fc.bias"] = np.zeros((drafter.config.hidden_size,), store)
    # EAGLE-1 drafts are Llama layers (a Qwen2 one: with q/k/v biases)
    cfg = drafter_hf_config(drafter, dtype, architectures=["LlamaForCausalLMEagle" if sglang else "LlamaForCausalLM"],
                            num_hidden_layers=drafter.config.num_layers, bias="fc.bias" in tensors)
    if drafter.decoder.attention_bias:
        cfg["qkv_bias"] = True
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    return tensors, cfg


def drafter_hf_config(drafter, dtype: str, **fields) -> dict:
    """The config.json of an exported EAGLE drafter: its decoder as a Llama layer, `fields`, and who wrote it."""
    cfg = drafter.decoder.to_hf_config()
    cfg.pop("use_sliding_window", None)
    cfg.update(model_type="llama", attention_bias=drafter.decoder.attention_bias, tie_word_embeddings=False,
               torch_dtype=dtype, exported_by="medusa-jax", **fields,
               medusa_jax={"head_type": drafter.head_type, "draft_depth": drafter.config.num_heads,
                           "base_model_name_or_path": drafter.config.base_model_name_or_path})
    return cfg


def is_eagle_folder(folder: Path, raw: dict | None) -> bool:
    return raw is not None and "num_hidden_layers" in raw and has_drafter_tensor(folder, raw, EAGLE_ARCHITECTURES,
                                                                                 "fc.weight")


def has_drafter_tensor(folder: Path, raw: dict | None, architectures: tuple[str, ...], name: str) -> bool:
    """config.json names one of `architectures` and the folder's weights hold the tensor `name`."""
    if raw is None or not any(a in architectures for a in raw.get("architectures") or []):
        return False
    try:
        return name in TensorSource.from_files(find_model_weights(folder)).names
    except CheckpointError:
        return False


def drafter_decoder(raw: dict, base_config: ModelConfig | None, dtype: str, origin: str) -> ModelConfig:
    """The drafter's decoder config from its config.json: a Llama layer (q/k/v biases with "qkv_bias" or
    "attention_bias"), its own rope_theta (default 10000), checked against the base's shapes."""
    hf = dict(raw)
    hf["model_type"] = "llama"
    hf["attention_bias"] = bool(raw.get("qkv_bias") or raw.get("attention_bias"))
    decoder = ModelConfig.from_hf_config(hf, dtype=dtype)
    if base_config is not None:
        for field in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(decoder, field) != getattr(base_config, field):
                raise CheckpointError(f"{origin}: the drafter's {field} {getattr(decoder, field)} does not match "
                                      f"the base model's {getattr(base_config, field)}")
    return decoder


def equals_base(lm_vd: np.ndarray, base_vd: np.ndarray | None) -> bool:
    """The stored lm_head is the base lm_head (compared after rounding the base to the stored dtype)."""
    if base_vd is None or lm_vd.shape != base_vd.shape:
        return False
    return np.array_equal(np.asarray(lm_vd, np.float32), base_vd.astype(lm_vd.dtype).astype(np.float32))


def lm_head_mode(source: TensorSource, raw: dict, vocab: int, base_vd: np.ndarray | None, origin: str):
    """(lm_head mode, draft vocabulary size or None, token_map or None) of a folder's lm_head tensors."""
    names = set(source.names)
    if "lm_head.weight" not in names:
        if {"d2t", "t2d"} & names:
            raise CheckpointError(f"{origin}: has d2t/t2d but no lm_head.weight")
        return "shared", None, None
    rows = int(source.array("lm_head.weight").shape[0])
    if "d2t" not in names:
        if rows != vocab:
            raise CheckpointError(f"{origin}: lm_head.weight has {rows} rows, vocab_size is {vocab}, and no d2t "
                                  f"maps a draft vocabulary")
        return ("shared" if equals_base(source.array("lm_head.weight"), base_vd) else "own"), None, None
    token_map = token_map_from(source.array("d2t"), source.array("t2d") if "t2d" in names else None, vocab, origin)
    if token_map.shape[0] != rows or int(raw.get("draft_vocab_size", rows)) != rows:
        raise CheckpointError(f"{origin}: lm_head.weight has {rows} rows, d2t {token_map.shape[0]}, "
                              f"draft_vocab_size {raw.get('draft_vocab_size')}: they must agree")
    return "truncated", rows, token_map


def load_eagle(folder: Path, raw: dict, base_config: ModelConfig | None, dtype: str = "float32",
               num_heads: int | None = None, base_vd: np.ndarray | None = None) -> EagleDrafter:
    """An EAGLE-1 folder -> an EagleDrafter (lm_head "shared" unless the folder holds its own, lm_head_mode).
    base_vd: the base's lm_head [V, D]; a stored lm_head equal to it loads as "shared"."""
    origin = str(folder)
    source = TensorSource.from_files(find_model_weights(folder))
    decoder = drafter_decoder(raw, base_config, dtype, origin)
    names = set(source.names)
    mode, draft_vocab, token_map = lm_head_mode(source, raw, decoder.vocab_size, base_vd, origin)
    ours = raw.get("medusa_jax") or {}
    depth = num_heads or int(ours.get("draft_depth", 8))
    config = HeadsConfig(decoder.hidden_size, decoder.vocab_size, num_heads=depth, num_layers=decoder.num_layers,
                         lm_head=mode, truncated_vocab_size=draft_vocab, dtype=dtype,
                         base_model_name_or_path=str(ours.get("base_model_name_or_path", "")), head_type="eagle",
                         decoder=decoder, fc_bias="fc.bias" in names)
    tensors = read_named(source, EagleDrafter, config, native_to_eagle,
                         {"embed_tokens.weight", "d2t", "t2d", "lm_head.weight"}, origin, "an EAGLE-1 drafter")
    if token_map is not None:
        tensors["token_map"] = token_map
    if mode == "shared":
        tensors.pop("lm_head.kernel", None)
    return heads_from_tensors(config, tensors, origin)


def read_named(source: TensorSource, cls, config: HeadsConfig, theirs_of, allowed: set[str], origin: str,
               what: str) -> dict[str, np.ndarray]:
    """The parameters of `cls(config)` read from `source` by their names in a layout (theirs_of(path); None: not a
    tensor of the layout), kernels transposed from [out, in]; CheckpointError naming what is missing and which
    tensors beyond `allowed` nothing reads."""
    _, state = nnx.split(nnx.eval_shape(lambda: cls(config, nnx.Rngs(0))))
    theirs = {".".join(path): theirs_of(".".join(path)) for path, _ in param_paths(state)}
    theirs = {name: t for name, t in theirs.items() if t is not None}
    names = set(source.names)
    missing, unexpected = [t for t in theirs.values() if t not in names], sorted(names - set(theirs.values()) - allowed)
    if missing or unexpected:
        raise CheckpointError(f"{origin}: not {what} of this shape: missing {missing}; unexpected {unexpected}")
    return {name: source.array(t).T if name.endswith("kernel") else source.array(t) for name, t in theirs.items()}


def export_eagle(drafter: EagleDrafter, base: CausalLM, out: str | os.PathLike, *, dtype: str = "float16",
                 sglang: bool = False, overwrite: bool = False) -> Path:
    tensors, config = eagle_tensors(drafter, base, dtype, sglang)
    return write_heads_folder(out, EAGLE_WEIGHTS, tensors, config, overwrite=overwrite)


def eagle_serving_notes(drafter: EagleDrafter, sglang: bool) -> list[str]:
    cfg = drafter.config
    notes = ["vLLM: speculative_config={'method': 'eagle', 'model': <out>, 'num_speculative_tokens': N} "
             "(EagleLlamaForCausalLM builds fc without a bias)" if not sglang else
             "SGLang: --speculative-algorithm EAGLE --speculative-draft-model-path <out> (LlamaForCausalLMEagle, "
             "fc.bias)",
             "the EAGLE authors' code (SafeAILab/EAGLE, cnets1.py): EaModel.from_pretrained(use_eagle3=False, "
             "ea_model_path=<out>) reads config.json's \"bias\" and model.safetensors; the PyPI package eagle-llm "
             "1.2.1 reads only pytorch_model.bin and fixes the rotary base at 10000 (docs/interop.md)"]
    if cfg.fc_bias and not sglang:
        notes.append("the drafter has an fc bias: vLLM's EAGLE-1 Llama draft has none and cannot load it")
    if cfg.lm_head != "shared":
        maps = ", d2t/t2d" if cfg.lm_head == "truncated" else ""
        notes.append(f"the drafter's own lm_head ({cfg.head_vocab_size} rows{maps}) "
                     f"is in the folder: runtimes that take the base's lm_head for EAGLE-1 drafts (the authors' "
                     f"cnets1.py, SGLang) leave it unread and draft with another head than the one measured here")
    if drafter.decoder.attention_bias:
        notes.append("q/k/v biases (a Qwen2 base): \"qkv_bias\": true, the key the authors' cnets1.py reads, and "
                     "\"attention_bias\": true for vLLM/transformers")
    return notes
