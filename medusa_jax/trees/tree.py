"""Medusa candidate trees: the official `medusa_choices` format -> static NumPy buffers, built once (their layout
in docs/modules.md), and the dynamic tree spec `DynamicTree` ("dynamic:N[,k=K,d=D]", grown per step by
medusa_jax/trees/dynamic_tree.py), which `load_tree` parses."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

# The official default tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py), listed in the order its
# greedy construction added the nodes: every prefix of this list is itself a valid tree.
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)

# Smaller trees for CPUs, where a verify of ~16 tokens costs about one token: the first n nodes of the
# official greedy order (the n most likely nodes under the Vicuna-7B head accuracies it was built from).
PRESETS: dict[str, tuple[tuple[int, ...], ...]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "mc_sim_7b_32": MC_SIM_7B_63[:32],
    "mc_sim_7b_16": MC_SIM_7B_63[:16],
    "mc_sim_7b_8": MC_SIM_7B_63[:8],
}
DEFAULT_TREE = "mc_sim_7b_16"


class TreeError(ValueError):
    """An invalid medusa_choices tree."""


DYNAMIC_PREFIX = "dynamic:"
DEFAULT_DYNAMIC_DEPTH = 4  # drafting depths: the shipped heads' number of heads (bench/dynamic_trees)


def default_dynamic_top_k(nodes: int, depth: int) -> int:
    """K for "dynamic:N" without k=: 4 (on the shipped SmolLM2 heads K = 4 beat K = 2, and K = 8 or 12 drafted
    barely more tokens/step at 16 nodes, bench/dynamic_trees_k/, for K^2 candidates per depth), raised to the
    smallest K whose K + (D - 1) K^2 drafted candidates hold the N nodes (64 nodes at depth 4 need K = 5), and
    never above N."""
    if nodes < 1 or depth < 1:
        return 1  # an invalid spec: DynamicTree says why
    k = min(4, nodes)
    while k + (depth - 1) * k * k < nodes:
        k += 1
    return k


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A dynamic (EAGLE-2 style) draft tree: per step and per row, the drafter grows it D depths deep, expanding
    the K children of the K best frontier nodes of each depth (by cumulative draft probability), then keeps the N
    best of all drafted nodes (medusa_jax/trees/dynamic_tree.py). N counts the verified nodes without the root, as a
    static tree's paths do: T = N + 1 tree tokens per row. Hashable: a static argument of the jitted loop."""

    nodes: int  # N
    top_k: int = 4  # K: frontier nodes per depth and children per expanded node
    depth: int = DEFAULT_DYNAMIC_DEPTH  # D: drafting depths (the deepest accepted path)

    def __post_init__(self):
        for field in ("nodes", "top_k", "depth"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise TreeError(f"dynamic tree: {field} must be an integer >= 1, got {value!r}")
        if self.nodes > self.num_candidates:
            raise TreeError(f"dynamic tree {self.name}: keeps {self.nodes} nodes but drafts only {self.num_candidates} "
                            f"(K + (D - 1) K^2 with K={self.top_k}, D={self.depth}); raise k or d")

    @property
    def name(self) -> str:
        return f"{DYNAMIC_PREFIX}{self.nodes},k={self.top_k},d={self.depth}"

    @property
    def num_tokens(self) -> int:
        """T: tree tokens verified per step, the root included."""
        return self.nodes + 1

    @property
    def num_candidates(self) -> int:
        """Drafted nodes reranked per step: the root's K children, then K x K children per further depth."""
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    def to_json(self) -> dict:
        """The trees.json form."""
        return {"dynamic": {"nodes": self.nodes, "top_k": self.top_k, "depth": self.depth}}

    @classmethod
    def from_json(cls, entry, origin: str = "trees.json") -> "DynamicTree":
        spec = entry.get("dynamic") if isinstance(entry, dict) and set(entry) == {"dynamic"} else None
        if not isinstance(spec, dict) or "nodes" not in spec or set(spec) - {"nodes", "top_k", "depth"}:
            raise TreeError(f"{origin}: a dynamic tree entry is {{\"dynamic\": {{\"nodes\": N, \"top_k\": K, "
                            f"\"depth\": D}}}} (top_k and depth optional), got {entry!r}")
        depth = spec.get("depth", DEFAULT_DYNAMIC_DEPTH)
        top_k = spec.get("top_k", default_dynamic_top_k(spec["nodes"], depth)
                         if isinstance(spec["nodes"], int) and isinstance(depth, int) else None)
        try:
            return cls(spec["nodes"], top_k, depth)
        except TreeError as e:
            raise TreeError(f"{origin}: {e}") from None

    def check(self, num_heads: int | None = None, max_top_k: int | None = None) -> "DynamicTree":
        if num_heads is not None and self.depth > num_heads:
            raise TreeError(f"dynamic tree {self.name} drafts {self.depth} depths but there are only {num_heads} "
                            f"Medusa heads")
        if max_top_k is not None and self.top_k > max_top_k:
            raise TreeError(f"dynamic tree {self.name} takes top-{self.top_k} but top-k is at most {max_top_k}")
        return self


def parse_dynamic_tree(text: str, num_heads: int | None = None, max_top_k: int | None = None) -> DynamicTree:
    """ "dynamic:N" or "dynamic:N,k=K,d=D" (either suffix optional). Without d=, D = min(4, num_heads); without k=,
    `default_dynamic_top_k`."""
    if not text.startswith(DYNAMIC_PREFIX):
        raise TreeError(f"{text!r}: a dynamic tree is written dynamic:N[,k=K,d=D]")
    head, *options = text[len(DYNAMIC_PREFIX):].split(",")
    values = {}
    try:
        values["nodes"] = int(head)
        for option in options:
            key, sep, value = option.strip().partition("=")
            if not sep or key not in ("k", "d") or key in values:
                raise ValueError(option)
            values[key] = int(value)
    except ValueError:
        raise TreeError(f"{text!r}: a dynamic tree is written dynamic:N[,k=K,d=D] (integers)") from None
    depth = values.get("d", DEFAULT_DYNAMIC_DEPTH if num_heads is None else min(DEFAULT_DYNAMIC_DEPTH, num_heads))
    top_k = values.get("k", default_dynamic_top_k(values["nodes"], depth))
    return DynamicTree(values["nodes"], top_k, depth).check(num_heads, max_top_k)


@dataclasses.dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Static buffers of one tree (layout: docs/modules.md). Hashable by its paths, so it can be a static
    argument of a jitted function; the arrays become compile-time constants."""

    name: str
    paths: tuple[tuple[int, ...], ...]  # sorted by (length, ranks); node i + 1 is paths[i]
    top_k: int  # candidates needed per head (largest rank + 1)
    depth: int  # longest path = number of heads used
    ancestor_mask_tt: np.ndarray
    depth_t: np.ndarray
    parent_t: np.ndarray
    head_t: np.ndarray
    rank_t: np.ndarray
    candidate_index_t: np.ndarray
    retrieve_ce: np.ndarray
    retrieve_valid_ce: np.ndarray

    @property
    def num_tokens(self) -> int:
        """T: tree tokens verified per step, the root included."""
        return len(self.paths) + 1

    @property
    def num_leaves(self) -> int:
        return self.retrieve_ce.shape[0]

    def nodes_per_depth(self) -> list[int]:
        """Number of nodes at depth 1, 2, ... (the root excluded)."""
        return np.bincount(self.depth_t, minlength=self.depth + 1)[1:].tolist()

    def __eq__(self, other):
        return isinstance(other, TreeBuffers) and self.paths == other.paths

    def __hash__(self):
        return hash(self.paths)


def _normalise(choices, origin: str) -> list[tuple[int, ...]]:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) == 0:
        raise TreeError(f"{origin}: a tree must be a non-empty list of paths (lists of ranks), got {choices!r}")
    paths = []
    for path in choices:
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or len(path) == 0:
            raise TreeError(f"{origin}: every path must be a non-empty list of ranks, got {path!r}")
        for rank in path:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
                raise TreeError(f"{origin}: path {list(path)} holds {rank!r}; ranks must be integers")
            if rank < 0:
                raise TreeError(f"{origin}: path {list(path)} has a negative rank {rank}; ranks are 0-based")
        paths.append(tuple(int(r) for r in path))
    return paths


def build_tree(choices: Sequence[Sequence[int]], *, name: str = "custom", num_heads: int | None = None,
               max_top_k: int | None = None) -> TreeBuffers:
    """Validates a medusa_choices list and builds its buffers. `num_heads` bounds the depth and `max_top_k`
    the ranks when given."""
    paths = _normalise(choices, name)
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if path in seen:
            raise TreeError(f"{name}: path {list(path)} appears more than once")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeError(f"{name}: path {list(path)} has no parent: its prefix {list(path[:-1])} is missing")
        if num_heads is not None and len(path) > num_heads:
            raise TreeError(f"{name}: path {list(path)} has depth {len(path)} but there are only {num_heads} "
                            f"Medusa heads")
        if max_top_k is not None and max(path) >= max_top_k:
            raise TreeError(f"{name}: path {list(path)} uses rank {max(path)} but top-k is at most {max_top_k}")

    paths.sort(key=lambda p: (len(p), p))
    node_of = {p: i + 1 for i, p in enumerate(paths)}
    num_tokens, depth = len(paths) + 1, max(len(p) for p in paths)
    top_k = max(max(p) for p in paths) + 1

    depth_t = np.zeros(num_tokens, np.int32)
    parent_t = np.zeros(num_tokens, np.int32)
    head_t = np.full(num_tokens, -1, np.int32)
    rank_t = np.zeros(num_tokens, np.int32)
    mask_tt = np.zeros((num_tokens, num_tokens), bool)
    mask_tt[:, 0] = True  # every node sees the root
    for path, t in node_of.items():
        depth_t[t], head_t[t], rank_t[t] = len(path), len(path) - 1, path[-1]
        parent_t[t] = node_of.get(path[:-1], 0)
        for e in range(1, len(path) + 1):
            mask_tt[t, node_of[path[:e]]] = True
    candidate_index_t = np.where(head_t >= 0, 1 + head_t * top_k + rank_t, 0).astype(np.int32)

    has_child = {p[:-1] for p in paths}
    leaves = [p for p in paths if p not in has_child]
    retrieve_ce = np.zeros((len(leaves), depth + 1), np.int32)
    valid_ce = np.zeros((len(leaves), depth + 1), bool)
    valid_ce[:, 0] = True
    for c, leaf in enumerate(leaves):
        for e in range(1, len(leaf) + 1):
            retrieve_ce[c, e] = node_of[leaf[:e]]
            valid_ce[c, e] = True
    arrays = dict(ancestor_mask_tt=mask_tt, depth_t=depth_t, parent_t=parent_t, head_t=head_t, rank_t=rank_t,
                  candidate_index_t=candidate_index_t, retrieve_ce=retrieve_ce, retrieve_valid_ce=valid_ce)
    for a in arrays.values():
        a.setflags(write=False)
    return TreeBuffers(name=name, paths=tuple(paths), top_k=top_k, depth=depth, **arrays)


def load_tree(name_or_path: "str | os.PathLike | TreeBuffers | DynamicTree", *, num_heads: int | None = None,
              max_top_k: int | None = None) -> "TreeBuffers | DynamicTree":
    """A preset name (see PRESETS), a dynamic tree "dynamic:N[,k=K,d=D]" (a DynamicTree), or a JSON file holding a
    list of paths or {"medusa_choices": [...]}. A TreeBuffers or DynamicTree passes through (checked against
    num_heads / max_top_k)."""
    if isinstance(name_or_path, DynamicTree):
        return name_or_path.check(num_heads, max_top_k)
    if isinstance(name_or_path, str) and name_or_path.startswith(DYNAMIC_PREFIX):
        return parse_dynamic_tree(name_or_path, num_heads, max_top_k)
    if isinstance(name_or_path, TreeBuffers):
        return build_tree(name_or_path.paths, name=name_or_path.name, num_heads=num_heads, max_top_k=max_top_k)
    key = str(name_or_path)
    if key in PRESETS:
        return build_tree(PRESETS[key], name=key, num_heads=num_heads, max_top_k=max_top_k)
    path = Path(key)
    if not path.is_file():
        raise TreeError(f"unknown tree {key!r}: not a preset ({', '.join(PRESETS)}), not {DYNAMIC_PREFIX}N and not "
                        f"a file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TreeError(f"{path}: not valid JSON ({e})") from None
    if isinstance(raw, dict):
        if "medusa_choices" not in raw:
            raise TreeError(f"{path}: a JSON object must have a 'medusa_choices' list")
        raw = raw["medusa_choices"]
    return build_tree(raw, name=path.stem, num_heads=num_heads, max_top_k=max_top_k)
