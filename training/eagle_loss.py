"""EAGLE drafter training: teacher forcing on the base's features, EAGLE-1's objective.

A batch is packed rows [B, T] of whole conversations with the base's final hidden state at every position
(feat [B, T, D]: a feature store's rows, or the backbone's output in the step). At position t the drafter reads
the pair (f_t + noise, x_{t+1}) (uniform noise on the input features only), attends causally within the
conversation, and its output g_t is trained towards f_{t+1}:
    loss = feature_weight * SmoothL1(g_t, f_{t+1})  (mean over D)
         + ce_weight * CE(softmax(lm_head(f_{t+1})), lm_head(g_t))  (the base's distribution of x_{t+2})
averaged over the positions where t + 1 is an assistant (loss) token of the same conversation. The lm_head of
both sides is the drafter's vocabulary (the base's own, or its draft vocabulary's columns, whose teacher is the
base distribution renormalised over them). Accuracy counts the drafter's top-1 against the base's greedy token
(over the draft vocabulary while training; over the full vocabulary in evaluation, which is what greedy
acceptance at depth 1 sees: a greedy token outside a draft vocabulary is a miss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.backbone import CausalLM
from medusa_jax.eagle import EagleDrafter
from medusa_jax.training import losses
from medusa_jax.training.data import segment_mask

FEATURE_KEYS = ("feat", "tokens", "segment_ids", "positions", "loss_mask", "noise_seed")


def _shift(x_bt, fill=0):
    """x at t + 1 (fill past the row's end)."""
    pad = jnp.full_like(x_bt[:, :1], fill)
    return jnp.concatenate([x_bt[:, 1:], pad], axis=1)


def feature_noise(seeds_b, shape_td, scale: float, dtype) -> jax.Array:
    """[B, T, D] uniform noise in [-scale, scale), one stream per row's seed."""
    if scale == 0:
        return jnp.zeros((seeds_b.shape[0],) + tuple(shape_td), dtype)
    draw = jax.vmap(lambda s: jax.random.uniform(jax.random.key(s), shape_td, jnp.float32, -scale, scale))
    return draw(seeds_b).astype(dtype)


def base_greedy(base: CausalLM, hidden_btd: jax.Array, chunk: int = 256) -> jax.Array:
    """[B, T] argmax of the base logits, computed `chunk` positions at a time (a [B, T, V] array of a 49k
    vocabulary would not fit)."""
    b, t, d = hidden_btd.shape
    n = b * t
    pad = -n % chunk
    flat_xd = jnp.pad(hidden_btd.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
    ids = jax.lax.map(lambda h_cd: jnp.argmax(base.logits(h_cd), axis=-1).astype(jnp.int32), flat_xd)
    return ids.reshape(-1)[:n].reshape(b, t)


def eagle_stats(drafter: EagleDrafter, base: CausalLM, batch: dict, *, noise: float, feature_weight: float,
                ce_weight: float, full_vocab_targets: bool = False) -> tuple[jax.Array, losses.HeadStats, dict]:
    """(loss, HeadStats with one "head" (depth 1), {"feature_loss", "ce_loss"}) of one batch."""
    feat_btd = batch["feat"].astype(jnp.float32)
    tokens_bt, seg_bt = batch["tokens"], batch["segment_ids"]
    next_bt = _shift(tokens_bt)
    target_btd = jax.lax.stop_gradient(jnp.concatenate([feat_btd[:, 1:], jnp.zeros_like(feat_btd[:, :1])], 1))
    valid_bt = (seg_bt > 0) & (_shift(seg_bt) == seg_bt) & _shift(batch["loss_mask"].astype(bool), False)
    inputs_btd = feat_btd + feature_noise(batch["noise_seed"], feat_btd.shape[1:], noise, feat_btd.dtype)
    out_btd, _ = drafter(inputs_btd, next_bt, batch["positions"], segment_mask(seg_bt), None, base)
    f = jnp.float32
    count = jnp.sum(valid_bt, dtype=f)
    diff = jnp.abs(out_btd.astype(f) - target_btd)
    smooth_l1_bt = jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)
    feature_sum = jnp.sum(jnp.where(valid_bt, smooth_l1_bt, 0.0))
    # the teacher: the base's distribution over the drafter's vocabulary at f_{t+1}
    token_map = None if drafter.token_map is None else drafter.token_map[...]
    teacher_w_du = losses.teacher_lm_weight(base.lm_head_weight(), token_map)
    teacher_btu = jnp.dot(target_btd.astype(teacher_w_du.dtype), teacher_w_du).astype(f)
    student_btu = drafter.logits(out_btd, base)
    teacher_p_btu = jax.nn.softmax(teacher_btu, axis=-1)
    ce_bt = -jnp.sum(teacher_p_btu * jax.nn.log_softmax(student_btu, axis=-1), axis=-1)
    ce_sum = jnp.sum(jnp.where(valid_bt, ce_bt, 0.0))
    if full_vocab_targets:  # the base's own greedy token (full vocabulary)
        greedy_bt = base_greedy(base, target_btd)
    else:
        greedy_bt = drafter.to_full_vocab(jnp.argmax(teacher_btu, axis=-1).astype(jnp.int32))
    targets_bt = jnp.where(valid_bt, greedy_bt, losses.NO_TARGET)
    inverse = None if token_map is None else losses.inverse_token_map(token_map, base.config.vocab_size)
    _, in_vocab, total, top1, top5 = losses.one_head_stats(student_btu, targets_bt, inverse)
    stats = losses.stack_stats([(ce_sum, count, total, top1, top5)])
    denom = jnp.maximum(count, 1.0)
    loss = (feature_weight * feature_sum + ce_weight * ce_sum) / denom
    return loss, stats, {"feature_loss": feature_sum / denom, "ce_loss": ce_sum / denom}
