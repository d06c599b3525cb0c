"""The EAGLE drafter in the layout of the EAGLE authors' published drafts (SafeAILab/EAGLE, e.g.
yuhuili/EAGLE-LLaMA3-Instruct-8B), which vLLM's (`EagleLlamaForCausalLM`) and SGLang's (`LlamaForCausalLMEagle`)
EAGLE loaders read, and back.

A folder holds config.json (the base's Llama config with num_hidden_layers = the drafter's layers, "bias": false,
tie_word_embeddings false) and model.safetensors with PyTorch's [out, in] tensors, no key prefix:
    embed_tokens.weight                  [V, D]   a copy of the base's input embedding (EAGLE's own loader needs it)
    fc.weight                            [D, 2D]  input columns: the token embedding first, then the feature
    layers.{i}.self_attn.{q,k,v,o}_proj.weight  (+ .bias of q/k/v for a model with attention bias)
    layers.{i}.mlp.{gate,up,down}_proj.weight
    layers.{i}.post_attention_layernorm.weight, and layers.{i}.input_layernorm.weight for i > 0 only
No final norm and no lm_head: the drafter's output goes into the base's lm_head. A draft vocabulary (our
truncated lm_head) has no place in this layout: consumers use the base's full lm_head, and the folder loads back
as a drafter with lm_head "shared". fc has no bias (vLLM's EAGLE-1 Llama draft has none; with `sglang=True` the
export adds a zero fc.bias and names the architecture LlamaForCausalLMEagle, as SGLang's loader expects).
"""

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
from medusa_jax.heads.export import write_heads_folder
from medusa_jax.heads.folder import heads_from_tensors, heads_tensors
from medusa_jax.model.param_paths import param_paths
from medusa_jax.hf.tensor_files import CheckpointError, TensorSource, find_model_weights

EAGLE_WEIGHTS = "model.safetensors"
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM",
                       "MistralForCausalLM", "Qwen2ForCausalLM")
_LINEAR = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(kernel|bias)$")


