"""Where the project keeps files on this machine, and how reports name paths.

`cache_root()` is the folder of everything built or cached outside the repository: the prepared demo model,
JAX's persistent compilation cache, tokenized data sets (`$MEDUSA_JAX_CACHE`, default `~/.cache/medusa_jax`).
`portable_path()` names a path without this machine's absolute prefix, for reports that get committed.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$MEDUSA_JAX_CACHE` if set, else `~/.cache/medusa_jax`."""
    root = os.environ.get("MEDUSA_JAX_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "medusa_jax"


def portable_path(path: str | os.PathLike) -> str:
    """`path` as reports should name it: relative to the repository when inside it, `$MEDUSA_JAX_CACHE/...`
    when inside the cache folder, else the folder's own name (no absolute path of this machine)."""
    path = Path(path).expanduser().resolve()
    repo = Path(__file__).resolve().parent.parent
    for root, label in ((repo, None), (cache_root().resolve(), "$MEDUSA_JAX_CACHE")):
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        return str(rel) if label is None else f"{label}/{rel}"
    return path.name
