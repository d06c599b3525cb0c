"""All-or-nothing writes: build a file or folder under a temporary name beside it, then rename it into place.
Every file replacement of the project goes through here (no os.replace/os.rename elsewhere).

An interrupted write (an exception, a kill) leaves the previous version, or nothing, never half a file.
Results get the usual permissions (0666/0777 less the umask), not mkstemp's private 0600/0700.
Temporary names are `.NAME.PID.RANDOM.tmp`; one left by a killed process (PID no longer running) is removed the
next time NAME is written.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}."


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Removes the temporary files/folders of `path` left by processes that no longer run; returns them."""
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    for p in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = p.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or _running(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_path(p) as tmp:` write the file `tmp` (by name, e.g. savefig); it becomes p on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator:
    """`with atomic_file(p) as f: f.write(...)` — p appears, complete, only when the block succeeds."""
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with atomic_file(path, "w") as f:
        f.write(text)
    return Path(path)


def pyplot():
    """matplotlib.pyplot on the Agg backend (lazy: seconds to import, and the backend is chosen before it loads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure_atomic(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """A matplotlib figure saved with `fig.savefig` under a temporary name, then renamed, and closed; the format
    is the path's suffix (png without one)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(str(tmp), format=path.suffix[1:] or "png", **savefig_kwargs)
    pyplot().close(fig)
    return path


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """`with atomic_folder(d) as tmp:` fill tmp; on success it replaces d (if `replace`) in one rename."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temp_prefix(folder), suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())
        if folder.exists():
            if not replace:
                raise FileExistsError(f"{folder} already exists")
            shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_entries(staging: str | os.PathLike, folder: str | os.PathLike, last: str) -> None:
    """Moves every entry of the folder `staging` into `folder` as one commit: `folder/last` is removed first and
    renamed in last, so a reader (or a kill) never sees the new entries under the old `last` (e.g. new weights
    under an old config.json). A folder entry replaces its namesake whole. `staging` is removed."""
    staging, folder = Path(staging), Path(folder)
    (folder / last).unlink(missing_ok=True)
    for entry in sorted(staging.iterdir()):
        if entry.name == last:
            continue
        target = folder / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    if (staging / last).exists():
        os.replace(staging / last, folder / last)
    shutil.rmtree(staging, ignore_errors=True)
