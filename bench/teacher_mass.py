"""How much of the base model's next-token mass a truncated lm_head (--lm-head truncated:N) cannot represent,
measured on a self-distilled store's held-out replies (docs/modules.md)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.model.backbone import CausalLM
from medusa_jax.settings import at_least, check_settings, each, in_range, setting
from medusa_jax.training.data import top_token_ids
from medusa_jax.training.hidden_store import open_store

CHUNK = 256  # held-out positions per jitted softmax


@dataclasses.dataclass(frozen=True)
class TeacherMassConfig:
    sizes: tuple[int, ...] = setting((1024, 2048, 4096, 8192, 16384), each(at_least(1)))  # token_map sizes N
    # share of conversations measured; the map comes from the rest
    heldout_fraction: float = setting(0.2, in_range(0.0, 1.0, low_open=True, high_open=True))
    max_positions: int = setting(20000, at_least(1))  # held-out positions measured at most
    seed: int = 0  # held-out split and position sample

    def __post_init__(self):
        check_settings(self)


def outside_mass(base: CausalLM, store: str | os.PathLike, config: TeacherMassConfig) -> dict:
    """{"positions", "train_tokens", "mean_outside_mass": {str(N): mean teacher mass outside the top-N map}}."""
    train, held, _, _ = open_store(store).examples(1).split(config.heldout_fraction, config.seed)
    train_tokens = train.targets_xm[:, 0][train.targets_xm[:, 0] >= 0]
    maps = {n: top_token_ids(train_tokens, n, base.config.vocab_size) for n in config.sizes}
    probs = jax.jit(lambda h: jax.nn.softmax(base.logits(h.astype(jnp.float32)), axis=-1))
    rows = held.rows_x[np.random.default_rng(config.seed).permutation(len(held))[: config.max_positions]]
    inside = {n: 0.0 for n in config.sizes}
    for start in range(0, len(rows), CHUNK):
        p_xv = np.asarray(probs(jnp.asarray(held.hidden.take(np.sort(rows[start:start + CHUNK])))))
        for n, token_map in maps.items():
            inside[n] += float(p_xv[:, token_map].sum())
    return {"positions": int(len(rows)), "train_tokens": int(len(train_tokens)),
            "mean_outside_mass": {str(n): 1.0 - inside[n] / max(len(rows), 1) for n in config.sizes}}
