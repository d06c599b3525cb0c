"""Rotary position embeddings (HF "rotate half" convention), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, scaled as config.rope_scaling says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates x [b, t, heads, h] (q with its n query heads or k with its k KV heads) by the angles of
    positions [b, t]; inv_freq is [h / 2]. Computed in fp32, returned in x's dtype."""
    # half_angles [b, t, h / 2] (one angle per rotated pair; no legend letter for half a head width)
    half_angles = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)[None, None, :]
    angles_bth = jnp.concatenate([half_angles, half_angles], axis=-1)
    cos = jnp.cos(angles_bth)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles_bth)[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
