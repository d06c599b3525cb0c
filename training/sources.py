"""Where a training run's batches come from: one interface (`DataSource.feed`) over every kind of training data;
`open_source` picks the source (the table of sources is in docs/modules.md)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Protocol

import jax
import numpy as np

from medusa_jax.model.backbone import CausalLM
from medusa_jax.text import pad_token_id
from medusa_jax.training import hidden_store, memory_plan
from medusa_jax.training.data import (ChatData, DataConfig, EpochIterator, heldout_groups, load_chat_data, row_batch,
                                     row_iterator)
from medusa_jax.training.hidden_examples import HIDDEN_DTYPE, HiddenExamples
from medusa_jax.training.hidden_store import StoredSequences
from medusa_jax.training.sharegpt import DataError
from medusa_jax.training.teacher_forced import build_hidden_cache, place_rows


@dataclasses.dataclass
class Feed:
    """What the training loop reads."""

    iterator: EpochIterator  # this process's share of each global training batch, in seeded epoch order
    eval_batches: list[dict[str, np.ndarray]]  # this process's held-out batches (the last one padded)
    loss_tokens: np.ndarray  # training target tokens (a truncated token_map keeps their most frequent)
    tokens_per_step: Callable[[dict], int]  # tokens a global batch trains on, from this process's batch


@dataclasses.dataclass(frozen=True)
class FeedSettings:
    """What a source needs from the run's configuration (training.run.RunConfig)."""

    num_heads: int
    with_path: bool  # Hydra heads: hidden examples also carry the true tokens on each position's path
    teacher: bool  # distilled head losses: hidden batches also carry the teacher positions' hidden states
    batch_size: int  # packed rows per global step
    cached_batch_size: int  # positions per global step of hidden examples
    eval_batches: int  # at most this many held-out batches
    seed: int
    data: DataConfig
    memory_limit_gib: float | None
    hidden_cache_dir: Path  # where CachedHidden keeps the hidden states it computes
    max_tokens: int | None = None  # a feature store: its first conversations holding this many tokens


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What a source may use to build its feed: the loaded backbone and tokenizer, the EOS ids, the log."""

    base: CausalLM  # the frozen backbone (CachedHidden runs it once over the rows)
    tokenizer: object
    eos_ids: tuple[int, ...]
    log: Callable[[str], None] = print


class DataSource(Protocol):
    def feed(self, settings: FeedSettings, inputs: RunInputs) -> Feed:
        """The trainer's feed of this data."""


def _process() -> dict[str, int]:
    return dict(process_index=jax.process_index(), process_count=jax.process_count())


def _padded_batches(take: Callable[[np.ndarray], dict], num: int, global_batch: int, max_batches: int,
                    empty: Callable[[int], dict] | None = None) -> list[dict[str, np.ndarray]]:
    """Held-out batches of this process; the last one is completed with target-free filler: `empty(n)`, or by
    default zeros (padding rows: segment 0, no loss token)."""
    out = []
    p, n_proc = jax.process_index(), jax.process_count()
    local = global_batch // n_proc
    for start in range(0, min(num, max_batches * global_batch), global_batch):
        idx = np.arange(start + p * local, start + (p + 1) * local)
        real = idx[idx < num]
        part = take(real)
        if len(real) < local:
            fill = empty(local - len(real)) if empty else {k: np.zeros((local - len(real),) + v.shape[1:], v.dtype)
                                                             for k, v in part.items()}
            part = {k: np.concatenate([part[k], fill[k]]) for k in part}
        out.append(part)
    return out


def rows_feed(data: ChatData, settings: FeedSettings) -> Feed:
    """Packed rows: the backbone runs in the step."""
    n_proc = jax.process_count()
    return Feed(row_iterator(data.train, settings.batch_size, settings.seed, **_process()),
                _padded_batches(lambda i: row_batch(data.heldout.rows(i)), data.heldout.num_rows,
                                settings.batch_size, settings.eval_batches),
                data.train.tokens_bt[data.train.loss_mask_bt], lambda b: int((b["segment_ids"] > 0).sum()) * n_proc)


def hidden_feed(train: HiddenExamples, heldout: HiddenExamples, loss_tokens: np.ndarray,
                settings: FeedSettings) -> Feed:
    """Hidden examples: the heads' step only."""
    n_proc, teacher, batch = jax.process_count(), settings.teacher, settings.cached_batch_size
    return Feed(train.iterator(batch, settings.seed, teacher, **_process()),
                _padded_batches(lambda i: heldout.batch(i, teacher), len(heldout), batch, settings.eval_batches,
                                lambda n: heldout.filler(n, teacher)),
                loss_tokens, lambda b: len(b["targets"]) * n_proc)


def _log_packed(data: ChatData, settings: FeedSettings, log) -> ChatData:
    log(f"packed {data.num_conversations[0]} training / {data.num_conversations[1]} held-out conversations "
        f"into {data.train.num_rows} / {data.heldout.num_rows} rows of {settings.data.seq_len} tokens "
        f"({int(data.train.loss_mask_bt.sum())} training loss tokens; {data.dropped_no_loss_tokens} "
        f"conversations without loss tokens dropped)")
    return data


@dataclasses.dataclass(frozen=True)
class ChatConversations:
    """Conversations (`sharegpt.read_conversations`: 'sharegpt', a file, a datasets folder or name), tokenised
    with the chat template and packed into rows (data.load_chat_data)."""

    source: str | None

    def packed(self, settings: FeedSettings, inputs: RunInputs) -> ChatData:
        data = load_chat_data(self.source, inputs.tokenizer, inputs.eos_ids, settings.data, log=inputs.log)
        return _log_packed(data, settings, inputs.log)

    def feed(self, settings: FeedSettings, inputs: RunInputs) -> Feed:
        return rows_feed(self.packed(settings, inputs), settings)


