"""The step costs a mixed-draft step chooses its size with (`draft_merge.DraftSizes.costs`, measured here; the rule
it chooses by, on device inside the decode loop: `inference.size_choice`).

A size's cost is the time of the base forward of n + 1 tokens per row (the verify forward, lm_head included)
over that of one token, after `context` cached tokens, at the batch size that decodes: the verify forward is
most of a step, and on a CPU its time grows with n, on a GPU it hardly does. Given the drafter, the drafting every mixed step does whatever its size (the
heads' dynamic tree, the merge) is added to every size, plain included: the time of the mix's proposal over a
one-token forward.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.kv_cache import KVCache, attention_mask
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.trees.policy.step_cost import time_interleaved


def _forward_call(base: CausalLM, batch: int, tokens: int, context: int, cache_size: int) -> Callable[[], object]:
    """A jitted verify-shaped forward: `tokens` tokens per row after `context` cached ones, lm_head included. The
    cache is donated and the returned one fed to the next call, as the decode loop updates it in place (a
    forward on an undonated cache first copies every layer's K and V, a cost no decode step pays)."""
    cache = KVCache.zeros(base.config, batch, cache_size).replace(lengths_b=jnp.full((batch,), context, jnp.int32))
    tokens_bt = jnp.zeros((batch, tokens), jnp.int32)
    positions_bt = context + jnp.broadcast_to(jnp.arange(tokens), (batch, tokens))
    mask_bts = attention_mask(cache.lengths_b, jnp.tril(jnp.ones((tokens, tokens), bool)), cache_size)

    graphdef, params = nnx.split(base)

    @partial(jax.jit, donate_argnames=("cache",))
    def forward(params, tokens_bt, positions_bt, mask_bts, cache):
        model = nnx.merge(graphdef, params)
        hidden_btd, cache = model(tokens_bt, positions_bt, mask_bts, cache)
        return jnp.argmax(model.logits(hidden_btd), axis=-1), cache

    held = [cache]

    def call():
        tokens, held[0] = forward(params, tokens_bt, positions_bt, mask_bts, held[0])
        return jax.block_until_ready(tokens)

    return call


def _propose_call(base: CausalLM, drafter, sizes: DraftSizes, batch: int, context: int,
                  cache_size: int) -> Callable[[], object]:
    """A jitted proposal of a mix (all its drafters and the merge) from a state after `context` zero tokens."""
    graphdef, params = nnx.split(MedusaModel(base, drafter))
    prompt_bt = jnp.zeros((batch, context), jnp.int32)
    draft = drafter.init_draft(base, prompt_bt, jnp.full((batch,), context, jnp.int32), None, cache_size,
                               sizes.depth)
    hidden_bd = jnp.zeros((batch, base.config.hidden_size), base.config.jnp_dtype)

    @jax.jit
    def propose(params, draft, hidden_bd):
        model = nnx.merge(graphdef, params)
        proposal, _ = model.heads.propose(hidden_bd, jnp.zeros((batch,), jnp.int32), model.base, sizes, draft,
                                          jnp.ones((batch,), bool))
        return proposal

    return lambda: jax.block_until_ready(propose(params, draft, hidden_bd))


def measure_size_costs(base: CausalLM, sizes: Sequence[int], *, batch: int = 1, context: int = 256,
                       rounds: int = 7, drafter=None, depth: int = 1) -> tuple[float, ...]:
    """Seconds of a forward of n + 1 tokens per row over one of 1 token, for n in sizes (interleaved rounds, the
    median, made non-decreasing in n; this machine, this batch size; size 0, a plain step, costs 1): the `costs` of a DraftSizes."""
    cache_size = context + max(sizes) + 2 + depth
    drafted = sorted({n for n in sizes if n > 0})
    calls = [_forward_call(base, batch, n + 1, context, cache_size) for n in [0] + drafted]
    if drafter is not None:  # the drafting itself, every step
        calls.append(_propose_call(base, drafter, DraftSizes(tuple(sizes), (1.0,) * len(sizes), depth), batch,
                                   context, cache_size))
    seconds = time_interleaved(calls, rounds)
    drafting = seconds[-1] / seconds[0] if drafter is not None else 0.0
    relative, highest = {}, 1.0
    for n, s in zip(drafted, seconds[1:]):  # a larger step never costs less (timing noise on a loaded machine)
        highest = max(highest, s / seconds[0])
        relative[n] = highest
    return tuple(relative.get(n, 1.0) + drafting for n in sizes)
