"""Rotary position embeddings (HF "rotate half" convention), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.config import ModelConfig


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


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq_f: np.ndarray) -> jax.Array:
    """Rotates x [B, T, H, D] by the angles of positions [B, T]; computed in fp32, returned in x's dtype."""
    angles_btf = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_f)[None, None, :]
    angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)
    cos = jnp.cos(angles_btd)[:, :, None, :].astype(x_bthd.dtype)
    sin = jnp.sin(angles_btd)[:, :, None, :].astype(x_bthd.dtype)
    half = x_bthd.shape[-1] // 2
    rotated = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
    return x_bthd * cos + rotated * sin
