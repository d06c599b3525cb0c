"""Medusa-1 CPU path: run the frozen backbone over the data once and keep its final hidden states.

With the backbone frozen, every epoch would recompute the same hidden states; caching them makes an epoch cost
only the heads. Only the hidden states some example needs are kept (float16): those of positions with at
least one head target (the examples, hidden_examples.py) and those of the positions t + 1 + i whose base
distribution is head i's distilled target (the positions just before a loss token), so padding and
prompt-only positions cost nothing afterwards. For Hydra heads each example also keeps its path [E], the
tokens t + 1 .. t + M.

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

from medusa_jax.atomic import atomic_file, write_text_atomic
from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.hydra import path_tokens
from medusa_jax.training.data import PackedRows
from medusa_jax.training.hidden_examples import HiddenExamples, HiddenRows
from medusa_jax.training.losses import head_targets, shifted_targets
from medusa_jax.training.objectives import backbone_hidden

CHUNK_ROWS = 64
CACHE_VERSION = "v2"  # v2: teacher positions and rows
STORE_DTYPE = np.float16


def rows_fingerprint(rows: PackedRows) -> str:
    h = hashlib.sha256()
    for a in (rows.tokens_bt, rows.segment_ids_bt, rows.loss_mask_bt):
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
    """A finished cache folder; `examples()` loads all chunks into memory."""

    def __init__(self, folder: Path):
        self.folder = folder

    def examples(self) -> HiddenExamples:
        meta = json.loads((self.folder / "meta.json").read_text())
        parts = [dict(np.load(self.folder / f"chunk_{c:05d}.npz")) for c in range(meta["chunks"])]
        hidden = HiddenRows([p["hidden"] for p in parts], width=meta["hidden_size"])
        start = np.cumsum([0] + [len(p["hidden"]) for p in parts])

        def rows(key, c):
            r = parts[c][key].astype(np.int64)
            return np.where(r >= 0, r + start[c], -1)

        path = np.concatenate([p["path"] for p in parts]) if "path" in parts[0] else None
        return HiddenExamples(hidden, np.concatenate([rows("rows", c) for c in range(len(parts))]),
                              np.concatenate([p["targets"] for p in parts]),
                              np.concatenate([rows("teacher_rows", c) for c in range(len(parts))]), path_xe=path)

    def arrays(self) -> dict[str, np.ndarray]:
        """All examples as one "hidden" batch (small caches, tests)."""
        ex = self.examples()
        return ex.batch(np.arange(len(ex)))


def build_hidden_cache(base: CausalLM, rows: PackedRows, num_heads: int, root: str | os.PathLike,
                       batch_rows: int = 8, progress: Callable[[int, int], None] | None = None,
                       with_path: bool = False) -> HiddenCache:
    """Computes (or reuses) the cache of `rows` under `root`. `progress(done_rows, total_rows)` is called
    after each chunk. `with_path`: also keep each example's path tokens (Hydra heads)."""
    key = (f"{model_fingerprint(base)}-{rows_fingerprint(rows)}-k{num_heads}-{CACHE_VERSION}"
           + ("-path" if with_path else ""))
    folder = Path(root) / key
    folder.mkdir(parents=True, exist_ok=True)
    chunks = -(-rows.num_rows // CHUNK_ROWS)
    if (folder / "meta.json").exists():
        return HiddenCache(folder)
    graphdef, state = nnx.split(base)
    data = (jnp.asarray(rows.tokens_bt), jnp.asarray(rows.loss_mask_bt), jnp.asarray(rows.segment_ids_bt))
    targets_mbt = np.asarray(head_targets(*data, num_heads))
    teacher_bt = np.asarray(shifted_targets(*data, 1)) >= 0  # positions t + 1 + i some head's teacher reads
    for c in range(chunks):
        path = folder / f"chunk_{c:05d}.npz"
        if path.exists():
            continue
        lo, hi = c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, rows.num_rows)
        hidden, targets, example_rows, teacher_rows, paths, stored = [], [], [], [], [], 0
        for b0 in range(lo, hi, batch_rows):
            idx = np.arange(b0, b0 + batch_rows) % rows.num_rows  # a short last batch repeats rows: one shape
            part = rows.rows(idx)
            h_btd = np.asarray(_hidden_rows(graphdef, state, jnp.asarray(part.tokens_bt),
                                            jnp.asarray(part.positions_bt),
                                            jnp.asarray(part.segment_ids_bt)))
            keep = min(batch_rows, hi - b0)
            t_mbt = targets_mbt[:, b0:b0 + keep]
            example_bt = (t_mbt >= 0).any(axis=0)
            store_bt = example_bt | teacher_bt[b0:b0 + keep]
            if np.abs(h_btd[:keep][store_bt]).max(initial=0.0) > np.finfo(STORE_DTYPE).max:
                raise OverflowError("hidden states exceed the float16 range; this backbone cannot use the cache")
            hidden.append(h_btd[:keep][store_bt].astype(STORE_DTYPE))
            row_bt = np.where(store_bt, stored + np.cumsum(store_bt.reshape(-1)).reshape(store_bt.shape) - 1, -1)
            stored += int(store_bt.sum())
            t = np.arange(row_bt.shape[1])
            teacher_bmt = np.stack([np.where((t_mbt[i] >= 0) & (t + 1 + i < len(t)),
                                             row_bt[:, np.minimum(t + 1 + i, len(t) - 1)], -1)
                                    for i in range(num_heads)], axis=1)
            example_rows.append(row_bt[example_bt])
            teacher_rows.append(np.moveaxis(teacher_bmt, 1, -1)[example_bt])
            targets.append(np.moveaxis(t_mbt, 0, -1)[example_bt].astype(np.int32))
            paths.append(path_tokens(rows.tokens_bt[b0:b0 + keep], num_heads)[example_bt])
        extra = {"path": np.concatenate(paths)} if with_path else {}
        with atomic_file(path) as f:
            np.savez(f, hidden=np.concatenate(hidden), targets=np.concatenate(targets),
                     rows=np.concatenate(example_rows), teacher_rows=np.concatenate(teacher_rows), **extra)
        if progress is not None:
            progress(hi, rows.num_rows)
    write_text_atomic(folder / "meta.json", json.dumps({"chunks": chunks, "rows": rows.num_rows,
                                                        "num_heads": num_heads,
                                                        "hidden_size": base.config.hidden_size}))
    return HiddenCache(folder)

