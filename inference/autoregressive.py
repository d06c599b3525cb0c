"""Plain (one token per forward) decoding: prefill + a `jax.lax.while_loop`, one jitted call per batch.

Shapes: B rows, P padded prompt length, N = max_new_tokens, S cache slots (S >= P + N).
Rows finish independently at an EOS id; a finished row keeps computing (the batch is one matmul) but never
advances its cache length again, so it writes only to scratch slots.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.inference.sampling import SamplingConfig, sample_tokens


def prefill(model: CausalLM, prompt_bp: jax.Array, prompt_lens_b: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs the right-padded prompts from slot 0. Returns (hidden state of each row's last prompt token
    [B, D], cache with lengths = prompt_lens)."""
    b, p = prompt_bp.shape
    cache = cache.replace(lengths_b=jnp.zeros((b,), jnp.int32))
    positions_bp = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    mask_bps = attention_mask(cache.lengths_b, causal_block(p), cache.cache_size)
    hidden_bpd, cache = model(prompt_bp, positions_bp, mask_bps, cache)
    last_bd = jnp.take_along_axis(hidden_bpd, (prompt_lens_b - 1)[:, None, None], axis=1)[:, 0]
    return last_bd, cache.replace(lengths_b=prompt_lens_b.astype(jnp.int32))


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def plain_step(model: CausalLM, cache: KVCache, token_b: jax.Array, key: jax.Array,
               sampling: SamplingConfig) -> tuple[jax.Array, KVCache]:
    """One plain step: the forward of each row's newest token at slot `length` (its K/V written) and the next
    token sampled; lengths unchanged. The decode loop runs exactly this, and build_tree's timing does too."""
    lengths_b = cache.lengths_b
    mask_b1s = attention_mask(lengths_b, causal_block(1), cache.cache_size)
    hidden_b1d, cache = model(token_b[:, None], lengths_b[:, None], mask_b1s, cache)
    return sample_tokens(model.logits(hidden_b1d[:, 0]), key, sampling), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LoopState:
    cache: KVCache
    last_token_b: jax.Array  # the newest emitted token of each row, not yet in the cache
    out_bn: jax.Array  # emitted tokens, pad after a row's end
    num_out_b: jax.Array
    done_b: jax.Array
    key: jax.Array


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "eos_ids", "pad_id"),
         donate_argnames=("cache",))
def decode(graphdef, params, cache: KVCache, prompt_bp, prompt_lens_b, key, *, max_new_tokens: int,
           sampling: SamplingConfig, eos_ids: tuple[int, ...], pad_id: int):
    """Prefill + plain decoding in one call. Returns (tokens [B, N], number of new tokens [B], cache)."""
    model: CausalLM = nnx.merge(graphdef, params)
    b = prompt_bp.shape[0]
    last_bd, cache = prefill(model, prompt_bp, prompt_lens_b, cache)
    key, sub = jax.random.split(key)
    first_b = sample_tokens(model.logits(last_bd), sub, sampling)
    out_bn = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_b)
    state = _LoopState(cache, first_b, out_bn, jnp.ones((b,), jnp.int32), is_eos(first_b, eos_ids), key)

    def cond(s: _LoopState):
        return jnp.any(~s.done_b & (s.num_out_b < max_new_tokens))

    def body(s: _LoopState):
        active_b = ~s.done_b & (s.num_out_b < max_new_tokens)
        lengths_b = s.cache.lengths_b
        key, sub = jax.random.split(s.key)
        token_b, cache = plain_step(model, s.cache, s.last_token_b, sub, sampling)
        token_b = jnp.where(active_b, token_b, pad_id)
        rows = jnp.arange(b)
        idx_b = jnp.minimum(s.num_out_b, max_new_tokens - 1)
        out_bn = s.out_bn.at[rows, idx_b].set(jnp.where(active_b, token_b, s.out_bn[rows, idx_b]))
        cache = cache.replace(lengths_b=lengths_b + active_b.astype(jnp.int32))
        return _LoopState(cache, jnp.where(active_b, token_b, s.last_token_b), out_bn,
                          s.num_out_b + active_b.astype(jnp.int32),
                          s.done_b | (active_b & is_eos(token_b, eos_ids)), key)

    state = jax.lax.while_loop(cond, body, state)
    return state.out_bn, state.num_out_b, state.cache
