"""The two-stage argmax and top-k over a vocabulary (`model.vocab_reduce`) give exactly what jnp.argmax and
jax.lax.top_k give: ties (lower index first), -inf, equal block maxima, leading axes, vocabularies that are and
are not a multiple of the block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.model import vocab_reduce
from medusa_jax.model.vocab_reduce import BLOCK, first_argmax, top_k


def values(shape, seed: int) -> np.ndarray:
    """Few distinct values (many ties, also between blocks' maxima), some -inf, as float32."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, shape).astype(np.float32)
    x[rng.random(shape) < 0.05] = -np.inf
    return x


@pytest.mark.parametrize("shape", [(49152,), (3, 49152), (2, 5, 1024), (4, 130), (7, 128 * 3), (1, 2 * BLOCK)])
def test_first_argmax_is_jnp_argmax(shape):
    for seed in range(3):
        x = values(shape, seed)
        x_spread = x + np.random.default_rng(seed).normal(size=shape).astype(np.float32)  # ties only by chance
        for case in (x, x_spread):
            np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(case)), np.argmax(case, axis=-1))


@pytest.mark.parametrize("shape, k", [((4096,), 5), ((3, 49152), 8), ((2, 5, 4096), 4), ((4, 130), 3), ((6, 128 * 40), 10),
                                      ((2, 128 * 8), 4)])
def test_top_k_is_lax_top_k(shape, k):
    for seed in range(3):
        x = values(shape, seed)
        x_spread = x + np.random.default_rng(seed).normal(size=shape).astype(np.float32)
        for case in (x, x_spread):
            got_v, got_i = jax.jit(top_k, static_argnums=1)(case, k)
            want_v, want_i = jax.lax.top_k(case, k)
            np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
            np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_the_blocks_are_searched_only_where_they_save_work():
    """The two-stage forms run only over whole blocks, enough of them (else the one-stage forms): checked on what
    XLA is given."""
    def ops(fn, *args):
        return str(jax.make_jaxpr(fn)(*args))
    assert "reshape" in ops(first_argmax, jnp.zeros((2, 49152))) and "reshape" not in ops(first_argmax, jnp.zeros((2, 130)))
    staged = ops(lambda x: top_k(x, 8), jnp.zeros((2, 49152)))
    assert staged.count("top_k") == 2 and "sort" in staged
    assert ops(lambda x: top_k(x, 8), jnp.zeros((2, 128 * 16))).count("top_k") == 1  # 16 blocks < 4 k
    assert vocab_reduce._blocks(jnp.zeros((1, 130)), 1) is None
