"""Hardware-aware Medusa trees: greedy construction by expected accepted length, sized by measured step time.

Inputs are two measurements (the heads' held-out accuracy, `medusa_jax.trees.search.head_accuracy`, and the step
costs of this machine, `inference.step_cost`):
    accuracy_mr [num_heads, top_k]  P(head m's rank-r guess equals the base model's greedy token at t+2+m)
    step time   seconds of one Medusa step as a function of T, the tree tokens verified (the root included)

Under greedy acceptance at most one node per depth can be accepted (siblings hold different tokens, and only
one prefix is the base model's continuation), so the accepted length is the number of accepted nodes and its
expectation is the sum over nodes of P(every node on the path is right). Taking the heads as independent, a
node's value is the product of its path's accuracies, `prod_m accuracy_mr[m, path[m]]` (the Medusa paper's
construction). A node is worth at most its parent, so adding the most valuable frontier node one at a time
gives a sequence in which every prefix is a valid tree and the tree of n nodes maximises the expected accepted
length among trees of n nodes. Tokens per step = 1 + expected accepted length (the base model's own token).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Sequence

import numpy as np

Path_ = tuple[int, ...]


def check_accuracy_table(accuracy_mr) -> np.ndarray:
    acc = np.asarray(accuracy_mr, np.float64)
    if acc.ndim != 2 or acc.shape[0] < 1 or acc.shape[1] < 1:
        raise ValueError(f"accuracy table must be [num_heads, top_k] with both >= 1, got shape {acc.shape}")
    if not np.all(np.isfinite(acc)) or acc.min() < 0 or acc.max() > 1:
        raise ValueError("accuracy table entries must be probabilities in [0, 1]")
    return acc


def path_value(path: Sequence[int], accuracy_mr) -> float:
    """P(every node on the path is the base model's greedy token), heads taken as independent."""
    acc = np.asarray(accuracy_mr, np.float64)
    return float(np.prod([acc[m, r] for m, r in enumerate(path)]))


def expected_tokens_per_step(paths: Sequence[Sequence[int]], accuracy_mr) -> float:
    """1 (the base model's token) + the expected number of accepted tree nodes."""
    acc = check_accuracy_table(accuracy_mr)
    for p in paths:
        if len(p) > acc.shape[0] or max(p) >= acc.shape[1]:
            raise ValueError(f"path {list(p)} is outside the {acc.shape[0]} heads x top-{acc.shape[1]} table")
    return 1.0 + sum(path_value(p, acc) for p in paths)


def greedy_tree(accuracy_mr, max_nodes: int) -> list[tuple[Path_, float]]:
    """The first `max_nodes` nodes in greedy order, each with its value; every prefix is a valid tree and the
    values never increase. Ties go to the shorter, then lexicographically smaller path (deterministic)."""
    acc = check_accuracy_table(accuracy_mr)
    num_heads, top_k = acc.shape
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    frontier: list[tuple[float, int, Path_]] = []

    def push(path: Path_, value: float) -> None:
        heapq.heappush(frontier, (-value, len(path), path))

    for r in range(top_k):
        push((r,), acc[0, r])
    order: list[tuple[Path_, float]] = []
    while frontier and len(order) < max_nodes:
        neg_value, _, path = heapq.heappop(frontier)
        order.append((path, -neg_value))
        if len(path) < num_heads:
            for r in range(top_k):
                push(path + (r,), -neg_value * acc[len(path), r])
    return order


def nondecreasing_fit(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators). A bigger tree does
    all of a smaller one's work, so its step is never cheaper: a measured dip is machine-load noise."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]]
    return [m for m, c in blocks for _ in range(int(c))]


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Measured step seconds at a few tree sizes; linear interpolation between them (no extrapolation)."""

    tokens: tuple[int, ...]  # T values measured, increasing
    seconds: tuple[float, ...]

    def __post_init__(self):
        if len(self.tokens) < 1 or len(self.tokens) != len(self.seconds):
            raise ValueError("StepCost needs as many seconds as token counts, at least one")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"tree sizes must be strictly increasing, got {self.tokens}")
        if min(self.seconds) <= 0:
            raise ValueError("step times must be positive")

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def __call__(self, num_tokens: int) -> float:
        if not self.tokens[0] <= num_tokens <= self.tokens[-1]:
            raise ValueError(f"step time for T={num_tokens} is outside the measured range "
                             f"[{self.tokens[0]}, {self.tokens[-1]}]")
        return float(np.interp(num_tokens, self.tokens, self.seconds))


@dataclasses.dataclass(frozen=True)
class TreeChoice:
    order: tuple[Path_, ...]  # greedy order, longest considered
    node_values: tuple[float, ...]
    tokens_per_step: tuple[float, ...]  # [n - 1]: expected tokens per step of the first n nodes
    tokens_per_second: tuple[float, ...]  # [n - 1]: tokens_per_step / step_cost(n + 1)
    best_num_nodes: int

    @property
    def paths(self) -> tuple[Path_, ...]:
        return self.order[: self.best_num_nodes]

    @property
    def predicted_tokens_per_step(self) -> float:
        return self.tokens_per_step[self.best_num_nodes - 1]


def _tokens_per_second(per_step: np.ndarray, step_cost: Callable[[int], float] | StepCost) -> np.ndarray:
    """[n - 1]: per_step[n - 1] / step_cost(n + 1) for trees of n nodes; NaN where a measured `StepCost` has no
    time for that size."""
    low, high = (step_cost.tokens[0], step_cost.max_tokens) if isinstance(step_cost, StepCost) else (1, None)
    per_second = np.array([per_step[n - 1] / step_cost(n + 1) if low <= n + 1 <= (high or n + 1) else np.nan
                           for n in range(1, len(per_step) + 1)])
    if np.all(np.isnan(per_second)):
        raise ValueError(f"no tree size between 1 and {len(per_step)} nodes has a measured step time "
                         f"(measured T = {low}..{high})")
    return per_second


def fastest_greedy_tree(accuracy_mr, step_cost: Callable[[int], float] | StepCost, max_nodes: int) -> TreeChoice:
    """Greedy trees of 1..max_nodes nodes; keeps the size with the most expected tokens per second. With a
    measured `StepCost`, sizes outside its measured range get NaN tokens/s and are never chosen."""
    order = greedy_tree(accuracy_mr, max_nodes)
    values = np.array([v for _, v in order])
    per_step = 1.0 + np.cumsum(values)
    per_second = _tokens_per_second(per_step, step_cost)
    best = int(np.nanargmax(per_second)) + 1
    return TreeChoice(order=tuple(p for p, _ in order), node_values=tuple(values.tolist()),
                      tokens_per_step=tuple(per_step.tolist()), tokens_per_second=tuple(per_second.tolist()),
                      best_num_nodes=best)


def batch_tokens_per_step(order: Sequence[Sequence[int]], per_sequence_smr, batch: int) -> np.ndarray:
    """[n - 1]: tokens per step of the first n nodes of `order` for a batch of `batch` rows, from each held-out
    sequence's own accuracy table ([S, num_heads, top_k]; a sequence is one row's text).

    A batch decodes until its slowest row is done: N tokens per row take max_b N / tau_b steps, tau_b a row's
    own tokens per step. With rows drawn from the held-out sequences, the batch makes 1 / E[max of `batch`
    draws of 1 / tau_s] tokens per row and step (the order statistic over the S sequences, in closed form).
    Batch 1 gives the harmonic mean of the tau_s: long stretches of hard text cost more steps than easy ones
    save. Rows of a plain batch all take N steps, so the plain side has no such loss."""
    acc_smr = np.asarray(per_sequence_smr, np.float64)
    if acc_smr.ndim != 3 or acc_smr.shape[0] < 1:
        raise ValueError(f"per-sequence accuracy must be [sequences, num_heads, top_k], got shape {acc_smr.shape}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    for table in acc_smr:
        check_accuracy_table(table)
    values_sn = np.array([[path_value(p, table) for p in order] for table in acc_smr])
    steps_sn = 1.0 / (1.0 + np.cumsum(values_sn, axis=1))  # steps per token of each sequence, first n nodes
    count = acc_smr.shape[0]
    ranks = np.arange(1, count + 1)
    weights = (ranks / count) ** batch - ((ranks - 1) / count) ** batch  # P(the max is the k-th smallest)
    return 1.0 / (weights @ np.sort(steps_sn, axis=0))


def rescore_for_batch(choice: TreeChoice, per_sequence_smr, batch: int,
                      step_cost: Callable[[int], float] | StepCost) -> TreeChoice:
    """`choice` (same greedy order) re-sized with `batch_tokens_per_step` in place of the pooled prediction."""
    per_step = batch_tokens_per_step(choice.order, per_sequence_smr, batch)
    per_second = _tokens_per_second(per_step, step_cost)
    return dataclasses.replace(choice, tokens_per_step=tuple(per_step.tolist()),
                               tokens_per_second=tuple(per_second.tolist()),
                               best_num_nodes=int(np.nanargmax(per_second)) + 1)
