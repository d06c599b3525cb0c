"""Fresh draft heads of every kind: Medusa (`medusa_jax.heads`), Hydra (`medusa_jax.hydra_heads`) or an EAGLE
drafter (`medusa_jax.eagle`).

Kept apart from both so that heads.py needs nothing from hydra_heads.py (Hydra heads build on heads.py's
pieces); everything that creates heads by `HeadsConfig.head_type` goes through `heads_class`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.eagle import EagleDrafter
from medusa_jax.heads import HeadsBase, HeadsConfig, MedusaHeads
from medusa_jax.hydra_heads import HydraHeads

HEADS_CLASSES = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleDrafter}


def heads_class(config: HeadsConfig) -> type[HeadsBase]:
    """The heads class of config.head_type (each takes (config, rngs, token_map=None))."""
    return HEADS_CLASSES[config.head_type]


def init_heads(config: HeadsConfig, base: CausalLM, seed: int = 0,
               token_map: np.ndarray | None = None) -> HeadsBase:
    """Fresh heads (Medusa or Hydra, by config.head_type): identity ResBlocks; own lm_heads copy the base
    lm_head (its columns at token_map if truncated)."""
    if config.hidden_size != base.config.hidden_size or config.vocab_size != base.config.vocab_size:
        raise ValueError(f"heads (hidden {config.hidden_size}, vocab {config.vocab_size}) do not match the base "
                         f"model (hidden {base.config.hidden_size}, vocab {base.config.vocab_size})")
    if config.head_type == "eagle" and config.decoder is None:  # the drafter's layers: the base's architecture
        config = dataclasses.replace(config, decoder=base.config)
    heads = heads_class(config)(config, nnx.Rngs(seed), token_map=token_map)
    if config.lm_head != "shared":
        lm_head_dv = base.lm_head_weight()
        if config.lm_head == "truncated":
            lm_head_dv = lm_head_dv[:, heads.token_map[...]]
        for head in [heads] if config.head_type == "eagle" else heads.heads:
            head.lm_head.kernel[...] = lm_head_dv.astype(head.lm_head.kernel[...].dtype)
    return heads
