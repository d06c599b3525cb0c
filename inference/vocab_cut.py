"""The top-k and top-p cut of sampling (`sampling.target_logits`) without sorting the vocabulary when the largest
few logits decide it: a cut keeps every logit >= a threshold, and that threshold is found among the `count`
largest (`lax.top_k`, on XLA:CPU a TopK custom call, not a sort) unless it lies below them; then more
candidates are tried, and after the last the whole vocabulary is sorted (`sorted_threshold`, the definition).

The k-th largest logit is among the candidates when k <= count. The top-p threshold is the smallest logit whose
mass before it (descending order, within the top-k) is < top_p; it is among the candidates when k <= count
(the kept logits tied with the k-th beyond the candidates change nothing: the k-th itself is a candidate) or
when the candidates' mass before some candidate already reaches top_p. Either way the threshold is the one the
sort gives, so the cut keeps the same logits: bit-identical results, save that the softmax normaliser is summed
in vocabulary order instead of sorted order, so a row whose top-p boundary lies within float rounding (~1e-7
of the mass) of top_p may keep one token more or fewer than the sort would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# the candidate counts tried in turn (`cut_logits`) before the sort: a top-k-only step whose every k fits the few
# (transformers' default top_k, 50, does), else top-p steps: SmolLM2's top 1024 tokens decide top-p 0.9 at every
# reply position measured at temperature 0.7, not at all of them at temperature 1, where its top 4096 do
# (bench/sampling/vocab_cut/top_mass.md)
TOP_K_CANDIDATES = (64,)
TOP_P_CANDIDATES = (1024, 4096)


def largest(scaled_xv: jax.Array, count: int) -> jax.Array:
    """[..., count]: the `count` largest logits, descending. `lax.top_k` is a sort and a slice to XLA, which XLA:CPU
    turns back into its TopK only when nothing but that slice reads the sort; the optimisation barrier keeps the
    readers (e.g. of one element) from being folded into the slice, which would leave a full sort."""
    return jax.lax.optimization_barrier(jax.lax.top_k(scaled_xv, count)[0])


def sorted_threshold(scaled_xv: jax.Array, k_x1: jax.Array, top_p_x1: jax.Array) -> jax.Array:
    """[..., 1]: the smallest logit the cut keeps, from a full descending sort (k_x1 in [1, v]: v keeps all; top_p_x1
    >= 1: no top-p cut). Top-k keeps every logit >= the k-th (ties kept); top-p then keeps a sorted entry while
    the mass before it is < top_p (the top one always)."""
    sorted_xv = -jnp.sort(-scaled_xv, axis=-1)
    kth_x1 = jnp.take_along_axis(sorted_xv, jnp.broadcast_to(k_x1 - 1, sorted_xv.shape[:-1] + (1,)), axis=-1)
    in_top_k_xv = sorted_xv >= kth_x1
    probs_xv = jax.nn.softmax(jnp.where(in_top_k_xv, sorted_xv, -jnp.inf), axis=-1)
    mass_before_xv = jnp.cumsum(probs_xv, axis=-1) - probs_xv
    keep_xv = in_top_k_xv & ((mass_before_xv < top_p_x1) | (top_p_x1 >= 1.0))
    return jnp.min(jnp.where(keep_xv, sorted_xv, jnp.inf), axis=-1, keepdims=True)


def candidate_threshold(scaled_xv: jax.Array, k_x1: jax.Array, top_p_x1: jax.Array,
                        count: int) -> tuple[jax.Array, jax.Array]:
    """(threshold [..., 1], decided [..., 1] bool): `sorted_threshold`'s value from the `count` largest logits
    where decided holds (module docstring); elsewhere the threshold is meaningless."""
    v = scaled_xv.shape[-1]
    count = min(count, v)
    top_xr = largest(scaled_xv, count)
    k_inside_x1 = k_x1 <= count
    kth_x1 = jnp.where(k_x1 >= v, -jnp.inf,
                       jnp.take_along_axis(top_xr, jnp.clip(jnp.broadcast_to(k_x1, top_xr.shape[:-1] + (1,)) - 1,
                                                            0, count - 1), axis=-1))
    max_x1 = top_xr[..., :1]
    normaliser_x1 = jnp.sum(jnp.exp(jnp.where(scaled_xv >= kth_x1, scaled_xv, -jnp.inf) - max_x1), axis=-1,
                            keepdims=True)
    in_top_k_xr = top_xr >= kth_x1
    probs_xr = jnp.where(in_top_k_xr, jnp.exp(top_xr - max_x1), 0.0) / normaliser_x1
    mass_before_xr = jnp.cumsum(probs_xr, axis=-1) - probs_xr
    keep_xr = in_top_k_xr & (mass_before_xr < top_p_x1)
    top_p_threshold_x1 = jnp.min(jnp.where(keep_xr, top_xr, jnp.inf), axis=-1, keepdims=True)
    threshold_x1 = jnp.where(top_p_x1 >= 1.0, kth_x1, top_p_threshold_x1)
    boundary_inside_x1 = jnp.any(mass_before_xr >= top_p_x1, axis=-1, keepdims=True)
    decided_x1 = k_inside_x1 | ((k_x1 >= v) & ((top_p_x1 >= 1.0) | boundary_inside_x1))
    return threshold_x1, decided_x1


def cut_logits(scaled_xv: jax.Array, k_x1: jax.Array, top_p_x1: jax.Array, counts: tuple[int, ...],
               active_x1: jax.Array | bool = True) -> jax.Array:
    """scaled_xv with -inf below the cut's threshold: `candidate_threshold` with counts[0] candidates; where that
    leaves an active row undecided (inactive rows: unused), with counts[1], ...; after the last, the full sort
    (each try for every row: one `lax.cond` apiece)."""
    active_x1 = jnp.asarray(active_x1)

    def threshold(counts):
        if not counts:
            return sorted_threshold(scaled_xv, k_x1, top_p_x1)
        threshold_x1, decided_x1 = candidate_threshold(scaled_xv, k_x1, top_p_x1, counts[0])
        return jax.lax.cond(jnp.all(decided_x1 | ~active_x1), lambda: threshold_x1, lambda: threshold(counts[1:]))

    return jnp.where(scaled_xv >= threshold(counts), scaled_xv, -jnp.inf)
