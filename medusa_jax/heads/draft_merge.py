"""Several drafters' candidates merged into ONE tree per step and row, and the few static draft sizes a step
chooses among (`DraftSizes`; the choice among them: `inference.size_choice`). How candidates are deduplicated,
scored across drafters and padded: docs/modules.md. Axes as in dynamic_tree.py; a: the merged candidates of a
step (all drafters' nodes without their roots)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import RowTree, TreeProposal
from medusa_jax.trees.tree import DynamicTree


# Bins of a drafter's own conditional score (its predicted P(node right | parent right)): bin k holds the values
# with k edges at or below them. Calibration counts (bench/merge_calibration.py) and tables
# (heads/merge_calibration.py) are indexed by it.
PROB_EDGES = (0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def score_bin(probability: float) -> int:
    """The bin of one conditional score (host side, in float32 as `score_bins` on device)."""
    return int(np.searchsorted(np.asarray(PROB_EDGES, np.float32), np.float32(probability), side="right"))


def score_bins(probability_x: jax.Array) -> jax.Array:
    return jnp.searchsorted(jnp.asarray(PROB_EDGES, jnp.float32), probability_x, side="right").astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SpanCosts:
    """A mix's step costs timed at several attention spans (the slots a step attends over: its cache, or its
    attention window, `KVCache.window`). A step's verify forward reads every slot of its span for each of its n + 1
    tokens and a plain step for one, so a size costs more plain steps over a larger span (bench/size_costs_by_cache).
    `costs[i]` holds each size's step over a plain step of `spans[i]` slots (`draft_size.measure_span_costs`).
    Hashable."""

    spans: tuple[int, ...]  # ascending, distinct, each >= 1
    costs: tuple[tuple[float, ...], ...]  # per span: one cost per size

    def __post_init__(self):
        spans = tuple(self.spans)
        if not spans or list(spans) != sorted(set(spans)) or spans[0] < 1:
            raise ValueError(f"cost spans must be distinct ascending slot counts >= 1, got {self.spans!r}")
        if len(self.costs) != len(spans) or len({len(row) for row in self.costs}) != 1 or not self.costs[0] or \
                not all(c > 0 for row in self.costs for c in row):
            raise ValueError(f"cost spans {spans} need one row of costs > 0 each, all of one length, got "
                             f"{self.costs!r}")

    def at(self, span: int) -> tuple[float, ...]:
        """Each size's cost at `span` slots: linear in the span between the timed spans and along the last piece
        past the last one (it under-prices far past it: bench/size_costs_by_cache), the first span's below it (a
        step reads its weights whatever its span); never below the least timed cost, and a larger size never
        costing less than a smaller one."""
        costs = np.asarray(self.costs, np.float64)  # [spans, sizes]
        spans = np.asarray(self.spans, np.float64)
        if len(spans) == 1 or span <= spans[0]:
            at = costs[0]
        else:
            i = min(int(np.searchsorted(spans, span)) - 1, len(spans) - 2)
            w = (span - spans[i]) / (spans[i + 1] - spans[i])
            at = np.maximum((1 - w) * costs[i] + w * costs[i + 1], costs.min(axis=0))
        return tuple(float(c) for c in np.maximum.accumulate(at))


@dataclasses.dataclass(frozen=True)
class DraftSizes:
    """The static shapes of a mixed-draft step: `sizes` verified node counts (0: a plain step) the step chooses
    among by predicted tokens per second (`inference.draft_size`), `costs` the measured time of a step of each
    size relative to a plain step, on this machine at this batch size, and `depth` the deepest path. Hashable:
    a static argument of the jitted loop."""

    sizes: tuple[int, ...]  # ascending, distinct, each >= 0
    costs: tuple[float, ...]  # same length; a plain step (size 0) costs 1
    depth: int  # D: the deepest drafted path (the accept-length axis is D + 1)
    # the costs by attention span, when timed at several (`costs` are then those at by_span.spans[0]): a step prices
    # its sizes at the span it attends over (`at_span`); None: `costs` at every span
    by_span: SpanCosts | None = None

    def __post_init__(self):
        sizes = tuple(self.sizes)
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes) or \
                list(sizes) != sorted(set(sizes)) or sizes[-1] < 1:
            raise ValueError(f"draft sizes must be distinct ascending integers >= 0, one >= 1; got {self.sizes!r}")
        if len(self.costs) != len(sizes) or not all(c > 0 for c in self.costs):
            raise ValueError(f"draft sizes {sizes} need one cost > 0 each, got {self.costs!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"draft depth must be an integer >= 1, got {self.depth!r}")
        if self.by_span is not None and len(self.by_span.costs[0]) != len(sizes):
            raise ValueError(f"draft sizes {sizes} need costs by span with one cost per size, got "
                             f"{self.by_span.costs!r}")

    @staticmethod
    def timed(sizes: Sequence[int], costs: SpanCosts, depth: int) -> "DraftSizes":
        """The sizes with the costs timed at `costs.spans` (`costs` the first span's; by span where there are
        several)."""
        return DraftSizes(tuple(sizes), costs.at(costs.spans[0]), depth,
                          costs if len(costs.spans) > 1 else None)

    def at_span(self, span: int) -> "DraftSizes":
        """These sizes priced at a step that attends over `span` slots (`SpanCosts.at`; unchanged without
        `by_span`). Static: the decode step calls it with its cache's window or size while it is traced."""
        if self.by_span is None:
            return self
        return dataclasses.replace(self, costs=self.by_span.at(span), by_span=None)

    @property
    def nodes(self) -> int:
        return self.sizes[-1]

    @property
    def num_tokens(self) -> int:
        """T of the largest step: verified tokens, the root included (the cache's scratch slots)."""
        return self.nodes + 1

    @property
    def cost_note(self) -> str:
        """The costs as a reply's or a log's note says them (each size's, "x a plain step"), by span where timed so."""
        def said(costs) -> str:
            return "/".join(f"{c:.2f}" for c in costs)
        if self.by_span is None:
            return f"{said(self.costs)}x a plain step"
        return ", ".join(f"{said(self.by_span.at(span))}x over {span} slots" for span in self.by_span.spans) + \
            " (a plain step's)"

    def record(self) -> dict:
        """The sizes as a results.json records them: sizes, costs (the first span's), depth and the costs by span
        (None where untimed by span), rounded to 3 decimals."""
        def rounded(costs) -> list[float]:
            return [round(c, 3) for c in costs]
        return {"sizes": list(self.sizes), "costs": rounded(self.costs), "depth": self.depth,
                "costs_by_span": None if self.by_span is None else {
                    str(span): rounded(self.by_span.at(span)) for span in self.by_span.spans}}

    @property
    def name(self) -> str:
        return "mixed:" + "/".join(str(n) for n in self.sizes) + f",d={self.depth}"

    def tree(self, nodes: int) -> DynamicTree:
        """The per-row tree spec of one size (any node may have up to `nodes` children)."""
        return DynamicTree(nodes, top_k=max(nodes, 1), depth=self.depth)


