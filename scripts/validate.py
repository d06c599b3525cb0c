"""The command lines' checks of paths, models, data and meshes, run before any model loads or work starts.

Numbers are checked at parse time (`cli_args.ArgumentParser`); this module checks what the numbers cannot say:
- inputs (`--model`, `--data`, `--heads`, prompt files) exist and are readable, and a model folder is one this
  backbone loads (config.json of a supported architecture, weights, a tokenizer) — read from config.json alone;
  what is cheap to read is read: tree specs, question files, a ShareGPT --data file up to its first usable
  conversation, a heads folder's config.json and trees.json; a flag given as '' is refused, not ignored;
- outputs can be written (the nearest existing parent is a writable folder where a file can really be created —
  root passes os.access everywhere, /proc and /sys included —, no parent is a regular file, an
  existing file is writable) and are not an input, nor inside an input folder (`--output MODEL/config.json` is
  refused: it would overwrite the model);
- meshes fit the devices and the batch sizes they split.
Every failure is a `UsageError` whose message names the flag and the fix; the scripts print it as one
`error:` line and exit with status 2 (`fail`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import jax

from medusa_jax.assets import SHIPPED_HEADS, is_default_model, resolve_heads_dir, shipped_heads_dir
from medusa_jax.demo_model import default_model_dir, resolve_model_dir
from medusa_jax.heads import recycle, recycle_file
from medusa_jax.trees import trees_file
from medusa_jax.trees.tree import DYNAMIC_PREFIX, PRESETS, TreeError, load_tree
from medusa_jax.inference.mixed_decoding import UNTRAINED, MixError, parse_mix
from medusa_jax.hub import cached_folder, is_hub_id
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training import hidden_store
from medusa_jax.training.sharegpt import DataError, read_conversation_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class UsageError(ValueError):
    """A bad flag, path or combination; the message names the flag and the fix."""


def fail(e: BaseException) -> int:
    """Prints `error: MESSAGE` as one line on stderr; returns exit status 2."""
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"error: {message}", file=sys.stderr)
    return 2


# ---- where an input lives (cheap: nothing is built or downloaded) -----------------------------------------------
def model_location(arg: str | os.PathLike | None) -> Path | None:
    """The folder `--model ARG` names, for comparisons: a local path, the default model's cache folder (built
    or not), a cached Hub snapshot, or None (a Hub id not cached yet)."""
    if arg is None:
        return None
    if is_default_model(arg):
        return default_model_dir()
    if is_hub_id(arg):
        return cached_folder(str(arg))
    return Path(arg)


def heads_location(arg: str | os.PathLike | None) -> Path | None:
    if arg is None or str(arg) == recycle.HEAD_TYPE:  # Token Recycling reads no folder
        return None
    if str(arg) in SHIPPED_HEADS:
        return shipped_heads_dir(SHIPPED_HEADS[str(arg)])
    if is_hub_id(arg):
        return cached_folder(str(arg))
    return Path(arg)


# ---- inputs ------------------------------------------------------------------------------------------------------
def given(flag: str, value: str | None, what: str) -> None:
    """A flag given as '' (or blanks) names nothing: refused rather than read as 'not given'."""
    if value is not None and not str(value).strip():
        raise UsageError(f"{flag}: empty value; give {what} (or leave the flag out)")


def tree_arg(flag: str, spec: str | None) -> None:
    """A tree spec (preset, dynamic:N[,k=K,d=D] or JSON file) parsed now, before any model loads; how it fits the
    heads (their number, their top-k) is checked when they load."""
    if spec is None:
        return
    given(flag, spec, f"a preset ({', '.join(PRESETS)}), {DYNAMIC_PREFIX}N or a tree JSON file")
    if spec not in PRESETS and not spec.startswith(DYNAMIC_PREFIX):
        input_file(flag, spec)
    try:
        load_tree(spec)
    except (TreeError, ValueError, OSError) as e:
        raise UsageError(f"{flag} {spec}: {e}") from None


def recycle_tree(flag: str, spec: str | None) -> None:
    """A --tree for `--heads recycle`: a template (recycle.TEMPLATES), or a preset or tree file whose paths are
    at most recycle.DEFAULT_MAX_DEPTH deep and use ranks below the table's width; never a dynamic tree."""
    if spec is None or spec in recycle.TEMPLATES:
        return
    if spec.startswith(DYNAMIC_PREFIX):
        raise UsageError(f"{flag} {spec}: Token Recycling drafts a static template, not a dynamic tree; give one of "
                         f"{', '.join(recycle.TEMPLATES)}, a preset or a tree file")
    tree_arg(flag, spec)
    try:
        load_tree(spec, num_heads=recycle.DEFAULT_MAX_DEPTH, max_top_k=recycle.DEFAULT_TOP_K)
    except (TreeError, ValueError, OSError) as e:
        raise UsageError(f"{flag} {spec}: {e} (Token Recycling drafts from a table of {recycle.DEFAULT_TOP_K} "
                         f"successors per token, at most {recycle.DEFAULT_MAX_DEPTH} deep)") from None


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


