"""The train step's vocabulary-wide losses with logits in token chunks under one scan: one chunk's [tokens, V]
logits exist at a time, forward and backward (exact; docs/modules.md)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.training import losses


def _chunked(x_bt, chunk: int, count: int, pad_value):
    """[B, T, ...] -> [count, B, chunk, ...], padded at the end of T with `pad_value`."""
    pad = count * chunk - x_bt.shape[1]
    if pad:
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x_bt.ndim - 2)
        x_bt = jnp.pad(x_bt, widths, constant_values=pad_value)
    x_bt = x_bt.reshape(x_bt.shape[0], count, chunk, *x_bt.shape[2:])
    return jnp.moveaxis(x_bt, 1, 0)


def chunked_sums(sums_fn: Callable[..., tuple], arrays: tuple, pads: tuple, chunk: int) -> tuple:
    """sums_fn(*arrays) over chunks of `chunk` tokens along axis 1, added up; `pads` pad the last chunk so that
    sums_fn adds nothing. chunk 0, a single chunk or no token axis: one call, as is."""
    t = arrays[0].shape[1] if arrays[0].ndim >= 3 else 0
    if chunk <= 0 or t <= chunk:
        return sums_fn(*arrays)
    count = -(-t // chunk)
    xs = tuple(None if a is None else _chunked(a, chunk, count, p) for a, p in zip(arrays, pads))

    @jax.checkpoint
    def body(total, chunk_xs):
        return jax.tree.map(jnp.add, total, tuple(sums_fn(*chunk_xs))), None

    first = jax.eval_shape(lambda: tuple(sums_fn(*(None if x is None else x[0] for x in xs))))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
    total, _ = jax.lax.scan(body, zeros, xs)
    return total


def head_sums(graphdef, state, inputs: tuple, lm_w_dv, targets_x, inverse_v, teacher_xd, teacher_w_dv,
              chunk: int) -> tuple:
    """One head's sums (losses.head_stats_with_teacher) on `inputs` (its call's arguments, [B, T, ...]) in token
    chunks."""
    def sums(*arrays):
        *inputs, targets_x, teacher_xd = arrays
        head = nnx.merge(graphdef, state)
        h_xd = head(*inputs)
        logits_xv = jnp.dot(h_xd, lm_w_dv.astype(h_xd.dtype)) if head.lm_head is None else head.lm_head(h_xd)
        return losses.head_stats_with_teacher(logits_xv, targets_x, inverse_v, teacher_xd, teacher_w_dv)

    return chunked_sums(sums, (*inputs, targets_x, teacher_xd), (0,) * len(inputs) + (losses.NO_TARGET, 0), chunk)


def _shared_weights(heads, base, with_teacher: bool):
    """(inverse token map or None, the base lm_head for shared heads or None, the teacher's weight or None)."""
    token_map_u = None if heads.token_map is None else heads.token_map[...]
    inverse_v = None if token_map_u is None else losses.inverse_token_map(token_map_u, heads.config.vocab_size)
    lm_w_dv = base.lm_head_weight() if heads.config.lm_head == "shared" else None
    teacher_w_dv = losses.teacher_lm_weight(base.lm_head_weight(), token_map_u) if with_teacher else None
    return inverse_v, lm_w_dv, teacher_w_dv


def checkpointed_head_stats(heads, base, head_inputs: Callable[[int], tuple], targets_mx, teacher_hidden_mxd=None,
                            chunk: int = 0) -> losses.HeadStats:
    """Per-head sums of Medusa or Hydra heads, one head after another: head i runs on `head_inputs(i)`, is scored
    on targets_mx[i] (and the teacher's KL), its logits rematerialised in chunks of `chunk` tokens."""
    inverse_v, lm_w_dv, teacher_w_dv = _shared_weights(heads, base, teacher_hidden_mxd is not None)
    per_head = []
    for i, head in enumerate(heads.heads):
        graphdef, state = nnx.split(head)
        fn = jax.checkpoint(partial(head_sums, graphdef, chunk=chunk))
        teacher_xd = None if teacher_hidden_mxd is None else teacher_hidden_mxd[i]
        per_head.append(fn(state, head_inputs(i), lm_w_dv, targets_mx[i], inverse_v, teacher_xd, teacher_w_dv))
    return losses.stack_stats(per_head)


def hydra_head_stats(heads, base, hidden_xd, path_xe, targets_mx, teacher_hidden_mxd=None,
                     chunk: int = 0) -> losses.HeadStats:
    """Per-head sums of M Hydra heads. hidden [..., D], path tokens [..., M], targets [M, ...], optional teacher
    hidden states for the KL. Head i reads the embeddings of path[..., :i + 1] in the base's input table
    (frozen and shared: no gradient flows into it)."""
    embeds_xed = jax.lax.stop_gradient(base.embed_tokens(path_xe))
    return checkpointed_head_stats(heads, base, lambda i: (hidden_xd, embeds_xed[..., : i + 1, :]), targets_mx,
                                   teacher_hidden_mxd, chunk)


def lm_sums(base, hidden_btd, targets_bt, chunk: int) -> tuple:
    """Medusa-2's base next-token cross-entropy (targets from losses.shifted_targets(..., 1)) in token chunks:
    (sum, count)."""
    def sums(h_btd, t_bt):
        return losses.one_head_stats(base.logits(h_btd), t_bt)[:2]

    return chunked_sums(sums, (hidden_btd, targets_bt), (0, losses.NO_TARGET), chunk)


def reference_kl_sums(base, reference, hidden_btd, reference_hidden_btd, targets_bt, chunk: int) -> tuple:
    """Medusa-2's KL to the original backbone (losses.kl_to_reference) in token chunks: (sum, count)."""
    def sums(h_btd, ref_btd, t_bt):
        return losses.kl_to_reference(base.logits(h_btd), reference.logits(ref_btd), t_bt >= 0)

    return chunked_sums(sums, (hidden_btd, reference_hidden_btd, targets_bt), (0, 0, losses.NO_TARGET), chunk)
