"""The EAGLE drafter's batches from a FEATURES hidden-state store: whole conversations packed first-fit into rows
with the base's hidden state at every position, read memory-mapped, a noise seed per row."""

from __future__ import annotations

import numpy as np

from medusa_jax.training.data import EpochIterator, heldout_groups
from medusa_jax.training.hidden_examples import HIDDEN_DTYPE
from medusa_jax.training.hidden_store import StoredSequences
from medusa_jax.training.sharegpt import DataError
from medusa_jax.training.teacher_forced import place_rows


class FeatureRows:
    """Packed rows over a subset of a store's conversations."""

    def __init__(self, store: StoredSequences, conversations: np.ndarray, seq_len: int, seed: int = 0):
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


def split_store(store: StoredSequences, heldout_fraction: float, seq_len: int,
                seed: int) -> tuple[FeatureRows, FeatureRows]:
    """(training rows, held-out rows), split by conversation as every other data source is."""
    n = len(store.ids)
    held = np.zeros(n, bool)
    held[heldout_groups(n, heldout_fraction, seed)] = True
    return (FeatureRows(store, np.nonzero(~held)[0], seq_len, seed),
            FeatureRows(store, np.nonzero(held)[0], seq_len, seed + 1))
