"""Medusa training losses and accuracies.

Head i (0-based) at position t is trained on the token at t + 2 + i (the base lm_head covers t + 1), when that
token is an assistant (loss) token of the same packed conversation. Per-head cross-entropy means are
combined as sum_i decay**i * CE_i (Medusa: decay 0.8). A truncated-vocabulary head cannot emit tokens outside
its token_map: such targets are left out of its loss but count as misses in its accuracy, so the reported
accuracy is what the decoder will see.

Medusa-2 adds either the base model's own next-token loss or, when training on self-distilled data, the KL
divergence from the frozen original model's next-token distribution (which keeps the base model's outputs,
and so the decoder's results, close to the original).

Statistics are sums and counts (not means), so they add up over batches and devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NO_TARGET = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadStats:
    """Per-head sums, each [K]."""
    loss_sum: jax.Array  # summed cross-entropy over in-vocabulary targets
    count: jax.Array  # targets inside the head's vocabulary (the loss denominator)
    total: jax.Array  # all targets (the accuracy denominator)
    top1: jax.Array  # targets ranked first
    top5: jax.Array  # targets ranked in the first five

    def __add__(self, other: "HeadStats") -> "HeadStats":
        return jax.tree.map(jnp.add, self, other)

    def mean_losses(self) -> jax.Array:
        return self.loss_sum / jnp.maximum(self.count, 1)

    def summary(self, prefix: str = "") -> dict[str, list[float]]:
        s = jax.tree.map(np.asarray, self)
        total = np.maximum(s.total, 1)
        return {f"{prefix}head_loss": (s.loss_sum / np.maximum(s.count, 1)).tolist(),
                f"{prefix}top1": (s.top1 / total).tolist(), f"{prefix}top5": (s.top5 / total).tolist(),
                f"{prefix}targets": s.total.astype(int).tolist()}


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
    """[K, B, T]: head i's target at each position (token t + 2 + i), -1 where there is none."""
    return jnp.stack([shifted_targets(tokens_bt, loss_mask_bt, segment_ids_bt, 2 + i) for i in range(num_heads)])


def inverse_token_map(token_map_n, vocab_size: int) -> jax.Array:
    """[V]: position of each full-vocabulary id in token_map, -1 if absent."""
    inv = jnp.full((vocab_size,), NO_TARGET, jnp.int32)
    return inv.at[token_map_n].set(jnp.arange(token_map_n.shape[0], dtype=jnp.int32))


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
    return HeadStats(*(jnp.stack(col) for col in zip(*per_head)))


def head_stats(logits_kxv, targets_kx, inverse_map_v=None) -> HeadStats:
    """All heads at once (fine for small vocabularies; the trainer computes heads one by one)."""
    return stack_stats([one_head_stats(logits_kxv[i], targets_kx[i], inverse_map_v)
                        for i in range(logits_kxv.shape[0])])


def head_weights(num_heads: int, decay: float) -> jax.Array:
    return jnp.asarray([decay ** i for i in range(num_heads)], jnp.float32)


def medusa_loss(stats: HeadStats, decay: float) -> jax.Array:
    """sum_i decay**i * mean cross-entropy of head i."""
    return jnp.sum(head_weights(stats.loss_sum.shape[0], decay) * stats.mean_losses())


def lm_loss(logits_btv, targets_bt) -> tuple[jax.Array, jax.Array]:
    """Base model next-token cross-entropy (targets from shifted_targets(..., 1)). Returns (sum, count)."""
    loss_sum, count, *_ = one_head_stats(logits_btv, targets_bt)
    return loss_sum, count


def kl_to_reference(logits_btv, reference_logits_btv, valid_bt) -> tuple[jax.Array, jax.Array]:
    """KL(reference || model) of the next-token distributions, summed over valid positions. Returns
    (sum, count)."""
    ref_logp = jax.nn.log_softmax(jax.lax.stop_gradient(reference_logits_btv).astype(jnp.float32), axis=-1)
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    kl_bt = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    return jnp.sum(jnp.where(valid_bt, kl_bt, 0.0)), jnp.sum(valid_bt, dtype=jnp.float32)
