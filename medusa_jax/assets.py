"""Medusa heads shipped inside the package (package data under medusa_jax/assets/heads/<name>/).

`--heads default` resolves to the SmolLM2-135M-Instruct heads, trained by the command in the README's
"Training" section; any other value is taken as a heads folder path. The folder also carries `trees.json`,
the heads' Medusa tree per backend and batch size (`medusa_jax.heads_trees`, written by scripts/build_tree.py).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

DEFAULT_HEADS = "smollm2"  # for SmolLM2-135M-Instruct


def shipped_heads_dir(name: str = DEFAULT_HEADS) -> Path:
    """The folder of the shipped heads `name` (it may be missing in a source checkout without them)."""
    return Path(str(importlib.resources.files("medusa_jax"))) / "assets" / "heads" / name


def resolve_heads_dir(arg: str | os.PathLike) -> Path:
    """'default' -> the shipped SmolLM2 heads; anything else -> that folder. Raises FileNotFoundError."""
    if str(arg) == "default":
        folder = shipped_heads_dir()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--heads default: no shipped heads at {folder}; train them with the command "
                                    f"in the README's Training section, or pass a heads folder")
        return folder
    folder = Path(arg)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: heads folder does not exist")
    return folder