def model_folder(flag: str, folder: str | os.PathLike, *, tokenizer: bool = True, weights: bool = True) -> Path:
    """A local model folder this backbone loads: config.json of a supported architecture, weights, tokenizer."""
    folder = Path(folder)
    if not folder.exists():
        raise UsageError(f"{flag} {folder} does not exist (give a HF model folder, 'default', or a Hub id ORG/NAME)")
    if not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file, not a model folder (give the folder that holds config.json, "
                         f"the weights and the tokenizer)")
    config = folder / "config.json"
    try:
        hf = json.loads(config.read_text())
        ModelConfig.from_hf_config(hf)
    except FileNotFoundError:
        raise UsageError(f"{flag} {folder}: not a HF model folder (no config.json)") from None
    except PermissionError:
        raise UsageError(f"{flag} {folder}: config.json is not readable (check its permissions)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{flag} {folder}: config.json does not describe a model medusa-jax loads ({e})") from None
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise UsageError(f"{flag} {folder}: no weights (expected one of {', '.join(WEIGHT_FILES)})")
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{flag} {folder}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    return folder


def max_positions(folder: Path) -> int:
    return ModelConfig.from_hf_config(json.loads((Path(folder) / "config.json").read_text())).max_position_embeddings


def model_arg(flag: str, arg: str, *, tokenizer: bool = True) -> Path:
    """`--model ARG` checked without building anything when it is a local folder; 'default' and Hub ids are
    resolved (built once / read from the Hugging Face cache, downloaded if online), then checked."""
    if is_default_model(arg) or is_hub_id(arg):
        try:
            folder = resolve_model_dir(arg)
        except (OSError, RuntimeError) as e:
            raise UsageError(f"{flag} {arg}: {e}") from None
    else:
        folder = Path(arg)
    return model_folder(flag, folder, tokenizer=tokenizer)


def heads_arg(flag: str, arg: str) -> Path:
    try:
        folder = resolve_heads_dir(arg)
    except OSError as e:
        raise UsageError(f"{e}") from None
    if not (folder / "config.json").is_file():
        raise UsageError(f"{flag} {folder}: not a heads folder (no config.json)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"{flag} {folder}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag} {folder}: config.json is not a JSON object; give a heads folder")
    try:  # the heads' own trees (read when decoding without --tree) must parse
        trees_file.read_trees_file(folder / trees_file.FILE_NAME)
    except (ValueError, OSError) as e:
        raise UsageError(f"{flag} {folder}: its {trees_file.FILE_NAME} is unreadable ({e}); rebuild it with "
                         f"scripts/build_tree.py or remove it") from None
    return folder


def heads_mix_arg(flag: str, arg: str) -> Path | None:
    """A --heads mix (`inference.mixed_decoding`: drafters joined by '+', e.g. default+lookup): every part a
    drafter that needs no folder or a heads folder (checked as `heads_arg`); returns the heads folder or None."""
    for part in arg.split("+"):
        if part.strip() and part not in UNTRAINED and part not in SHIPPED_HEADS and not is_hub_id(part) \
                and not Path(part).exists():
            raise UsageError(f"{flag} {arg}: {part!r} is neither a drafter ({', '.join(UNTRAINED)}) nor a heads "
                             f"folder ('default', 'default-medusa', a folder or a Hub id)")
    try:
        _, trained = parse_mix(arg)
    except MixError as e:
        raise UsageError(f"{flag} {e}") from None
    return None if trained is None else heads_arg(flag, trained)


