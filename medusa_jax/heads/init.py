"""Fresh draft heads of any registered type, and the one table of head types.

`HEAD_CLASSES` maps `HeadsConfig.head_type` to the class that implements it: Medusa heads (`heads.medusa`),
Hydra heads (`heads.hydra`), the EAGLE drafter (`heads.eagle`) and the EAGLE-3 drafter (`heads.eagle3`). Everything that builds heads from a config (fresh heads here, a heads folder in
`heads.folder`, the trainer's compute-dtype copies) goes through `heads_class`, so a new head type registers
here (and its name in `heads.config.HEAD_TYPES`). Kept apart from the head modules so that none of them needs
another's (Hydra heads build on Medusa heads' pieces).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.config import FEATURE_DRAFTERS, HEAD_TYPES, HeadsConfig
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.heads.hydra import HydraHeads
from medusa_jax.heads.medusa import HeadsBase, MedusaHeads

# head_type -> class; every class takes (config, rngs, token_map=None)
HEAD_CLASSES: dict[str, type[HeadsBase]] = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleDrafter,
                                            "eagle3": Eagle3Drafter}
assert tuple(HEAD_CLASSES) == HEAD_TYPES, "register every head type in HEAD_CLASSES and HEAD_TYPES alike"


def heads_class(config: HeadsConfig) -> type[HeadsBase]:
    """The class of config.head_type (MedusaHeads, HydraHeads, ...)."""
    return HEAD_CLASSES[config.head_type]


def init_heads(config: HeadsConfig, base: CausalLM, seed: int = 0,
               token_map: np.ndarray | None = None) -> HeadsBase:
    """Fresh heads (of config.head_type): identity ResBlocks; own lm_heads copy the base lm_head (its columns at
    token_map if truncated)."""
    if config.hidden_size != base.config.hidden_size or config.vocab_size != base.config.vocab_size:
        raise ValueError(f"heads (hidden {config.hidden_size}, vocab {config.vocab_size}) do not match the base "
                         f"model (hidden {base.config.hidden_size}, vocab {base.config.vocab_size})")
    if config.head_type in FEATURE_DRAFTERS and config.decoder is None:  # the drafter's layers: the base's
        config = dataclasses.replace(config, decoder=base.config)
    heads = heads_class(config)(config, nnx.Rngs(seed), token_map=token_map)
    if config.lm_head != "shared":
        lm_head_dv = base.lm_head_weight()
        if config.lm_head == "truncated":
            lm_head_dv = lm_head_dv[:, heads.token_map[...]]
        for head in [heads] if config.head_type in FEATURE_DRAFTERS else heads.heads:
            head.lm_head.kernel[...] = lm_head_dv.astype(head.lm_head.kernel[...].dtype)
    return heads
