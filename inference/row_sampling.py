"""Token selection with every row's own sampling settings, so greedy and sampled requests share one decode step
(the generation engine's rows: inference/row_decode.py).

`RowSampling` carries `SamplingConfig`'s three settings as per-row arrays plus a seed per row. A row draws its
token number i (0 = the first token after the prompt) with the key fold_in(key(seed), i), so a request's tokens
depend on its seed and prompt only, not on which row it got or what else shares the batch. The distribution a
sampled row draws from is `sampling.target_logits`'s (temperature, then top-k with ties kept, then top-p);
rows at temperature 0 take `sampling.greedy_tokens`. A step whose rows are all greedy skips the sampling work
(one `lax.cond`); one whose sampled rows have no top-k or top-p cut needs no more than the scaled logits (one
`lax.switch`); a cut is found among the largest logits, the vocabulary sorted only when they leave it open
(inference/vocab_cut.py).

A row may also accept a drafted tree typically (`acceptance.AcceptanceConfig` kind "typical", the official Medusa's
sampling mode): `typical_b` marks it, with its own posterior threshold and alpha; the tree decoder's rows read them
(inference/row_acceptance.py). None there (a RowSampling built by hand): no row accepts typically.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.sampling import SamplingConfig, greedy_tokens
from medusa_jax.inference.vocab_cut import TOP_K_CANDIDATES, TOP_P_CANDIDATES, cut_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    temperature_b: jax.Array  # float32; 0: greedy
    top_p_b: jax.Array  # float32 in (0, 1]
    top_k_b: jax.Array  # int32; 0: no top-k cut
    seed_b: jax.Array  # uint32
    typical_b: jax.Array | None = None  # bool: the row accepts a drafted tree typically (sampled rows only)
    posterior_threshold_b: jax.Array | None = None  # float32: typical acceptance's epsilon
    posterior_alpha_b: jax.Array | None = None  # float32: typical acceptance's delta

    @classmethod
    def of(cls, configs: Sequence[SamplingConfig], seeds: Sequence[int],
           acceptances: Sequence[AcceptanceConfig] | None = None) -> "RowSampling":
        """NumPy arrays for these rows (each config already validated by SamplingConfig; `acceptances`, one per row,
        checked against it by `acceptance.DecodeConfig`; None: no row accepts typically)."""
        acceptances = acceptances or [AcceptanceConfig()] * len(configs)
        return cls(np.asarray([c.temperature for c in configs], np.float32),
                   np.asarray([c.top_p for c in configs], np.float32),
                   np.asarray([c.top_k for c in configs], np.int32),
                   np.asarray([s % 2**32 for s in seeds], np.uint32),
                   np.asarray([a.kind == "typical" for a in acceptances], bool),
                   np.asarray([a.posterior_threshold for a in acceptances], np.float32),
                   np.asarray([a.posterior_alpha for a in acceptances], np.float32))

    @classmethod
    def greedy(cls, rows: int) -> "RowSampling":
        return cls.of([SamplingConfig()] * rows, [0] * rows)

    def put_rows(self, rows_n: jax.Array, new: "RowSampling") -> "RowSampling":
        """These settings with rows rows_n[i] (index >= b: dropped) set to new's row i."""
        return jax.tree.map(lambda old, fresh: old.at[rows_n].set(fresh.astype(old.dtype), mode="drop"), self, new)

    @property
    def typical_rows_b(self) -> jax.Array:
        """[b] bool: the rows that accept typically (sampled rows marked typical)."""
        if self.typical_b is None:
            return jnp.zeros(self.temperature_b.shape, bool)
        return self.typical_b & (self.temperature_b > 0)


def row_target_logits(logits_bxv: jax.Array, sampling: RowSampling) -> jax.Array:
    """[b, ..., v] logits -> fp32 [b, ..., v] logits of each row's sampling distribution: `sampling.target_logits`
    with the row's own temperature, top-k and top-p (rows at temperature 0 are scaled by 1 and may be cut or not:
    their result is unused). The axes between b and v (a tree's nodes) share their row's settings."""
    def per_row(x_b):  # [b] -> [b, 1, ..., 1] against [b, ..., v]
        return x_b.reshape(x_b.shape + (1,) * (logits_bxv.ndim - 1))

    scaled_bxv = logits_bxv.astype(jnp.float32) / per_row(jnp.where(sampling.temperature_b > 0,
                                                                    sampling.temperature_b, 1.0))
    v = scaled_bxv.shape[-1]
    sampled_b = sampling.temperature_b > 0
    k_b = jnp.where((sampling.top_k_b > 0) & (sampling.top_k_b < v), sampling.top_k_b, v)
    cuts_k_b, cuts_p_b = sampled_b & (k_b < v), sampled_b & (sampling.top_p_b < 1.0)

    def cut(counts):
        return lambda: cut_logits(scaled_bxv, per_row(k_b), per_row(sampling.top_p_b), counts, per_row(sampled_b))

    # no sampled row cuts: the scaled logits; top-k only, within the few candidates: those; else the top-p ones
    few_b = ~cuts_k_b | (k_b <= TOP_K_CANDIDATES[-1])
    branch = jnp.where(~jnp.any(cuts_k_b | cuts_p_b), 0, jnp.where(jnp.any(cuts_p_b) | ~jnp.all(few_b), 2, 1))
    return jax.lax.switch(branch, [lambda: scaled_bxv, cut(TOP_K_CANDIDATES), cut(TOP_P_CANDIDATES)])


def row_keys(seed_b: jax.Array, index_b: jax.Array) -> jax.Array:
    """[b] keys: fold_in(key(seed), index) row by row (a request's draws depend on its seed and position only)."""
    return jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(seed_b, index_b)


def sample_rows(logits_bv: jax.Array, sampling: RowSampling, index_b: jax.Array) -> jax.Array:
    """One token per row (int32 [b]): the argmax for rows at temperature 0, else a draw from
    row_target_logits with the key fold_in(key(seed_b), index_b) (index_b: the token's number in its reply)."""
    greedy_b = greedy_tokens(logits_bv)

    def sampled():
        keys_b = row_keys(sampling.seed_b, index_b)
        drawn_b = jax.vmap(lambda key, logits_v: jax.random.categorical(key, logits_v))(
            keys_b, row_target_logits(logits_bv, sampling))
        return jnp.where(sampling.temperature_b > 0, drawn_b.astype(jnp.int32), greedy_b)

    return jax.lax.cond(jnp.any(sampling.temperature_b > 0), sampled, lambda: greedy_b)
