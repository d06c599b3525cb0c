"""Batched generation with row refill, keeping the hidden state behind every token (self-distillation).

Chat replies differ wildly in length (a greeting: 10 tokens; a greedy small model: often the whole budget).
A plain batch runs until its longest row ends, so on self-distillation data most rows sit idle for most
steps. Here B decode slots run in jitted chunks of C steps; at each chunk boundary finished slots are given
new prompts (prefilled into their rows of the shared KV cache), so the batch stays full. The building
blocks are the engine's: `autoregressive.prefill`, the backbone forward over the static per-row cache,
`sample_tokens`, `is_eos`.

Generating the data already computes the backbone's final hidden state at every reply position; keeping it
lets Medusa-1 train heads without a second pass over the backbone (on a CPU that pass costs about as much
as the generation). For each emitted token we keep the hidden state that produced it: the last prompt
token's for a reply's first token, the previous reply token's after that. So head i's target for the
hidden state of token j is token j + 1 + i (position t + 2 + i, as in training/losses.py).
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
class Slots:
    """B decode rows over one KV cache. A row is idle when done_b (finished, or never filled)."""
    cache: KVCache
    last_token_b: jax.Array  # newest token of each row, not yet in the cache
    num_out_b: jax.Array  # tokens emitted for the row's current reply
    done_b: jax.Array

    @classmethod
    def empty(cls, config, batch_size: int, cache_size: int) -> "Slots":
        b = batch_size
        return cls(KVCache.zeros(config, b, cache_size), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32),
                   jnp.ones((b,), bool))


@partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_ids"), donate_argnames=("slots",))
def admit(graphdef, params, slots: Slots, rows_n, prompt_np, prompt_lens_n, key, *, sampling: SamplingConfig,
          eos_ids: tuple[int, ...]):
    """Prefills n prompts (right-padded [n, P]) into rows `rows_n` (index >= B: filler, dropped).
    Returns (slots, first token [n], hidden state that produced it [n, D])."""
    model: CausalLM = nnx.merge(graphdef, params)
    n, p = prompt_np.shape
    fresh = KVCache.zeros(model.config, n, p, dtype=slots.cache.k_lbshd.dtype)
    last_nd, fresh = prefill(model, prompt_np, prompt_lens_n, fresh)
    first_n = sample_tokens(model.logits(last_nd), key, sampling)
    cache = slots.cache
    k = cache.k_lbshd.at[:, rows_n, :p].set(fresh.k_lbshd, mode="drop")
    v = cache.v_lbshd.at[:, rows_n, :p].set(fresh.v_lbshd, mode="drop")
    lengths = cache.lengths_b.at[rows_n].set(prompt_lens_n, mode="drop")
    slots = Slots(cache.replace(k_lbshd=k, v_lbshd=v, lengths_b=lengths),
                  slots.last_token_b.at[rows_n].set(first_n, mode="drop"),
                  slots.num_out_b.at[rows_n].set(1, mode="drop"),
                  slots.done_b.at[rows_n].set(is_eos(first_n, eos_ids), mode="drop"))
    return slots, first_n, last_nd


@partial(jax.jit, static_argnames=("graphdef", "steps", "max_new_tokens", "sampling", "eos_ids", "pad_id"),
         donate_argnames=("slots",))
def run_chunk(graphdef, params, slots: Slots, key, *, steps: int, max_new_tokens: int, sampling: SamplingConfig,
              eos_ids: tuple[int, ...], pad_id: int):
    """Up to `steps` decode steps of every live row. Returns (slots, tokens [B, C], hidden [B, C, D], emitted
    [B]): row b's new tokens are tokens[b, :emitted[b]], each with the hidden state that produced it."""
    model: CausalLM = nnx.merge(graphdef, params)
    b = slots.last_token_b.shape[0]
    d = model.config.hidden_size
    single = causal_block(1)
    rows = jnp.arange(b)

    def body(i, carry):
        s, tokens_bc, hidden_bcd, emitted_b, key = carry
        active_b = ~s.done_b & (s.num_out_b < max_new_tokens)
        lengths_b = s.cache.lengths_b
        hidden_b1d, cache = model(s.last_token_b[:, None], lengths_b[:, None],
                                  attention_mask(lengths_b, single, s.cache.cache_size), s.cache)
        key, sub = jax.random.split(key)
        token_b = jnp.where(active_b, sample_tokens(model.logits(hidden_b1d[:, 0]), sub, sampling), pad_id)
        tokens_bc = tokens_bc.at[rows, emitted_b].set(token_b, mode="drop")
        hidden_bcd = hidden_bcd.at[rows, emitted_b].set(hidden_b1d[:, 0].astype(hidden_bcd.dtype), mode="drop")
        step_b = active_b.astype(jnp.int32)
        s = Slots(cache.replace(lengths_b=lengths_b + step_b), jnp.where(active_b, token_b, s.last_token_b),
                  s.num_out_b + step_b, s.done_b | ~active_b | is_eos(token_b, eos_ids))
        # an inactive row writes at index `emitted` == its count, which the next active step overwrites or
        # which lies past what the caller reads
        return s, tokens_bc, hidden_bcd, emitted_b + step_b, key

    def cond(carry):
        i, (s, *_rest) = carry
        return (i < steps) & jnp.any(~s.done_b & (s.num_out_b < max_new_tokens))

    init = (slots, jnp.full((b, steps), pad_id, jnp.int32), jnp.zeros((b, steps, d), jnp.float32),
            jnp.zeros((b,), jnp.int32), key)
    _, (slots, tokens_bc, hidden_bcd, emitted_b, _) = jax.lax.while_loop(
        cond, lambda carry: (carry[0] + 1, body(carry[0], carry[1])), (0, init))
    return slots, tokens_bc, hidden_bcd, emitted_b
