"""Drafter state row by row, for the generation engine's drafted rows (inference/drafted_rows.py).

A drafter that keeps a state through a reply (EAGLE, EAGLE-3, prompt lookup) gets its rows' state built from their
prompts at admission (`prompt_prefill`) and scattered into the batch's state (`put_draft_rows`); heads without a
state (Medusa, Hydra) carry None. A state that outlives a reply (`keeps_draft`: Token Recycling's table) is ONE for
all rows, the engine's; a mix's state is its members' tuple, each shared or per row (`shared_fields`).
docs/serving.md, "Drafting" and "Shared drafter state"."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.lookup import LookupDrafter
from medusa_jax.heads.medusa import HeadsBase, MedusaModel
from medusa_jax.heads.mixed import MixedDrafter
from medusa_jax.inference.autoregressive import prefill_states


ROW_STATE_DRAFTERS = (EagleDrafter, LookupDrafter)  # a state with one row per request, built from its prompt


def check_servable(heads) -> None:
    """Raises ValueError for a drafter whose state is neither shared (`keeps_draft`) nor one row per request
    (none kept, or a kind of ROW_STATE_DRAFTERS); a mix's members are checked one by one."""
    if isinstance(heads, MixedDrafter):
        for member in heads.drafters:
            check_servable(member)
    elif not (getattr(heads, "keeps_draft", False) or type(heads).init_draft is HeadsBase.init_draft
              or isinstance(heads, ROW_STATE_DRAFTERS)):
        raise ValueError(f"{type(heads).__name__}: the generation engine serves Medusa, Hydra, EAGLE, EAGLE-3, "
                         f"Token Recycling and prompt lookup drafters and their mixes; this one's state is neither "
                         f"one row per request nor shared (keeps_draft)")


def shared_fields(heads) -> Any:
    """A prefix of the drafter's state: True over a state shared by all rows (the drafter's `keeps_draft`), False
    over one with a row per request; a mix's is its members' tuple."""
    if isinstance(heads, MixedDrafter):
        return tuple(shared_fields(member) for member in heads.drafters)
    return bool(getattr(heads, "keeps_draft", False))


def shared_start(heads, base, rows: int, cache_size: int, depth: int) -> Any:
    """The shared parts' starting state, the drafter's own (e.g. a warm recycling table), None over the parts kept
    row by row: `init_draft` of empty prompts (length 0: nothing of them is read)."""
    if isinstance(heads, MixedDrafter):
        return tuple(shared_start(member, base, rows, cache_size, depth) for member in heads.drafters)
    if not shared_fields(heads):
        return None
    prompt_b1, lens_b = jnp.zeros((rows, 1), jnp.int32), jnp.zeros((rows,), jnp.int32)
    hidden_b1d = jnp.zeros((rows, 1, base.config.hidden_size), base.config.jnp_dtype)
    return heads.init_draft(base, prompt_b1, lens_b, hidden_b1d, cache_size, depth)


def shared_part(draft: Any, shared: Any) -> Any:
    """The draft with the parts kept row by row replaced by None."""
    return jax.tree.map(lambda is_shared, part: part if is_shared else None, shared, draft)


def prompt_prefill(model: MedusaModel, prompt_nt, prompt_lens_n, cache_size: int, depth: int,
                   dtype=None, shared: Any = None, real_n=None) -> tuple[jax.Array, KVCache, Any]:
    """The base prefill of n right-padded prompts into a fresh cache of their width, and the drafter's state
    from them (None for heads that keep none) with a drafter cache of cache_size slots where it has one; dtype:
    the base cache's (None: the model's). `shared`: the engine's shared drafter state (`shared_part`), which the
    drafter then refreshes from the prompts instead of its own; `real_n` [n] bool: the rows
    that are prompts (the others, fillers, count as empty for the drafter). Returns (last hidden state [n, d],
    base cache, drafter state)."""
    heads, (n, t) = model.heads, prompt_nt.shape
    fresh = KVCache.zeros(model.base.config, n, t, dtype=dtype)
    taps = heads.feature_layers
    last_nd, fresh, hidden_ntx = prefill_states(model.base, prompt_nt, prompt_lens_n, fresh, taps)
    if shared is not None:
        heads.keep_draft(shared)  # this traced copy of the drafter starts from the engine's state
    lens_n = prompt_lens_n if real_n is None else jnp.where(real_n, prompt_lens_n, 0)
    draft = heads.init_draft(model.base, prompt_nt, lens_n, hidden_ntx, cache_size, depth)
    return last_nd, fresh, draft


@partial(jax.jit, static_argnames=("graphdef", "rows", "cache_size", "depth"))
def _idle_draft(graphdef, params, *, rows: int, cache_size: int, depth: int) -> Any:
    """The drafter state of `rows` one-token prompts; only its shapes are used (`empty_draft`), and jit's trace
    cache keeps them: a new engine of the same model and shapes does not trace the base's prefill again."""
    prompt_b1, lens_b = jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows,), jnp.int32)
    return prompt_prefill(nnx.merge(graphdef, params), prompt_b1, lens_b, cache_size, depth)[2]


def empty_draft(model: MedusaModel, rows: int, cache_size: int, depth: int) -> Any:
    """The drafter's state before any request: zeros shaped as `rows` idle rows where it keeps one per row (None
    for heads that keep none), the drafter's own where it is shared (`shared_start`)."""
    graphdef, params = nnx.split(model)
    shapes = _idle_draft.eval_shape(graphdef, params, rows=rows, cache_size=cache_size, depth=depth)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    start = shared_start(model.heads, model.base, rows, cache_size, depth)
    def pick(is_shared, empty, own):  # a copy of the drafter's own: the engine's calls donate their state
        return jax.tree.map(lambda x: jnp.array(x, copy=True), own) if is_shared else empty

    return jax.tree.map(pick, shared_fields(model.heads), zeros, start)


def put_draft_rows(draft: Any, rows_n: jax.Array, fresh: Any, shared: Any = False) -> Any:
    """draft with rows rows_n[i] (index >= b: dropped) set to fresh's row i: a drafter KVCache by
    `KVCache.put_rows` (fresh's slots first, its lengths), every other array along its leading row axis (fresh's
    entries first where it is narrower, as a token buffer of the prompt's width, zeros after); the parts
    `shared` marks (`shared_fields`) are fresh's whole (the shared state refreshed from the prompts)."""
    def put(old, new):
        if isinstance(old, KVCache):
            return old.put_rows(rows_n, new)
        gap = [(0, 0)] + [(0, o - n) for o, n in zip(old.shape[1:], new.shape[1:])]
        new = jnp.pad(new, gap) if any(after for _, after in gap) else new
        return old.at[rows_n].set(new.astype(old.dtype), mode="drop")

    def put_part(is_shared, old, new):
        if is_shared:
            return jax.tree.map(lambda o, f: f.astype(o.dtype), old, new)
        return jax.tree.map(put, old, new, is_leaf=lambda x: isinstance(x, KVCache))

    return jax.tree.map(put_part, shared, draft, fresh)