def data_arg(flag: str, arg: str | None) -> Path | None:
    """--data: 'sharegpt', a readable ShareGPT file holding a usable conversation, a saved dataset /
    self-distilled store / feature store folder, or a datasets name (checked when read). Returns the local path,
    or None for a name."""
    if arg is None or arg == "sharegpt":
        return None
    path = Path(arg)
    if path.is_file():
        input_file(flag, path)
        try:  # read up to the first usable conversation: a broken file fails now, not after the model loads
            read_conversation_file(path, limit=1)
        except (DataError, UnicodeDecodeError, OSError) as e:
            message = str(e)
            raise UsageError(f"{flag} {message}" if message.startswith(str(path)) else
                             f"{flag} {path}: {message}") from None
        return path
    if path.is_dir():
        known = (hidden_store.is_store(path) or hidden_store.first_format_folder(path) is not None
                 or any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")))
        if not known:
            raise UsageError(f"{flag} {path} is a folder but not a saved dataset (dataset_info.json), a self-distilled "
                             f"store or a feature store: give a ShareGPT .json/.jsonl file or such a folder")
        return path
    if path.exists():
        raise UsageError(f"{flag} {path}: neither a file nor a folder")
    if path.suffix in (".json", ".jsonl", ".arrow") or str(arg).startswith((".", "/", "~")) or str(arg).count("/") > 1:
        raise UsageError(f"{flag} {path}: no such file or folder")
    return None


# ---- outputs -----------------------------------------------------------------------------------------------------
def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def not_an_input(flag: str, path: str | os.PathLike, inputs: Mapping[str, "str | os.PathLike | None"]) -> None:
    """Refuses an output that is an input, or inside an input folder."""
    out = Path(path).expanduser().resolve()
    for in_flag, given in inputs.items():
        if given is None:
            continue
        src = Path(given).expanduser().resolve()
        same = out == src or (out.exists() and src.exists() and os.path.samefile(out, src))
        if same:
            raise UsageError(f"{flag} {path} is the {in_flag} {'folder' if src.is_dir() else 'file'}: writing it "
                             f"would destroy the input; choose another {flag}")
        if src.is_dir() and _inside(out, src):
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
    if not str(path).strip():
        raise UsageError(f"{flag}: empty path; give a file name")
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder: give a file name")
    writable_place(flag, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable (check its permissions)")
    not_an_input(flag, path, inputs)
    return path


def output_folder(flag: str, path: str | os.PathLike, inputs: Mapping[str, "str | os.PathLike | None"] = {}) -> Path:
    """A folder the command will create or write into: a folder (or absent), writable, not an input."""
    if not str(path).strip():
        raise UsageError(f"{flag}: empty path; give a folder")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file: give a folder (it may not exist yet)")
    writable_place(flag, path)
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the folder is not writable (check its permissions)")
    not_an_input(flag, path, inputs)
    return path


# ---- meshes ------------------------------------------------------------------------------------------------------
def mesh_devices(flag: str, spec: str | None, local: bool = False):
    """The parsed --mesh, checked against the devices there are (call after distributed initialisation)."""
    mesh = MeshConfig.parse(spec)
    available = len(jax.local_devices() if local else jax.devices())
    if mesh.size > available:
        raise UsageError(f"{flag} {spec}: needs {mesh.size} devices, {available} available; use a smaller mesh "
                         f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N forces N devices)")
    return mesh


def divides_rows(flag: str, value: int, mesh_flag: str, spec: str | None) -> None:
    """A training batch that must split evenly over the mesh's data x fsdp rows."""
    mesh = MeshConfig.parse(spec)
    rows = mesh.data * mesh.fsdp
    if value % rows:
        raise UsageError(f"{flag} {value} does not split over {mesh_flag} {spec} (data x fsdp = {rows}): use a "
                         f"multiple of {rows}")
