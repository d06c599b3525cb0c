"""The hidden-state store: token sequences with the frozen base's final hidden states, as Arrow shards on disk,
one format for every producer, appended atomically, read memory-mapped; the format is in docs/modules.md."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from medusa_jax.atomic import atomic_path, write_text_atomic
from medusa_jax.training.data import ChatData, DataConfig, heldout_groups, pack
from medusa_jax.training.hidden_examples import HiddenExamples, HiddenRows, sequence_examples
from medusa_jax.training.sharegpt import DataError, ReadReport

STORE_DTYPE = np.float16
FIRST_FORMAT_GLOB = "batch-*.npz"  # the retired first format: OUTPUT.hidden/batch-*.npz (now refused)


@dataclasses.dataclass(frozen=True)
class StoreKind:
    format: str  # "format" in the meta file
    meta_file: str
    per_reply: bool  # hidden rows cover the reply only (and rows carry a turn), else every position
    sequences: str  # what a row is, for messages
    description: str


FEATURES = StoreKind("medusa-jax-features-v1", "feature_store.json", False, "conversations",
                     "medusa-jax teacher-forced conversations with the base model's final hidden states")
REPLIES = StoreKind("medusa-jax-distilled-v1", "distill_store.json", True, "replies",
                    "medusa-jax self-distilled replies with the base model's hidden states")
KINDS = (FEATURES, REPLIES)


def kind_of(path: str | os.PathLike | None) -> StoreKind | None:
    """The kind of the store at `path`; None when it is not a store."""
    return next((k for k in KINDS if (Path(path) / k.meta_file).is_file()), None) if path else None


def is_store(path: str | os.PathLike | None, kind: StoreKind | None = None) -> bool:
    found = kind_of(path)
    return found is not None and kind in (None, found)


def store_path(output: str | os.PathLike) -> Path:
    """Where self-distillation writes the store of its JSONL output `output`."""
    return Path(str(output) + ".arrow")


def find_store(data: str | os.PathLike | None) -> Path | None:
    """The store `data` names: a store folder itself, or a self-distillation JSONL output with its store beside it
    (OUTPUT.arrow); None otherwise."""
    if is_store(data):
        return Path(data)
    if data and is_store(store_path(data), REPLIES):
        return store_path(data)
    return None


def first_format_folder(data: str | os.PathLike | None) -> Path | None:
    """The folder of hidden states in the first, retired format of `self_distill --save-hidden`
    (OUTPUT.hidden/batch-*.npz) that `data` names, itself or beside the JSONL OUTPUT; None if there is none."""
    if not data:
        return None
    for folder in (Path(data), Path(str(data) + ".hidden")):
        if folder.is_dir() and any(folder.glob(FIRST_FORMAT_GLOB)):
            return folder
    return None


def first_format_error(folder: Path) -> DataError:
    return DataError(f"{folder}: hidden states in the first self-distillation format ({FIRST_FORMAT_GLOB}), which is "
                     f"no longer read; regenerate them with the current scripts/self_distill.py --save-hidden into a "
                     f"new --output (it writes the Arrow store OUTPUT.arrow) and train with --data OUTPUT.arrow")


def refuse_first_format(data: str | os.PathLike | None, cache_hidden: bool) -> None:
    """Raises `first_format_error` when training would have read the first format: `data` is such a folder, or
    a JSONL output with one beside it, no store, and hidden states asked for (--cache-hidden)."""
    folder = first_format_folder(data)
    if folder is not None and (folder == Path(data) or (cache_hidden and find_store(data) is None)):
        raise first_format_error(folder)


def schema(hidden_size: int, kind: StoreKind):
    import datasets  # lazy (here and below): seconds to import, needed only when a store is written or read

    turn = {"turn": datasets.Value("int32")} if kind.per_reply else {}
    return datasets.Features({
        "id": datasets.Value("string"), **turn, "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("bool")),
        "hidden": datasets.List(datasets.List(datasets.Value("float16"), length=hidden_size))})


def sequence_table(rows, hidden_size: int, kind: StoreKind):
    """A pyarrow table of the store's schema. Rows are (id, turn, prompt ids, reply ids, hidden [len(reply), D])
    for REPLIES, (id, input_ids, loss_mask, hidden [len(input_ids), D]) for FEATURES."""
    import pyarrow as pa  # lazy, as in schema()

    seqs = []  # (id, turn, input_ids, loss_mask, hidden)
    for row in rows:
        if kind.per_reply:
            rid, turn, prompt, reply, hidden = row
            seqs.append((rid, turn, [*prompt, *reply], [False] * len(prompt) + [True] * len(reply), hidden))
        else:
            seqs.append((row[0], None, *row[1:]))
        rid, _, ids, mask, hidden = seqs[-1]
        want = (int(np.sum(mask)) if kind.per_reply else len(ids), hidden_size)
        if np.shape(hidden) != want:
            raise ValueError(f"sequence {rid!r}: hidden {np.shape(hidden)} does not match {want[0]} tokens x "
                             f"{hidden_size}")

    def column(k: int, dtype):
        parts = [np.asarray(s[k], dtype).reshape(-1) for s in seqs] or [np.zeros((0,), dtype)]
        offsets = np.concatenate([[0], np.cumsum([len(s[k]) for s in seqs], dtype=np.int64)]).astype(np.int32)
        values = pa.array(np.concatenate(parts))
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values if k != 4 else
                                        pa.FixedSizeListArray.from_arrays(values, hidden_size))

    turn = [pa.array([s[1] for s in seqs], pa.int32())] if kind.per_reply else []
    cols = [pa.array([s[0] for s in seqs], pa.string()), *turn, column(2, np.int32), column(3, bool),
            column(4, STORE_DTYPE)]
    return pa.Table.from_arrays(cols, schema=schema(hidden_size, kind).arrow_schema)


def listed_shards(folder: str | os.PathLike) -> list[str]:
    return [f["filename"] for f in json.loads((Path(folder) / "state.json").read_text())["_data_files"]]


def _write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


class StoreWriter:
    """Appends shards to a store of `kind` (created if missing). `build`: the settings (beyond format and hidden
    size) that an existing store must have been built with, e.g. a feature store's model, data and chunking."""

    def __init__(self, folder: str | os.PathLike, hidden_size: int, kind: StoreKind = REPLIES,
                 build: dict | None = None):
        self.folder, self.hidden_size, self.kind = Path(folder), hidden_size, kind
        meta, path = {"format": kind.format, "hidden_size": hidden_size, **(build or {})}, self.folder / kind.meta_file
        if path.is_file():
            found = json.loads(path.read_text())
            diff = sorted(k for k in meta if found.get(k) != meta[k])
            if diff:
                raise DataError(f"{self.folder} was built with other settings ({', '.join(diff)} differ): choose "
                                f"another output folder, or the same model, data and settings to resume it")
            return
        if self.folder.exists() and any(self.folder.iterdir()):
            raise DataError(f"{self.folder} exists and is not a {kind.format} hidden-state store: choose an empty "
                            f"or new output folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        info = {"citation": "", "homepage": "", "license": "", "description": kind.description,
                "features": schema(hidden_size, kind).to_dict()}
        _write_json(self.folder / "dataset_info.json", info)
        self._write_state([])
        _write_json(path, meta)

    def shards(self) -> list[str]:
        return listed_shards(self.folder)

    def _write_state(self, shards: list[str]) -> None:
        state = {"_data_files": [{"filename": s} for s in shards], "_format_columns": None, "_format_kwargs": {},
                 "_format_type": None, "_output_all_columns": False, "_split": None,
                 "_fingerprint": hashlib.sha256("|".join(shards).encode()).hexdigest()[:16]}
        _write_json(self.folder / "state.json", state)

    def append(self, rows, name: str | None = None) -> str:
        """Writes one shard of `rows` (see sequence_table) and lists it. Returns its file name."""
        from datasets.arrow_writer import ArrowWriter  # lazy, as in schema()

        shards = self.shards()
        k = len(shards)
        while name is None or name in shards:
            name, k = f"part-{k:06d}.arrow", k + 1
        with atomic_path(self.folder / name) as tmp:
            writer = ArrowWriter(features=schema(self.hidden_size, self.kind), path=str(tmp))
            writer.write_table(sequence_table(rows, self.hidden_size, self.kind))
            writer.finalize()
            writer.close()
        self._write_state(shards + [name])
        return name

    def shard_ids(self, name: str) -> list[str]:
        import pyarrow as pa  # lazy, as in schema()

        with pa.memory_map(str(self.folder / name)) as source:
            return pa.ipc.open_stream(source).read_all().column("id").to_pylist()

    def drop_uncommitted(self, committed: set[str]) -> list[str]:
        """Unlists (and deletes) the shards holding a conversation missing from `committed` (the JSONL ids):
        written by a run that stopped before appending their JSONL lines. Returns their names."""
        shards = self.shards()
        dropped = [name for name in shards if any(rid not in committed for rid in self.shard_ids(name))]
        if dropped:
            self._write_state([s for s in shards if s not in dropped])
            for name in dropped:
                (self.folder / name).unlink(missing_ok=True)
        return dropped


