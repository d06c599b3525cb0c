"""Training data from a teacher-forced feature store (feature_store.py): whole conversations packed into rows (the
EAGLE drafter), or the store's positions as cached-hidden examples (Medusa and Hydra heads).

The store's conversations are split by conversation (seeded, hidden_examples.heldout_groups), then packed first-fit
into rows of seq_len tokens (each conversation whole: the store already cut it to its seq_len). A batch of rows
gathers its tokens, loss mask and float16 features (from the memory-mapped store: only the batch's rows are
read) into the trainer's "features" batch (trainer.py), with a noise seed per row. Every epoch visits the rows in
a new seeded order (data.EpochIterator, whose position is saved in checkpoints).
"""

from __future__ import annotations

import numpy as np

from medusa_jax.training.data import EpochIterator
from medusa_jax.training.feature_store import FeatureConversations, place_rows
from medusa_jax.training.hidden_examples import HIDDEN_DTYPE, HiddenExamples, HiddenRows, heldout_groups
from medusa_jax.training.sharegpt import DataError


class FeatureRows:
    """Packed rows over a subset of a store's conversations."""

    def __init__(self, store: FeatureConversations, conversations: np.ndarray, seq_len: int, seed: int = 0):
        lengths = store.lengths_c[conversations]
        if lengths.size and lengths.max() > seq_len:
            raise DataError(f"the store holds conversations of {int(lengths.max())} tokens, longer than --seq-len "
                            f"{seq_len}: train with --seq-len >= the store's (feature_store.json build.seq_len)")
        self.store, self.seq_len, self.seed = store, seq_len, seed
        self.members = [conversations[np.asarray(r)] for r in place_rows(lengths.tolist(), seq_len)]

    @property
    def num_rows(self) -> int:
        return len(self.members)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.store.lengths_c[m].sum() for m in self.members))

    def loss_tokens(self) -> np.ndarray:
        """The assistant tokens of these conversations (a draft vocabulary's frequency source)."""
        s = self.store
        picks = [np.arange(s.starts_c[c], s.starts_c[c] + s.lengths_c[c]) for m in self.members for c in m]
        index = np.concatenate(picks) if picks else np.zeros((0,), np.int64)
        return s.tokens_x[index][s.loss_x[index]]

    def batch(self, rows) -> dict[str, np.ndarray]:
        s, t = self.store, self.seq_len
        b, d = len(rows), s.hidden_chunks[0].shape[1]
        tokens, segments, positions = (np.zeros((b, t), np.int32) for _ in range(3))
        loss = np.zeros((b, t), bool)
        feat = np.zeros((b, t, d), HIDDEN_DTYPE)
        starts = np.cumsum([0] + [len(c) for c in s.hidden_chunks])
        for r, row in enumerate(rows):
            at = 0
            for seg, c in enumerate(self.members[row]):
                lo, n = int(s.starts_c[c]), int(s.lengths_c[c])
                tokens[r, at:at + n] = s.tokens_x[lo:lo + n]
                loss[r, at:at + n] = s.loss_x[lo:lo + n]
                segments[r, at:at + n] = seg + 1
                positions[r, at:at + n] = np.arange(n)
                k = int(np.searchsorted(starts, lo, side="right") - 1)  # a conversation lies in one chunk
                feat[r, at:at + n] = s.hidden_chunks[k][lo - starts[k]:lo - starts[k] + n]
                at += n
        return {"feat": feat, "tokens": tokens, "segment_ids": segments, "positions": positions,
                "loss_mask": loss, "noise_seed": np.zeros((b,), np.int32)}

    def iterator(self, global_batch: int, seed: int, **kw) -> EpochIterator:
        return NoisedIterator(self.num_rows, self.batch, global_batch, seed, **kw)


class NoisedIterator(EpochIterator):
    """An EpochIterator whose batches carry a noise seed per row drawn from the data position (epoch, batch,
    row): a resumed run draws the same noise as an uninterrupted one."""

    def __next__(self) -> dict[str, np.ndarray]:
        batch = super().__next__()
        local = len(batch["noise_seed"])
        first = (self.epoch * self.batches_per_epoch + self.index - 1) * self.global_batch + self.process_index * local
        batch["noise_seed"] = ((first + np.arange(local) + self.seed * 7919) % (2 ** 31 - 1)).astype(np.int32)
        return batch


def split_store(store: FeatureConversations, heldout_fraction: float, seq_len: int,
                seed: int) -> tuple[FeatureRows, FeatureRows]:
    """(training rows, held-out rows), split by conversation as every other data source is."""
    n = len(store.ids)
    held = np.zeros(n, bool)
    held[heldout_groups(n, heldout_fraction, seed)] = True
    return (FeatureRows(store, np.nonzero(~held)[0], seq_len, seed),
            FeatureRows(store, np.nonzero(held)[0], seq_len, seed + 1))


def conversation_examples(store: FeatureConversations, num_heads: int, with_path: bool = False) -> HiddenExamples:
    """Every position of the store as a cached-hidden example (hidden_examples.py) for heads: at position j of a
    conversation, head i's target is token j + 2 + i when it is an assistant token of the same conversation, its
    teacher the stored hidden state at j + 1 + i; Hydra heads' path is the true tokens j + 1 .. j + M (0 past the
    conversation). Groups are conversations (the held-out split); the hidden rows stay memory-mapped."""
    x = store.num_tokens
    conv_x = np.repeat(np.arange(len(store.ids)), store.lengths_c)
    end_x = (store.starts_c + store.lengths_c)[conv_x]
    g = np.arange(x, dtype=np.int64)
    offs = np.arange(num_heads)
    target_pos = g[:, None] + 2 + offs[None, :]
    valid = target_pos < end_x[:, None]
    valid &= store.loss_x[np.minimum(target_pos, x - 1)]
    keep = valid.any(axis=1)
    rows = g[keep]
    valid = valid[keep]
    targets = np.where(valid, store.tokens_x[np.minimum(target_pos[keep], x - 1)], -1).astype(np.int32)
    teacher = np.where(valid, rows[:, None] + 1 + offs[None, :], -1).astype(np.int64)
    path = None
    if with_path:
        path_pos = rows[:, None] + 1 + offs[None, :]
        inside = path_pos < end_x[keep][:, None]
        path = np.where(inside, store.tokens_x[np.minimum(path_pos, x - 1)], 0).astype(np.int32)
    return HiddenExamples(HiddenRows(store.hidden_chunks), rows, targets, teacher, conv_x[keep], path)
