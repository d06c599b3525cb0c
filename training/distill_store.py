"""Self-distilled data stored through `datasets` (Arrow): token ids, loss mask and the base's hidden states.

The store is a folder that `datasets.load_from_disk` opens (state.json lists its Arrow shards,
dataset_info.json its features) plus `distill_store.json` (format, hidden size). One row per generated reply:
  id         string       the conversation's id (its record in the self-distillation JSONL)
  turn       int32        which assistant turn of the conversation it is
  input_ids  list<int32>  the prompt the model saw (chat template applied), then the generated reply tokens
  loss_mask  list<bool>   true on the reply tokens
  hidden     list<fixed_size_list<float16, D>>  one row per reply token: hidden[j] is the base's final hidden
             state at position P - 1 + j (P = prompt length), the state that produced reply token j
Shards are appended, never rewritten: each is written under a temporary name and renamed, then state.json is
replaced atomically, so an interrupted writer leaves a store that lists only complete shards. The loader
memory-maps the shards and hands training zero-copy views of the hidden buffers (hidden_examples.HiddenRows):
a batch reads only its rows, the store is never loaded whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from medusa_jax.atomic import atomic_path, write_text_atomic
from medusa_jax.training.data import ChatData, DataConfig, pack
from medusa_jax.training.hidden_examples import HiddenExamples, HiddenRows, heldout_groups, reply_examples
from medusa_jax.training.sharegpt import DataError, ReadReport

FORMAT = "medusa-jax-distilled-v1"
META_FILE = "distill_store.json"
FIRST_FORMAT_GLOB = "batch-*.npz"  # the retired first format: OUTPUT.hidden/batch-*.npz (now refused)


def features(hidden_size: int):
    import datasets  # lazy (here and below): seconds to import, needed only when a store is written or read

    return datasets.Features({
        "id": datasets.Value("string"), "turn": datasets.Value("int32"),
        "input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("bool")),
        "hidden": datasets.List(datasets.List(datasets.Value("float16"), length=hidden_size))})


def is_store(path: str | os.PathLike | None) -> bool:
    return bool(path) and (Path(path) / META_FILE).is_file()


def store_path(output: str | os.PathLike) -> Path:
    """Where self-distillation writes the store of its JSONL output `output`."""
    return Path(str(output) + ".arrow")


def find_store(data: str | os.PathLike | None) -> Path | None:
    """The store `data` names: the store folder itself, or a self-distillation JSONL output with its store
    beside it (OUTPUT.arrow); None otherwise."""
    if is_store(data):
        return Path(data)
    if data and is_store(store_path(data)):
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


def _write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def replies_table(replies: Iterable[tuple[str, int, list[int], list[int], np.ndarray]], hidden_size: int):
    """(id, turn, prompt ids, reply ids, hidden [len(reply), D]) tuples -> a pyarrow table of the store's schema."""
    import pyarrow as pa  # lazy, with datasets (above)

    replies = list(replies)
    ids = [list(p) + list(r) for _, _, p, r, _ in replies]
    masks = [[False] * len(p) + [True] * len(r) for _, _, p, r, _ in replies]
    for rid, _, _, r, h in replies:
        if h.shape != (len(r), hidden_size):
            raise ValueError(f"reply of {rid!r}: hidden {h.shape} does not match {len(r)} tokens x {hidden_size}")
    lengths = [len(r) for _, _, _, r, _ in replies]
    flat = np.concatenate([h for *_, h in replies]).astype(np.float16).reshape(-1) if replies else \
        np.zeros((0,), np.float16)
    rows = pa.FixedSizeListArray.from_arrays(pa.array(flat), hidden_size)
    hidden = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32()), rows)
    schema = features(hidden_size).arrow_schema
    cols = [pa.array([r[0] for r in replies], pa.string()), pa.array([r[1] for r in replies], pa.int32()),
            pa.array(ids, pa.list_(pa.int32())), pa.array(masks, pa.list_(pa.bool_())), hidden]
    return pa.Table.from_arrays(cols, schema=schema)


class StoreWriter:
    """Appends shards to a store (created if missing)."""

    def __init__(self, folder: str | os.PathLike, hidden_size: int):
        self.folder, self.hidden_size = Path(folder), hidden_size
        meta = self.folder / META_FILE
        if meta.is_file():
            found = json.loads(meta.read_text())
            if found.get("format") != FORMAT or found.get("hidden_size") != hidden_size:
                raise DataError(f"{self.folder} holds {found}, not a {FORMAT} store of hidden size {hidden_size}")
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        info = {"citation": "", "homepage": "", "license": "", "features": features(hidden_size).to_dict(),
                "description": "medusa-jax self-distilled replies with the base model's hidden states"}
        _write_json(self.folder / "dataset_info.json", info)
        self._write_state([])
        _write_json(meta, {"format": FORMAT, "hidden_size": hidden_size})

    def shards(self) -> list[str]:
        return [f["filename"] for f in json.loads((self.folder / "state.json").read_text())["_data_files"]]

    def _write_state(self, shards: list[str]) -> None:
        state = {"_data_files": [{"filename": s} for s in shards], "_format_columns": None, "_format_kwargs": {},
                 "_format_type": None, "_output_all_columns": False, "_split": None,
                 "_fingerprint": hashlib.sha256("|".join(shards).encode()).hexdigest()[:16]}
        _write_json(self.folder / "state.json", state)

    def append(self, replies, name: str | None = None) -> str:
        """Writes one shard of `replies` (see replies_table) and lists it. Returns its file name."""
        from datasets.arrow_writer import ArrowWriter  # lazy, as in features()

        shards = self.shards()
        k = len(shards)
        while name is None or name in shards:
            name, k = f"part-{k:06d}.arrow", k + 1
        with atomic_path(self.folder / name) as tmp:
            writer = ArrowWriter(features=features(self.hidden_size), path=str(tmp))
            writer.write_table(replies_table(replies, self.hidden_size))
            writer.finalize()
            writer.close()
        self._write_state(shards + [name])
        return name

    def shard_ids(self, name: str) -> list[tuple[str, int]]:
        import pyarrow as pa  # lazy, as in features()

        with pa.memory_map(str(self.folder / name)) as source:
            table = pa.ipc.open_stream(source).read_all().select(["id", "turn"])
        return list(zip(table.column("id").to_pylist(), table.column("turn").to_pylist()))

    def drop_uncommitted(self, committed: set[str]) -> list[str]:
        """Unlists (and deletes) the shards holding a conversation missing from `committed` (the JSONL ids):
        written by a run that stopped before appending their JSONL lines. Returns their names."""
        shards, dropped = self.shards(), []
        for name in shards:
            if any(rid not in committed for rid, _ in self.shard_ids(name)):
                dropped.append(name)
        if dropped:
            self._write_state([s for s in shards if s not in dropped])
            for name in dropped:
                (self.folder / name).unlink(missing_ok=True)
        return dropped


