"""Cached Medusa-1 examples: each hidden state stored once, examples (positions) that point into them; a batch
reads only its rows, so a store larger than memory streams from disk; docs/modules.md."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from medusa_jax.training.data import EpochIterator, heldout_groups

HIDDEN_DTYPE = np.float16


class HiddenRows:
    """Rows [X, D] of one or more [X_c, D] arrays, gathered by global row index."""

    def __init__(self, chunks: Sequence[np.ndarray], width: int | None = None):
        self.chunks = [c for c in chunks if len(c)]
        self.width = int(self.chunks[0].shape[1]) if self.chunks else int(width or 0)
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, rows: np.ndarray) -> np.ndarray:
        """rows [...] int -> [..., D] float16."""
        rows = np.asarray(rows)
        flat = rows.reshape(-1)
        if len(self.chunks) == 1:
            out = np.asarray(self.chunks[0][flat], HIDDEN_DTYPE)
        else:
            out = np.empty((len(flat), self.width), HIDDEN_DTYPE)
            chunk = np.searchsorted(self.starts, flat, side="right") - 1
            for c in np.unique(chunk):
                sel = chunk == c
                out[sel] = self.chunks[c][flat[sel] - self.starts[c]]
        return out.reshape(rows.shape + (self.width,))


@dataclasses.dataclass(frozen=True)
class HiddenExamples:
    hidden: HiddenRows
    rows_x: np.ndarray  # int64: hidden row of each example
    targets_xm: np.ndarray  # int32: head i's target token (-1 = none)
    teacher_rows_xm: np.ndarray  # int64: row of the hidden state at t + 1 + i (-1 = none)
    groups_x: np.ndarray | None = None  # conversation of each example (the held-out split is by conversation)
    path_xe: np.ndarray | None = None  # int32: tokens t + 1 .. t + M (Hydra heads' teacher forcing; 0 = none)

    def __len__(self) -> int:
        return len(self.rows_x)

    @property
    def num_heads(self) -> int:
        return int(self.targets_xm.shape[1])

    def subset(self, index) -> "HiddenExamples":
        g = None if self.groups_x is None else self.groups_x[index]
        path = None if self.path_xe is None else self.path_xe[index]
        return HiddenExamples(self.hidden, self.rows_x[index], self.targets_xm[index], self.teacher_rows_xm[index], g,
                              path)

    def batch(self, index, teacher: bool = False) -> dict[str, np.ndarray]:
        """The trainer's "hidden" batch of examples `index` (+ "teacher_hidden" [x, M, D] with `teacher`,
        + "path" [x, E] when the examples carry paths)."""
        idx = np.asarray(index)
        rows = self.rows_x[idx]
        out = {"hidden": self.hidden.take(rows), "targets": self.targets_xm[idx]}
        if self.path_xe is not None:
            out["path"] = self.path_xe[idx]
        if teacher:
            t = self.teacher_rows_xm[idx]
            out["teacher_hidden"] = self.hidden.take(np.where(t >= 0, t, rows[:, None]))  # masked where -1
        return out

    def filler(self, n: int, teacher: bool = False) -> dict[str, np.ndarray]:
        """n target-free examples (completes the last held-out batch)."""
        m, d = self.num_heads, self.hidden.width
        out = {"hidden": np.zeros((n, d), HIDDEN_DTYPE), "targets": np.full((n, m), -1, np.int32)}
        if self.path_xe is not None:
            out["path"] = np.zeros((n, m), np.int32)
        if teacher:
            out["teacher_hidden"] = np.zeros((n, m, d), HIDDEN_DTYPE)
        return out

    def split(self, heldout_fraction: float, seed: int) -> tuple["HiddenExamples", "HiddenExamples", int, int]:
        """(train, held-out, #train groups, #held-out groups): a seeded permutation of the groups, as data.py."""
        groups = np.unique(self.groups_x)
        held_groups = groups[heldout_groups(len(groups), heldout_fraction, seed)]
        held = np.isin(self.groups_x, held_groups)
        return self.subset(~held), self.subset(held), len(groups) - len(held_groups), len(held_groups)

    def iterator(self, global_batch: int, seed: int, teacher: bool = False, **kw) -> EpochIterator:
        """Batches in the same seeded (epoch, index) order scheme as packed rows."""
        return EpochIterator(len(self), lambda idx: self.batch(idx, teacher), global_batch, seed, **kw)


def sequence_examples(hidden: HiddenRows, starts_c, lengths_c, tokens_x, loss_x, hidden_starts_c, hidden_lengths_c,
                      hidden_from_c, num_heads: int, groups_c=None, with_path: bool = False) -> HiddenExamples:
    """Examples of sequences stored back to back (hidden_store.StoredSequences): at position p head i's target is
    token p + 2 + i where that is a loss token, its teacher the hidden row after p + i; targetless positions dropped."""
    lengths_c, hidden_lengths_c = np.asarray(lengths_c, np.int64), np.asarray(hidden_lengths_c, np.int64)
    seq_h = np.repeat(np.arange(len(lengths_c)), hidden_lengths_c)
    h = np.arange(len(seq_h), dtype=np.int64)
    r = h - np.asarray(hidden_starts_c, np.int64)[seq_h]
    g = np.asarray(starts_c, np.int64)[seq_h] + np.asarray(hidden_from_c, np.int64)[seq_h] + r  # token index
    end = (np.asarray(starts_c, np.int64) + lengths_c)[seq_h]
    offs = np.arange(num_heads)[None, :]
    tokens_x, last = np.asarray(tokens_x), len(tokens_x) - 1
    target = g[:, None] + 2 + offs
    valid = (target < end[:, None]) & (r[:, None] + 1 + offs < hidden_lengths_c[seq_h][:, None])
    valid &= np.asarray(loss_x)[np.clip(target, 0, last)]
    keep = valid.any(axis=1)
    rows, valid, g, end = h[keep], valid[keep], g[keep], end[keep]
    targets = np.where(valid, tokens_x[np.clip(g[:, None] + 2 + offs, 0, last)], -1).astype(np.int32)
    teacher = np.where(valid, rows[:, None] + 1 + offs, -1).astype(np.int64)
    path = None
    if with_path:
        at = g[:, None] + 1 + offs
        path = np.where(at < end[:, None], tokens_x[np.clip(at, 0, last)], 0).astype(np.int32)
    groups = None if groups_c is None else np.asarray(groups_c)[seq_h[keep]]
    return HiddenExamples(hidden, rows, targets, teacher, groups, path)


def reply_examples(hidden: HiddenRows, lengths_b, tokens_x, num_heads: int, groups_b=None,
                   with_path: bool = False) -> HiddenExamples:
    """Examples of generated replies stored back to back, tokens only: hidden row s + j produced token j, so head i's
    target at example j is token j + 1 + i."""
    lengths_b = np.asarray(lengths_b, np.int64)
    starts_b = np.concatenate([[0], np.cumsum(lengths_b)[:-1]]).astype(np.int64)
    return sequence_examples(hidden, starts_b, lengths_b, tokens_x, np.ones(len(tokens_x), bool), starts_b, lengths_b,
                             np.full(len(lengths_b), -1), num_heads, groups_b, with_path)