def merge_proposals(proposals: list[TreeProposal], depth: int, calibrations: Sequence | None = None) -> TreeProposal:
    """One candidate tree from several (module docstring); T = 1 + the sum of their non-root nodes. The roots are
    the same token (node 0); the result is deduplicated but not cut: `keep_best` cuts it. `calibrations`: per
    proposal a `merge_calibration.MemberCalibration` or None (its own scores)."""
    calibrations = tuple(calibrations) if calibrations is not None else (None,) * len(proposals)
    tokens, parents, depths, scores, conditionals = [], [], [], [], []
    offset = 0
    for p, calibration in zip(proposals, calibrations):
        parents.append(jnp.where(p.parent_bt[:, 1:] == 0, 0, p.parent_bt[:, 1:] + offset))
        tokens.append(p.tokens_bt[:, 1:])
        depths.append(p.depth_bt[:, 1:])
        scores.append(p.score_bt[:, 1:])
        conditionals.append(member_conditional(p, calibration)[:, 1:])
        offset += p.tokens_bt.shape[1] - 1
    root = proposals[0]
    token_bt = jnp.concatenate([root.tokens_bt[:, :1]] + tokens, axis=1).astype(jnp.int32)
    parent_bt = jnp.concatenate([root.parent_bt[:, :1] * 0] + parents, axis=1).astype(jnp.int32)
    depth_bt = jnp.concatenate([root.depth_bt[:, :1] * 0] + depths, axis=1).astype(jnp.int32)
    score_bt = jnp.concatenate([root.score_bt[:, :1] * 0] + scores, axis=1).astype(jnp.float32)
    conditional_bt = jnp.concatenate([jnp.ones_like(score_bt[:, :1])] + conditionals, axis=1)
    b, t = token_bt.shape
    node_t = jnp.arange(t, dtype=jnp.int32)
    for _ in range(depth):  # a node under a non-candidate is none (-inf)
        score_bt = jnp.minimum(score_bt, jnp.take_along_axis(score_bt, parent_bt, axis=1))
    valid_bt = (score_bt > -jnp.inf) | (node_t == 0)
    same_bt_t = (token_bt[:, :, None] == token_bt[:, None, :]) & valid_bt[:, :, None] & valid_bt[:, None, :]
    same_bt_t &= (node_t[:, None] > 0) & (node_t[None, :] > 0)
    canon_bt = jnp.broadcast_to(node_t, (b, t))
    for _ in range(depth):  # a node's parent is settled one round before the node itself
        canon_parent_bt = jnp.take_along_axis(canon_bt, parent_bt, axis=1)
        equal_btt = same_bt_t & (canon_parent_bt[:, :, None] == canon_parent_bt[:, None, :])
        canon_bt = jnp.where(valid_bt & (node_t > 0), jnp.argmax(equal_btt, axis=2).astype(jnp.int32), node_t)
    parent_bt = jnp.take_along_axis(canon_bt, parent_bt, axis=1)
    # a node proposed by several drafters is wrong only if each copy is (noisy-or of the copies' conditionals)
    copies_btt = (canon_bt[:, None, :] == node_t[None, :, None]) & valid_bt[:, None, :]  # [b, t, a]: a copies t
    miss_bt = jnp.sum(jnp.where(copies_btt, jnp.log1p(-conditional_bt)[:, None, :], 0.0), axis=2)
    log_conditional_bt = jnp.log(-jnp.expm1(jnp.minimum(miss_bt, -1e-6)))
    kept_bt = (canon_bt == node_t) & valid_bt & (node_t > 0)
    path_bt = jnp.where(kept_bt, log_conditional_bt, 0.0)
    for _ in range(depth):  # the path's log acceptance: the sum of its conditionals (parents settle first)
        path_bt = jnp.where(kept_bt, log_conditional_bt + jnp.take_along_axis(path_bt, parent_bt, axis=1), 0.0)
    score_bt = jnp.where(kept_bt, path_bt, -jnp.inf).at[:, 0].set(0.0)
    return TreeProposal(token_bt, parent_bt, depth_bt, score_bt)


