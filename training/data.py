"""Chat data -> packed fixed-length rows with an assistant-only loss mask, a held-out split by conversation, and
seeded batches; docs/modules.md."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from medusa_jax import paths
from medusa_jax.atomic import atomic_folder
from medusa_jax.settings import SEED, at_least, check_settings, in_range, setting
from medusa_jax.text import pad_token_id
from medusa_jax.training.sharegpt import DataError, ReadReport, read_conversations

CACHE_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    seq_len: int = setting(1024, at_least(8))
    heldout_fraction: float = setting(0.02, in_range(0.0, 1.0, high_open=True))
    seed: int = setting(0, SEED)
    num_proc: int = setting(1, at_least(1))  # tokenisation processes (datasets.map)
    cache_dir: str | None = None  # None: $MEDUSA_JAX_CACHE/tokenized (default ~/.cache/medusa_jax/tokenized)
    limit: int | None = setting(None, at_least(1))  # use only the first N usable conversations

    def __post_init__(self):
        check_settings(self)


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """B rows of T tokens. segment_ids 0 marks padding; positions restart at 0 for each conversation."""
    tokens_bt: np.ndarray  # int32
    segment_ids_bt: np.ndarray  # int32
    positions_bt: np.ndarray  # int32
    loss_mask_bt: np.ndarray  # bool, True on assistant tokens

    @property
    def num_rows(self) -> int:
        return int(self.tokens_bt.shape[0])

    def rows(self, index) -> "PackedRows":
        return PackedRows(self.tokens_bt[index], self.segment_ids_bt[index], self.positions_bt[index],
                          self.loss_mask_bt[index])


@dataclasses.dataclass(frozen=True)
class ChatData:
    train: PackedRows
    heldout: PackedRows
    report: ReadReport
    num_conversations: tuple[int, int]  # (train, heldout)
    dropped_no_loss_tokens: int  # conversations whose assistant tokens all fell beyond seq_len


def tokenize_messages(tokenizer, messages: list[dict[str, str]], eos_ids: tuple[int, ...], where: str = ""
                      ) -> tuple[list[int], list[int]]:
    """Chat-template token ids and a 0/1 mask that is 1 on assistant reply tokens (up to and including the
    first end-of-turn token of each reply)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False)
        through = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"{where}: the chat template does not render conversations prefix by prefix, so "
                            f"assistant tokens cannot be located")
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    eos = set(eos_ids)
    for lo, hi in spans:
        inside = [j for j, (start, _) in enumerate(offsets) if lo <= start < hi]
        ends = [j for j in inside if ids[j] in eos]
        for j in inside if not ends else [j for j in inside if j <= ends[0]]:
            mask[j] = 1
    return ids, mask


def _tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def source_fingerprint(source: str | None) -> str:
    path = Path(source) if source and source != "sharegpt" else None
    if path is not None and path.exists():
        st = path.stat()
        return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return str(source)


