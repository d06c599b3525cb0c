"""The mixed tree's calibrated scores (medusa_jax/heads/merge_calibration.py, draft_merge.merge_proposals): a
member's conditional scores are mapped through its measured counts (the drafter's own score where few were
counted), a node several members propose combines their conditionals, a path scores the product of its nodes',
and the shipped counts load and apply by drafter kind."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.heads import merge_calibration
from medusa_jax.heads.draft_merge import PROB_EDGES, keep_best, merge_proposals, score_bin, score_bins
from medusa_jax.heads.merge_calibration import PRIOR_WEIGHT, MemberCalibration, parse_counts
from medusa_jax.heads.mixed import MixedDrafter
from medusa_jax.heads.lookup import LookupDrafter

from test_mixed_drafts import chain, paths_of

BINS = len(PROB_EDGES) + 1


def counts(depths: int, cells: dict) -> MemberCalibration:
    """{(depth, bin): (tried, right)} -> a MemberCalibration, every other cell empty."""
    tried = [[0] * BINS for _ in range(depths)]
    right = [[0] * BINS for _ in range(depths)]
    for (d, k), (t, r) in cells.items():
        tried[d - 1][k], right[d - 1][k] = t, r
    return MemberCalibration(tuple(map(tuple, tried)), tuple(map(tuple, right)))


def test_bins_on_host_and_device_agree():
    probabilities = np.asarray([0.0, 0.005, 0.01, 0.0125, 0.3, 0.35, 0.9, 0.97, 1.0], np.float32)
    assert np.asarray(score_bins(jnp.asarray(probabilities))).tolist() == [score_bin(float(p)) for p in probabilities]
    assert score_bin(0.0) == 0 and score_bin(1.0) == BINS - 1


def test_conditional_is_the_counted_rate_pulled_to_the_own_score_where_few_were_counted():
    calibration = counts(2, {(1, score_bin(0.3)): (1000, 600), (2, score_bin(0.3)): (5, 5)})
    own = jnp.asarray([0.3, 0.3, 0.3, 0.05])
    depth = jnp.asarray([1, 2, 7, 1])  # depth 7 counts as the deepest counted (2)
    got = np.asarray(calibration.conditional(own, depth))
    w = PRIOR_WEIGHT
    np.testing.assert_allclose(got, [(600 + w * 0.3) / (1000 + w), (5 + w * 0.3) / (5 + w),
                                     (5 + w * 0.3) / (5 + w), 0.05], rtol=1e-6)
    with pytest.raises(ValueError, match="0 <= right <= tried"):
        counts(1, {(1, 3): (2, 3)})


def test_merge_scores_paths_with_calibrated_conditionals_and_combines_copies():
    # member a: chain 4 5 6 with own conditional 0.5 per node; member b: chain 4 9 with own 0.2
    a, b = chain([4, 5, 6], np.log(0.5)), chain([4, 9], np.log(0.2))
    cal_a = counts(3, {(1, score_bin(0.5)): (10_000, 9_000), (2, score_bin(0.5)): (10_000, 1_000)})
    merged = merge_proposals([a, b], depth=3, calibrations=(cal_a, None))
    paths = paths_of(merged, 0)
    q_a1 = (9_000 + PRIOR_WEIGHT * 0.5) / (10_000 + PRIOR_WEIGHT)
    q_a2 = (1_000 + PRIOR_WEIGHT * 0.5) / (10_000 + PRIOR_WEIGHT)
    q_4 = 1 - (1 - q_a1) * (1 - 0.2)  # token 4 from both members
    assert paths[(4,)] == [pytest.approx(np.log(q_4), rel=1e-5)]
    assert paths[(4, 5)] == [pytest.approx(np.log(q_4) + np.log(q_a2), rel=1e-5)]
    assert paths[(4, 5, 6)] == [pytest.approx(np.log(q_4) + np.log(q_a2) + np.log(0.5), rel=1e-5)]  # depth 3: none
    assert paths[(4, 9)] == [pytest.approx(np.log(q_4) + np.log(0.2), rel=1e-5)]
    kept = paths_of(keep_best(merged, 2), 0)  # calibrated, 4 9 (0.2) beats 4 5 (~0.1)
    assert set(kept) == {(4,), (4, 9)}
    uncalibrated = paths_of(keep_best(merge_proposals([a, b], depth=3), 2), 0)
    assert set(uncalibrated) == {(4,), (4, 5)}


def test_shipped_counts_load_and_mixes_apply_them_by_kind(tmp_path):
    shipped = merge_calibration.shipped_calibrations()
    assert {"recycle", "hydra", "lookup"} <= set(shipped)
    for calibration in shipped.values():
        assert sum(map(sum, calibration.tried)) > 1000
    mix = MixedDrafter([LookupDrafter()], [None], ["lookup"], config=None)
    assert mix.calibrations == (shipped["lookup"],)
    own = MixedDrafter([LookupDrafter()], [None], ["lookup"], config=None, calibrations=[None])
    assert own.calibrations == (None,)
    bad = {"prob_edges": [0.5], "lookup": {"tried": [[0] * BINS], "right": [[0] * BINS]}}
    with pytest.raises(ValueError, match="other edges"):
        parse_counts(json.loads(json.dumps(bad)))
