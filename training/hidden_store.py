"""The first hidden-state format of `self_distill --save-hidden` (OUTPUT.hidden/batch-*.npz): reading it, and
converting it into the Arrow store (distill_store.py) that training streams.

Each npz is one flush of the self-distillation run: ids/turns of its replies, their token ids (flat, with
offsets) and the hidden state behind each token ([n, D] float16; h_j produced token j). The npz is written
before its JSONL lines, so a batch whose conversations are not (yet) all in the JSONL is skipped: it is either
being committed by a running job (a later conversion picks it up) or was left by a run killed in between
(its conversations were regenerated into a later batch). Each (id, turn) is used once, the first one found.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from medusa_jax.text import chat_prompt_ids
from medusa_jax.training.distill_store import META_FILE, StoreWriter, is_store, store_path
from medusa_jax.training.hidden_examples import HiddenExamples, HiddenRows, reply_examples
from medusa_jax.training.sharegpt import DataError, read_conversation_file


def hidden_store_path(output: str | os.PathLike) -> Path:
    return Path(str(output) + ".hidden")


def write_hidden_batch(folder: Path, saved: list[tuple[str, int, list[int], np.ndarray]]) -> None:
    """Writes one batch in the first format (what the converter reads; kept for its tests): ids/turns of the
    replies, their token ids (flat, with offsets), hidden [n, D] fp16."""
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [len(t) for _, _, t, _ in saved]
    arrays = {"ids": np.asarray([s[0] for s in saved]), "turns": np.asarray([s[1] for s in saved], np.int32),
              "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
              "tokens": np.concatenate([np.asarray(s[2], np.int32) for s in saved]),
              "hidden": np.concatenate([s[3] for s in saved]).astype(np.float16)}
    name = "batch-" + "".join(c if c.isalnum() else "_" for c in str(saved[0][0]))[:64]
    tmp = folder / f".{name}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, folder / f"{name}.npz")


def store_for(data: str | None) -> Path | None:
    """The npz folder self-distillation wrote next to `data`, if there is one."""
    if not data:
        return None
    folder = hidden_store_path(data)
    return folder if folder.is_dir() and any(folder.glob("batch-*.npz")) else None


def _committed(data: str | os.PathLike) -> dict[str, list[dict[str, str]]]:
    """id -> messages of the complete JSONL records (read only: a half-written last line is ignored)."""
    path = Path(data)
    if not path.is_file():
        return {}
    records, _ = read_conversation_file(path)
    return {str(r["id"]): r["messages"] for r in records}


def _read_batch(path: Path, committed) -> list[tuple[str, int, np.ndarray, np.ndarray]] | None:
    """[(id, turn, tokens, hidden)] of one npz batch; None unless its conversations are all committed."""
    with np.load(path) as z:
        ids = [str(i) for i in z["ids"].tolist()]
        if not ids or any(i not in committed for i in ids):
            return None
        offsets, tokens, hidden = z["offsets"], z["tokens"], z["hidden"]
        return [(rid, int(turn), tokens[offsets[r]:offsets[r + 1]], hidden[offsets[r]:offsets[r + 1]])
                for r, (rid, turn) in enumerate(zip(ids, z["turns"].tolist()))]


def _batches(data, committed):
    for path in sorted(hidden_store_path(data).glob("batch-*.npz")):
        yield path, _read_batch(path, committed)


def load_distilled_examples(data: str, num_heads: int, with_path: bool = False) -> tuple[HiddenExamples, int]:
    """All committed replies of the npz batches, in memory. Returns (examples grouped by conversation,
    number of conversations). `with_path`: the examples also carry their path tokens (Hydra heads)."""
    committed = _committed(data)
    lengths, tokens, hidden, groups, seen, conv = [], [], [], [], set(), {}
    for _, replies in _batches(data, committed):
        for rid, turn, tok, h in replies or ():
            if (rid, turn) in seen or len(tok) < 1:
                continue
            seen.add((rid, turn))
            lengths.append(len(tok))
            tokens.append(tok)
            hidden.append(h)
            groups.append(conv.setdefault(rid, len(conv)))
    if not lengths:
        raise DataError(f"{hidden_store_path(data)}: no saved hidden states of conversations listed in {data}")
    rows = HiddenRows([np.concatenate(hidden)])
    return reply_examples(rows, np.asarray(lengths), np.concatenate(tokens).astype(np.int32), num_heads,
                          np.asarray(groups), with_path), len(conv)


def convert_to_store(data: str | os.PathLike, tokenizer, store: str | os.PathLike | None = None,
                     log: Callable[[str], None] = print) -> Path:
    """Converts the npz batches next to the JSONL `data` into the Arrow store `store` (default
    distill_store.store_path(data)), one shard per batch. Rerunning it converts only the batches not yet in
    the store (safe while self-distillation is still writing; the JSONL is only read). The prompt ids are
    re-rendered from the JSONL records with `tokenizer` (the model's), exactly as self-distillation built them."""
    store = Path(store) if store is not None else store_path(data)
    committed = _committed(data)
    writer, listed, stored = None, set(), set()

    def open_writer(hidden_size):
        nonlocal writer, listed, stored
        writer = StoreWriter(store, hidden_size)
        listed = set(writer.shards())
        stored = {key for shard in listed for key in writer.shard_ids(shard)}

    if is_store(store):
        open_writer(json.loads((store / META_FILE).read_text())["hidden_size"])
    counts = {"converted": 0, "already": 0, "pending": 0, "replies": 0}
    for path in sorted(hidden_store_path(data).glob("batch-*.npz")):
        name = f"legacy-{path.stem}.arrow"
        if name in listed:  # converted before: not even read
            counts["already"] += 1
            continue
        replies = _read_batch(path, committed)
        if replies is None:
            counts["pending"] += 1
            continue
        if writer is None:
            open_writer(int(replies[0][3].shape[1]))
        rows = []
        for rid, turn, tok, h in replies:
            if (rid, turn) in stored or len(tok) < 1:
                continue
            stored.add((rid, turn))
            users = [k for k, m in enumerate(committed[rid]) if m["role"] == "user"]
            prompt = chat_prompt_ids(tokenizer, committed[rid][: users[turn] + 1])
            rows.append((rid, turn, prompt, tok.tolist(), h))
        if rows:
            writer.append(rows, name)
            counts["converted"] += 1
            counts["replies"] += len(rows)
    if writer is None:
        raise DataError(f"{hidden_store_path(data)}: no npz batch whose conversations are all in {data}")
    log(f"{store}: {counts['converted']} batches ({counts['replies']} replies) converted, {counts['already']} "
        f"already there, {counts['pending']} not yet committed to {data} (skipped)")
    return store
