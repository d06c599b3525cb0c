"""EAGLE-3 drafter training: the training-time test (Li et al., 2025), cross-entropy only, over the draft vocabulary;
docs/modules.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.model.backbone import CausalLM
from medusa_jax.training import losses
from medusa_jax.training.data import segment_mask
from medusa_jax.training.eagle_loss import depth_stats, draft_teacher, feature_noise, noise_seeds


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