def open_dataset(folder: str | os.PathLike):
    """The store as a memory-mapped `datasets.Dataset`."""
    import datasets  # lazy, as in schema()

    kind = kind_of(folder)
    if kind is None:
        raise DataError(f"{folder}: not a hidden-state store (no {' or '.join(k.meta_file for k in KINDS)}); build "
                        f"one with scripts/build_features.py or scripts/self_distill.py --save-hidden")
    if not listed_shards(folder):
        raise DataError(f"{folder}: the store holds no {kind.sequences} yet (its writer has not finished a first "
                        f"shard); let it run longer or pass another --data")
    return datasets.load_from_disk(str(folder), keep_in_memory=False)


@dataclasses.dataclass(frozen=True)
class StoredSequences:
    """A store's sequences back to back (tokens_x, loss_x; sequence c at starts_c[c], lengths_c[c]) and their hidden
    rows in memory-mapped chunks; the held-out groups are conversations."""

    kind: StoreKind
    ids: list[str]
    starts_c: np.ndarray
    lengths_c: np.ndarray
    tokens_x: np.ndarray
    loss_x: np.ndarray
    hidden_chunks: list[np.ndarray]
    hidden_lengths_c: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.lengths_c.sum())

    @property
    def hidden_starts_c(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.hidden_lengths_c)[:-1]]).astype(np.int64)

    @property
    def hidden_from_c(self) -> np.ndarray:
        return self.lengths_c - self.hidden_lengths_c - 1 if self.kind.per_reply else np.zeros_like(self.lengths_c)

    def groups_c(self) -> np.ndarray:
        if not self.kind.per_reply:
            return np.arange(len(self.ids))
        return np.unique(np.asarray(self.ids, dtype=object).astype(str), return_inverse=True)[1]

    def examples(self, num_heads: int, with_path: bool = False) -> HiddenExamples:
        """Every stored position with a head target as a cached-hidden example (hidden_examples.sequence_examples);
        the hidden rows stay memory-mapped. `with_path`: also the path tokens (Hydra heads)."""
        return sequence_examples(HiddenRows(self.hidden_chunks), self.starts_c, self.lengths_c, self.tokens_x,
                                 self.loss_x, self.hidden_starts_c, self.hidden_lengths_c, self.hidden_from_c,
                                 num_heads, self.groups_c(), with_path)


