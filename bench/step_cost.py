"""Where a Medusa step's time goes: each piece of the decoder's step jitted and timed on its own (profiling; tree
choice times the whole step, `trees.policy.step_cost`); the pieces are listed in docs/modules.md."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.kv_cache import KVCache, attention_mask
from medusa_jax.heads.hydra import HydraHeads
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.inference.acceptance import GREEDY, accept_tree
from medusa_jax.inference.medusa import compact_accepted
from medusa_jax.inference.sampling import greedy_tokens
from medusa_jax.trees.policy.step_cost import make_cache, time_call

PIECES = ("verify_forward", "base_logits", "acceptance", "heads_top_k", "cache_compaction")


def _tree_inputs(tree: TreeBuffers, batch: int, context: int, vocab: int):
    t = tree.num_tokens
    tokens_bt = jnp.asarray(np.random.RandomState(0).randint(0, vocab, (batch, t)), jnp.int32)
    positions_bt = jnp.asarray(context + tree.depth_t[None, :].repeat(batch, 0), jnp.int32)
    return tokens_bt, positions_bt


@partial(jax.jit, static_argnames=("graphdef", "tree"), donate_argnames=("cache",))
def _verify_forward(graphdef, params, cache, tokens_bt, positions_bt, *, tree: TreeBuffers):
    base: CausalLM = nnx.merge(graphdef, params)
    mask_bts = attention_mask(cache.lengths_b, jnp.asarray(tree.ancestor_mask_tt), cache.cache_size)
    return base(tokens_bt, positions_bt, mask_bts, cache)


@partial(jax.jit, static_argnames=("graphdef",))
def _base_logits(graphdef, params, hidden_btd):
    base: CausalLM = nnx.merge(graphdef, params)
    logits_btv = base.logits(hidden_btd)
    return logits_btv, greedy_tokens(logits_btv)


@partial(jax.jit, static_argnames=("tree",))
def _acceptance(tokens_bt, logits_btv, key, *, tree: TreeBuffers):
    return accept_tree(tree, tokens_bt, logits_btv, key, GREEDY)


@partial(jax.jit, static_argnames=("graphdef", "tree"))
def _heads_top_k(graphdef, params, hidden_bd, *, tree: TreeBuffers):
    base, heads = nnx.merge(graphdef, params)
    if isinstance(heads, HydraHeads):
        return heads.tree_tokens(hidden_bd, jnp.zeros(hidden_bd.shape[:1], jnp.int32), base, tree)
    return heads.top_k(hidden_bd, base, tree.top_k, tree.depth)


@partial(jax.jit, donate_argnames=("cache",))
def _compaction(cache, nodes_be):
    return compact_accepted(cache, nodes_be)


class _Donating:
    """Calls fn(cache, ...) repeatedly, feeding each call's returned cache into the next and resetting
    lengths so every call sees the same committed context."""

    def __init__(self, cache: KVCache, context: int):
        self.cache, self.context = cache, context

    def run(self, fn, *args):
        lengths = jnp.full_like(self.cache.lengths_b, self.context)
        out, cache = fn(self.cache.replace(lengths_b=lengths), *args)
        self.cache = cache
        return out


def piece_seconds(base: CausalLM, heads: MedusaHeads, tree: TreeBuffers, batch: int, context: int,
                  cache_size: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of each piece of a step (docs/modules.md), each jitted on its own."""
    base_def, base_params = nnx.split(base)
    both_def, both_params = nnx.split((base, heads))
    runner = _Donating(make_cache(base, batch, cache_size, context), context)
    tokens_bt, positions_bt = _tree_inputs(tree, batch, context, base.config.vocab_size)
    verify = lambda c, *a: _verify_forward(base_def, base_params, c, *a, tree=tree)  # noqa: E731
    out = {"verify_forward": time_call(lambda: runner.run(verify, tokens_bt, positions_bt), repeats)}
    hidden_btd = runner.run(verify, tokens_bt, positions_bt)
    out["base_logits"] = time_call(lambda: _base_logits(base_def, base_params, hidden_btd), repeats)
    logits_btv, _ = _base_logits(base_def, base_params, hidden_btd)
    key = jax.random.key(0)
    out["acceptance"] = time_call(lambda: _acceptance(tokens_bt, logits_btv, key, tree=tree), repeats)
    out["heads_top_k"] = time_call(lambda: _heads_top_k(both_def, both_params, hidden_btd[:, 0], tree=tree),
                                   repeats)
    nodes_be = jnp.broadcast_to(jnp.asarray(tree.retrieve_ce[0]), (batch, tree.depth + 1))
    compact = lambda c, n: (None, _compaction(c, n))  # noqa: E731
    out["cache_compaction"] = time_call(lambda: runner.run(compact, nodes_be), repeats)
    return out
