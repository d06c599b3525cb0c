"""The EAGLE-3 drafter in the layout of the EAGLE authors' published EAGLE-3 drafts (read by vLLM, SGLang and
speculators), and back; tensor names in docs/interop.md and docs/modules.md."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle3 import Eagle3Drafter, default_feature_layers
from medusa_jax.heads.eagle_layout import (drafter_decoder, drafter_hf_config, has_drafter_tensor, lm_head_tensors,
                                           read_named)
from medusa_jax.heads.export import write_heads_folder
from medusa_jax.heads.folder import heads_from_tensors, heads_tensors
from medusa_jax.hf.tensor_files import CheckpointError, TensorSource, find_model_weights
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig, resolve_dtype
from medusa_jax.heads.draft_vocab import token_map_from

EAGLE3_WEIGHTS = "model.safetensors"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
_MARK = "midlayer.self_attn.q_proj.weight"


def native_to_eagle3(name: str) -> str | None:
    """A drafter parameter path -> its tensor name in the published layout (None: token_map, not a tensor)."""
    if name == "token_map":
        return None
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name[:-len("kernel")] + "weight" if name.endswith(".kernel") else name


def eagle3_tensors(drafter: Eagle3Drafter, base: CausalLM, dtype: str = "float16") -> tuple[dict, dict]:
    """The drafter's tensors and config.json in the published EAGLE-3 layout."""
    store = np.dtype(resolve_dtype(dtype))
    tensors = {}
    for name, value in heads_tensors(drafter).items():
        if name in ("token_map", "lm_head.kernel"):
            continue
        tensors[native_to_eagle3(name)] = (value.T if name.endswith("kernel") else value).astype(store)
    head, draft_vocab = lm_head_tensors(drafter, store)
    if not head:  # a drafter over the base's lm_head: the layout has a head of its own, so write the base's
        head = {"lm_head.weight": np.asarray(jax.device_get(base.lm_head_weight())).T.astype(store)}
    tensors.update(head)
    return tensors, drafter_hf_config(drafter, dtype, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                                      draft_vocab_size=draft_vocab or drafter.config.vocab_size,
                                      eagle_aux_hidden_state_layer_ids=list(drafter.config.feature_layers))


def is_eagle3_folder(folder: Path, raw: dict | None) -> bool:
    return has_drafter_tensor(folder, raw, EAGLE3_ARCHITECTURES, _MARK)


def load_eagle3(folder: Path, raw: dict, base_config: ModelConfig | None, dtype: str = "float32",
                num_heads: int | None = None) -> Eagle3Drafter:
    """A published EAGLE-3 folder -> an Eagle3Drafter (lm_head "own" over the full vocabulary, or "truncated" over
    the draft vocabulary of d2t/t2d)."""
    origin = str(folder)
    source = TensorSource.from_files(find_model_weights(folder))
    names = set(source.names)
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"{origin}: an EAGLE-3 draft of {raw['num_hidden_layers']} layers; the published "
                              f"layout (and this drafter) has one midlayer")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise CheckpointError(f"{origin}: config.json sets {flag}, a speculators variant this drafter does "
                                  f"not implement (the published EAGLE-3 layer has none)")
    decoder = drafter_decoder(raw, base_config, dtype, origin)
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        if base_config is None:
            raise CheckpointError(f"{origin}: no eagle_aux_hidden_state_layer_ids in config.json: the default "
                                  f"layers depend on the base model, pass its config")
        layers = default_feature_layers(base_config.num_layers)
    layers = tuple(int(i) for i in layers)
    if len(set(layers)) != len(layers) or (base_config is not None and
                                           any(not 0 <= i <= base_config.num_layers for i in layers)):
        raise CheckpointError(f"{origin}: feature layers {layers} must be distinct and lie in the base's "
                              f"[0, {base_config.num_layers if base_config else 'L'}]")
    fc_cols = int(source.array("fc.weight").shape[1]) if "fc.weight" in names else None
    if fc_cols != len(layers) * decoder.hidden_size:
        raise CheckpointError(f"{origin}: fc.weight has {fc_cols} input columns; {len(layers)} fused layers of "
                              f"width {decoder.hidden_size} need {len(layers) * decoder.hidden_size}")
    token_map = None
    if "d2t" in names:
        token_map = token_map_from(source.array("d2t"), source.array("t2d") if "t2d" in names else None,
                                   decoder.vocab_size, origin)
    rows = int(source.array("lm_head.weight").shape[0]) if "lm_head.weight" in names else None
    if rows is not None and rows != int(raw.get("draft_vocab_size", rows)) or (
            token_map is None and rows not in (None, decoder.vocab_size)) or (
            token_map is not None and token_map.shape[0] != rows):
        raise CheckpointError(f"{origin}: lm_head.weight has {rows} rows; draft_vocab_size "
                              f"{raw.get('draft_vocab_size')}, d2t {None if token_map is None else len(token_map)}, "
                              f"vocab_size {decoder.vocab_size}: they must agree")
    ours = raw.get("medusa_jax") or {}
    depth = num_heads or int(ours.get("draft_depth", 8))
    config = HeadsConfig(decoder.hidden_size, decoder.vocab_size, num_heads=depth,
                         num_layers=1, lm_head="own" if token_map is None else "truncated",
                         truncated_vocab_size=None if token_map is None else int(token_map.shape[0]), dtype=dtype,
                         base_model_name_or_path=str(ours.get("base_model_name_or_path", "")), head_type="eagle3",
                         decoder=decoder.replace(num_layers=1), feature_layers=layers)
    tensors = read_named(source, Eagle3Drafter, config, native_to_eagle3, {"d2t", "t2d", "embed_tokens.weight"},
                         origin, "an EAGLE-3 drafter")
    if token_map is not None:
        tensors["token_map"] = token_map
    return heads_from_tensors(config, tensors, origin)


def export_eagle3(drafter: Eagle3Drafter, base: CausalLM, out: str | os.PathLike, *, dtype: str = "float16",
                  overwrite: bool = False) -> Path:
    tensors, config = eagle3_tensors(drafter, base, dtype)
    return write_heads_folder(out, EAGLE3_WEIGHTS, tensors, config, overwrite=overwrite)


def eagle3_serving_notes(drafter: Eagle3Drafter) -> list[str]:
    layers = list(drafter.config.feature_layers)
    return [f"vLLM: speculative_config={{'method': 'eagle3', 'model': <out>, 'num_speculative_tokens': N}} "
            f"(Eagle3LlamaForCausalLM); the fused base layers {layers} are in config.json's "
            f"eagle_aux_hidden_state_layer_ids",
            "SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path <out>; the authors' code "
            "(EaModel.from_pretrained(use_eagle3=True, ea_model_path=<out>)) fuses the base layers 2, L // 2 and "
            f"L - 3 whatever config.json says: serve it there only when those are {layers}",
            "speculators: `speculators convert` reads this layout (midlayer.* -> layers.0.*)"]
