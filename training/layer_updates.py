"""The optimiser's update of stacked layers ([L, ...] parameters) one layer at a time in a fori_loop, so XLA's
temporaries are one layer's; the global-norm clip is applied per slice; docs/modules.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def clip_by(t: jax.Array, grad_norm: jax.Array, max_norm: float | None) -> jax.Array:
    """`t` clipped by the global norm of all gradients, as optax.clip_by_global_norm (max_norm None: as is)."""
    if max_norm is None:
        return t
    return jax.lax.select(jnp.squeeze(grad_norm < max_norm), t, (t / grad_norm.astype(t.dtype)) * max_norm)


def clipped(inner: optax.GradientTransformation, max_norm: float | None) -> optax.GradientTransformationExtraArgs:
    """`inner` after the global-norm clip of its gradients (the norm is update's `grad_norm=`)."""
    def update(updates, state, params=None, *, grad_norm=None, **_):
        return inner.update(jax.tree.map(lambda t: clip_by(t, grad_norm, max_norm), updates), state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def layer_by_layer(inner: optax.GradientTransformation,
                   max_norm: float | None) -> optax.GradientTransformationExtraArgs:
    """`clipped(inner, max_norm)` over stacked parameters, one layer at a time. `inner` must update each leaf
    from that leaf alone (Adam, AdamW: elementwise); its state's leaves are either stacked like the parameters
    (moments) or scalars (step counts), which every layer's update advances alike and which are kept once."""
    def update(updates, state, params=None, *, grad_norm=None, **_):
        leaves = jax.tree.leaves(updates)
        if not leaves:
            return updates, state

        def layer(tree, i):
            return jax.tree.map(lambda x: x if x.ndim == 0 else jax.lax.dynamic_index_in_dim(x, i, keepdims=False),
                                tree)

        def put(tree, layer_tree, i):
            return jax.tree.map(lambda x, y: y.astype(x.dtype) if x.ndim == 0 else
                                jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), i, 0), tree, layer_tree)

        def body(i, carry):
            grads, new_state = carry
            grads_i = jax.tree.map(lambda t: clip_by(t, grad_norm, max_norm), layer(grads, i))
            # layer i of the carry is still the state before the update (the update is in place); scalars (step
            # counts) come from the state before the update: each layer advances them once
            state_i = jax.tree.map(lambda x, old: old if x.ndim == 0 else x, new_state, state)
            updates_i, state_i = inner.update(grads_i, layer(state_i, i),
                                              None if params is None else layer(params, i))
            return put(grads, updates_i, i), put(new_state, state_i, i)

        return jax.lax.fori_loop(0, leaves[0].shape[0], body, (updates, state))

    return optax.GradientTransformationExtraArgs(inner.init, update)
