"""Medusa training losses and accuracies: per-head CE (decay-weighted) and distilled KL, Medusa-2's LM term,
Hydra's teacher forcing; statistics are sums and counts; docs/modules.md."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NO_TARGET = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadStats:
    """Per-head sums, each [M]."""
    loss_sum: jax.Array  # summed cross-entropy over in-vocabulary targets
    count: jax.Array  # targets inside the head's vocabulary (the loss denominator)
    total: jax.Array  # all targets (the accuracy denominator)
    top1: jax.Array  # targets ranked first
    top5: jax.Array  # targets ranked in the first five
    kl_sum: jax.Array  # summed KL(teacher || head) (0 where the teacher is not computed)
    kl_count: jax.Array  # positions with a teacher (the KL denominator; 0 = not computed)

    def mean_losses(self) -> jax.Array:
        return self.loss_sum / jnp.maximum(self.count, 1)

    def mean_kl(self) -> jax.Array:
        return self.kl_sum / jnp.maximum(self.kl_count, 1)

    def summary(self, prefix: str = "") -> dict[str, list[float]]:
        s = jax.tree.map(np.asarray, self)
        total = np.maximum(s.total, 1)
        out = {f"{prefix}head_loss": (s.loss_sum / np.maximum(s.count, 1)).tolist(),
               f"{prefix}top1": (s.top1 / total).tolist(), f"{prefix}top5": (s.top5 / total).tolist(),
               f"{prefix}targets": s.total.astype(int).tolist()}
        if s.kl_count.sum() > 0:
            out[f"{prefix}head_kl"] = (s.kl_sum / np.maximum(s.kl_count, 1)).tolist()
        return out


def shifted(x_btx, k: int, fill=0) -> jax.Array:
    """x at t + k along axis 1 (`fill` past the row's end)."""
    return jnp.concatenate([x_btx[:, k:], jnp.full_like(x_btx[:, :k], fill)], axis=1)


def shifted_targets(tokens_bt, loss_mask_bt, segment_ids_bt, offset: int) -> jax.Array:
    """[B, T] targets: tokens[t + offset] where that token is a loss token of the same segment, else -1."""
    b, t = tokens_bt.shape
    if offset >= t:
        return jnp.full((b, t), NO_TARGET, jnp.int32)
    tgt = tokens_bt[:, offset:].astype(jnp.int32)
    valid = loss_mask_bt[:, offset:] & (segment_ids_bt[:, offset:] == segment_ids_bt[:, :-offset]) \
        & (segment_ids_bt[:, offset:] > 0)
    tgt = jnp.where(valid, tgt, NO_TARGET)
    return jnp.concatenate([tgt, jnp.full((b, offset), NO_TARGET, jnp.int32)], axis=1)


def head_targets(tokens_bt, loss_mask_bt, segment_ids_bt, num_heads: int) -> jax.Array:
    """[M, B, T]: head i's target at each position (token t + 2 + i), -1 where there is none."""
    return jnp.stack([shifted_targets(tokens_bt, loss_mask_bt, segment_ids_bt, 2 + i) for i in range(num_heads)])


def inverse_token_map(token_map_u, vocab_size: int) -> jax.Array:
    """[V]: position of each full-vocabulary id in token_map, -1 if absent."""
    inv = jnp.full((vocab_size,), NO_TARGET, jnp.int32)
    return inv.at[token_map_u].set(jnp.arange(token_map_u.shape[0], dtype=jnp.int32))


def one_head_stats(logits_xv, targets_x, inverse_map_v=None):
    """Sums for one head. logits [..., V_head] (any float dtype), targets [...] full-vocab ids (-1 = none).
    Returns (loss_sum, count, total, top1, top5) scalars."""
    logits_xv = logits_xv.astype(jnp.float32)
    has_target = targets_x >= 0
    head_ids = targets_x if inverse_map_v is None else jnp.where(has_target, inverse_map_v[jnp.maximum(targets_x, 0)],
                                                                 NO_TARGET)
    in_vocab = head_ids >= 0
    safe = jnp.maximum(head_ids, 0)[..., None]
    target_logit = jnp.take_along_axis(logits_xv, safe, axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits_xv, axis=-1) - target_logit
    rank = jnp.sum(logits_xv > target_logit[..., None], axis=-1)
    top1 = (jnp.argmax(logits_xv, axis=-1) == head_ids) & in_vocab
    top5 = (rank < 5) & in_vocab
    f = jnp.float32
    return (jnp.sum(jnp.where(in_vocab, nll, 0.0)), jnp.sum(in_vocab, dtype=f), jnp.sum(has_target, dtype=f),
            jnp.sum(top1, dtype=f), jnp.sum(top5, dtype=f))


def stack_stats(per_head: list[tuple]) -> HeadStats:
    """Per-head tuples of one_head_stats' five sums, optionally followed by distill_loss' (kl_sum, kl_count)."""
    zero = jnp.zeros((), jnp.float32)
    per_head = [tuple(h) + (zero, zero) if len(h) == 5 else tuple(h) for h in per_head]
    return HeadStats(*(jnp.stack(col) for col in zip(*per_head)))


def head_stats(logits_mxv, targets_mx, inverse_map_v=None) -> HeadStats:
    """All heads at once (fine for small vocabularies; the trainer computes heads one by one)."""
    return stack_stats([one_head_stats(logits_mxv[i], targets_mx[i], inverse_map_v)
                        for i in range(logits_mxv.shape[0])])


def medusa_loss(stats: HeadStats, decay: float, ce_weight: float = 1.0, kl_weight: float = 0.0) -> jax.Array:
    """sum_i decay**i * (ce_weight * mean cross-entropy of head i + kl_weight * mean KL of head i)."""
    per_head = ce_weight * stats.mean_losses() if ce_weight else 0.0
    if kl_weight:
        per_head = per_head + kl_weight * stats.mean_kl()
    weights_m = jnp.asarray([decay ** i for i in range(stats.loss_sum.shape[0])], jnp.float32)
    return jnp.sum(weights_m * per_head)


def distill_loss(student_logits_xv, teacher_logits_xv, mask_x) -> tuple[jax.Array, jax.Array]:
    """KL(teacher || student) over the last axis summed where mask_x (no gradient into the teacher), computed in fp32;
    returns (sum, count)."""
    teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits_xv).astype(jnp.float32), axis=-1)
    student_logp = jax.nn.log_softmax(student_logits_xv.astype(jnp.float32), axis=-1)
    kl_x = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1)
    return jnp.sum(jnp.where(mask_x, kl_x, 0.0)), jnp.sum(mask_x, dtype=jnp.float32)