def member_conditional(proposal: TreeProposal, calibration) -> jax.Array:
    """[b, t] each candidate's P(right | parent right): its own (the score over its parent's), calibrated where
    a calibration is given; clipped into [1e-6, 0.999] (0 conditionals would make paths -inf)."""
    parent_score_bt = jnp.take_along_axis(proposal.score_bt, proposal.parent_bt, axis=1)
    finite_bt = (proposal.score_bt > -jnp.inf) & (parent_score_bt > -jnp.inf)
    own_bt = jnp.where(finite_bt, jnp.exp(jnp.where(finite_bt, proposal.score_bt - parent_score_bt, 0.0)), 0.0)
    own_bt = jnp.clip(own_bt, 1e-6, 0.999)
    if calibration is not None:
        own_bt = jnp.clip(calibration.conditional(own_bt, proposal.depth_bt), 1e-6, 0.999)
    return own_bt


def keep_best(proposal: TreeProposal, nodes: int) -> TreeProposal:
    """The `nodes` best non-root nodes of a deduplicated candidate tree, parents first, padded where fewer score
    above -inf (module docstring); T = nodes + 1."""
    b, t = proposal.tokens_bt.shape
    rows_b1 = jnp.arange(b)[:, None]
    score_ba = proposal.score_bt[:, 1:]
    if nodes > t - 1:  # fewer candidates than nodes: pad the candidate list itself
        extra = nodes - (t - 1)
        score_ba = jnp.concatenate([score_ba, jnp.full((b, extra), -jnp.inf)], axis=1)
    best_bn, keep_bn = jax.lax.top_k(score_ba, nodes)
    keep_bn = jnp.sort(jnp.where(best_bn > -jnp.inf, keep_bn, keep_bn + score_ba.shape[1]), axis=1)  # pads last
    keep_bn = keep_bn % score_ba.shape[1]
    real_bn = jnp.take_along_axis(score_ba, keep_bn, axis=1) > -jnp.inf
    source_bn = jnp.minimum(keep_bn + 1, t - 1)  # node index in the proposal
    node_of_bt = jnp.zeros((b, t), jnp.int32).at[rows_b1, jnp.where(real_bn, source_bn, t)].set(
        jnp.arange(1, nodes + 1, dtype=jnp.int32), mode="drop")
    parent_bn = node_of_bt[rows_b1, proposal.parent_bt[rows_b1, source_bn]]
    token_bn = proposal.tokens_bt[rows_b1, source_bn]
    depth_bn = proposal.depth_bt[rows_b1, source_bn]
    # padding: a child of the root repeating the first kept depth-1 node's token (the root's when none)
    first_child_b = jnp.argmax(real_bn & (depth_bn == 1), axis=1)
    has_child_b = jnp.any(real_bn & (depth_bn == 1), axis=1)
    pad_token_b = jnp.where(has_child_b, token_bn[jnp.arange(b), first_child_b], proposal.tokens_bt[:, 0])
    zeros_b1 = jnp.zeros((b, 1), jnp.int32)
    return TreeProposal(
        jnp.concatenate([proposal.tokens_bt[:, :1], jnp.where(real_bn, token_bn, pad_token_b[:, None])], axis=1),
        jnp.concatenate([zeros_b1, jnp.where(real_bn, parent_bn, 0)], axis=1),
        jnp.concatenate([zeros_b1, jnp.where(real_bn, depth_bn, 1)], axis=1),
        jnp.concatenate([jnp.zeros((b, 1), jnp.float32), jnp.where(real_bn, score_ba[rows_b1, keep_bn], -jnp.inf)],
                        axis=1))


