"""Hydra heads' training by teacher forcing: the path a head sees is the true continuation.

At position t (hidden state h_t, whose base logits predict x_{t+1}) head i sees the embeddings of the true
tokens x_{t+1}..x_{t+1+i} (the root and the drafts an ideal head 0..i-1 would have made) and is trained on
x_{t+2+i}: the same targets as Medusa head i (`losses.head_targets`). The path tokens of a position are
path[..., j] = x_{t+1+j}, j = 0..K-1 (`hydra_heads.path_tokens`; 0 past the end of a row, where there is no
target). Cached batches ({"hidden", "targets", "path"}) carry them; packed rows derive them in the step.

The per-head loss is the shared `losses.head_stats_with_teacher`: cross-entropy, plus the distilled (KL) head
loss when teacher hidden states are given. Hydra head i's teacher at t is the same as Medusa head i's: the base
lm_head on the base hidden state at t + 1 + i (trainer.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.hydra_heads import HydraHeads
from medusa_jax.training import losses


def _one_hydra_head(graphdef, state, hidden_xd, embeds_xjd, lm_w_dv, targets_x, inverse_v, teacher_hidden_xd=None,
                    teacher_w_dv=None):
    head = nnx.merge(graphdef, state)
    h = head(hidden_xd, embeds_xjd)
    logits = jnp.dot(h, lm_w_dv.astype(h.dtype)) if head.lm_head is None else head.lm_head(h)
    return losses.head_stats_with_teacher(logits, targets_x, inverse_v, teacher_hidden_xd, teacher_w_dv)


def hydra_head_stats(heads: HydraHeads, base: CausalLM, hidden_xd, path_xk, targets_kx, teacher_hidden_kxd=None
                     ) -> losses.HeadStats:
    """Per-head sums of the K heads. hidden [..., D], path tokens [..., K], targets [K, ...], optional teacher
    hidden states (head i's [..., D] at index i) for the KL. Each head's logits (and its teacher's) are
    rematerialised in the backward pass (one [..., V] block live), as for Medusa heads."""
    inverse = None
    if heads.token_map is not None:
        inverse = losses.inverse_token_map(heads.token_map[...], heads.config.vocab_size)
    lm_w_dv = base.lm_head_weight() if heads.config.lm_head == "shared" else None
    embeds_xkd = jax.lax.stop_gradient(base.embed_tokens(path_xk))  # the base's table: frozen, shared
    teacher_w_dv = None
    if teacher_hidden_kxd is not None:
        teacher_w_dv = losses.teacher_lm_weight(base.lm_head_weight(),
                                                None if heads.token_map is None else heads.token_map[...])
    per_head = []
    for i, head in enumerate(heads.heads):
        graphdef, state = nnx.split(head)
        fn = jax.checkpoint(partial(_one_hydra_head, graphdef))
        teacher = None if teacher_hidden_kxd is None else teacher_hidden_kxd[i]
        per_head.append(fn(state, hidden_xd, embeds_xkd[..., : i + 1, :], lm_w_dv, targets_kx[i], inverse, teacher,
                           teacher_w_dv))
    return losses.stack_stats(per_head)
