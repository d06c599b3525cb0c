"""Fresh draft heads of any registered kind (`heads.kinds`): identity ResBlocks, own lm_heads copied from the base."""

from __future__ import annotations

import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.kinds import heads_class
from medusa_jax.heads.medusa import HeadsBase


def init_heads(config: HeadsConfig, base: CausalLM, seed: int = 0,
               token_map: np.ndarray | None = None) -> HeadsBase:
    """Fresh heads (of config.head_type): identity ResBlocks; own lm_heads copy the base lm_head (its columns at
    token_map if truncated)."""
    if config.hidden_size != base.config.hidden_size or config.vocab_size != base.config.vocab_size:
        raise ValueError(f"heads (hidden {config.hidden_size}, vocab {config.vocab_size}) do not match the base "
                         f"model (hidden {base.config.hidden_size}, vocab {base.config.vocab_size})")
    cls = heads_class(config.head_type)
    config = cls.complete_config(config, base)
    heads = cls(config, nnx.Rngs(seed), token_map=token_map)
    if config.lm_head != "shared":
        lm_head_dv = base.lm_head_weight()
        if config.lm_head == "truncated":
            lm_head_dv = lm_head_dv[:, heads.token_map[...]]
        for head in heads.lm_head_modules():
            head.lm_head.kernel[...] = lm_head_dv.astype(head.lm_head.kernel[...].dtype)
    return heads
