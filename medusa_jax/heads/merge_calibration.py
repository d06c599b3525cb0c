"""Measured acceptance of each drafter's candidates, by depth and by the drafter's own score: what the mixed tree
(`heads.draft_merge.merge_proposals`) scores a node with; why, and how the shipped counts were made, in
docs/modules.md."""

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