def cache_root(config: DataConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else paths.cache_root() / "tokenized"


def tokenize_conversations(records: list[dict[str, Any]], tokenizer, eos_ids: tuple[int, ...],
                           config: DataConfig, source_key: str):
    """A `datasets.Dataset` with columns id, input_ids, loss_mask (cached on disk)."""
    import datasets  # lazy: seconds to import, needed only to tokenise a chat data set

    key = hashlib.sha256(json.dumps([CACHE_VERSION, source_key, _tokenizer_fingerprint(tokenizer),
                                     list(eos_ids), config.seq_len, config.limit, len(records)]).encode())
    folder = cache_root(config) / key.hexdigest()[:24]
    if (folder / "dataset_info.json").exists():
        return datasets.load_from_disk(str(folder))

    def encode(row, index):
        ids, mask = tokenize_messages(tokenizer, row["messages"], eos_ids, f"conversation {index} (id {row['id']!r})")
        return {"input_ids": ids[: config.seq_len], "loss_mask": mask[: config.seq_len]}

    ds = datasets.Dataset.from_list(records)
    ds = ds.map(encode, with_indices=True, remove_columns=["messages"],
                num_proc=config.num_proc if config.num_proc > 1 else None,
                desc="tokenising")
    with atomic_folder(folder) as tmp:
        ds.save_to_disk(str(tmp))
    return datasets.load_from_disk(str(folder))


def first_fit(lengths: list[int], width: int, order=None, window: int | None = None) -> list[list[int]]:
    """Rows of sequence indices: each sequence (at most `width` long), taken in `order` (default: as given), goes
    into the first row with room for it among the last `window` open rows (None: all of them)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in range(len(lengths)) if order is None else order:
        for r in range(0 if window is None else max(0, len(rows) - window), len(rows)):
            if room[r] >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def pack(sequences: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int, window: int = 64) -> PackedRows:
    """First-fit packing (over the last `window` open rows, which keeps it linear) in the given order."""
    rows = first_fit([len(ids) for ids, _ in sequences], seq_len, window=window)
    shape = (len(rows), seq_len)
    tokens = np.full(shape, pad_id, np.int32)
    segments = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    loss = np.zeros(shape, bool)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members):
            ids, mask = sequences[i]
            n = len(ids)
            tokens[r, at:at + n] = ids
            segments[r, at:at + n] = s + 1
            positions[r, at:at + n] = np.arange(n)
            loss[r, at:at + n] = np.asarray(mask, bool)
            at += n
    return PackedRows(tokens, segments, positions, loss)


def load_chat_data(source: str | None, tokenizer, eos_ids: tuple[int, ...], config: DataConfig,
                   log=print) -> ChatData:
    """Reads, tokenises (cached), splits by conversation and packs. `source` as in `read_conversations`."""
    records, report = read_conversations(source, limit=config.limit)
    log(report.summary())
    ds = tokenize_conversations(records, tokenizer, eos_ids, config, source_fingerprint(source))
    ids_masks = list(zip(ds["input_ids"], ds["loss_mask"]))
    seqs = [(np.asarray(ids, np.int32), np.asarray(mask, np.int8)) for ids, mask in ids_masks if any(mask)]
    dropped = len(ids_masks) - len(seqs)
    if not seqs:
        raise DataError(f"{report.source}: no conversation has assistant tokens within the first "
                        f"{config.seq_len} tokens")
    order = np.random.default_rng(config.seed).permutation(len(seqs))
    n_held = len(heldout_groups(len(seqs), config.heldout_fraction, config.seed))  # that permutation's first share
    held = pack([seqs[i] for i in order[:n_held]], config.seq_len, pad_token_id(tokenizer, eos_ids))
    train = pack([seqs[i] for i in order[n_held:]], config.seq_len, pad_token_id(tokenizer, eos_ids))
    return ChatData(train, held, report, (len(seqs) - n_held, n_held), dropped)


def heldout_groups(num_groups: int, heldout_fraction: float, seed: int) -> np.ndarray:
    """Indices of the held-out groups (conversations): a seeded permutation's first share, at least one and
    never all when heldout_fraction > 0."""
    order = np.random.default_rng(seed).permutation(num_groups)
    n_held = int(round(heldout_fraction * num_groups))
    if heldout_fraction > 0 and num_groups > 1:
        n_held = min(max(n_held, 1), num_groups - 1)
    return order[:n_held]


def segment_mask(segment_ids_bt: np.ndarray):
    """[B, T, T] bool: causal attention within the same (non-padding) conversation of a packed row."""
    seg = jnp.asarray(segment_ids_bt)
    t = seg.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return same & causal[None]


def top_token_ids(loss_tokens: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """The n most frequent of the given (loss) tokens, ties by id, sorted: a truncated lm_head's token_map."""
    if n > vocab_size:
        raise ValueError(f"truncated vocabulary of {n} exceeds the model's vocabulary of {vocab_size}")
    counts = np.bincount(np.asarray(loss_tokens).reshape(-1), minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:n]).astype(np.int32)


def row_batch(rows: PackedRows) -> dict[str, np.ndarray]:
    """The trainer's "rows" batch."""
    return {"tokens": rows.tokens_bt, "segment_ids": rows.segment_ids_bt, "positions": rows.positions_bt,
            "loss_mask": rows.loss_mask_bt}


class EpochIterator:
    """Seeded per-epoch order over `num_items` items (packed rows or cached examples); yields
    `take(sorted indices)` for this process's share of each global batch (items [p * B/P, (p+1) * B/P) of
    it). The last incomplete batch of an epoch is dropped. `position` (epoch, index) is all its state."""

    def __init__(self, num_items: int, take: Callable[[np.ndarray], dict[str, np.ndarray]], global_batch: int,
                 seed: int, process_index: int = 0, process_count: int = 1, epoch: int = 0, index: int = 0):
        if global_batch % process_count:
            raise ValueError(f"global batch {global_batch} does not divide over {process_count} processes")
        if num_items < global_batch:
            raise DataError(f"only {num_items} training items (packed rows or cached positions), fewer than one "
                            f"batch of {global_batch}; lower --batch-size or add data")
        self.num_items, self.take, self.global_batch, self.seed = num_items, take, global_batch, seed
        self.process_index, self.process_count = process_index, process_count
        self.epoch, self.index = epoch, index

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.global_batch

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_items)
        local = self.global_batch // self.process_count
        start = self.index * self.global_batch + self.process_index * local
        self.index += 1
        return self.take(np.sort(order[start:start + local]))


def row_iterator(rows: PackedRows, global_batch: int, seed: int, **kw) -> EpochIterator:
    return EpochIterator(rows.num_rows, lambda idx: row_batch(rows.rows(idx)), global_batch, seed, **kw)
