"""The command lines' checks of input and output paths, run before any model loads or work starts; each failure
is a `UsageError` naming the flag and the fix (what is checked: docs/modules.md)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from medusa_jax.heads import recycle_file


class UsageError(ValueError):
    """A bad flag, path or combination; the message names the flag and the fix."""


def fail(e: BaseException) -> int:
    """Prints `error: MESSAGE` as one line on stderr; returns exit status 2."""
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"error: {message}", file=sys.stderr)
    return 2


# ---- inputs ------------------------------------------------------------------------------------------------------
def given(flag: str, value: str | None, what: str) -> None:
    """A flag given as '' (or blanks) names nothing: refused rather than read as 'not given'."""
    if value is not None and not str(value).strip():
        raise UsageError(f"{flag}: empty value; give {what} (or leave the flag out)")


def recycle_table_file(flag: str, path: str | os.PathLike | None) -> None:
    """A Token Recycling table file (heads.recycle_file) that loads; its vocabulary is checked with the model."""
    if path is None:
        return
    given(flag, path, "a recycling table file (.npz)")
    input_file(flag, path)
    try:
        recycle_file.load_table(path)
    except recycle_file.RecycleFileError as e:
        raise UsageError(f"{flag} {e}") from None


def file_read_by(flag: str, path: str | os.PathLike | None, read: Callable[[Path], object]) -> None:
    """An input file (e.g. --question-file) that exists, is readable and that `read` accepts (it is read again when
    the command runs); `read` raises ValueError (UnicodeDecodeError included) or OSError for a bad file."""
    if path is None:
        return
    input_file(flag, path)
    try:
        read(Path(path))
    except (ValueError, OSError) as e:
        raise UsageError(f"{flag} {path}: {e}") from None


def input_file(flag: str, path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder: give a file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{flag} {path}: not readable (check its permissions)")
    return path


# ---- outputs -----------------------------------------------------------------------------------------------------
def not_an_input(flag: str, path: str | os.PathLike, inputs: Mapping[str, "str | os.PathLike | None"]) -> None:
    """Refuses an output that is an input, or inside an input folder."""
    out = Path(path).expanduser().resolve()
    for in_flag, given in inputs.items():
        if given is None:
            continue
        src = Path(given).expanduser().resolve()
        if out == src or (out.exists() and src.exists() and os.path.samefile(out, src)):
            raise UsageError(f"{flag} {path} is the {in_flag} {'folder' if src.is_dir() else 'file'}: writing it "
                             f"would destroy the input; choose another {flag}")
        if src.is_dir() and out.is_relative_to(src):
            raise UsageError(f"{flag} {path} is inside the {in_flag} folder {given}: it would overwrite or add to "
                             f"the input; choose a path outside it")


def writable_place(flag: str, path: str | os.PathLike) -> None:
    """The nearest existing ancestor of `path` is a writable folder (no ancestor is a regular file)."""
    path = Path(path).expanduser().absolute()
    parent = path.parent
    while not parent.exists():
        if parent.is_symlink():
            raise UsageError(f"{flag} {path}: {parent} is a broken link")
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder; choose a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {parent} (permission denied); choose a writable place")
    try:  # os.access says yes to root everywhere, also in /proc and /sys: create (and remove) a file to be sure
        fd, probe = tempfile.mkstemp(prefix=".medusa_jax_probe.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {parent} ({e.strerror or e}); choose a writable "
                         f"place") from None


def output_file(flag: str, path: str | os.PathLike, inputs: Mapping[str, "str | os.PathLike | None"] = {}) -> Path:
    """A file the command will write (or append to): writable, not a folder, not an input."""
    return _output(flag, path, inputs, folder=False)


def output_folder(flag: str, path: str | os.PathLike, inputs: Mapping[str, "str | os.PathLike | None"] = {}) -> Path:
    """A folder the command will create or write into: a folder (or absent), writable, not an input."""
    return _output(flag, path, inputs, folder=True)


def _output(flag: str, path, inputs, folder: bool) -> Path:
    if not str(path).strip():
        raise UsageError(f"{flag}: empty path; give {'a folder' if folder else 'a file name'}")
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise UsageError(f"{flag} {path} is a file: give a folder (it may not exist yet)" if folder else
                         f"{flag} {path} is a folder: give a file name")
    writable_place(flag, path)
    if path.exists() and not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
        raise UsageError(f"{flag} {path}: the {'folder' if folder else 'file'} is not writable (check its "
                         f"permissions)")
    not_an_input(flag, path, inputs)
    return path
