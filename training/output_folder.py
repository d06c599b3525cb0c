"""The training output folder: refuse folders the trainer did not write, one run at a time, a clean log on resume,
the final files in one commit; the rules are in docs/modules.md."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Iterator

from medusa_jax.atomic import write_text_atomic

MARKER = ".medusa_jax_train"
LOCK = ".train.lock"
LOG = "train_log.jsonl"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")


class OutputFolderError(ValueError):
    """The output folder is not one the trainer may write (the message says why and what to do)."""


def _holds_model(folder: Path) -> bool:
    """A model folder: a config.json with a model_type next to weights, or weights of any kind but ours."""
    weights = [p.name for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.name != "heads.safetensors"]
    config = folder / "config.json"
    if config.is_file():
        try:
            hf = json.loads(config.read_text())
        except (OSError, ValueError):
            hf = {}
        if isinstance(hf, dict) and "model_type" in hf and "medusa_num_heads" not in hf:
            return True
    return bool(weights)


def check_output(output: str | os.PathLike, force: bool = False) -> None:
    """Refuses a file, a model folder, or (without `force`) a non-empty folder the trainer did not write."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"--output {out} is a file; give a folder for the heads (it may not exist yet)")
    if not out.is_dir() or (out / MARKER).exists() or not any(out.iterdir()):
        return
    if _holds_model(out):
        raise OutputFolderError(f"--output {out} holds a model (config.json with a model_type, or weights); the "
                                f"trainer would overwrite its config.json: choose another --output")
    if not force:
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise OutputFolderError(f"--output {out} holds files the trainer did not write ({shown}); choose a new or "
                                f"empty folder, or pass --force-output to add the trainer's files to it")


class OutputLock:
    """`with OutputLock(folder):` creates the folder and its marker, and holds the folder's exclusive lock."""

    def __init__(self, output: str | os.PathLike):
        self.folder = Path(output)
        self._fd: int | None = None
        self._made: list[Path] = []

    def __enter__(self) -> "OutputLock":
        self._made = missing_folders(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if not (self.folder / MARKER).exists():
            write_text_atomic(self.folder / MARKER, json.dumps({"written_by": "medusa_jax scripts/train_heads.py"}))
        self._fd = exclusive_lock(self.folder / LOCK, f"--output {self.folder} is in use by another training run (it "
                                  f"holds {self.folder / LOCK}); wait for it to finish or choose another --output")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._fd is None:
            return
        if exc_type is not None and self._made and {p.name for p in self.folder.iterdir()} <= {MARKER, LOCK}:
            for name in (MARKER, LOCK):  # a run that failed before writing anything: leave no folder behind
                (self.folder / name).unlink(missing_ok=True)
            remove_empty(self._made)
        unlock(self._fd)
        self._fd = None


def missing_folders(path: str | os.PathLike) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first (what mkdir(parents=True) would make)."""
    path, made = Path(path).absolute(), []
    while not path.exists() and path != path.parent:
        made.append(path)
        path = path.parent
    return made


def remove_empty(folders: list[Path]) -> None:
    """Removes the folders (deepest first) that are empty; stops at the first one that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def made_folders(path: str | os.PathLike, include_path: bool = False) -> Iterator[None]:
    """Creates `path`'s missing parent folders; if the block fails, removes those of them still empty (and
    `path` itself, with `include_path`, when the block made it and left it empty)."""
    made = missing_folders(Path(path) if include_path else Path(path).parent)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


class FileLock:
    """`with FileLock(path, flag):` one writer for `path` at a time: an exclusive flock on the hidden file
    `.NAME.lock` beside it (the OS drops it when the process dies), removed when released. A second writer
    stops with OutputFolderError naming `flag`."""

    def __init__(self, path: str | os.PathLike, flag: str = "--output"):
        self.path = Path(path)
        self.lock = self.path.with_name(f".{self.path.name}.lock")
        self.flag = flag
        self._fd: int | None = None

    def __enter__(self) -> "FileLock":
        self._fd = exclusive_lock(self.lock, f"{self.flag} {self.path} is being written by another run (it holds "
                                  f"{self.lock}); wait for it to finish or choose another {self.flag}")
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            self.lock.unlink(missing_ok=True)
            unlock(self._fd)
            self._fd = None


def exclusive_lock(path: Path, busy: str) -> int:
    """An exclusive flock on the file `path` (made if missing) holding this process's id; OutputFolderError(busy)
    when another process holds it. Returns the file descriptor (`unlock` releases it)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputFolderError(busy) from None
        try:  # the holder before us may have removed the file after we opened it: lock the file on disk
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def check_previous_run(output: str | os.PathLike, checkpoint_dir: str | os.PathLike, resume: bool) -> None:
    """Without --resume, a folder with checkpoints or a training log is refused (nothing is deleted)."""
    if resume:
        return
    folder, log = Path(checkpoint_dir), Path(output) / LOG  # the Orbax step folders, read without Orbax:
    steps = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()) if folder.is_dir() else []
    if steps:
        raise OutputFolderError(f"{checkpoint_dir} already holds checkpoints (latest step {steps[-1]}): pass --resume "
                                f"to continue that run, or choose another --output/--checkpoint-dir")
    if log.exists():
        raise OutputFolderError(f"{log} holds a previous run's log: pass --resume to continue that run (the log is "
                                f"cut back to its last checkpoint), or choose another --output")


def truncate_log(output: str | os.PathLike, step: int) -> int:
    """Keeps the train_log.jsonl records of steps <= `step` (atomic rewrite); returns how many were dropped."""
    log = Path(output) / LOG
    if not log.exists():
        return 0
    def kept(line: str) -> bool:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut off by a kill
            return False
        return isinstance(record, dict) and record.get("step", 0) <= step

    lines = log.read_text().splitlines()
    keep = [line for line in lines if kept(line)]
    if len(keep) < len(lines):
        write_text_atomic(log, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)
