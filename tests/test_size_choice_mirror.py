"""The offline replay's numpy mirror of the shipped size rule (`bench.size_choice_replay.RatioRule`) follows the
device rule (`inference.size_choice.SizeChoiceState`) step by step: the rules compared offline are the rules that
run."""

import jax.numpy as jnp
import numpy as np

from medusa_jax.bench.size_choice_replay import Position, RatioRule
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.inference.size_choice import SizeChoiceState


def random_positions(rng, n, sizes):
    """Predictions that grow with the size, true accepts in three regimes: nothing, some, a repeat."""
    out = []
    for i in range(n):
        regime = (i // 25) % 3
        grow = np.cumsum(rng.uniform(0.0, 1.0, len(sizes))) * np.asarray([s > 0 for s in sizes])
        true = np.minimum(np.floor(grow * (0.0, 0.6, 2.5)[regime]), np.asarray(sizes, float))
        lookup = grow * 3.0 if regime == 2 and rng.uniform() < 0.5 else np.zeros(len(sizes))
        out.append(Position(grow, lookup, true))
    return out


def test_the_replays_mirror_makes_the_device_rules_choices():
    sizes = DraftSizes((0, 2, 5, 16), (1.11, 1.58, 1.67, 2.31), depth=8)
    costs = np.asarray(sizes.costs)
    steps = random_positions(np.random.default_rng(0), 150, sizes.sizes)
    mirror, state = RatioRule(list(sizes.sizes), list(costs)), SizeChoiceState.start(sizes)
    one = jnp.float32(1)
    made = {"skipped": 0, "drafted": set()}
    for p in steps:
        want = mirror.decide(p)
        lookup_pays = bool(np.any((np.asarray(sizes.sizes) > 0) & ((1 + p.lookup_k) / costs > 1)))
        if not (bool(state.drafts) or lookup_pays):
            state = state.skipped()
            assert want is None
            made["skipped"] += 1
            continue
        got = int(state.choose(jnp.asarray(p.accepts_k, jnp.float32), jnp.asarray(p.lookup_k, jnp.float32), sizes,
                               one))
        assert got == want
        made["drafted"].add(got)
        accepted_k = np.where(np.arange(len(sizes.sizes)) <= got, p.true_k, 0.0)
        mirror.learn(got, float(p.accepts_k[got]), float(p.true_k[got]), accepted_k)
        state = state.drafted(sizes, jnp.int32(got), jnp.asarray(accepted_k, jnp.float32), one,
                              jnp.asarray(p.accepts_k, jnp.float32))
        np.testing.assert_allclose(np.asarray(state.ratios)[1:], mirror.ratios()[1:], rtol=1e-4)
        assert int(state.skip_left) == mirror.skip_left
    # the walk went through skipped steps and more than one drafted size
    assert made["skipped"] > 0 and len(made["drafted"]) >= 2


def test_a_batch_replay_of_one_row_is_the_row_replay_and_a_batch_waits_for_its_last_row():
    from medusa_jax.bench.size_choice_replay import FixedSize, replay, replay_batch

    sizes, costs = [0, 2, 5, 16], [1.11, 1.58, 1.67, 2.31]
    rng = np.random.default_rng(1)
    rows = [random_positions(rng, n, sizes) for n in (150, 90, 40)]
    one = replay_batch([rows[0]], RatioRule(sizes, costs), costs, 1.02)
    alone = replay(rows[0], RatioRule(sizes, costs), costs, 1.02)
    assert one["cost"] == alone["cost"] and one["skipped"] == alone["skipped"] and one["drafted"] == alone["drafted"]
    # every step verifies 5 nodes: the batch takes as many steps as its slowest row alone, at that size's cost
    batch = replay_batch(rows, FixedSize(sizes, costs, 2), costs, 1.02)
    slowest = max(replay(r, FixedSize(sizes, costs, 2), costs, 1.02)["drafted"] for r in rows)
    assert batch["drafted"] == slowest and np.isclose(batch["cost"], slowest * costs[2])
    assert np.isclose(batch["speedup"], 150 / batch["cost"])


def test_the_batch_replays_left_weights_are_the_device_rules_counted_rows():
    """`row_weights("left")` (the batch replay of rows that end together) weighs exactly the rows the device rule
    counts (`SizeChoiceState.counted_rows`), each alike; "mean" those of rows that do not end together."""
    from medusa_jax.bench.size_choice_replay import row_weights

    sizes = DraftSizes((0, 2, 5), (1.1, 1.5, 1.7), depth=8)
    rng = np.random.default_rng(2)
    for _ in range(50):
        active = rng.uniform(size=4) < 0.7
        out = rng.integers(0, 4, size=4) * 30  # ties are common
        for together, kind in ((True, "left"), (False, "mean")):
            counted = np.asarray(SizeChoiceState.start(sizes, together).counted_rows(jnp.asarray(active),
                                                                                     jnp.asarray(128 - out)))
            w = row_weights(kind, active, out, 128)
            np.testing.assert_array_equal(w > 0, counted)
            if counted.any():
                np.testing.assert_allclose(w[counted], 1 / counted.sum())


def test_the_fitted_reference_recovers_an_affine_calibration_and_then_chooses_as_the_oracle():
    """`FittedReference` (a replay reference, not a device rule): where each size's accepted tokens are an exact
    affine function of the two predictions, its per-answer fit recovers that function, so it makes the oracle's
    choices at every step and its replay matches the oracle's."""
    from medusa_jax.bench.size_choice_replay import FittedReference, Oracle, replay

    sizes, costs, skip = [0, 2, 5, 16], [1.14, 1.40, 1.53, 2.18], 1.03
    rng = np.random.default_rng(3)
    coef = np.asarray([[0.0, 0.0, 0.0], [-0.2, 0.5, 0.1], [-0.4, 0.6, 0.2], [-0.9, 0.7, 0.3]])
    steps = []
    for _ in range(120):
        accepts = np.cumsum(rng.uniform(0.0, 1.5, 4)) * np.asarray([s > 0 for s in sizes])
        lookup = accepts * rng.uniform() if rng.uniform() < 0.4 else np.zeros(4)
        steps.append(Position(accepts, lookup, coef[:, 0] + coef[:, 1] * accepts + coef[:, 2] * lookup))
    fitted = FittedReference(sizes, costs, skip)
    fitted.fit(steps)
    np.testing.assert_allclose(fitted.coef_k3[1:], coef[1:], rtol=1e-6)  # float64 least squares on exact data
    oracle = Oracle(sizes, costs, skip)
    positive = [p for p in steps if np.all(p.true_k >= 0)]  # the fit clips at 0 as the outcome cannot go below
    assert len(positive) > 40 and all(fitted.decide(p) == oracle.decide(p) for p in positive)
    walked = replay(positive, FittedReference(sizes, costs, skip), costs, skip)
    assert walked["drafted"] > 0 and walked["skipped"] > 0
    assert np.isclose(walked["cost"], replay(positive, Oracle(sizes, costs, skip), costs, skip)["cost"])
