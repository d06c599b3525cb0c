"""Token selection from logits: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature == 0 means greedy (argmax); otherwise sample from softmax(logits / T) within top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_p_filter(logits_bv: jax.Array, top_p: float) -> jax.Array:
    """Sets to -inf every logit outside the smallest set whose probability mass reaches top_p."""
    if top_p >= 1.0:
        return logits_bv
    sorted_bv = jnp.sort(logits_bv, axis=-1)[..., ::-1]
    cum_bv = jnp.cumsum(jax.nn.softmax(sorted_bv, axis=-1), axis=-1)
    # keep a sorted entry if the mass before it is < top_p (so the top token is always kept)
    keep_bv = (cum_bv - jax.nn.softmax(sorted_bv, axis=-1)) < top_p
    threshold_b = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_bv >= threshold_b, logits_bv, -jnp.inf)


def sample_tokens(logits_bv: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32)."""
    if config.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    scaled = top_p_filter(logits_bv.astype(jnp.float32) / config.temperature, config.top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
