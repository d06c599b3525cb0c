"""THE tree policy: `choose_tree` gives the tree to decode with, or plain decoding, and why. A tree the caller gives
always wins; else the heads' own tree for this batch size, calibrated on this machine when a model is at hand
(`calibration`), else trees.json's choice as shipped (`trees_file.resolve_tree`). `HEADS_TREE` asks for the heads'
own (BatchSettings.tree, inference/api.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax

from medusa_jax.trees.tree import DynamicTree, TreeBuffers, build_tree, load_tree
from medusa_jax.trees.trees_file import HeadsTrees, resolve_tree
from medusa_jax.trees.policy.calibration import Calibrated, calibrated_paths, check_mode


@dataclasses.dataclass(frozen=True)
class HeadsOwnTree:
    """The heads' own tree for the backend and batch size, calibrated or as shipped, or plain where none pays."""


HEADS_TREE = HeadsOwnTree()  # BatchSettings.tree: the heads' own tree (or plain where none pays)


@dataclasses.dataclass(frozen=True)
class ChosenTree:
    tree: TreeBuffers | DynamicTree | None  # None: decode plainly
    note: str  # where the tree came from, or why decoding is plain, for logs and JSON rows


def choose_tree(heads_config, trees: HeadsTrees | None, batch_size: int,
                tree: "str | os.PathLike | TreeBuffers | DynamicTree | None" = None, *, model=None,
                calibration: str | None = None, progress: bool = True) -> ChosenTree:
    """The tree to decode with (the module docstring's order). `heads_config`: the heads' HeadsConfig (trees are
    checked against its heads and ranks); `trees`: their trees.json (`trees_file.trees_of`); `model`: an
    `inference.sharded.ShardedModel` with these heads, to calibrate on (None: no calibration); `calibration`:
    "auto", "redo" or "skip" (None: $MEDUSA_JAX_CALIBRATION or "auto"); `progress`: calibration's progress
    lines on stderr."""
    limits = dict(num_heads=heads_config.num_heads, max_top_k=heads_config.head_vocab_size)
    if tree is not None:
        given = load_tree(tree, **limits)
        if isinstance(given, DynamicTree):
            return ChosenTree(given, f"dynamic tree {given.name} (given)")
        return ChosenTree(given, f"tree {given.name} of {len(given.paths)} nodes (given)")
    mode = None if model is None else check_mode(calibration)
    if mode not in (None, "skip") and trees is not None:
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else None
        result = calibrated_paths(model, trees, jax.default_backend(), batch_size, mode, progress=say)
        if isinstance(result, Calibrated):
            return ChosenTree(result.tree, result.note)
    resolution = resolve_tree(trees, jax.default_backend(), batch_size)
    if resolution.plain:
        return ChosenTree(None, resolution.note)
    if resolution.dynamic is not None:
        return ChosenTree(resolution.dynamic.check(**limits), resolution.note)
    if resolution.preset is not None:
        return ChosenTree(load_tree(resolution.preset, **limits), resolution.note)
    name = f"heads_{resolution.backend}_batch{resolution.batch}"
    return ChosenTree(build_tree(resolution.paths, name=name, **limits), resolution.note)