@dataclasses.dataclass(frozen=True)
class StoreRows:
    """The sequences of a hidden-state store as packed rows (a reply with its prompt, loss on the reply; a
    conversation, loss on its assistant tokens): the backbone-in-the-step path for a store (GPU, Medusa-2)."""

    store: Path

    def packed(self, settings: FeedSettings, inputs: RunInputs) -> ChatData:
        pad = pad_token_id(inputs.tokenizer, inputs.eos_ids)
        return _log_packed(hidden_store.store_chat_data(self.store, settings.data, pad), settings, inputs.log)

    def feed(self, settings: FeedSettings, inputs: RunInputs) -> Feed:
        return rows_feed(self.packed(settings, inputs), settings)


@dataclasses.dataclass(frozen=True)
class CachedHidden:
    """Packed rows whose frozen-backbone hidden states are computed once into a hidden-state store and kept
    (teacher_forced.build_hidden_cache): Medusa-1 on a CPU, where an epoch then costs only the heads."""

    rows: ChatConversations

    def feed(self, settings: FeedSettings, inputs: RunInputs) -> Feed:
        data = self.rows.packed(settings, inputs)
        # the cached hidden states are read at random: check that they fit in memory before computing them
        positions = int(data.train.loss_mask_bt.sum() + data.heldout.loss_mask_bt.sum())
        per_position = (2 * inputs.base.config.hidden_size + 8  # + rows, targets and path
                        + (16 if settings.with_path else 12) * settings.num_heads)
        memory_plan.check_cache_fits(positions * per_position, settings.memory_limit_gib)
        cached = []
        for name, rows in (("train", data.train), ("held-out", data.heldout)):
            t0 = time.perf_counter()
            cache = build_hidden_cache(
                inputs.base, rows, settings.num_heads, settings.hidden_cache_dir, with_path=settings.with_path,
                progress=lambda d, n, name=name, t0=t0: inputs.log(f"hidden cache ({name}): {d}/{n} tokens, "
                                                                   f"{time.perf_counter() - t0:.0f} s"))
            cached.append(cache.examples())
        return hidden_feed(*cached, data.train.tokens_bt[data.train.loss_mask_bt], settings)


@dataclasses.dataclass(frozen=True)
class StoreHidden:
    """The positions of a hidden-state store as hidden examples, their hidden states memory-mapped: heads train
    on the hidden states self-distillation saved with its replies, or on a feature store's."""

    store: Path

    def feed(self, settings: FeedSettings, inputs: RunInputs) -> Feed:
        store = hidden_store.open_store(self.store, settings.max_tokens)
        examples = store.examples(settings.num_heads, settings.with_path)
        train, heldout, n_train, n_held = examples.split(settings.data.heldout_fraction, settings.seed)
        inputs.log(f"hidden-state store {self.store}: {n_train} training / {n_held} held-out conversations "
                   f"({store.num_tokens} tokens), {len(train)} / {len(heldout)} positions")
        return hidden_feed(train, heldout, train.targets_xm[:, 0][train.targets_xm[:, 0] >= 0], settings)


# ---- the EAGLE drafter's batches from a FEATURES store: whole conversations packed first-fit into rows with the
# base's hidden state at every position, read memory-mapped, a noise seed per row ---------------------------------
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


@dataclasses.dataclass(frozen=True)
class FeatureStoreRows:
    """A teacher-forced feature store: whole conversations packed into rows with the base's hidden state at every
    position, split by conversation (`split_store`); trains the EAGLE drafter."""

    store: Path

    def feed(self, settings: FeedSettings, inputs: RunInputs) -> Feed:
        store = hidden_store.open_store(self.store, settings.max_tokens)
        dc = settings.data
        train, held = split_store(store, dc.heldout_fraction, dc.seq_len, settings.seed)
        inputs.log(f"feature store {self.store}: {len(store.ids)} conversations, {store.num_tokens} tokens; "
                   f"{train.num_rows} training / {held.num_rows} held-out rows of {dc.seq_len} "
                   f"({train.num_tokens} / {held.num_tokens} tokens)")
        n_proc = jax.process_count()
        return Feed(train.iterator(settings.batch_size, settings.seed, **_process()),
                    _padded_batches(held.batch, held.num_rows, settings.batch_size, settings.eval_batches),
                    train.loss_tokens(), lambda b: int((b["segment_ids"] > 0).sum()) * n_proc)


def open_source(data: str | None, cache_hidden: bool, feature_rows: bool = False) -> DataSource:
    """The source of `--data` (None: the packaged ShareGPT file); `cache_hidden` asks for hidden examples. A
    feature store feeds a kind that reads `feature_rows` (the EAGLE drafter, training.objectives) packed rows with
    their features, other heads hidden examples."""
    if hidden_store.is_store(data, hidden_store.FEATURES):
        return FeatureStoreRows(Path(data)) if feature_rows else StoreHidden(Path(data))
    hidden_store.refuse_first_format(data, cache_hidden)
    store = hidden_store.find_store(data)
    if store is not None:
        return StoreHidden(store) if cache_hidden else StoreRows(store)
    rows = ChatConversations(data)
    return CachedHidden(rows) if cache_hidden else rows
