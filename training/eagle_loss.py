"""EAGLE drafter training: teacher forcing on the base's features, EAGLE-1's objective (feature SmoothL1 + CE),
depths > 1 trained as they draft; EAGLE-3's training-time test (CE only, on fused features); docs/modules.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.training import losses
from medusa_jax.training.losses import shifted
from medusa_jax.training.data import segment_mask


def feature_noise(seeds_b, shape_td, scale: float, dtype) -> jax.Array:
    """[B, T, D] uniform noise in [-scale, scale), one stream per row's seed."""
    if scale == 0:
        return jnp.zeros((seeds_b.shape[0],) + tuple(shape_td), dtype)
    draw = jax.vmap(lambda s: jax.random.uniform(jax.random.key(s), shape_td, jnp.float32, -scale, scale))
    return draw(seeds_b).astype(dtype)


def content_seeds(tokens_bt: jax.Array) -> jax.Array:
    """[B] int32 noise seeds drawn from each row's tokens (a hash: position-weighted sum, wrapping), for batches
    that carry no `noise_seed`: the same row always draws the same noise, so a resumed run draws what an
    uninterrupted one would; different rows draw different noise."""
    t = tokens_bt.shape[1]
    weights_t = (2 * jnp.arange(t, dtype=jnp.uint32) + 1) * jnp.uint32(2654435761)
    mixed_b = jnp.sum(tokens_bt.astype(jnp.uint32) * weights_t[None, :], axis=1, dtype=jnp.uint32)
    return (mixed_b >> 1).astype(jnp.int32)


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
                ce_weight: float, depth: int = 1, decay: float = 1.0,
                full_vocab_targets: bool = False) -> tuple[jax.Array, losses.HeadStats, dict]:
    """(loss, HeadStats with one row per drafted depth, {"feature_loss", "ce_loss"}) of one batch. depth > 1
    also trains depths 2..depth on the drafter's own outputs along the true tokens (`EagleDrafter.unrolled`, the
    chain a tree step drafts; EAGLE-3's training-time test), depth k weighted decay**(k - 1)."""
    f = jnp.float32
    feat_btd = batch["feat"].astype(f)
    tokens_bt, seg_bt = batch["tokens"], batch["segment_ids"]
    inputs_btd = feat_btd + feature_noise(noise_seeds(batch), feat_btd.shape[1:], noise, feat_btd.dtype)
    if depth == 1:
        out_btd, _ = drafter(inputs_btd, shifted(tokens_bt, 1), batch["positions"], segment_mask(seg_bt), None, base)
        outs = [out_btd]
    else:
        outs = list(drafter.unrolled(inputs_btd, tokens_bt, base, depth, seg_bt))
    teacher = draft_teacher(drafter, base)
    per_depth, loss, feature_total, ce_total = [], 0.0, 0.0, 0.0
    for k, out_btd in enumerate(outs, start=1):
        target_btd, valid_bt, row = depth_stats(drafter, base, out_btd, batch, k, teacher, full_vocab_targets)
        diff = jnp.abs(out_btd.astype(f) - target_btd)
        smooth_l1_bt = jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)
        feature_sum = jnp.sum(jnp.where(valid_bt, smooth_l1_bt, 0.0))
        per_depth.append(row)
        ce_sum, denom = row[0], jnp.maximum(row[1], 1.0)
        weight = decay ** (k - 1)
        loss = loss + weight * (feature_weight * feature_sum + ce_weight * ce_sum) / denom
        feature_total, ce_total = feature_total + feature_sum / denom, ce_total + ce_sum / denom
    extras = {"feature_loss": feature_total / depth, "ce_loss": ce_total / depth}
    return loss, losses.stack_stats(per_depth), extras


def noise_seeds(batch: dict) -> jax.Array:
    """[B] the batch's noise seeds; packed rows (features from the backbone in the step) carry none: one from each
    row's tokens (`content_seeds`)."""
    return batch["noise_seed"] if "noise_seed" in batch else content_seeds(batch["tokens"])


