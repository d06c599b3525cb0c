"""What each drafter kind trains on, by the kind's name in `medusa_jax.heads.kinds.DRAFTERS` (heads never import
training, so a kind's training half lives here). A trainable kind is one entry in OBJECTIVES; a kind with none
(a training-free drafter) is decoded but not trained."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import resolve_dtype
from medusa_jax.heads.hydra import path_tokens
from medusa_jax.training import chunked_loss, losses
from medusa_jax.training.data import segment_mask
from medusa_jax.training.eagle_loss import eagle3_stats, eagle_stats, with_features


def backbone_hidden(base: CausalLM, batch: dict[str, jax.Array]) -> jax.Array:
    """[B, T, D] final-norm hidden states of packed rows (attention stays inside each conversation; the
    cache-free forward: no KV cache is built)."""
    hidden_btd, _ = base(batch["tokens"], batch["positions"], segment_mask(batch["segment_ids"]))
    return hidden_btd


@dataclasses.dataclass(frozen=True)
class LossSettings:
    config: Any  # trainer.TrainConfig
    full_vocab_targets: bool = False  # evaluation: scored against the base's greedy token, no input noise
    reference: Callable[[], CausalLM] | None = None  # Medusa-2's KL term: the original backbone, built on demand


def _head_inputs(base: CausalLM, heads, batch: dict, s: LossSettings):
    """(hidden states, targets [M, ...], path tokens or None, teacher hidden states or None) of a hidden-examples
    batch, or of packed rows run through the backbone."""
    config, num_heads = s.config, heads.config.num_heads
    dtype = resolve_dtype(config.compute_dtype)
    teacher = None
    if "hidden" in batch:
        if config.uses_teacher:
            if "teacher_hidden" not in batch:
                raise ValueError(f"head_loss {config.head_loss!r} needs 'teacher_hidden' in cached batches")
            teacher = jnp.moveaxis(batch["teacher_hidden"], 1, 0).astype(dtype)  # [M, N, D]
        # path [N, M]: Hydra only
        return batch["hidden"].astype(dtype), jnp.moveaxis(batch["targets"], -1, 0), batch.get("path"), teacher
    hidden = backbone_hidden(base, batch)
    if not config.medusa2:
        hidden = jax.lax.stop_gradient(hidden)
    targets = losses.head_targets(batch["tokens"], batch["loss_mask"], batch["segment_ids"], num_heads)
    if config.uses_teacher:
        frozen_hidden = jax.lax.stop_gradient(hidden)
        teacher = [losses.shifted(frozen_hidden, 1 + i) for i in range(num_heads)]  # zeros: no target there
    return hidden, targets, path_tokens(batch["tokens"], num_heads), teacher


def medusa_stats(heads, base, hidden, path, targets, teacher, config) -> losses.HeadStats:
    return chunked_loss.checkpointed_head_stats(heads, base, lambda i: (hidden,), targets, teacher, config.loss_chunk)


def hydra_stats(heads, base, hidden, path, targets, teacher, config) -> losses.HeadStats:
    if path is None:
        raise ValueError("Hydra heads need the path tokens ('path') in cached batches")
    return chunked_loss.hydra_head_stats(heads, base, hidden, path, targets, teacher, config.loss_chunk)


def heads_loss(head_stats, base: CausalLM, heads, batch: dict, s: LossSettings):
    """Medusa and Hydra heads: each head's loss against the token at t + 2 + i (and its teacher), decayed per
    head; in Medusa-2 plus the base's LM loss (or KL to the original backbone)."""
    hidden, targets, path, teacher = _head_inputs(base, heads, batch, s)
    config, extras = s.config, {}
    stats = head_stats(heads, base, hidden, path, targets, teacher, config)
    loss = losses.medusa_loss(stats, config.loss_decay, *config.head_loss_weights)
    if config.medusa2:
        next_bt = losses.shifted_targets(batch["tokens"], batch["loss_mask"], batch["segment_ids"], 1)
        if config.distill_kl:
            reference = s.reference()
            base_sum, base_count = chunked_loss.reference_kl_sums(
                base, reference, hidden, backbone_hidden(reference, batch), next_bt, config.loss_chunk)
        else:
            base_sum, base_count = chunked_loss.lm_sums(base, hidden, next_bt, config.loss_chunk)
        extras["base_loss"] = base_sum / jnp.maximum(base_count, 1.0)
        loss = loss + config.lm_loss_weight * extras["base_loss"]
    return loss, stats, extras


def eagle_loss(base: CausalLM, drafter, batch: dict, s: LossSettings):
    """The EAGLE drafter: EAGLE-1's feature and distribution losses on the base's features (eagle_loss.py)."""
    if "feat" not in batch:  # packed rows: the frozen backbone gives the features in the step
        batch = {**batch, "feat": jax.lax.stop_gradient(backbone_hidden(base, batch))}
    cfg = s.config
    return eagle_stats(drafter, base, batch, noise=0.0 if s.full_vocab_targets else cfg.eagle_noise,
                       feature_weight=cfg.eagle_feature_weight, ce_weight=cfg.eagle_ce_weight,
                       depth=cfg.eagle_train_depth, decay=cfg.loss_decay, full_vocab_targets=s.full_vocab_targets)


def eagle3_loss(base: CausalLM, drafter, batch: dict, s: LossSettings):
    """The EAGLE-3 drafter: cross-entropy over unrolled steps on the fused features the frozen backbone gives in
    the step (packed rows only; eagle_loss.py)."""
    cfg = s.config
    return eagle3_stats(drafter, base, with_features(base, batch, drafter.feature_layers),
                        noise=0.0 if s.full_vocab_targets else cfg.eagle_noise, depth=cfg.eagle_train_depth,
                        decay=cfg.loss_decay, full_vocab_targets=s.full_vocab_targets)


@dataclasses.dataclass(frozen=True)
class Objective:
    loss: Callable[..., tuple]  # (base, heads, batch, LossSettings) -> (loss, HeadStats, extras)
    joint_backbone: bool = False  # may train the backbone too (Medusa-2)
    path_tokens: bool = False  # hidden examples carry the true tokens on each position's path (Hydra)
    # reads packed rows with the base's feature at every position (a feature store, or the frozen backbone in the
    # step), not hidden examples: no --cache-hidden (EAGLE)
    feature_rows: bool = False
    # reads the base's residual stream at several layers, computed from packed rows in the step: no feature store,
    # no --cache-hidden, one decoder layer (EAGLE-3)
    fused_features: bool = False


OBJECTIVES: dict[str, Objective] = {
    "medusa": Objective(partial(heads_loss, medusa_stats), joint_backbone=True),
    "hydra": Objective(partial(heads_loss, hydra_stats), path_tokens=True),
    "eagle": Objective(eagle_loss, feature_rows=True),
    "eagle3": Objective(eagle3_loss, fused_features=True),
}


def objective_for(kind: str) -> Objective:
    """The objective of drafter kind `kind`; ValueError when the kind is not trained."""
    if kind not in OBJECTIVES:
        raise ValueError(f"{kind} drafters are not trained here; trainable kinds: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[kind]
