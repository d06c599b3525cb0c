"""A starting point for an EAGLE-1 drafter's training: fc starts as [0; I] (the drafter's input is the feature
itself) and the token embedding enters scaled by `embed_scale` = RMS(feature) / RMS(embedding), both estimated from
the base's weights, so Adam moves both halves of fc at one relative rate; the scale is folded into fc on export
(heads.eagle_layout). Why and the SmolLM2 figures: docs/training.md, "EAGLE drafters"."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.folder import heads_from_tensors, heads_tensors
from medusa_jax.model.backbone import CausalLM


def feature_to_embedding_rms(base: CausalLM) -> float:
    """RMS of a final-norm feature (the norm's weights') over the RMS of the token embedding."""
    norm_w = np.asarray(jax.device_get(base.norm.weight[...]), np.float64)
    emb = np.asarray(jax.device_get(base.embed_tokens.embedding[...]), np.float64)
    return float(np.sqrt(np.mean(norm_w ** 2)) / np.sqrt(np.mean(emb ** 2)))


def identity_feature_init(drafter: EagleDrafter, base: CausalLM) -> EagleDrafter:
    """The drafter with fc = [0; I] (bias zero) and embed_scale = feature_to_embedding_rms(base); every other
    weight as it was."""
    if not drafter.fc_options:
        raise ValueError(f"identity_feature_init is for EAGLE-1 drafters (head_type 'eagle'), got "
                         f"{drafter.config.head_type!r}")
    d = drafter.config.hidden_size
    tensors = heads_tensors(drafter)
    kernel = np.zeros((2 * d, d), tensors["fc.kernel"].dtype)
    kernel[d:] = np.eye(d, dtype=kernel.dtype)
    tensors["fc.kernel"] = kernel
    if "fc.bias" in tensors:
        tensors["fc.bias"] = np.zeros_like(tensors["fc.bias"])
    config = dataclasses.replace(drafter.config, embed_scale=feature_to_embedding_rms(base))
    return heads_from_tensors(config, tensors, "identity_feature_init")

