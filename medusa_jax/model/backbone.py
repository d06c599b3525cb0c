"""Flax NNX Llama-family decoder (Llama, Mistral, Qwen2) over the static KV cache of `kv_cache.py`. The forward takes
token ids [B, T], explicit positions [B, T] and a boolean mask [B, T, S] over the cache slots
(`kv_cache.attention_mask`; the Medusa tree mask passes through), writes the new K/V at each row's `lengths` offset
and returns the final-norm hidden states; `logits()` maps them to the vocabulary. Without a cache (training's packed
rows) the tokens attend to each other under a [B, T, T] mask. A stacked model (`LayerExecution.scan`) runs the
layers under one scan over a stacked cache (`layer_stack.py`)."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.attention import cache_attention, self_attention
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.kv_cache import KVCache, write_layer
from medusa_jax.model.layer_stack import layer_slices, run_cached_layers, run_layers, stacked
from medusa_jax.model.rope import apply_rope, inverse_frequencies
from medusa_jax.model.sharding import constrain_rows

# the most rows whose tied-embedding logits keep the [V, x] product on a CPU (`CausalLM.logits`): 64 rows measured
# alike either way, 128 and 256 slower with it
FEW_ROWS = 32
# XLA:CPU compile options for the jits of tree steps alone (no prefill inside): XLA's own dot for every dot in place
# of the YNNPACK fusion. YNNPACK pays on a prefill's hundreds of rows (SmolLM2, 96 / 384 / 1,024 rows: 1.2x / 1.6x /
# 1.4x slower without it) but loses on a tree step's few: SmolLM2's mixed step (default+recycle+lookup@16, batch 1,
# context 256; 15 rounds interleaved, two runs each, 2-core EPYC) costs 1.93 / 2.42 / 3.45 plain steps verifying
# 2 / 5 / 16 nodes with it, 1.44-1.47 / 1.65-1.66 / 2.25-2.36 without; a plain step (one row, XLA's own
# matrix-vector product either way) is unchanged (bench/few_row_dots/). Those figures were taken at a load of about 2,
# where YNNPACK's multi-threaded few-row dots lose most; on a quiet machine the costs without it were about those
# session 22's quiet calibration found with it (bench/mixed_drafts/session24_quiet). Other backends ignore the option.
# One row only: from two rows on a plain step's dots are YNNPACK's too, and a tree step without them loses its
# cheapest branch. A mixed step that skips the drafting is a plain step of the tree-step jit: at batch 4 (2-core
# EPYC, SmolLM2, MT-Bench first turns, the engine's chunk) it cost 1.173 plain steps without YNNPACK and 0.995
# with it, and the chunk verifying 2 / 5 nodes 1.599 / 2.173 against 1.464 / 1.965 (bench/mixed_drafts_batch4/ynnpack).
TREE_STEP_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def tree_step_compiler_options(rows: int) -> dict[str, str]:
    """The XLA compile options of a jit that runs tree steps alone over `rows` rows: `TREE_STEP_COMPILER_OPTIONS`
    for one row, XLA's defaults for more (the comment above)."""
    return TREE_STEP_COMPILER_OPTIONS if rows == 1 else {}


@functools.lru_cache(maxsize=None)
def _jitted(fn: Callable, options: tuple[tuple[str, str], ...], static_argnames: tuple[str, ...],
            donate_argnames: tuple[str, ...]) -> Callable:
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames, compiler_options=dict(options))


