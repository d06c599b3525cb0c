"""A drafter's own vocabulary in the EAGLE-3 authors' convention, which both EAGLE layouts use here.

A draft vocabulary of Vt tokens (our truncated lm_head's `token_map`: draft id j -> full-vocabulary id map[j]) is
stored as two tensors:
    d2t  [Vt] int64  the OFFSET from a draft id to its full-vocabulary id: map[j] = j + d2t[j]
    t2d  [V]  bool   which full-vocabulary ids are in the draft vocabulary
and config.json's "draft_vocab_size" = Vt. vLLM (llama_eagle3.py) adds arange(Vt) to d2t on load; SGLang and
the authors' code index `d2t` the same way. The ids must ascend: the EAGLE-3 tools build d2t from a sorted id
list, and t2d (a mask) cannot tell any other order.
"""

from __future__ import annotations

import numpy as np

from medusa_jax.hf.tensor_files import CheckpointError


def draft_vocab_tensors(token_map: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """token_map [Vt] (full-vocabulary ids, ascending) -> {"d2t", "t2d"}."""
    ids_u = np.asarray(token_map, np.int64)
    if np.any(np.diff(ids_u) <= 0):
        raise ValueError("a draft vocabulary's ids must ascend (d2t/t2d cannot tell another order); "
                         "sort the token map and the lm_head's columns alike")
    t2d = np.zeros((vocab_size,), bool)
    t2d[ids_u] = True
    return {"d2t": ids_u - np.arange(ids_u.shape[0], dtype=np.int64), "t2d": t2d}


def token_map_from(d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int, origin: str) -> np.ndarray:
    """d2t [Vt] (and t2d [V], checked against it when present) -> token_map [Vt] int32."""
    ids_u = np.arange(d2t.shape[0], dtype=np.int64) + np.asarray(d2t, np.int64)
    if ids_u.size and (ids_u.min() < 0 or ids_u.max() >= vocab_size or np.any(np.diff(ids_u) <= 0)):
        raise CheckpointError(f"{origin}: d2t does not map the draft vocabulary to distinct ascending ids in "
                              f"[0, {vocab_size})")
    if t2d is not None:
        if t2d.shape != (vocab_size,) or not np.array_equal(np.nonzero(np.asarray(t2d))[0], ids_u):
            raise CheckpointError(f"{origin}: t2d {tuple(t2d.shape)} does not mark exactly the ids d2t maps to")
    return ids_u.astype(np.int32)
