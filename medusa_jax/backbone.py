"""Flax NNX Llama-family decoder (Llama, Mistral, Qwen2) over the static KV cache of `kv_cache.py`.

The forward takes token ids [B, T], explicit positions [B, T] and an explicit boolean attention mask
[B, T, S] over all S cache slots (build it with `kv_cache.attention_mask`): the Medusa tree mask passes
through unchanged. It writes the new K/V at each row's `lengths` offset and returns the final-norm hidden
states; `logits()` maps hidden states to the vocabulary (tied or untied lm_head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.config import ModelConfig
from medusa_jax.attention import attention_windows, cached_attention, row_groups, window_index
from medusa_jax.kv_cache import KVCache, write_layer_rows
from medusa_jax.sharding import constrain_rows
from medusa_jax.rope import apply_rope, inverse_frequencies


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _linear(d_in: int, d_out: int, bias: bool, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Linear:
    dtype = config.jnp_dtype
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, h = config.hidden_size, config.head_dim
        self.config = config
        self.q_proj = _linear(d, config.num_heads * h, config.attention_bias, config, rngs)
        self.k_proj = _linear(d, config.num_kv_heads * h, config.attention_bias, config, rngs)
        self.v_proj = _linear(d, config.num_kv_heads * h, config.attention_bias, config, rngs)
        self.o_proj = _linear(config.num_heads * h, d, False, config, rngs)

    def __call__(self, x_btd, positions_bt, mask_bts, k_lbskh, v_lbskh, layer: int, lengths_b, inv_freq, window,
                 groups):
        """Writes this layer's new K/V into the stacked cache buffers and attends over layer `layer` of them,
        rows of row group i reading only cache window window[i] (see medusa_jax.attention)."""
        cfg = self.config
        b, t, _ = x_btd.shape
        n, k, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        q_btnh = apply_rope(self.q_proj(x_btd).reshape(b, t, n, h), positions_bt, inv_freq)
        k_btkh = apply_rope(self.k_proj(x_btd).reshape(b, t, k, h), positions_bt, inv_freq)
        v_btkh = self.v_proj(x_btd).reshape(b, t, k, h)
        k_lbskh = write_layer_rows(k_lbskh, layer, k_btkh, lengths_b)
        v_lbskh = write_layer_rows(v_lbskh, layer, v_btkh, lengths_b)
        out_btkgh = cached_attention(q_btnh.reshape(b, t, k, g, h), k_lbskh, v_lbskh, layer, mask_bts, window,
                                     groups)
        return self.o_proj(out_btkgh.reshape(b, t, n * h)), k_lbskh, v_lbskh


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(d, f, False, config, rngs)
        self.up_proj = _linear(d, f, False, config, rngs)
        self.down_proj = _linear(f, d, False, config, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.jnp_dtype)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.jnp_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions_bt, mask_bts, k_lbskh, v_lbskh, layer: int, lengths_b, inv_freq, window, groups):
        attn, k_lbskh, v_lbskh = self.self_attn(
            self.input_layernorm(x), positions_bt, mask_bts, k_lbskh, v_lbskh, layer, lengths_b, inv_freq, window,
            groups)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_lbskh, v_lbskh


class CausalLM(nnx.Module):
    """Embeddings, decoder layers, final norm and (tied or own) lm_head of a Llama-family model."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = config.jnp_dtype
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs, embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            config.hidden_size, config.vocab_size, False, config, rngs)

    def __call__(self, tokens_bt, positions_bt, mask_bts, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Returns (final-norm hidden states [B, T, D], cache with the new K/V written; lengths unchanged)."""
        cfg = self.config
        if cfg.sliding_window is not None:
            slot_s = jnp.arange(cache.cache_size, dtype=jnp.int32)
            mask_bts = mask_bts & ((positions_bt[:, :, None] - slot_s[None, None, :]) < cfg.sliding_window)
        inv_freq = inverse_frequencies(cfg)
        x = constrain_rows(self.embed_tokens(tokens_bt))  # no-op unless traced under a mesh (jax.set_mesh)
        groups = row_groups(tokens_bt.shape[0])  # contiguous row groups, each reading its own cache prefix
        group_windows = window_index(mask_bts, attention_windows(cache.cache_size), groups)
        k_all, v_all = cache.k_lbskh, cache.v_lbskh
        for i, layer in enumerate(self.layers):
            x, k_all, v_all = layer(x, positions_bt, mask_bts, k_all, v_all, i, cache.lengths_b, inv_freq,
                                   group_windows, groups)
            x = constrain_rows(x)
        return self.norm(x), cache.replace(k_lbskh=k_all, v_lbskh=v_all)

    def logits(self, hidden):
        """hidden [..., D] -> logits [..., V] in fp32."""
        if self.lm_head is None:
            # embedding [V, D] as the left operand: XLA CPU streams it as is, where `attend` (hidden @ E.T)
            # copied a transposed 113 MB embedding on every SmolLM2 decode step.
            embedding_vd = self.embed_tokens.embedding[...]
            hidden_xd = hidden.reshape(-1, hidden.shape[-1]).astype(embedding_vd.dtype)
            out_vx = jax.lax.dot_general(embedding_vd, hidden_xd, (((1,), (1,)), ((), ())))
            out = out_vx.T.reshape(*hidden.shape[:-1], embedding_vd.shape[0])
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def lm_head_weight(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]
