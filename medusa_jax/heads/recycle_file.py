"""Token Recycling tables on disk (an .npz of `table` [V, r] and a JSON `meta`) and the shipped SmolLM2 table, used
only where the model's fingerprint matches (`starting_table`); the format and its checks: docs/recycle.md."""

from __future__ import annotations

import hashlib
import importlib.resources
import io
import json
import os
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from medusa_jax.atomic import atomic_file
from medusa_jax.model.backbone import CausalLM

FORMAT = "medusa-jax-recycle-table"
VERSION = 1
SHIPPED_TABLE = "smollm2.npz"  # under medusa_jax/assets/recycle/: SmolLM2-135M-Instruct's warm table
FINGERPRINT_ROWS = 64  # embedding rows hashed into the fingerprint


class RecycleFileError(ValueError):
    """A table file that cannot be read, or does not fit the model."""


def shipped_table_path() -> Path:
    return Path(str(importlib.resources.files("medusa_jax"))) / "assets" / "recycle" / SHIPPED_TABLE


def model_fingerprint(base: CausalLM) -> str:
    """The architecture's sizes plus a digest of the first FINGERPRINT_ROWS input embeddings rounded to
    bfloat16 (the same for a float32 or a bfloat16 load of one checkpoint)."""
    c = base.config
    rows_vd = base.embed_tokens.embedding[...][:FINGERPRINT_ROWS]
    if not rows_vd.is_fully_addressable:  # split over processes: every process gathers the same rows
        from jax.experimental import multihost_utils
        rows_vd = multihost_utils.process_allgather(rows_vd, tiled=True)
    digest = hashlib.sha256(np.asarray(jnp.asarray(rows_vd).astype(jnp.bfloat16)).tobytes()).hexdigest()[:16]
    return (f"{c.model_type}-v{c.vocab_size}-d{c.hidden_size}-f{c.intermediate_size}-l{c.num_layers}-"
            f"n{c.num_heads}-k{c.num_kv_heads}-emb{digest}")


def save_table(path: str | os.PathLike, table_vr: np.ndarray, *, model: str, note: str = "") -> Path:
    """Writes a table file (atomically); returns its path."""
    table_vr = np.asarray(table_vr)
    vocab, top_k = table_vr.shape
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    meta = dict(format=FORMAT, version=VERSION, vocab_size=int(vocab), top_k=int(top_k), model=model, note=note)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, table=table_vr.astype(dtype), meta=np.asarray(json.dumps(meta)))
    path = Path(path)
    with atomic_file(path) as f:
        f.write(buffer.getvalue())
    return path


def load_table(path: str | os.PathLike, vocab_size: int | None = None) -> tuple[np.ndarray, dict]:
    """(table [V, r] int32, meta) of a table file; RecycleFileError names what is wrong."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            if set(archive.files) != {"table", "meta"}:
                raise RecycleFileError(f"{path}: not a recycling table (entries {sorted(archive.files)}, expected "
                                       f"'meta' and 'table')")
            meta, table = json.loads(str(archive["meta"])), archive["table"]
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        if isinstance(e, RecycleFileError):
            raise
        raise RecycleFileError(f"{path}: not a recycling table file ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise RecycleFileError(f"{path}: not a {FORMAT} file of version {VERSION}")
    if table.ndim != 2 or table.dtype not in (np.uint16, np.uint32) or table.shape != (meta.get("vocab_size"),
                                                                                       meta.get("top_k")):
        raise RecycleFileError(f"{path}: table of shape {table.shape} and dtype {table.dtype} does not match its "
                               f"header (vocab_size {meta.get('vocab_size')}, top_k {meta.get('top_k')})")
    if table.size and int(table.max()) >= table.shape[0]:
        raise RecycleFileError(f"{path}: holds token id {int(table.max())} >= its vocab_size {table.shape[0]}")
    if vocab_size is not None and table.shape[0] != vocab_size:
        raise RecycleFileError(f"{path}: a table for a vocabulary of {table.shape[0]} tokens; the model has "
                               f"{vocab_size}")
    return table.astype(np.int32), meta


def starting_table(base: CausalLM, path: str | os.PathLike | None = None, fingerprint: str | None = None
                   ) -> tuple[np.ndarray | None, str]:
    """(table or None: start empty, where it came from): the file at `path` if given (vocabulary checked), else
    the shipped SmolLM2 table where the model's fingerprint (`model_fingerprint`) matches its own."""
    if path is not None:
        table, _ = load_table(path, base.config.vocab_size)
        return table, f"recycling table {Path(path).name}"
    shipped = shipped_table_path()
    if shipped.is_file():
        table, meta = load_table(shipped)
        if table.shape[0] == base.config.vocab_size and meta["model"] == (fingerprint or model_fingerprint(base)):
            return table, "the shipped warm SmolLM2 recycling table"
    return None, "an empty recycling table (warms up as it decodes)"
