"""Plain decoding: prefill + a `jax.lax.while_loop` whose body is `plain_step` (also the step that step-cost timing
jits), one jitted call per batch; the prefills the other decoders share. Shapes: b rows, t padded prompt length,
o = max_new_tokens, s cache slots (s >= t + o). A row finished at an EOS keeps computing (the batch is one matmul)
but never advances its cache length, so it writes only to scratch slots."""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.kv_cache import K_SLOT_AXIS, V_SLOT_AXIS, KVCache, attention_mask, causal_block
from medusa_jax.inference.engine import PROMPT_BUCKET, width_ladder
from medusa_jax.inference.sampling import SamplingConfig, is_eos, sample_tokens


def prefill(model: CausalLM, prompt_bt: jax.Array, prompt_lens_b: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs the right-padded prompts from slot 0. Returns (hidden state of each row's last prompt token
    [b, d], cache with lengths = prompt_lens)."""
    last_bd, cache, _ = prefill_states(model, prompt_bt, prompt_lens_b, cache)
    return last_bd, cache


def prefill_states(model: CausalLM, prompt_bt: jax.Array, prompt_lens_b: jax.Array,
                   cache: KVCache, taps: tuple[int, ...] = ()) -> tuple[jax.Array, KVCache, jax.Array]:
    """`prefill`, also returning the hidden state of every prompt position [b, t, d] (a drafter's prefill); with
    `taps`, the base's residual stream entering those layers instead ([b, t, len(taps) d], `forward_taps`)."""
    b, t = prompt_bt.shape
    cache = cache.replace(lengths_b=jnp.zeros((b,), jnp.int32))
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask_bts = attention_mask(cache.lengths_b, causal_block(t), cache.cache_size)
    hidden_btd, cache, taps_btf = model.forward_taps(prompt_bt, positions_bt, mask_bts, cache, taps)
    last_bd = jnp.take_along_axis(hidden_btd, (prompt_lens_b - 1)[:, None, None], axis=1)[:, 0]
    return last_bd, cache.replace(lengths_b=prompt_lens_b.astype(jnp.int32)), hidden_btd if taps_btf is None else taps_btf


def prefill_widths(width: int, smallest: int = PROMPT_BUCKET) -> tuple[int, ...]:
    """The prompt widths a prefill group may run at: those of `engine.width_ladder(smallest)` below width, then
    width itself."""
    return tuple(itertools.takewhile(lambda w: w < width, width_ladder(smallest))) + (width,)


def run_if(flag: jax.Array, fn: Callable[..., Any], carry: Any, operands: Any = None) -> Any:
    """fn(carry) where the scalar `flag` holds, else carry: a `while_loop` of at most one trip. Not a
    `lax.switch`/`cond`: XLA gives a conditional's result its own buffers, so a branch that writes the cache
    copied every layer's whole K and V twice (in the branch and back into the carry); a while loop updates its
    carry in place (tests/test_decode_hlo.py). Inside `jax.shard_map` the flag may vary by device; the trip
    clears it with an op on the flag itself (`~flag`, false inside the trip), which keeps that type.

    What fn computes from values it does not carry, XLA's loop-invariant code motion hoists out of the loop, so
    it runs whether the flag holds or not. Work that must run only where the flag holds reads its inputs from the
    carry, or from `operands`, which then reach it as fn(carry, operands) through an optimization barrier with the
    trip's flag: a prefill's widths (`narrow_prefill_states`: every width's first-layer projections ran, 10-14% of
    a 40-token prompt's prefill on a 2-core CPU; tests/test_decode_hlo.py). A mixed step's drafting stays hoisted
    (`medusa.mixed_step`: measured faster so on a CPU)."""
    def trip(c):
        if operands is None:
            return ~c[0], fn(c[1])
        flag_, operands_ = jax.lax.optimization_barrier((c[0], operands))
        return ~flag_, fn(c[1], operands_)

    _, carry = jax.lax.while_loop(lambda c: c[0], trip, (flag, carry))
    return carry


def narrow_prefill_states(model: CausalLM, prompt_bt: jax.Array, prompt_lens_b: jax.Array, cache: KVCache,
                          all_hidden: bool = False, taps: tuple[int, ...] = ()
                          ) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """`prefill_states` of the whole batch at the narrowest of `prefill_widths(t)` that holds its longest prompt,
    written into `cache` in place (one `run_if` per width); slots from that width to t keep what they held. Returns
    `prefill`'s pair and, with all_hidden, `prefill_states`' per-position states (zero past the width), else None."""
    b, t = prompt_bt.shape
    widths = prefill_widths(t)
    if len(widths) == 1:
        last_bd, cache, hidden_btd = prefill_states(model, prompt_bt, prompt_lens_b, cache, taps)
        return last_bd, cache, hidden_btd if all_hidden else None
    d, dtype = model.config.hidden_size, model.config.jnp_dtype
    start = (cache, jnp.zeros((b, d), dtype),
             jnp.zeros((b, t, d * max(len(taps), 1)), dtype) if all_hidden else None)

    def at_width(w):
        def run(carry, prompt):  # the prompt as an operand (`run_if`: else every width's first layer runs)
            (cache, _, hidden_btd), (tokens_bt, lens_b) = carry, prompt
            last_bd, cache, h_bwd = prefill_states(model, tokens_bt[:, :w], lens_b, cache, taps)
            if all_hidden:
                hidden_btd = jax.lax.dynamic_update_slice_in_dim(hidden_btd, h_bwd.astype(dtype), 0, axis=1)
            return cache, last_bd.astype(dtype), hidden_btd
        return run

    branch = jnp.searchsorted(jnp.asarray(widths), jnp.max(prompt_lens_b))
    carry = start
    for index, w in enumerate(widths):
        carry = run_if(branch == index, at_width(w), carry, (prompt_bt, prompt_lens_b))
    cache, last_bd, hidden_btd = carry
    return last_bd, cache, hidden_btd


def grouped_prefill(model: CausalLM, prompt_bt: jax.Array, prompt_lens_b: jax.Array, cache: KVCache,
                    groups: int) -> tuple[jax.Array, KVCache]:
    """`grouped_prefill_states` without the per-position hidden states."""
    last_bd, cache, _ = grouped_prefill_states(model, prompt_bt, prompt_lens_b, cache, groups)
    return last_bd, cache


def grouped_prefill_states(model: CausalLM, prompt_bt: jax.Array, prompt_lens_b: jax.Array, cache: KVCache,
                           groups: int, all_hidden: bool = False,
                           taps: tuple[int, ...] = ()) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """`prefill` in `groups` equal groups of rows sorted by length (inside the jitted call), so a short prompt is not
    computed at the batch's padded width: a `fori_loop` prefills each group into a fresh cache at the narrowest of
    `prefill_widths(t)` that holds its longest prompt (a `lax.switch` over those static widths) and scatters it into
    its rows of `cache`. Returns `prefill`'s pair and, with all_hidden, `prefill_states`' per-position states (else
    None). groups == 1, or a batch it does not divide, is one group prefilled in place (`narrow_prefill_states`)."""
    b, t = prompt_bt.shape
    if groups <= 1 or b % groups:
        return narrow_prefill_states(model, prompt_bt, prompt_lens_b, cache, all_hidden, taps)
    n, widths = b // groups, prefill_widths(t)
    lens_b = prompt_lens_b.astype(jnp.int32)
    order_b = jnp.argsort(-lens_b, stable=True).astype(jnp.int32)
    sorted_bt, sorted_lens_b = prompt_bt[order_b], lens_b[order_b]

    def group(g, carry):
        cache, last_bd, hidden_btd = carry
        rows_n = jax.lax.dynamic_slice_in_dim(order_b, g * n, n)
        lens_n = jax.lax.dynamic_slice_in_dim(sorted_lens_b, g * n, n)
        tokens_nt = jax.lax.dynamic_slice_in_dim(sorted_bt, g * n, n)

        def at_width(w):
            def run(tokens_nt, lens_n):
                fresh = KVCache.zeros(model.config, n, w, dtype=cache.dtype)
                h_nd, fresh, h_nwd = prefill_states(model, tokens_nt[:, :w], lens_n, fresh, taps)
                if w < t:  # every branch returns K/V t slots wide (the switch's result has one shape)
                    fresh = fresh.map_layers(lambda k: jnp.pad(k, ((0, 0),) * K_SLOT_AXIS + ((0, t - w),)),
                                             lambda v: jnp.pad(v, ((0, 0),) * V_SLOT_AXIS + ((0, t - w), (0, 0))))
                    h_nwd = jnp.pad(h_nwd, ((0, 0), (0, t - w), (0, 0)))
                return fresh, h_nd, (h_nwd if all_hidden else None)
            return run

        # the narrowest width that holds the group's longest prompt; the cache stays outside the switch (a
        # cache passed through its branches was copied whole per group)
        branch = jnp.searchsorted(jnp.asarray(widths), jnp.max(lens_n))
        fresh, h_nd, h_ntd = jax.lax.switch(branch, [at_width(w) for w in widths], tokens_nt, lens_n)
        if all_hidden:
            hidden_btd = hidden_btd.at[rows_n].set(h_ntd.astype(hidden_btd.dtype))
        return cache.put_rows(rows_n, fresh), last_bd.at[rows_n].set(h_nd.astype(last_bd.dtype)), hidden_btd

    d, dtype = model.config.hidden_size, model.config.jnp_dtype
    last_bd = jnp.zeros((b, d), dtype)
    hidden_btd = jnp.zeros((b, t, d * max(len(taps), 1)), dtype) if all_hidden else None
    cache, last_bd, hidden_btd = jax.lax.fori_loop(0, groups, group, (cache, last_bd, hidden_btd))
    return last_bd, cache.replace(lengths_b=lens_b), hidden_btd


def prefill_groups(batch_size: int, row_multiple: int = 1) -> int:
    """How many length groups `grouped_prefill` cuts a batch into: groups of at least 4 rows, at most 8
    groups; 1 (the whole batch at once) on a mesh that splits rows (row_multiple > 1: its rows are spread
    over devices, and moving them into groups would cost collectives)."""
    if row_multiple > 1 or batch_size < 8:
        return 1
    groups = min(8, batch_size // 4)
    while batch_size % groups:
        groups -= 1
    return groups


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainState:
    """b decode rows over one KV cache, between two plain steps."""

    cache: KVCache  # lengths_b: tokens of each row in the cache
    token_b: jax.Array  # the newest emitted token of each row, not yet in the cache
    out_bo: jax.Array  # tokens emitted into this buffer (pad after them)
    num_out_b: jax.Array  # tokens of each row in out_bo
    budget_b: jax.Array  # a row stops when num_out_b reaches it (<= o)
    done_b: jax.Array  # finished (an EOS emitted) or an empty slot
    key: jax.Array
    hidden_bod: jax.Array | None = None  # the hidden state behind each token of out_bo (self-distillation)

    @property
    def active_b(self) -> jax.Array:
        return ~self.done_b & (self.num_out_b < self.budget_b)


def plain_step(model: CausalLM, state: PlainState, *, sampling: SamplingConfig,
               eos_ids: tuple[int, ...]) -> PlainState:
    """One plain step: the forward of each row's newest token at slot `length` (its K/V written), the next
    token sampled; an active row appends it to out_bo (and its hidden state to hidden_bod) and advances its
    cache length by one, an inactive row changes nothing but scratch slots."""
    active_b = state.active_b
    key, sub = jax.random.split(state.key)
    cache, lengths_b = state.cache, state.cache.lengths_b
    mask_b1s = attention_mask(lengths_b, causal_block(1), cache.cache_size)
    hidden_b1d, cache = model(state.token_b[:, None], lengths_b[:, None], mask_b1s, cache)
    token_b = sample_tokens(model.logits(hidden_b1d[:, 0]), sub, sampling)
    rows_b = jnp.arange(token_b.shape[0])
    slot_b = jnp.where(active_b, state.num_out_b, state.out_bo.shape[1])  # past the end: dropped
    hidden_bod = state.hidden_bod
    if hidden_bod is not None:
        hidden_bod = hidden_bod.at[rows_b, slot_b].set(hidden_b1d[:, 0].astype(hidden_bod.dtype), mode="drop")
    step_b = active_b.astype(jnp.int32)
    return PlainState(cache.replace(lengths_b=lengths_b + step_b), jnp.where(active_b, token_b, state.token_b),
                      state.out_bo.at[rows_b, slot_b].set(token_b, mode="drop"), state.num_out_b + step_b,
                      state.budget_b, state.done_b | (active_b & is_eos(token_b, eos_ids)), key, hidden_bod)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "eos_ids", "pad_id",
                                   "prefill_groups"), donate_argnames=("cache",))
def decode(graphdef, params, cache: KVCache, prompt_bt, prompt_lens_b, key, *, max_new_tokens: int,
           sampling: SamplingConfig, eos_ids: tuple[int, ...], pad_id: int, prefill_groups: int = 1):
    """Prefill (`grouped_prefill` in prefill_groups length groups) + plain decoding in one call. Returns
    (tokens [b, o], number of new tokens [b], cache)."""
    model: CausalLM = nnx.merge(graphdef, params)
    b = prompt_bt.shape[0]
    last_bd, cache = grouped_prefill(model, prompt_bt, prompt_lens_b, cache, prefill_groups)
    key, sub = jax.random.split(key)
    first_b = sample_tokens(model.logits(last_bd), sub, sampling)
    out_bo = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_b)
    state = PlainState(cache, first_b, out_bo, jnp.ones((b,), jnp.int32), jnp.full((b,), max_new_tokens, jnp.int32),
                       is_eos(first_b, eos_ids), key)
    state = jax.lax.while_loop(lambda s: jnp.any(s.active_b),
                               partial(plain_step, model, sampling=sampling, eos_ids=eos_ids), state)
    return state.out_bo, state.num_out_b, state.cache
