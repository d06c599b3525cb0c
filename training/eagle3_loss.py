"""EAGLE-3 drafter training: the training-time test (Li et al., 2025), cross-entropy only, over the draft vocabulary;
docs/modules.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.model.backbone import CausalLM
from medusa_jax.training import losses
from medusa_jax.training.data import segment_mask
from medusa_jax.training.eagle_loss import _shift_by, base_greedy, content_seeds, feature_noise


def with_features(base: CausalLM, batch: dict, feature_layers: tuple[int, ...]) -> dict:
    """The batch with "feat" [B, T, D] (final hidden states) and "taps" [B, T, len * D] from one frozen forward
    of its packed rows."""
    hidden_btd, _, taps_btf = base.forward_taps(batch["tokens"], batch["positions"], segment_mask(batch["segment_ids"]),
                                                None, feature_layers)
    return {**batch, "feat": jax.lax.stop_gradient(hidden_btd), "taps": jax.lax.stop_gradient(taps_btf)}


def eagle3_stats(drafter: Eagle3Drafter, base: CausalLM, batch: dict, *, noise: float, depth: int,
                 decay: float = 0.8, full_vocab_targets: bool = False) -> tuple[jax.Array, losses.HeadStats, dict]:
    """(loss, HeadStats with one row per depth, {"ce_loss"}) of one batch with "feat" and "taps"."""
    f = jnp.float32
    feat_btd, taps_btf = batch["feat"].astype(f), batch["taps"].astype(f)
    tokens_bt, seg_bt, loss_bt = batch["tokens"], batch["segment_ids"], batch["loss_mask"].astype(bool)
    seeds = batch.get("noise_seed")
    if seeds is None:
        seeds = content_seeds(tokens_bt)
    h_btd = drafter.project(taps_btf + feature_noise(seeds, taps_btf.shape[1:], noise, taps_btf.dtype))
    outs = drafter.unrolled(h_btd, tokens_bt, base, depth, seg_bt)
    token_map = None if drafter.token_map is None else drafter.token_map[...]
    teacher_w_du = losses.teacher_lm_weight(base.lm_head_weight(), token_map)
    inverse = None if token_map is None else losses.inverse_token_map(token_map, base.config.vocab_size)
    per_depth, loss, ce_total = [], 0.0, 0.0
    for k in range(1, depth + 1):
        target_btd = jax.lax.stop_gradient(_shift_by(feat_btd, k))
        valid_bt = (seg_bt > 0) & (_shift_by(seg_bt, k) == seg_bt) & _shift_by(loss_bt, k, False)
        count = jnp.sum(valid_bt, dtype=f)
        teacher_btu = jnp.dot(target_btd.astype(teacher_w_du.dtype), teacher_w_du).astype(f)
        student_btu = drafter.logits(outs[k - 1], base)
        ce_bt = -jnp.sum(jax.nn.softmax(teacher_btu, axis=-1) * jax.nn.log_softmax(student_btu, axis=-1), axis=-1)
        ce_sum = jnp.sum(jnp.where(valid_bt, ce_bt, 0.0))
        if full_vocab_targets:
            greedy_bt = base_greedy(base, target_btd)
        else:
            greedy_bt = drafter.to_full_vocab(jnp.argmax(teacher_btu, axis=-1).astype(jnp.int32))
        _, _, total, top1, top5 = losses.one_head_stats(student_btu, jnp.where(valid_bt, greedy_bt, losses.NO_TARGET),
                                                        inverse)
        per_depth.append((ce_sum, count, total, top1, top5))
        denom = jnp.maximum(count, 1.0)
        loss = loss + decay ** (k - 1) * ce_sum / denom
        ce_total = ce_total + ce_sum / denom
    return loss, losses.stack_stats(per_depth), {"ce_loss": ce_total / depth}
