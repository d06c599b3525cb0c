"""The teacher-forced feature store: existing chat text -> the frozen base's final hidden state at every position.

One teacher-forced forward per conversation (no generation), so a store is made at prefill speed: the drafter of
`medusa_jax.heads.eagle` trains on it. A store is a folder that `datasets.load_from_disk`
opens (state.json, dataset_info.json, Arrow shards) plus `feature_store.json` (format, hidden size, how it was
built). One row per conversation:
  id         string       the conversation's id in its source
  input_ids  list<int32>  the conversation rendered with the chat template (cut to seq_len tokens)
  loss_mask  list<bool>   true on assistant reply tokens (data.tokenize_messages)
  hidden     list<fixed_size_list<float16, D>>  one row per token: hidden[i] is the base's final-norm state at
             position i (its logits predict token i + 1)
Conversations are taken in a seeded random order and cut into chunks of about `chunk_tokens` tokens; chunk c is
shard `part-{c:06d}.arrow`, written under a temporary name, renamed, then listed in state.json (replaced
atomically). A build stops once its chunks hold `max_tokens` tokens; a rerun skips the chunks already listed, so
an interrupted build resumes where it stopped and a larger `max_tokens` grows the store: the first chunks of a
5M-token store are the 1M-token store of the same settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.training.data import DataConfig, tokenize_conversations, source_fingerprint
from medusa_jax.training.sharegpt import DataError, read_conversations
from medusa_jax.training.objectives import backbone_hidden

FORMAT = "medusa-jax-features-v1"
META_FILE = "feature_store.json"
STORE_DTYPE = np.float16


@dataclasses.dataclass(frozen=True)
class FeatureStoreConfig:
    max_tokens: int = 5_000_000  # stop once the store holds this many tokens (all positions)
    seq_len: int = 2048  # a conversation keeps its first seq_len tokens; rows of the forward are this wide
    rows_per_call: int = 2  # packed rows per forward call
    chunk_tokens: int = 65_536  # tokens per shard (about)
    seed: int = 0  # the order conversations are taken in
    limit: int | None = None  # read only the first N usable conversations of the source

    def __post_init__(self):
        for name in ("max_tokens", "seq_len", "rows_per_call", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def build_key(self) -> dict:
        """The settings a resumed build must share with the store (max_tokens may grow)."""
        return {"seq_len": self.seq_len, "chunk_tokens": self.chunk_tokens, "seed": self.seed, "limit": self.limit}


def features(hidden_size: int):
    import datasets  # heavy; only the writer needs the schema objects

    return datasets.Features({
        "id": datasets.Value("string"), "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("bool")),
        "hidden": datasets.List(datasets.List(datasets.Value("float16"), length=hidden_size))})


def is_feature_store(path) -> bool:
    return bool(path) and (Path(path) / META_FILE).is_file()


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def listed_shards(folder: Path) -> list[str]:
    return [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]


def _write_state(folder: Path, shards: list[str]) -> None:
    state = {"_data_files": [{"filename": s} for s in shards], "_format_columns": None, "_format_kwargs": {},
             "_format_type": None, "_output_all_columns": False, "_split": None,
             "_fingerprint": hashlib.sha256("|".join(shards).encode()).hexdigest()[:16]}
    _write_json(folder / "state.json", state)


def _open_for_writing(folder: Path, meta: dict) -> None:
    """Creates the store, or checks that an existing one was built with the same settings."""
    if (folder / META_FILE).is_file():
        found = json.loads((folder / META_FILE).read_text())
        same = {k: found.get(k) for k in ("format", "hidden_size", "model", "source", "build")}
        want = {k: meta[k] for k in same}
        if same != want:
            diff = sorted(k for k in same if same[k] != want[k])
            raise DataError(f"{folder} was built with other settings ({', '.join(diff)} differ): choose another "
                            f"output folder, or the same model, data and settings to resume it")
        return
    if folder.exists() and any(folder.iterdir()):
        raise DataError(f"{folder} exists and is not a feature store: choose an empty or new output folder")
    folder.mkdir(parents=True, exist_ok=True)
    info = {"citation": "", "homepage": "", "license": "", "features": features(meta["hidden_size"]).to_dict(),
            "description": "medusa-jax teacher-forced conversations with the base model's final hidden states"}
    _write_json(folder / "dataset_info.json", info)
    _write_state(folder, [])
    _write_json(folder / META_FILE, meta)


def _conversation_table(rows: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], hidden_size: int):
    import pyarrow as pa

    lengths = [len(ids) for _, ids, _, _ in rows]
    flat = np.concatenate([h for *_, h in rows]).astype(STORE_DTYPE).reshape(-1)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
    hidden = pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(pa.array(flat), hidden_size))
    cols = [pa.array([r[0] for r in rows], pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([r[1] for r in rows]), pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([r[2] for r in rows]).astype(bool))),
            hidden]
    return pa.Table.from_arrays(cols, schema=features(hidden_size).arrow_schema)


def _append_shard(folder: Path, name: str, rows, hidden_size: int) -> None:
    from datasets.arrow_writer import ArrowWriter

    tmp = folder / f".{name}.{os.getpid()}.tmp"
    writer = ArrowWriter(features=features(hidden_size), path=str(tmp))
    writer.write_table(_conversation_table(rows, hidden_size))
    writer.finalize()
    writer.close()
    os.replace(tmp, folder / name)
    _write_state(folder, listed_shards(folder) + [name])


def chunks_of(lengths: list[int], chunk_tokens: int, max_tokens: int) -> list[list[int]]:
    """Consecutive index ranges of about chunk_tokens tokens each (cut by chunk_tokens alone, so chunk c is the
    same whatever max_tokens is), as many as cover max_tokens tokens."""
    out, current, in_chunk, total = [], [], 0, 0
    for i, n in enumerate(lengths):
        if total >= max_tokens and not current:
            break
        current.append(i)
        in_chunk += n
        total += n
        if in_chunk >= chunk_tokens:
            out.append(current)
            current, in_chunk = [], 0
    if current:
        out.append(current)
    return out


def place_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit-decreasing packing of sequences (each <= width) into rows: the members of each row."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if free >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


@partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_bt, positions_bt, segments_bt):
    return backbone_hidden(nnx.merge(graphdef, state),
                           {"tokens": tokens_bt, "positions": positions_bt, "segment_ids": segments_bt})


def chunk_hidden(base: CausalLM, seqs: list[np.ndarray], config: FeatureStoreConfig,
                 put: Callable[[np.ndarray], jax.Array] = jnp.asarray) -> list[np.ndarray]:
    """The final hidden states [len(seq), D] (float32) of each token sequence, by packed teacher-forced forwards
    of `rows_per_call` rows of seq_len tokens (attention stays inside each sequence). `put` places a batch
    array on the devices (a mesh's batch sharding)."""
    graphdef, state = nnx.split(base)
    placement = place_rows([len(s) for s in seqs], config.seq_len)
    out: list[np.ndarray | None] = [None] * len(seqs)
    b, t = config.rows_per_call, config.seq_len
    for r0 in range(0, len(placement), b):
        tokens, positions, segments = (np.zeros((b, t), np.int32) for _ in range(3))
        spans = []
        for r, members in enumerate(placement[r0:r0 + b]):
            at = 0
            for s, i in enumerate(members):
                n = len(seqs[i])
                tokens[r, at:at + n], positions[r, at:at + n], segments[r, at:at + n] = seqs[i], np.arange(n), s + 1
                spans.append((i, r, at, n))
                at += n
        hidden_btd = np.asarray(_forward(graphdef, state, put(tokens), put(positions), put(segments)))
        for i, r, at, n in spans:
            out[i] = hidden_btd[r, at:at + n]
    return out


def _ordered_conversations(tokenizer, eos_ids, source, config: FeatureStoreConfig, log):
    records, report = read_conversations(source, limit=config.limit)
    log(report.summary())
    data_config = DataConfig(seq_len=config.seq_len, limit=config.limit)
    ds = tokenize_conversations(records, tokenizer, eos_ids, data_config, source_fingerprint(source))
    ids, tokens, masks = ds["id"], ds["input_ids"], ds["loss_mask"]
    usable = [i for i in range(len(ids)) if any(masks[i])]
    if not usable:
        raise DataError(f"{report.source}: no conversation has assistant tokens within the first {config.seq_len}")
    order = [usable[j] for j in np.random.default_rng(config.seed).permutation(len(usable))]
    return ([str(ids[i]) for i in order], [np.asarray(tokens[i], np.int32) for i in order],
            [np.asarray(masks[i], bool) for i in order], report)


def build_feature_store(base: CausalLM, tokenizer, eos_ids: tuple[int, ...], source: str | None,
                        output: str | os.PathLike, config: FeatureStoreConfig = FeatureStoreConfig(),
                        model_name: str = "", put: Callable[[np.ndarray], jax.Array] = jnp.asarray,
                        log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """Builds (or resumes, or grows) the store at `output`; returns its folder."""
    folder = Path(output)
    ids, tokens, masks, _ = _ordered_conversations(tokenizer, eos_ids, source, config, log)
    meta = {"format": FORMAT, "hidden_size": base.config.hidden_size, "model": model_name,
            "source": "sharegpt" if source in (None, "sharegpt") else Path(str(source)).name,
            "build": config.build_key()}
    _open_for_writing(folder, meta)
    chunks = chunks_of([len(t) for t in tokens], config.chunk_tokens, config.max_tokens)
    done = set(listed_shards(folder))
    todo = [c for c in range(len(chunks)) if f"part-{c:06d}.arrow" not in done]
    total = sum(len(tokens[i]) for c in range(len(chunks)) for i in chunks[c])
    stored = total - sum(len(tokens[i]) for c in todo for i in chunks[c])
    log(f"{folder}: {len(chunks)} chunks ({total:,} tokens, {sum(map(len, chunks)):,} conversations); "
        f"{len(chunks) - len(todo)} already stored ({stored:,} tokens)")
    if total < config.max_tokens:
        log(f"the source holds only {total:,} usable tokens, fewer than max_tokens={config.max_tokens:,}")
    bar = None
    if progress:
        from tqdm.auto import tqdm  # a progress bar only when asked for
        bar = tqdm(total=total, initial=stored, unit="tok", unit_scale=True, desc="features", dynamic_ncols=True)
    t0, made = time.perf_counter(), 0
    for c in todo:
        members = chunks[c]
        hidden = chunk_hidden(base, [tokens[i] for i in members], config, put)
        peak = max(float(np.abs(h).max()) for h in hidden)
        if not np.isfinite(peak) or peak > np.finfo(STORE_DTYPE).max:
            raise OverflowError(f"hidden states reach {peak}: beyond float16; this model cannot use the store")
        rows = [(ids[i], tokens[i], masks[i], h) for i, h in zip(members, hidden)]
        _append_shard(folder, f"part-{c:06d}.arrow", rows, base.config.hidden_size)
        n = sum(len(tokens[i]) for i in members)
        made += n
        if bar is not None:
            bar.update(n)
            bar.set_postfix(tok_s=f"{made / (time.perf_counter() - t0):.0f}")
    if bar is not None:
        bar.close()
    return folder


@dataclasses.dataclass(frozen=True)
class FeatureConversations:
    """A store's conversations back to back: conversation c is tokens_x[starts_c[c]:starts_c[c] + lengths_c[c]],
    with loss_x and the hidden rows of the same range (`hidden`, memory-mapped [X, D] float16 chunks)."""

    ids: list[str]
    starts_c: np.ndarray
    lengths_c: np.ndarray
    tokens_x: np.ndarray
    loss_x: np.ndarray
    hidden_chunks: list[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths_c.sum())


def _record_batches(folder: Path) -> Iterator:
    import datasets  # the memory-mapped Arrow table

    table = datasets.load_from_disk(str(folder), keep_in_memory=False).data.table
    yield from (rb for rb in table.to_batches() if rb.num_rows)


def open_feature_store(folder: str | os.PathLike, max_tokens: int | None = None) -> FeatureConversations:
    """The store's conversations (its first conversations holding max_tokens tokens, when given), hidden rows
    memory-mapped: nothing of the hidden states is read until a batch gathers its rows."""
    folder = Path(folder)
    if not is_feature_store(folder):
        raise DataError(f"{folder}: not a feature store (no {META_FILE}); build one with scripts/build_features.py")
    d = json.loads((folder / META_FILE).read_text())["hidden_size"]
    ids, lengths, tokens, loss, chunks, total = [], [], [], [], [], 0
    for rb in _record_batches(folder):
        n_c = rb.column("input_ids").value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        rows = rb.column("hidden").flatten().flatten().to_numpy(zero_copy_only=True).reshape(-1, d)
        keep = len(n_c) if max_tokens is None else int(np.searchsorted(np.cumsum(n_c) + total, max_tokens) + 1)
        keep = min(keep, len(n_c))
        upto = int(n_c[:keep].sum())
        ids += rb.column("id").to_pylist()[:keep]
        lengths.append(n_c[:keep])
        tokens.append(rb.column("input_ids").flatten().to_numpy(zero_copy_only=False)[:upto].astype(np.int32))
        loss.append(rb.column("loss_mask").flatten().to_numpy(zero_copy_only=False)[:upto].astype(bool))
        chunks.append(rows[:upto])
        total += upto
        if max_tokens is not None and total >= max_tokens:
            break
    if not ids:
        raise DataError(f"{folder}: the store holds no conversations yet")
    lengths_c = np.concatenate(lengths)
    starts_c = np.concatenate([[0], np.cumsum(lengths_c)[:-1]]).astype(np.int64)
    return FeatureConversations(ids, starts_c, lengths_c, np.concatenate(tokens), np.concatenate(loss), chunks)