def tree_step_jit(fn: Callable, rows: int, *, static_argnames: Sequence[str] = (),
                  donate_argnames: Sequence[str] = ()) -> Callable:
    """`jax.jit(fn, ...)` compiled with `tree_step_compiler_options(rows)`: one jit per function and options, kept
    (so its compilations are)."""
    return _jitted(fn, tuple(sorted(tree_step_compiler_options(rows).items())), tuple(static_argnames),
                   tuple(donate_argnames))


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

    def __call__(self, x_btd, positions_bt, mask_bts, k_bkhs, v_bksh, lengths_b, inv_freq):
        """Writes this layer's new K/V into its cache buffers and attends over them; returns (out, K, V).
        Without cache buffers (k_bkhs None) it attends over the call's own K/V (mask [B, T, T]) and returns
        (out, None, None)."""
        cfg = self.config
        b, t, _ = x_btd.shape
        n, k, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        q_btnh = apply_rope(self.q_proj(x_btd).reshape(b, t, n, h), positions_bt, inv_freq)
        k_btkh = apply_rope(self.k_proj(x_btd).reshape(b, t, k, h), positions_bt, inv_freq)
        v_btkh = self.v_proj(x_btd).reshape(b, t, k, h)
        if k_bkhs is None:  # the call's own K/V (its T tokens are the slots)
            out_btkgh = self_attention(q_btnh.reshape(b, t, k, g, h), k_btkh, v_btkh, mask_bts,
                                       cfg.execution.attention)
            return self.o_proj(out_btkgh.reshape(b, t, n * h)), None, None
        k_bkhs, v_bksh = write_layer(k_bkhs, v_bksh, k_btkh, v_btkh, lengths_b)
        s = mask_bts.shape[-1]  # the slots attended: the cache's window (`KVCache.window`) or all of them
        out_btkgh = cache_attention(q_btnh.reshape(b, t, k, g, h), k_bkhs[..., :s], v_bksh[:, :, :s], mask_bts,
                                    cfg.execution.attention)
        return self.o_proj(out_btkgh.reshape(b, t, n * h)), k_bkhs, v_bksh


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(d, f, False, config, rngs)
        self.up_proj = _linear(d, f, False, config, rngs)
        self.down_proj = _linear(f, d, False, config, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals. input_norm=False leaves out the input RMSNorm (the first
    layer of an EAGLE drafter, whose input is already a mix of normed features and embeddings)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, input_norm: bool = True):
        self.input_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps, config.jnp_dtype) if input_norm
                                else None)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.jnp_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions_bt, mask_bts, k_bkhs, v_bksh, lengths_b, inv_freq):
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        attn, k_bkhs, v_bksh = self.self_attn(normed, positions_bt, mask_bts, k_bkhs, v_bksh,
                                              lengths_b, inv_freq)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_bkhs, v_bksh


