"""Token selection from logits: greedy, or sampling at a temperature within top-k and top-p; and the stop rule
(`is_eos`) every decoder applies to the tokens it selects.

`target_logits` is THE definition of the sampled distribution: plain sampling (`sample_tokens`) and Medusa's
exact acceptance (`exact_acceptance`) both draw from softmax(target_logits(...)), so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from medusa_jax.inference.vocab_cut import TOP_P_CANDIDATES, cut_logits, largest
from medusa_jax.model.vocab_reduce import first_argmax


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature == 0 means greedy (argmax); otherwise sample from softmax(logits / T) restricted to the
    top_k most likely tokens (0: no cut), then to the smallest set of those holding top_p of their mass."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no top-k cut), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_logits(logits_xv: jax.Array, config: SamplingConfig) -> jax.Array:
    """[..., V] logits -> fp32 [..., V] logits of the sampling distribution (temperature > 0): logits / T,
    -inf outside the top_k (every token tied with the k-th is kept), then top_p applied to what is left
    (the order of transformers' logits processors)."""
    if config.greedy:
        raise ValueError("target_logits needs temperature > 0 (greedy decoding takes the argmax)")
    scaled_xv = logits_xv.astype(jnp.float32) / config.temperature
    v = scaled_xv.shape[-1]
    k = config.top_k if 0 < config.top_k < v else v
    if config.top_p < 1.0:  # a sort of the vocabulary only when its largest logits leave the cut open
        return cut_logits(scaled_xv, jnp.int32(k), jnp.float32(config.top_p), TOP_P_CANDIDATES)
    if k < v:
        kth_x1 = largest(scaled_xv, k)[..., -1:]
        return jnp.where(scaled_xv >= kth_x1, scaled_xv, -jnp.inf)
    return scaled_xv


def greedy_tokens(logits_xv: jax.Array) -> jax.Array:
    """[..., V] -> [...] int32: the first index of the maximum over the last axis (= jnp.argmax for finite
    logits; `model.vocab_reduce.first_argmax`, which XLA:CPU runs faster than argmax's (value, index) reduce: its
    cost on SmolLM2's vocabulary, docs/results.md, "Fixes this benchmark led to")."""
    return first_argmax(logits_xv)


def sample_tokens(logits_bv: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32)."""
    if config.greedy:
        return greedy_tokens(logits_bv)
    return jax.random.categorical(key, target_logits(logits_bv, config), axis=-1).astype(jnp.int32)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """Which tokens end their row: any of eos_ids (none when eos_ids is empty)."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))
