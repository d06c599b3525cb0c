"""Medusa-1 CPU path: run the frozen backbone over the data once and keep its final hidden states.

With the backbone frozen, every epoch would recompute the same hidden states; caching them makes an epoch cost
only the heads. Only positions that have at least one head target are kept, as flat examples
(hidden [N, D] float16, targets [N, K] full-vocab ids, -1 = none; for Hydra heads also path [N, K], the
tokens t + 1 .. t + K), so padding and prompt-only positions cost nothing afterwards.

The cache lives in a folder keyed by (backbone weights, data rows, number of heads, path or not) and is
written in chunks (each written to a temp file and renamed): an interrupted build resumes at the first
missing chunk.
On a GPU the backbone is cheap next to the step overhead; keep it in the step there (the default).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.hydra_heads import path_tokens
from medusa_jax.training.data import EpochIterator, PackedRows
from medusa_jax.training.losses import head_targets
from medusa_jax.training.trainer import backbone_hidden

CHUNK_ROWS = 64
STORE_DTYPE = np.float16


def rows_fingerprint(rows: PackedRows) -> str:
    h = hashlib.sha256()
    for a in (rows.tokens_rl, rows.segment_ids_rl, rows.loss_mask_rl):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(base: CausalLM) -> str:
    """Cheap identity of the backbone: config + a few sampled weight values of every parameter."""
    h = hashlib.sha256(repr(base.config).encode())
    for _, leaf in sorted(nnx.to_flat_state(nnx.state(base, nnx.Param)), key=lambda kv: str(kv[0])):
        flat = np.asarray(jax.device_get(leaf[...])).reshape(-1)
        h.update(flat[:: max(1, flat.size // 64)][:64].astype(np.float32).tobytes())
    return h.hexdigest()[:16]


@partial(jax.jit, static_argnums=0)
def _hidden_rows(graphdef, state, tokens, positions, segments):
    base = nnx.merge(graphdef, state)
    return backbone_hidden(base, {"tokens": tokens, "positions": positions, "segment_ids": segments})


class HiddenCache:
    """Flat (hidden, targets) examples; `arrays()` loads all chunks into memory."""

    def __init__(self, folder: Path):
        self.folder = folder

    def arrays(self) -> dict[str, np.ndarray]:
        meta = json.loads((self.folder / "meta.json").read_text())
        parts = [np.load(self.folder / f"chunk_{c:05d}.npz") for c in range(meta["chunks"])]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0].files}


def build_hidden_cache(base: CausalLM, rows: PackedRows, num_heads: int, root: str | os.PathLike,
                       batch_rows: int = 8, progress: Callable[[int, int], None] | None = None,
                       with_path: bool = False) -> HiddenCache:
    """Computes (or reuses) the cache of `rows` under `root`. `progress(done_rows, total_rows)` is called
    after each chunk. `with_path`: also keep each position's path tokens (Hydra heads)."""
    key = f"{model_fingerprint(base)}-{rows_fingerprint(rows)}-k{num_heads}" + ("-path" if with_path else "")
    folder = Path(root) / key
    folder.mkdir(parents=True, exist_ok=True)
    chunks = -(-rows.num_rows // CHUNK_ROWS)
    if (folder / "meta.json").exists():
        return HiddenCache(folder)
    graphdef, state = nnx.split(base)
    targets_krt = np.asarray(head_targets(jnp.asarray(rows.tokens_rl), jnp.asarray(rows.loss_mask_rl),
                                          jnp.asarray(rows.segment_ids_rl), num_heads))
    for c in range(chunks):
        path = folder / f"chunk_{c:05d}.npz"
        if path.exists():
            continue
        lo, hi = c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, rows.num_rows)
        hidden, targets, paths = [], [], []
        for b0 in range(lo, hi, batch_rows):
            idx = np.arange(b0, b0 + batch_rows) % rows.num_rows  # a short last batch repeats rows: one shape
            part = rows.rows(idx)
            h_btd = np.asarray(_hidden_rows(graphdef, state, jnp.asarray(part.tokens_rl),
                                            jnp.asarray(part.positions_rl),
                                            jnp.asarray(part.segment_ids_rl)))
            keep = min(batch_rows, hi - b0)
            t_kbt = targets_krt[:, b0:b0 + keep]
            sel_bt = (t_kbt >= 0).any(axis=0)
            if np.abs(h_btd[:keep][sel_bt]).max(initial=0.0) > np.finfo(STORE_DTYPE).max:
                raise OverflowError("hidden states exceed the float16 range; this backbone cannot use the cache")
            hidden.append(h_btd[:keep][sel_bt].astype(STORE_DTYPE))
            targets.append(np.moveaxis(t_kbt, 0, -1)[sel_bt].astype(np.int32))
            paths.append(path_tokens(rows.tokens_rl[b0:b0 + keep], num_heads)[sel_bt])
        tmp = folder / f".chunk_{c:05d}.tmp.npz"
        extra = {"path": np.concatenate(paths)} if with_path else {}
        np.savez(tmp, hidden=np.concatenate(hidden), targets=np.concatenate(targets), **extra)
        os.replace(tmp, path)
        if progress is not None:
            progress(hi, rows.num_rows)
    tmp = folder / ".meta.json.tmp"
    tmp.write_text(json.dumps({"chunks": chunks, "rows": rows.num_rows, "num_heads": num_heads}))
    os.replace(tmp, folder / "meta.json")
    return HiddenCache(folder)


def example_iterator(arrays: dict[str, np.ndarray], global_batch: int, seed: int, **kw) -> EpochIterator:
    """Batches of flat cached examples, in the same seeded (epoch, index) order scheme as packed rows."""
    return EpochIterator(len(arrays["targets"]), lambda idx: {k: v[idx] for k, v in arrays.items()},
                         global_batch, seed, **kw)