class CausalLM(nnx.Module):
    """Embeddings, decoder layers, final norm and (tied or own) lm_head of a Llama-family model."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = config.jnp_dtype
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs, embedding_init=nnx.initializers.normal(0.02))
        layers = [DecoderLayer(config, rngs) for _ in range(config.num_layers)]
        # one by one, or one module of [L, ...] parameters that the forward scans over (layer_stack.py)
        self.layers = stacked(layers) if config.execution.scan else nnx.List(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            config.hidden_size, config.vocab_size, False, config, rngs)

    def __call__(self, tokens_bt, positions_bt, mask_bts,
                 cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        """Returns (final-norm hidden states [B, T, D], cache with the new K/V written; lengths unchanged).
        cache=None: the tokens attend only to each other, mask_bts is [B, T, T] (key t of the call's own
        tokens at positions_bt[:, t]), and no cache is built or returned (None)."""
        hidden_btd, cache, _ = self.forward_taps(tokens_bt, positions_bt, mask_bts, cache)
        return hidden_btd, cache

    def forward_taps(self, tokens_bt, positions_bt, mask_bts, cache: KVCache | None = None,
                     taps: tuple[int, ...] = ()) -> tuple[jax.Array, KVCache | None, jax.Array | None]:
        """`__call__`, plus the residual stream ENTERING each layer i of the static tuple `taps` (i = num_layers:
        the last layer's output, before the final norm), concatenated in the order of `taps`: [B, T, len(taps) D]
        (None without taps). An EAGLE-3 drafter reads these from the same forward that verifies its tree."""
        cfg = self.config
        if any(not 0 <= i <= cfg.num_layers for i in taps):
            raise ValueError(f"taps {taps} must lie in [0, {cfg.num_layers}]")
        tapped = {}
        if cache is not None and cache.num_layers != cfg.num_layers:
            raise ValueError(f"the KV cache has {cache.num_layers} layers; the model has {cfg.num_layers}")
        if cfg.sliding_window is not None:  # key position: its slot in the cache, its own position without one
            keys_bs = (positions_bt if cache is None else jnp.arange(cache.cache_size, dtype=jnp.int32)[None, :])
            mask_bts = mask_bts & ((positions_bt[:, :, None] - keys_bs[:, None, :]) < cfg.sliding_window)
        if cache is not None and cache.window is not None:
            mask_bts = mask_bts[..., :cache.window]
        inv_freq = inverse_frequencies(cfg)
        x = constrain_rows(self.embed_tokens(tokens_bt))  # no-op unless traced under a mesh (jax.set_mesh)
        if cache is None and not taps:  # unrolled or scanned, with remat, as cfg.execution says (layer_stack.py)
            return self.norm(run_layers(self.layers, x, positions_bt, mask_bts, inv_freq, cfg.execution)), None, None
        if cache is not None and cache.stacked:  # a stacked model over a stacked cache: one scan (layer_stack.py)
            if not cfg.execution.scan:
                raise ValueError("a stacked KV cache needs stacked layers (LayerExecution(scan=True)); build the "
                                 "cache with KVCache.zeros(config, ...), which follows the model")
            x, k_lbkhs, v_lbksh, inputs_lbtd = run_cached_layers(
                self.layers, x, positions_bt, mask_bts, cache.k_bkhs, cache.v_bksh, cache.lengths_b, inv_freq,
                keep_inputs=bool(taps))
            tapped = {i: (x if i == cfg.num_layers else inputs_lbtd[i]) for i in taps}
            taps_btf = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
            return self.norm(x), cache.replace(k_bkhs=k_lbkhs, v_bksh=v_lbksh), taps_btf
        layers = layer_slices(self.layers, cfg.num_layers) if cfg.execution.scan else self.layers
        k_layers, v_layers = [], []
        for i, layer in enumerate(layers):
            tapped[i] = x
            if cache is None:  # a cache-free forward with taps: layer by layer (no scan, no remat)
                x, _, _ = layer(x, positions_bt, mask_bts, None, None, None, inv_freq)
            else:
                x, k_bkhs, v_bksh = layer(x, positions_bt, mask_bts, cache.k_bkhs[i], cache.v_bksh[i],
                                          cache.lengths_b, inv_freq)
                k_layers.append(k_bkhs)
                v_layers.append(v_bksh)
            x = constrain_rows(x)
        if cache is not None:
            cache = cache.replace(k_bkhs=tuple(k_layers), v_bksh=tuple(v_layers))
        tapped[cfg.num_layers] = x
        taps_btf = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return self.norm(x), cache, taps_btf

    def logits(self, hidden):
        """hidden [..., D] -> logits [..., V] in fp32."""
        if self.lm_head is None:
            # embedding [V, D] as the left operand: XLA CPU streams it as is, where `attend` (hidden @ E.T)
            # copied a transposed 113 MB embedding on every SmolLM2 decode step.
            embedding_vd = self.embed_tokens.embedding[...]
            hidden_xd = hidden.reshape(-1, hidden.shape[-1]).astype(embedding_vd.dtype)
            out_vx = jax.lax.dot_general(embedding_vd, hidden_xd, (((1,), (1,)), ((), ())))
            if 1 < hidden_xd.shape[0] <= FEW_ROWS and jax.default_backend() == "cpu":
                # a few rows (a tree verify, the heads' drafts): the product kept [V, x]. Left alone, XLA folds
                # the transpose below into the dot, whose embedding becomes the right operand, the slower order
                # for XLA:CPU's YNNPACK dot: 2 / 5 / 17 rows cost 2.1x / 2.4x / 3.7x one row, with
                # the barrier 1.5x / 2.1x / 3.2x (SmolLM2's [49152, 576], bench/mixed_drafts/lm_head_rows/). One
                # row (a plain step) is XLA's own matrix-vector product either way.
                out_vx = jax.lax.optimization_barrier(out_vx)
            out = out_vx.T.reshape(*hidden.shape[:-1], embedding_vd.shape[0])
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def lm_head_weight(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]


def with_layer_execution(model: CausalLM, execution: LayerExecution) -> CausalLM:
    """`model` running as `execution` says, its layers stacked or unstacked to match (`layer_stack.py`); the
    other parameters are shared, not copied."""
    config = model.config.replace(execution=execution)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    state = nnx.state(model)
    if execution.scan and not model.config.execution.scan:
        state["layers"] = nnx.state(stacked(list(model.layers)))
    elif model.config.execution.scan and not execution.scan:
        state["layers"] = nnx.state(nnx.List(layer_slices(model.layers, config.num_layers)))
    return nnx.merge(graphdef, state)
