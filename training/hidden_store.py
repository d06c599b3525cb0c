"""Medusa-1 examples straight from self-distillation's saved hidden states (`self_distill --save-hidden`).

Each generated reply of n tokens with hidden states h_0..h_{n-1} (h_j produced token j) gives n - 1 examples:
hidden h_j with head i's target token j + 1 + i (-1 past the reply's end) and, for Hydra heads, the path
tokens j + i (0 past the end): the root token j and the true drafts before head i's target. Only replies
whose conversation is in the JSONL file are used (a batch whose lines were never appended is ignored), each
(id, turn) once. The held-out split is by conversation: a seeded permutation of the conversation ids, as in data.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from medusa_jax.training.self_distill import done_ids, hidden_store_path
from medusa_jax.training.sharegpt import DataError


@dataclasses.dataclass(frozen=True)
class DistilledExamples:
    train: dict[str, np.ndarray]  # {"hidden": [N, D] float16, "targets": [N, K] int32 (, "path": [N, K] int32)}
    heldout: dict[str, np.ndarray]
    train_tokens: np.ndarray  # every generated token of the training replies (for a truncated token_map)
    num_conversations: tuple[int, int]


def store_for(data: str | None) -> Path | None:
    """The hidden-state folder self-distillation wrote next to `data`, if there is one."""
    if not data:
        return None
    folder = hidden_store_path(data)
    return folder if folder.is_dir() and any(folder.glob("batch-*.npz")) else None


def reply_examples(tokens_n: np.ndarray, hidden_nd: np.ndarray, num_heads: int) -> dict[str, np.ndarray]:
    n = len(tokens_n)
    j = np.arange(n - 1)[:, None] + 1 + np.arange(num_heads)[None, :]  # [n-1, K] target positions
    targets = np.where(j < n, tokens_n[np.minimum(j, n - 1)], -1).astype(np.int32)
    path = np.where(j - 1 < n, tokens_n[np.minimum(j - 1, n - 1)], 0).astype(np.int32)
    return {"hidden": hidden_nd[: n - 1], "targets": targets, "path": path}


def load_distilled_examples(data: str, num_heads: int, heldout_fraction: float, seed: int,
                            with_path: bool = False) -> DistilledExamples:
    """`with_path`: the examples also carry their path tokens (Hydra heads)."""
    folder = hidden_store_path(data)
    wanted = done_ids(Path(data))
    replies: dict[str, list[dict[str, np.ndarray]]] = {}
    seen = set()
    for path in sorted(folder.glob("batch-*.npz")):
        with np.load(path) as z:
            offsets, tokens, hidden = z["offsets"], z["tokens"], z["hidden"]
            for r, (rid, turn) in enumerate(zip(z["ids"].tolist(), z["turns"].tolist())):
                if rid not in wanted or (rid, turn) in seen or offsets[r + 1] - offsets[r] < 2:
                    continue
                seen.add((rid, turn))
                lo, hi = offsets[r], offsets[r + 1]
                replies.setdefault(rid, []).append(reply_examples(tokens[lo:hi], hidden[lo:hi], num_heads))
    if not replies:
        raise DataError(f"{folder}: no saved hidden states of conversations listed in {data}")
    ids = sorted(replies)
    order = np.random.default_rng(seed).permutation(len(ids))
    n_held = int(round(heldout_fraction * len(ids)))
    if heldout_fraction > 0 and len(ids) > 1:
        n_held = min(max(n_held, 1), len(ids) - 1)
    held_ids, train_ids = [ids[i] for i in order[:n_held]], [ids[i] for i in order[n_held:]]

    def arrays(chosen):
        parts = [p for rid in chosen for p in replies[rid]]
        names = ("hidden", "targets", "path") if with_path else ("hidden", "targets")
        if not parts:
            return {"hidden": np.zeros((0, 0), np.float16), "targets": np.zeros((0, num_heads), np.int32),
                    **({"path": np.zeros((0, num_heads), np.int32)} if with_path else {})}
        return {name: np.concatenate([p[name] for p in parts]) for name in names}

    train = arrays(train_ids)
    tokens = np.concatenate([p["targets"][:, 0] for rid in train_ids for p in replies[rid]])
    return DistilledExamples(train, arrays(held_ids), tokens[tokens >= 0], (len(train_ids), len(held_ids)))