def open_store(folder: str | os.PathLike):
    """The store as a memory-mapped `datasets.Dataset`."""
    import datasets  # lazy, as in features()

    if not is_store(folder):
        raise DataError(f"{folder}: not a self-distilled store (no {META_FILE})")
    if not json.loads((Path(folder) / "state.json").read_text())["_data_files"]:
        raise DataError(f"{folder}: the store holds no replies yet (self-distillation has not written its first "
                        f"shard); let it run longer or pass another --data")
    return datasets.load_from_disk(str(folder), keep_in_memory=False)


def _columns(folder):
    """Per record batch of the memory-mapped table: ids, turns, reply lengths, reply tokens, hidden rows
    [n, D] (a zero-copy view)."""
    table = open_store(folder).data.table
    d = json.loads((Path(folder) / META_FILE).read_text())["hidden_size"]
    for rb in table.to_batches():
        if rb.num_rows == 0:
            continue
        hidden = rb.column("hidden")
        lengths = hidden.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        rows = hidden.flatten().flatten().to_numpy(zero_copy_only=True).reshape(-1, d)
        ids_col = rb.column("input_ids")
        ends = np.cumsum(ids_col.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64))
        flat_ids = ids_col.flatten().to_numpy(zero_copy_only=False)
        starts = np.repeat(ends - lengths, lengths)
        within = np.arange(len(starts)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        yield (rb.column("id").to_pylist(), rb.column("turn").to_pylist(), lengths,
               flat_ids[starts + within].astype(np.int32), rows)


def load_store_examples(folder: str | os.PathLike, num_heads: int, with_path: bool = False) -> HiddenExamples:
    """Examples of every reply of the store (groups = conversations), hidden rows memory-mapped. `with_path`:
    they also carry their path tokens (Hydra heads; derived from the reply's token ids)."""
    ids, lengths, tokens, chunks, seen = [], [], [], [], set()
    for rid, turn, n, tok, rows in _columns(folder):
        for key in zip(rid, turn):
            if key in seen:
                raise DataError(f"{folder}: reply {key} is stored twice")
            seen.add(key)
        ids += rid
        lengths.append(n)
        tokens.append(tok)
        chunks.append(rows)
    if not ids:
        raise DataError(f"{folder}: the store holds no replies")
    _, groups = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)
    hidden = HiddenRows(chunks)
    return reply_examples(hidden, np.concatenate(lengths), np.concatenate(tokens), num_heads, groups, with_path)


def store_sequences(folder: str | os.PathLike) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """(input_ids, loss_mask) of every reply and its conversation id (the backbone-in-the-step path)."""
    ds = open_store(folder).select_columns(["id", "input_ids", "loss_mask"]).with_format("numpy")
    seqs, ids = [], []
    for batch in ds.iter(batch_size=1024):
        for rid, tok, mask in zip(batch["id"], batch["input_ids"], batch["loss_mask"]):
            seqs.append((np.asarray(tok, np.int32), np.asarray(mask, np.int8)))
            ids.append(str(rid))
    return seqs, ids


def store_chat_data(folder: str | os.PathLike, config: DataConfig, pad_id: int) -> ChatData:
    """Packed rows of the store's replies (prompt + reply, loss on the reply; each cut to seq_len), split by
    conversation: the backbone-in-the-step path for a store (GPU, Medusa-2)."""
    seqs, ids = store_sequences(folder)
    kept = [(s[0][: config.seq_len], s[1][: config.seq_len], rid) for s, rid in zip(seqs, ids)]
    usable = [k for k in kept if k[1].any()]
    if not usable:
        raise DataError(f"{folder}: no reply has loss tokens within the first {config.seq_len} tokens")
    names, groups = np.unique([k[2] for k in usable], return_inverse=True)
    held = np.isin(groups, heldout_groups(len(names), config.heldout_fraction, config.seed))
    train = pack([k[:2] for k, h in zip(usable, held) if not h], config.seq_len, pad_id)
    heldout = pack([k[:2] for k, h in zip(usable, held) if h], config.seq_len, pad_id)
    n_held = len(np.unique(groups[held]))
    report = ReadReport(str(folder), records=len(seqs), kept=len(usable))
    return ChatData(train, heldout, report, (len(names) - n_held, n_held), len(seqs) - len(usable))