def teacher_lm_weight(lm_w_dv, token_map_u=None) -> jax.Array:
    """The base lm_head [D, V] a head's teacher applies (gradient stopped; only the token_map columns [D, U]
    for a truncated head, so its teacher is renormalised over the map)."""
    w_dv = jax.lax.stop_gradient(lm_w_dv)
    return w_dv if token_map_u is None else jnp.take(w_dv, token_map_u, axis=1)


def head_stats_with_teacher(logits_xv, targets_x, inverse_map_v=None, teacher_hidden_xd=None, teacher_w_dv=None):
    """one_head_stats' sums, followed by distill_loss' (kl_sum, kl_count) against the teacher logits
    teacher_hidden @ teacher_w when a teacher is given (Medusa and Hydra heads alike)."""
    stats = one_head_stats(logits_xv, targets_x, inverse_map_v)
    if teacher_hidden_xd is None:
        return stats
    teacher_logits = jnp.dot(teacher_hidden_xd.astype(teacher_w_dv.dtype), teacher_w_dv)
    return stats + distill_loss(logits_xv, teacher_logits, targets_x >= 0)


def kl_to_reference(logits_btv, reference_logits_btv, valid_bt) -> tuple[jax.Array, jax.Array]:
    """Medusa-2: KL(reference || model) of the backbone's next-token distributions. Returns (sum, count)."""
    return distill_loss(logits_btv, reference_logits_btv, valid_bt)
