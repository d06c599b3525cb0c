"""Drafter state row by row, for the generation engine's drafted rows (inference/drafted_rows.py).

A drafter that keeps a state through a reply (EAGLE, EAGLE-3: `init_draft` is not `HeadsBase`'s) builds it from
the prompt, as `medusa.decode_states` does for a batch: the base prefill keeps every prompt position's hidden
state (or EAGLE-3's tapped features), and `init_draft` turns them into the drafter's cache of the prompt's
pairs. The engine admits prompts a few at a time into free rows of a running batch, so `prompt_prefill` builds
the n new rows' states and `put_draft_rows` scatters them into rows rows_n of the batch's state (a drafter
cache row by row, like the base cache; every other field by its leading row axis). Heads without a state
(Medusa, Hydra) carry None through all of it.

A drafter whose state outlives a reply (`keeps_draft`, Token Recycling's table) or that mixes drafters is not
served by the engine: its state is not one row per request.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.medusa import HeadsBase, MedusaModel
from medusa_jax.inference.autoregressive import prefill_states


def check_servable(heads) -> None:
    """Raises ValueError for drafters whose state is not one row per request (module docstring)."""
    if getattr(heads, "keeps_draft", False) or not (type(heads).init_draft is HeadsBase.init_draft
                                                     or isinstance(heads, EagleDrafter)):
        raise ValueError(f"{type(heads).__name__}: the generation engine serves Medusa, Hydra, EAGLE and EAGLE-3 "
                         f"drafters; this one's state is not one row per request")


def prompt_prefill(model: MedusaModel, prompt_nt, prompt_lens_n, cache_size: int, depth: int,
                   dtype=None) -> tuple[jax.Array, KVCache, Any]:
    """The base prefill of n right-padded prompts into a fresh cache of their width, and the drafter's state
    from them (None for heads that keep none) with a drafter cache of cache_size slots where it has one; dtype:
    the base cache's (None: the model's). Returns (last hidden state [n, d], base cache, drafter state)."""
    heads, (n, t) = model.heads, prompt_nt.shape
    fresh = KVCache.zeros(model.base.config, n, t, dtype=dtype)
    taps = heads.feature_layers
    last_nd, fresh, hidden_ntx = prefill_states(model.base, prompt_nt, prompt_lens_n, fresh, taps)
    draft = heads.init_draft(model.base, prompt_nt, prompt_lens_n, hidden_ntx, cache_size, depth)
    return last_nd, fresh, draft


def empty_draft(model: MedusaModel, rows: int, cache_size: int, depth: int) -> Any:
    """Zeros shaped as `rows` rows of the drafter's state (None for heads that keep none): idle rows."""
    def build():
        prompt_b1, lens_b = jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows,), jnp.int32)
        return prompt_prefill(model, prompt_b1, lens_b, cache_size, depth)[2]

    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(build))


def put_draft_rows(draft: Any, rows_n: jax.Array, fresh: Any) -> Any:
    """draft with rows rows_n[i] (index >= b: dropped) set to fresh's row i: a drafter KVCache by
    `KVCache.put_rows` (fresh's slots first, its lengths), every other array along its leading row axis."""
    def put(old, new):
        if isinstance(old, KVCache):
            return old.put_rows(rows_n, new)
        return old.at[rows_n].set(new.astype(old.dtype), mode="drop")

    return jax.tree.map(put, draft, fresh, is_leaf=lambda x: isinstance(x, KVCache))