def draft_teacher(drafter, base: CausalLM) -> tuple[jax.Array, jax.Array | None]:
    """(the base's lm_head over the drafter's vocabulary [D, U], the full-to-draft vocabulary map or None)."""
    token_map = None if drafter.token_map is None else drafter.token_map[...]
    return (losses.teacher_lm_weight(base.lm_head_weight(), token_map),
            None if token_map is None else losses.inverse_token_map(token_map, base.config.vocab_size))


def depth_stats(drafter, base: CausalLM, out_btd: jax.Array, batch: dict, k: int, teacher, full_vocab_targets: bool):
    """Depth k's output `out_btd` (drafting x_{t+k+1} at t) against the base: (its target feature f_{t+k}, the
    positions where t + k is a loss token of the same conversation, the HeadStats row (CE sum against the base's
    distribution over the drafter's vocabulary, count, total, top-1, top-5))."""
    f, (teacher_w_du, inverse) = jnp.float32, teacher
    seg_bt = batch["segment_ids"]
    target_btd = jax.lax.stop_gradient(shifted(batch["feat"].astype(f), k))
    valid_bt = (seg_bt > 0) & (shifted(seg_bt, k) == seg_bt) & shifted(batch["loss_mask"].astype(bool), k, False)
    teacher_btu = jnp.dot(target_btd.astype(teacher_w_du.dtype), teacher_w_du).astype(f)
    student_btu = drafter.logits(out_btd, base)
    ce_bt = -jnp.sum(jax.nn.softmax(teacher_btu, axis=-1) * jax.nn.log_softmax(student_btu, axis=-1), axis=-1)
    ce_sum = jnp.sum(jnp.where(valid_bt, ce_bt, 0.0))
    if full_vocab_targets:  # the base's own greedy token (full vocabulary)
        greedy_bt = base_greedy(base, target_btd)
    else:
        greedy_bt = drafter.to_full_vocab(jnp.argmax(teacher_btu, axis=-1).astype(jnp.int32))
    _, _, total, top1, top5 = losses.one_head_stats(student_btu, jnp.where(valid_bt, greedy_bt, losses.NO_TARGET),
                                                    inverse)
    return target_btd, valid_bt, (ce_sum, jnp.sum(valid_bt, dtype=f), total, top1, top5)


# ---- EAGLE-3 (Li et al., 2025): the training-time test, cross-entropy only, over the draft vocabulary --------------
def with_features(base: CausalLM, batch: dict, feature_layers: tuple[int, ...]) -> dict:
    """The batch with "feat" [B, T, D] (final hidden states) and "taps" [B, T, len * D] from one frozen forward
    of its packed rows."""
    hidden_btd, _, taps_btf = base.forward_taps(batch["tokens"], batch["positions"], segment_mask(batch["segment_ids"]),
                                                None, feature_layers)
    return {**batch, "feat": jax.lax.stop_gradient(hidden_btd), "taps": jax.lax.stop_gradient(taps_btf)}


def eagle3_stats(drafter: Eagle3Drafter, base: CausalLM, batch: dict, *, noise: float, depth: int,
                 decay: float = 0.8, full_vocab_targets: bool = False) -> tuple[jax.Array, losses.HeadStats, dict]:
    """(loss, HeadStats with one row per depth, {"ce_loss"}) of one batch with "feat" and "taps"."""
    taps_btf = batch["taps"].astype(jnp.float32)
    h_btd = drafter.project(taps_btf + feature_noise(noise_seeds(batch), taps_btf.shape[1:], noise, taps_btf.dtype))
    outs = drafter.unrolled(h_btd, batch["tokens"], base, depth, batch["segment_ids"])
    teacher = draft_teacher(drafter, base)
    per_depth, loss, ce_total = [], 0.0, 0.0
    for k in range(1, depth + 1):
        _, _, row = depth_stats(drafter, base, outs[k - 1], batch, k, teacher, full_vocab_targets)
        per_depth.append(row)
        ce_sum, denom = row[0], jnp.maximum(row[1], 1.0)
        loss = loss + decay ** (k - 1) * ce_sum / denom
        ce_total = ce_total + ce_sum / denom
    return loss, losses.stack_stats(per_depth), {"ce_loss": ce_total / depth}