def expected_accepts(proposal: TreeProposal, sizes: tuple[int, ...]) -> jax.Array:
    """[b, len(sizes)] predicted accepted tokens if the best n nodes are verified, n in sizes: the sum of their
    acceptance probabilities (node n is accepted with the probability that its whole path is)."""
    t = proposal.score_bt.shape[1]
    top_bn, _ = jax.lax.top_k(proposal.score_bt[:, 1:], min(max(sizes), t - 1))
    cumulative_bn = jnp.concatenate([jnp.zeros_like(top_bn[:, :1]), jnp.cumsum(jnp.exp(top_bn), axis=1)], axis=1)
    return cumulative_bn[:, jnp.asarray([min(n, t - 1) for n in sizes])]


def plain_row_tree(batch: int, depth: int) -> RowTree:
    """A one-node tree (the root alone) in RowTree form: verifying it is a plain step (accept length 0, the bonus
    token from the root's logits)."""
    zeros_b1 = jnp.zeros((batch, 1), jnp.int32)
    return RowTree(zeros_b1, zeros_b1, jnp.ones((batch, 1, 1), bool), jnp.zeros((batch, 1, depth + 1), jnp.int32),
                   jnp.zeros((batch, 1, depth + 1), bool), jnp.full((batch, 1, 1), -1, jnp.int32),
                   jnp.zeros((batch, 1, 1), bool), depth)