def native_to_eagle(name: str) -> str | None:
    """A drafter parameter path -> its EAGLE tensor name (None: not part of the layout)."""
    if name == "fc.kernel":
        return "fc.weight"
    m = _LINEAR.match(name)
    if m:
        return f"layers.{m.group(1)}.{m.group(2)}.{'weight' if m.group(4) == 'kernel' else 'bias'}"
    m = re.match(r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", name)
    if m:
        return name
    return None


def eagle_tensors(drafter: EagleDrafter, base: CausalLM, dtype: str = "float16",
                  sglang: bool = False) -> tuple[dict[str, np.ndarray], dict]:
    """The drafter's tensors and config.json in the EAGLE layout."""
    store = np.dtype(resolve_dtype(dtype))
    tensors = {}
    for name, value in heads_tensors(drafter).items():
        eagle = native_to_eagle(name)
        if eagle is None:
            continue  # lm_head (a draft vocabulary) and token_map: no place in this layout
        tensors[eagle] = (value.T if name.endswith("kernel") else value).astype(store)
    tensors["embed_tokens.weight"] = np.asarray(jax.device_get(base.embed_tokens.embedding[...])).astype(store)
    if sglang:
        tensors["fc.bias"] = np.zeros((drafter.config.hidden_size,), store)
    cfg = drafter.decoder.to_hf_config()
    cfg.update({"architectures": ["LlamaForCausalLMEagle" if sglang else "LlamaForCausalLM"],
                "num_hidden_layers": drafter.config.num_layers, "bias": bool(sglang),
                "tie_word_embeddings": False, "torch_dtype": dtype, "exported_by": "medusa-jax",
                "medusa_jax": {"head_type": "eagle", "draft_depth": drafter.config.num_heads,
                               "base_model_name_or_path": drafter.config.base_model_name_or_path}})
    if cfg["model_type"] != "llama":  # EAGLE-1 drafts are Llama layers; keep the fields a Llama config has
        cfg["model_type"] = "llama"
    return tensors, cfg


def is_eagle_folder(folder: Path, raw: dict | None) -> bool:
    if raw is None or "num_hidden_layers" not in raw:
        return False
    if not any(a in EAGLE_ARCHITECTURES for a in raw.get("architectures") or []):
        return False
    try:
        return "fc.weight" in TensorSource.from_files(find_model_weights(folder)).names
    except CheckpointError:
        return False


def load_eagle(folder: Path, raw: dict, base_config: ModelConfig | None, dtype: str = "float32",
               num_heads: int | None = None) -> EagleDrafter:
    """An EAGLE-layout folder -> an EagleDrafter with lm_head "shared" (the base's)."""
    origin = str(folder)
    source = TensorSource.from_files(find_model_weights(folder))
    hf = dict(raw)
    hf["model_type"] = hf.get("model_type") if hf.get("model_type") in ("llama", "mistral", "qwen2") else "llama"
    decoder = ModelConfig.from_hf_config(hf, dtype=dtype)
    if base_config is not None:
        for field in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(decoder, field) != getattr(base_config, field):
                raise CheckpointError(f"{origin}: the drafter's {field} {getattr(decoder, field)} does not match "
                                      f"the base model's {getattr(base_config, field)}")
        decoder = decoder.replace(rope_theta=base_config.rope_theta, rope_scaling=base_config.rope_scaling)
    names = set(source.names)
    if "fc.bias" in names and np.any(source.array("fc.bias")):
        raise CheckpointError(f"{origin}: fc.bias is not zero; medusa-jax drafters have no fc bias (train one "
                              f"with train_heads.py --head-type eagle instead)")
    depth = num_heads or int((raw.get("medusa_jax") or {}).get("draft_depth", 8))
    config = HeadsConfig(decoder.hidden_size, decoder.vocab_size, num_heads=depth,
                         num_layers=decoder.num_layers, lm_head="shared", dtype=dtype,
                         base_model_name_or_path=str((raw.get("medusa_jax") or {}).get("base_model_name_or_path", "")),
                         head_type="eagle", decoder=decoder.replace(num_layers=decoder.num_layers))
    _, state = nnx.split(nnx.eval_shape(lambda: EagleDrafter(config, nnx.Rngs(0))))
    expected = [".".join(path) for path, _ in param_paths(state)]
    tensors, missing = {}, []
    for name in expected:
        eagle = native_to_eagle(name)
        if eagle not in names:
            missing.append(eagle)
            continue
        value = source.array(eagle)
        tensors[name] = value.T if name.endswith("kernel") else value
    unexpected = sorted(names - {native_to_eagle(n) for n in expected} - {"embed_tokens.weight", "fc.bias",
                                                                            "lm_head.weight", "norm.weight"})
    if missing or unexpected:
        raise CheckpointError(f"{origin}: not an EAGLE drafter of this shape: missing {missing}; unexpected "
                              f"{unexpected}")
    return heads_from_tensors(config, tensors, origin)


def write_eagle_folder(out: str | os.PathLike, tensors: dict, config: dict, overwrite: bool = False) -> Path:
    return write_heads_folder(out, EAGLE_WEIGHTS, tensors, config, overwrite=overwrite)


def export_eagle(drafter: EagleDrafter, base: CausalLM, out: str | os.PathLike, *, dtype: str = "float16",
                 sglang: bool = False, overwrite: bool = False) -> Path:
    tensors, config = eagle_tensors(drafter, base, dtype, sglang)
    return write_eagle_folder(out, tensors, config, overwrite)


def eagle_serving_notes(drafter: EagleDrafter, sglang: bool) -> list[str]:
    notes = ["vLLM: speculative_config={'method': 'eagle', 'model': <out>, 'num_speculative_tokens': N} "
             "(EagleLlamaForCausalLM; fc without bias)" if not sglang else
             "SGLang: --speculative-algorithm EAGLE --speculative-draft-model-path <out> (LlamaForCausalLMEagle, "
             "zero fc.bias)",
             "EAGLE's own code (SafeAILab/EAGLE): EaModel.from_pretrained(ea_model_path=<out>) reads config.json's "
             "\"bias\" and the weights (model.safetensors)"]
    if drafter.config.lm_head == "truncated":
        notes.append(f"the draft vocabulary ({drafter.config.head_vocab_size} tokens) is not part of the layout: "
                     f"serving systems draft over the base's full lm_head")
    return notes
