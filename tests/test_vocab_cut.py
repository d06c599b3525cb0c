"""The top-k / top-p cut from the largest few logits (inference/vocab_cut.py) keeps exactly the logits the full sort
keeps (`sorted_threshold`, the definition): per-row settings mixed in one batch, ties at the k-th and at the top-p
boundary, rows whose candidates do not reach top_p (the sort fallback), and the static `target_logits`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.inference.row_sampling import RowSampling, row_target_logits
from medusa_jax.inference.sampling import SamplingConfig, target_logits
from medusa_jax.inference.vocab_cut import (TOP_K_CANDIDATES, TOP_P_CANDIDATES, candidate_threshold,
                                            sorted_threshold)

V = 8192  # > every candidate count, so the candidates, more candidates and the sort all run


def logits_btv(b: int, t: int, seed: int) -> jax.Array:
    """Rows in turn peaked (the top 1024 hold 0.9 of the mass), flat (the top 4096 do not) and between (the top 4096
    do, the top 1024 not), on a 0.5 grid (ties)."""
    rng = np.random.default_rng(seed)
    scale_b = np.asarray([6.0, 0.4, 1.8])[np.arange(b) % 3, None, None]
    return jnp.asarray(np.round(rng.normal(size=(b, t, V)) * scale_b * 2) / 2, jnp.float32)


def sorted_reference(logits_btv: jax.Array, config: SamplingConfig) -> np.ndarray:
    scaled_btv = logits_btv.astype(jnp.float32) / config.temperature
    k = config.top_k if 0 < config.top_k < V else V
    threshold_bt1 = sorted_threshold(scaled_btv, jnp.int32(k), jnp.float32(config.top_p))
    return np.asarray(jnp.where(scaled_btv >= threshold_bt1, scaled_btv, -jnp.inf))


@pytest.mark.parametrize("count", [*TOP_K_CANDIDATES, *TOP_P_CANDIDATES])
def test_candidate_threshold_keeps_what_the_sort_keeps_where_it_decides(count):
    scaled_btv = logits_btv(4, 2, 0)
    for k, top_p in [(1, 1.0), (5, 1.0), (count, 1.0), (count + 1, 1.0), (V, 1.0), (V, 0.9), (V, 0.5),
                     (7, 0.9), (count, 0.95), (count + 1, 0.9)]:
        k_x1, top_p_x1 = jnp.full((1, 1), k, jnp.int32), jnp.full((1, 1), top_p, jnp.float32)
        threshold_bt1, decided_bt1 = jax.device_get(candidate_threshold(scaled_btv, k_x1, top_p_x1, count))
        want_bt1 = np.asarray(sorted_threshold(scaled_btv, k_x1[..., None], top_p_x1[..., None]))
        kept_btv, want_kept_btv = np.asarray(scaled_btv) >= threshold_bt1, np.asarray(scaled_btv) >= want_bt1
        np.testing.assert_array_equal(kept_btv[decided_bt1[..., 0]], want_kept_btv[decided_bt1[..., 0]])
        if k <= count or top_p >= 1.0 and k == V:
            assert decided_bt1.all()
        elif k < V:
            assert not decided_bt1.any()  # the k-th lies beyond the candidates
        else:  # top-p alone: decided where the candidates but the last hold top_p of the mass
            exp_btv = np.exp(np.asarray(scaled_btv, np.float64) - np.max(scaled_btv, axis=-1, keepdims=True))
            mass_bt = np.sum(-np.sort(-exp_btv, axis=-1)[..., :count - 1], axis=-1) / np.sum(exp_btv, axis=-1)
            np.testing.assert_array_equal(decided_bt1[..., 0], mass_bt >= top_p)


@pytest.mark.parametrize("configs", [
    [SamplingConfig(0.7), SamplingConfig(1.3), SamplingConfig(), SamplingConfig(1.0)],  # no cut
    [SamplingConfig(0.7, top_k=50), SamplingConfig(1.0), SamplingConfig(1.0, top_k=TOP_K_CANDIDATES[-1]),
     SamplingConfig(0.0, top_p=0.5, top_k=3000)],  # top-k within the few candidates (greedy rows: unused)
    [SamplingConfig(0.7, top_k=TOP_K_CANDIDATES[-1] + 1), SamplingConfig(1.0, top_k=3), SamplingConfig(),
     SamplingConfig(0.9, top_k=1000)],  # top-k within the top-p candidates
    [SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_k=20), SamplingConfig(0.7, top_p=0.95, top_k=40),
     SamplingConfig(1.0, top_k=3000)],  # top-p decided by the candidates; a top-k beyond them: the sort
    [SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_k=5), SamplingConfig(1.0, top_p=0.9),
     SamplingConfig(0.7)],  # a top-p decided by the second candidate count only
    [SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_p=0.8), SamplingConfig(1.0, top_p=0.5, top_k=900),
     SamplingConfig(0.8)],  # a flat row's top-p beyond the candidates: the sort
])
def test_row_target_logits_keeps_exactly_what_the_sort_keeps(configs):
    x_btv = logits_btv(len(configs), 3, 1)
    got_btv = np.asarray(jax.jit(row_target_logits)(x_btv, RowSampling.of(configs, range(len(configs)))))
    for i, config in enumerate(configs):
        if not config.greedy:
            np.testing.assert_array_equal(got_btv[i], sorted_reference(x_btv[i: i + 1], config)[0])
            np.testing.assert_array_equal(got_btv[i], np.asarray(target_logits(x_btv[i], config)))


def test_target_logits_keeps_exactly_what_the_sort_keeps():
    x_btv = logits_btv(4, 2, 2)
    for config in [SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_p=0.6, top_k=30),
                   SamplingConfig(1.0, top_p=0.9, top_k=2000), SamplingConfig(0.5, top_k=7)]:
        np.testing.assert_array_equal(np.asarray(target_logits(x_btv, config)), sorted_reference(x_btv, config))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering of top_k")
def test_candidates_are_a_top_k_not_a_sort():
    """XLA:CPU runs `lax.top_k` as its TopK only when nothing else reads the sort it lowers to (vocab_cut.largest)."""
    x_bv = jnp.zeros((2, V), jnp.float32)
    for cut in [lambda x: candidate_threshold(x, jnp.int32(V), jnp.float32(0.9), TOP_P_CANDIDATES[0]),
                lambda x: target_logits(x, SamplingConfig(0.7, top_k=50))]:
        hlo = jax.jit(cut).lower(x_bv).compile().as_text()
        assert 'custom_call_target="TopK"' in hlo and " sort(" not in hlo
