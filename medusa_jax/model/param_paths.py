"""NNX state leaves by parameter path: the one walk that the HF loader and saver, the heads files and the
sharding rules share. A path is the tuple of attribute names and list indices down to a leaf, e.g.
("layers", "0", "self_attn", "q_proj", "kernel"); the Variable's own `.value` step is dropped."""

from __future__ import annotations

from typing import Callable

import jax

ParamPath = tuple[str, ...]


def _key_str(key) -> str | None:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    return None  # the Variable's `.value` attribute


def _path(key_path) -> ParamPath:
    return tuple(k for k in map(_key_str, key_path) if k is not None)


def param_paths(state) -> list[tuple[ParamPath, jax.ShapeDtypeStruct]]:
    """Every leaf of an (abstract or concrete) NNX state with its parameter path, in tree order."""
    return [(_path(key_path), leaf) for key_path, leaf in jax.tree_util.tree_leaves_with_path(state)]


def fill_state(state, values: Callable[[ParamPath, jax.ShapeDtypeStruct], jax.Array]):
    """Replaces every leaf of an (abstract) NNX state by values(path, leaf)."""
    return jax.tree_util.tree_map_with_path(lambda key_path, leaf: values(_path(key_path), leaf), state)
