"""Plain decoding that also returns the hidden state behind every generated token (self-distillation).

Generating self-distillation data already computes the backbone's final hidden state at every position of
each reply; keeping them lets Medusa-1 train the heads without a second forward pass over the data (on a
CPU that pass costs about as much as the generation). The loop is `inference/autoregressive.decode` with
one more carry buffer; it reuses that module's prefill, EOS test and sampler.

hidden_bnd[b, j] is the final-norm hidden state at the position whose next token is tokens_bn[b, j]:
the last prompt token for j = 0, generated token j - 1 after that. So head i's target for hidden_bnd[b, j]
is tokens_bn[b, j + 1 + i] (position t + 2 + i), as in training/losses.py.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.inference.autoregressive import is_eos, prefill
from medusa_jax.inference.sampling import SamplingConfig, sample_tokens
from medusa_jax.kv_cache import KVCache, attention_mask, causal_block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    cache: KVCache
    last_token_b: jax.Array
    out_bn: jax.Array
    hidden_bnd: jax.Array
    num_out_b: jax.Array
    done_b: jax.Array
    key: jax.Array


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "eos_ids", "pad_id"))
def decode_with_hidden(graphdef, params, cache: KVCache, prompt_bp, prompt_lens_b, key, *, max_new_tokens: int,
                       sampling: SamplingConfig, eos_ids: tuple[int, ...], pad_id: int):
    """Returns (tokens [B, N], number of new tokens [B], hidden [B, N, D] in the model dtype)."""
    model: CausalLM = nnx.merge(graphdef, params)
    b = prompt_bp.shape[0]
    last_bd, cache = prefill(model, prompt_bp, prompt_lens_b, cache)
    key, sub = jax.random.split(key)
    first_b = sample_tokens(model.logits(last_bd), sub, sampling)
    out_bn = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_b)
    hidden_bnd = jnp.zeros((b, max_new_tokens, last_bd.shape[-1]), last_bd.dtype).at[:, 0].set(last_bd)
    state = _State(cache, first_b, out_bn, hidden_bnd, jnp.ones((b,), jnp.int32),
                   is_eos(first_b, eos_ids), key)
    single = causal_block(1)
    rows = jnp.arange(b)

    def cond(s: _State):
        return jnp.any(~s.done_b & (s.num_out_b < max_new_tokens))

    def body(s: _State):
        active_b = ~s.done_b & (s.num_out_b < max_new_tokens)
        lengths_b = s.cache.lengths_b
        mask_b1s = attention_mask(lengths_b, single, s.cache.cache_size)
        hidden_b1d, cache = model(s.last_token_b[:, None], lengths_b[:, None], mask_b1s, s.cache)
        key, sub = jax.random.split(s.key)
        token_b = jnp.where(active_b, sample_tokens(model.logits(hidden_b1d[:, 0]), sub, sampling), pad_id)
        idx_b = jnp.minimum(s.num_out_b, max_new_tokens - 1)
        out_bn = s.out_bn.at[rows, idx_b].set(jnp.where(active_b, token_b, s.out_bn[rows, idx_b]))
        hidden_bnd = s.hidden_bnd.at[rows, idx_b].set(
            jnp.where(active_b[:, None], hidden_b1d[:, 0], s.hidden_bnd[rows, idx_b]))
        cache = cache.replace(lengths_b=lengths_b + active_b.astype(jnp.int32))
        return _State(cache, jnp.where(active_b, token_b, s.last_token_b), out_bn, hidden_bnd,
                      s.num_out_b + active_b.astype(jnp.int32), s.done_b | (active_b & is_eos(token_b, eos_ids)),
                      key)

    state = jax.lax.while_loop(cond, body, state)
    return state.out_bn, state.num_out_b, state.hidden_bnd
