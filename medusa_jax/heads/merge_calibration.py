"""Measured acceptance of each drafter's candidates, by depth and by the drafter's own score: what the mixed tree
(`heads.draft_merge.merge_proposals`) scores a node with.

Every drafter scores its candidates with a predicted P(node right | parent right) of its own: the heads their
probability, Token Recycling the measured acceptance of its rank, prompt lookup that of its match length. Those
are biased in different ways, so comparing them across drafters misallocates the node budget. Measured on 16
MT-Bench first turns (bench/mixed_tree/calibration.json): recycling's rank 0 was right 0.36 of the time at every
depth (its own score 0.26); prompt lookup's first drafted token after a 1-token match 0.25 (own 0.38) but each
later one of its chain 0.5-0.9; the Hydra heads' probabilities held at depth 1 and ran high at depth 3-4. A `MemberCalibration` holds, per depth (1..`MAX_DEPTH`, deeper counts as the
last) and bin of the drafter's own conditional score (`draft_merge.PROB_EDGES`), how many candidates were tried
(their parent on the greedy answer) and how many were right, counted by `bench/merge_calibration.py` on MT-Bench
prompts the benchmarks do not use. The calibrated conditional is (right + w * own) / (tried + w), w =
`PRIOR_WEIGHT`: the drafter's own score where few were counted.

The shipped counts (`assets/merge/smollm2.json`) were measured with SmolLM2-135M-Instruct and its shipped Hydra
heads; a mix applies them by drafter kind (a kind with no counts keeps its own scores).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp

from medusa_jax.heads.draft_merge import PROB_EDGES, score_bins

PRIOR_WEIGHT = 10.0  # candidates' worth of the drafter's own score in each cell
SHIPPED = "smollm2.json"  # under medusa_jax/assets/merge/


@dataclasses.dataclass(frozen=True)
class MemberCalibration:
    """Counts of one drafter kind: tried[d][k] and right[d][k], depth d + 1, score bin k. Hashable (static)."""

    tried: tuple[tuple[int, ...], ...]
    right: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        shape = (len(self.tried), {len(row) for row in self.tried})
        if not self.tried or shape[1] != {len(PROB_EDGES) + 1} or \
                (len(self.right), {len(row) for row in self.right}) != shape or \
                any(not 0 <= r <= t for rt, tt in zip(self.right, self.tried) for r, t in zip(rt, tt)):
            raise ValueError(f"a calibration needs tried and right counts of one shape [depth, "
                             f"{len(PROB_EDGES) + 1}], with 0 <= right <= tried")

    def conditional(self, own_x: jax.Array, depth_x: jax.Array) -> jax.Array:
        """The calibrated P(right | parent right) of candidates with own conditional score own_x at depth_x."""
        tried_dk, right_dk = (jnp.asarray(x, jnp.float32) for x in (self.tried, self.right))
        d_x = jnp.clip(depth_x - 1, 0, tried_dk.shape[0] - 1)
        k_x = score_bins(own_x)
        return (right_dk[d_x, k_x] + PRIOR_WEIGHT * own_x) / (tried_dk[d_x, k_x] + PRIOR_WEIGHT)


def parse_counts(counts: dict) -> dict[str, MemberCalibration]:
    """{kind: MemberCalibration} from a counts file's members ({kind: {"tried", "right"}}); other keys ignored."""
    if list(counts.get("prob_edges", PROB_EDGES)) != list(PROB_EDGES):
        raise ValueError("calibration counts were binned with other edges than draft_merge.PROB_EDGES")
    return {kind: MemberCalibration(tuple(map(tuple, c["tried"])), tuple(map(tuple, c["right"])))
            for kind, c in counts.items() if isinstance(c, dict) and {"tried", "right"} <= set(c)
            and isinstance(c["tried"], list)}


@lru_cache(maxsize=1)
def shipped_calibrations() -> dict[str, MemberCalibration]:
    path = Path(str(importlib.resources.files("medusa_jax"))) / "assets" / "merge" / SHIPPED
    return parse_counts(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def calibration_for(kind: str) -> MemberCalibration | None:
    """The shipped counts of a drafter kind (None: the drafter's own scores)."""
    return shipped_calibrations().get(kind)
