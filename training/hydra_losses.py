"""Hydra heads' training by teacher forcing: the path a head sees is the true continuation.

At position t (hidden state h_t, whose base logits predict x_{t+1}) head i sees the embeddings of the true
tokens x_{t+1}..x_{t+1+i} (the root and the drafts an ideal head 0..i-1 would have made) and is trained on
x_{t+2+i}: the same targets as Medusa head i (`losses.head_targets`). The path tokens of a position are
path[..., j] = x_{t+1+j}, j = 0..K-1 (`hydra_heads.path_tokens`; 0 past the end of a row, where there is no
target). Cached batches ({"hidden", "targets", "path"}) carry them; packed rows derive them in the step.

The per-head loss is the shared `losses.one_head_stats` (cross-entropy), called in one line in
`_one_hydra_head`: a distilled (KL) head loss plugs in there.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.hydra_heads import HydraHeads
from medusa_jax.training import losses


def _one_hydra_head(graphdef, state, hidden_xd, embeds_xjd, lm_w_dv, targets_x, inverse_v):
    head = nnx.merge(graphdef, state)
    h = head(hidden_xd, embeds_xjd)
    logits = jnp.dot(h, lm_w_dv.astype(h.dtype)) if head.lm_head is None else head.lm_head(h)
    return losses.one_head_stats(logits, targets_x, inverse_v)  # the per-head loss (a KL loss plugs in here)


def hydra_head_stats(heads: HydraHeads, base: CausalLM, hidden_xd, path_xk, targets_kx) -> losses.HeadStats:
    """Per-head sums of the K heads. hidden [..., D], path tokens [..., K], targets [K, ...]. Each head's
    logits are rematerialised in the backward pass (one [..., V] block live), as for Medusa heads."""
    inverse = None
    if heads.token_map is not None:
        inverse = losses.inverse_token_map(heads.token_map[...], heads.config.vocab_size)
    lm_w_dv = base.lm_head_weight() if heads.config.lm_head == "shared" else None
    embeds_xkd = jax.lax.stop_gradient(base.embed_tokens(path_xk))  # the base's table: frozen, shared
    per_head = []
    for i, head in enumerate(heads.heads):
        graphdef, state = nnx.split(head)
        fn = jax.checkpoint(partial(_one_hydra_head, graphdef))
        per_head.append(fn(state, hidden_xd, embeds_xkd[..., : i + 1, :], lm_w_dv, targets_kx[i], inverse))
    return losses.stack_stats(per_head)