def open_store(folder: str | os.PathLike, max_tokens: int | None = None) -> StoredSequences:
    """The store's sequences (its first sequences holding max_tokens tokens, when given), hidden rows memory-mapped:
    nothing of the hidden states is read until a batch gathers its rows."""
    table, kind = open_dataset(folder).data.table, kind_of(folder)
    d = json.loads((Path(folder) / kind.meta_file).read_text())["hidden_size"]
    ids, turns, lengths, hidden_lengths, tokens, loss, chunks, total = [], [], [], [], [], [], [], 0

    def lengths_of(column) -> np.ndarray:
        return column.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)

    for rb in table.to_batches():
        if not rb.num_rows:
            continue
        n_c, h_c = lengths_of(rb.column("input_ids")), lengths_of(rb.column("hidden"))
        keep = len(n_c) if max_tokens is None else int(np.searchsorted(np.cumsum(n_c) + total, max_tokens) + 1)
        keep = min(keep, len(n_c))
        upto = int(n_c[:keep].sum())
        ids += rb.column("id").to_pylist()[:keep]
        turns += rb.column("turn").to_pylist()[:keep] if kind.per_reply else []
        lengths.append(n_c[:keep])
        hidden_lengths.append(h_c[:keep])
        tokens.append(rb.column("input_ids").flatten().to_numpy(zero_copy_only=False)[:upto].astype(np.int32))
        loss.append(rb.column("loss_mask").flatten().to_numpy(zero_copy_only=False)[:upto].astype(bool))
        rows = rb.column("hidden").flatten().flatten().to_numpy(zero_copy_only=True).reshape(-1, d)
        chunks.append(rows[:int(h_c[:keep].sum())])
        total += upto
        if max_tokens is not None and total >= max_tokens:
            break
    if not ids:
        raise DataError(f"{folder}: the store holds no {kind.sequences}")
    if len(set(zip(ids, turns))) < len(turns):
        raise DataError(f"{folder}: a reply is stored twice (the same id and turn)")
    lengths_c = np.concatenate(lengths)
    starts_c = np.concatenate([[0], np.cumsum(lengths_c)[:-1]]).astype(np.int64)
    return StoredSequences(kind, ids, starts_c, lengths_c, np.concatenate(tokens), np.concatenate(loss), chunks,
                           np.concatenate(hidden_lengths))


def store_chat_data(folder: str | os.PathLike, config: DataConfig, pad_id: int) -> ChatData:
    """Packed rows of the store's sequences (loss on the assistant tokens; each cut to seq_len), split by
    conversation: the backbone-in-the-step path for a store (GPU, Medusa-2)."""
    store = open_store(folder)
    kept = [(store.tokens_x[s:s + n][: config.seq_len], store.loss_x[s:s + n][: config.seq_len].astype(np.int8), g)
            for s, n, g in zip(store.starts_c, store.lengths_c, store.groups_c())]
    usable = [k for k in kept if k[1].any()]
    if not usable:
        raise DataError(f"{folder}: no sequence has loss tokens within the first {config.seq_len} tokens")
    names, groups = np.unique([k[2] for k in usable], return_inverse=True)
    held = np.isin(groups, heldout_groups(len(names), config.heldout_fraction, config.seed))
    train = pack([k[:2] for k, h in zip(usable, held) if not h], config.seq_len, pad_id)
    heldout = pack([k[:2] for k, h in zip(usable, held) if h], config.seq_len, pad_id)
    n_held = len(np.unique(groups[held]))
    report = ReadReport(str(folder), records=len(kept), kept=len(usable))
    return ChatData(train, heldout, report, (len(names) - n_held, n_held), len(kept) - len(usable))
