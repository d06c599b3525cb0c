"""Medusa candidate trees: the official `medusa_choices` format -> static NumPy buffers, built once.

A tree is a list of paths of 0-based top-k ranks: `[a]` is head 0's top-(a+1) token as a child of the root,
`[a, b]` then head 1's top-(b+1) token below it, and so on. Node 0 is the root (the base model's own next
token); nodes 1..n are the paths sorted by (length, ranks). With T = n + 1 tree tokens the buffers are:
    ancestor_mask_tt  [T, T] bool   node t sees its ancestors and itself (root column all ones)
    depth_t           [T] int32     0 for the root; position of node t = row length + depth_t[t]
    parent_t          [T] int32     parent node (the root is its own parent)
    head_t, rank_t    [T] int32     node t is head_t's top-(rank_t+1) token (root: -1, 0)
    candidate_index_t [T] int32     index into the flat candidate list [root, head0 top-k, head1 top-k, ...]
    retrieve_ce       [C, depth+1]  nodes of candidate path c (one per leaf) by depth e, root first, padded
                                    with 0 past the leaf
    retrieve_valid_ce [C, depth+1]  bool, False on padding
"""

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


@dataclasses.dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Static buffers of one tree (see the module docstring). Hashable by its paths, so it can be a static
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


def load_tree(name_or_path: "str | os.PathLike | TreeBuffers", *, num_heads: int | None = None,
              max_top_k: int | None = None) -> TreeBuffers:
    """A preset name (see PRESETS), or a JSON file holding a list of paths or {"medusa_choices": [...]}.
    A TreeBuffers passes through (checked against num_heads / max_top_k)."""
    if isinstance(name_or_path, TreeBuffers):
        return build_tree(name_or_path.paths, name=name_or_path.name, num_heads=num_heads, max_top_k=max_top_k)
    key = str(name_or_path)
    if key in PRESETS:
        return build_tree(PRESETS[key], name=key, num_heads=num_heads, max_top_k=max_top_k)
    path = Path(key)
    if not path.is_file():
        raise TreeError(f"unknown tree {key!r}: not a preset ({', '.join(PRESETS)}) and not a file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TreeError(f"{path}: not valid JSON ({e})") from None
    if isinstance(raw, dict):
        if "medusa_choices" not in raw:
            raise TreeError(f"{path}: a JSON object must have a 'medusa_choices' list")
        raw = raw["medusa_choices"]
    return build_tree(raw, name=path.stem, num_heads=num_heads, max_top_k=max_top_k)
