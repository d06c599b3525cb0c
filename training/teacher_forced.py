"""The teacher-forced producer of the hidden-state store (kind FEATURES): the frozen base's final hidden state at
every position by packed forwards, resumable and growable; docs/modules.md."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.settings import SEED, at_least, check_settings, setting
from medusa_jax.training.data import DataConfig, PackedRows, first_fit, tokenize_conversations, source_fingerprint
from medusa_jax.training.hidden_examples import HiddenExamples, HiddenRows
from medusa_jax.training.hidden_store import FEATURES, STORE_DTYPE, StoreWriter, listed_shards, open_store
from medusa_jax.training.sharegpt import DataError, read_conversations
from medusa_jax.training.objectives import backbone_hidden

CACHE_VERSION = "v3"  # v3: a hidden-state store of every position (v2, npz chunks of example positions, is not read)
CACHE_CHUNK_ROWS = 64  # packed rows per shard of the --cache-hidden store


@dataclasses.dataclass(frozen=True)
class FeatureStoreConfig:
    max_tokens: int = setting(5_000_000, at_least(1))  # stop once the store holds this many tokens (all positions)
    seq_len: int = setting(2048, at_least(1))  # a conversation keeps its first seq_len tokens; forward rows' width
    rows_per_call: int = setting(2, at_least(1))  # packed rows per forward call
    chunk_tokens: int = setting(65_536, at_least(1))  # tokens per shard (about)
    seed: int = setting(0, SEED)  # the order conversations are taken in
    limit: int | None = setting(None, at_least(1))  # read only the first N usable conversations of the source

    def __post_init__(self):
        check_settings(self)

    def build_key(self) -> dict:
        """The settings a resumed build must share with the store (max_tokens may grow)."""
        return {"seq_len": self.seq_len, "chunk_tokens": self.chunk_tokens, "seed": self.seed, "limit": self.limit}


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
    return first_fit(lengths, width, order=sorted(range(len(lengths)), key=lambda i: -lengths[i]))


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


def _append_chunks(writer: StoreWriter, base: CausalLM, ids, tokens, masks, chunks: dict[int, list[int]],
                   config: FeatureStoreConfig, put, on_chunk: Callable[[int], None]) -> None:
    """Computes chunk c (members: indices into ids/tokens/masks) of `chunks` and appends it as part-{c:06d}.arrow;
    on_chunk(its tokens) after each."""
    for c, members in chunks.items():
        hidden = chunk_hidden(base, [tokens[i] for i in members], config, put)
        peak = max(float(np.abs(h).max()) for h in hidden)
        if not np.isfinite(peak) or peak > np.finfo(STORE_DTYPE).max:
            raise OverflowError(f"hidden states reach {peak}: beyond float16; this model cannot use the store")
        writer.append([(ids[i], tokens[i], masks[i], h) for i, h in zip(members, hidden)], f"part-{c:06d}.arrow")
        on_chunk(sum(len(tokens[i]) for i in members))


def _pending(writer: StoreWriter, tokens, config: FeatureStoreConfig) -> tuple[list[list[int]], dict[int, list[int]]]:
    """(every chunk of the store, the chunks it does not list yet by number)."""
    chunks = chunks_of([len(t) for t in tokens], config.chunk_tokens, config.max_tokens)
    done = set(writer.shards())
    return chunks, {c: m for c, m in enumerate(chunks) if f"part-{c:06d}.arrow" not in done}


def build_feature_store(base: CausalLM, tokenizer, eos_ids: tuple[int, ...], source: str | None,
                        output: str | os.PathLike, config: FeatureStoreConfig = FeatureStoreConfig(),
                        model_name: str = "", put: Callable[[np.ndarray], jax.Array] = jnp.asarray,
                        log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """Builds (or resumes, or grows) the store of chat text `source` at `output`; returns its folder."""
    folder = Path(output)
    ids, tokens, masks, _ = _ordered_conversations(tokenizer, eos_ids, source, config, log)
    writer = StoreWriter(folder, base.config.hidden_size, FEATURES, build={
        "model": model_name, "source": "sharegpt" if source in (None, "sharegpt") else Path(str(source)).name,
        "build": config.build_key()})
    chunks, todo = _pending(writer, tokens, config)
    total = sum(len(tokens[i]) for c in chunks for i in c)
    stored = total - sum(len(tokens[i]) for c in todo.values() for i in c)
    log(f"{folder}: {len(chunks)} chunks ({total:,} tokens, {sum(map(len, chunks)):,} conversations); "
        f"{len(chunks) - len(todo)} already stored ({stored:,} tokens)")
    if total < config.max_tokens:
        log(f"the source holds only {total:,} usable tokens, fewer than max_tokens={config.max_tokens:,}")
    bar, t0, made = None, time.perf_counter(), [0]
    if progress:
        from tqdm.auto import tqdm  # a progress bar only when asked for
        bar = tqdm(total=total, initial=stored, unit="tok", unit_scale=True, desc="features", dynamic_ncols=True)

    def advance(n: int) -> None:
        made[0] += n
        if bar is not None:
            bar.update(n)
            bar.set_postfix(tok_s=f"{made[0] / (time.perf_counter() - t0):.0f}")

    _append_chunks(writer, base, ids, tokens, masks, todo, config, put, advance)
    if bar is not None:
        bar.close()
    return folder


def rows_fingerprint(rows: PackedRows) -> str:
    h = hashlib.sha256()
    for a in (rows.tokens_bt, rows.segment_ids_bt, rows.loss_mask_bt):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(base: CausalLM) -> str:
    """Cheap identity of the backbone: config + a few sampled weight values of every parameter."""
    h = hashlib.sha256(repr(base.config).encode())
    for _, leaf in sorted(nnx.to_flat_state(nnx.state(base, nnx.Param)), key=lambda kv: str(kv[0])):
        flat = np.asarray(jax.device_get(leaf[...])).reshape(-1)
        h.update(flat[:: max(1, flat.size // 64)][:64].astype(np.float32).tobytes())
    return h.hexdigest()[:16]


def row_conversations(rows: PackedRows) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(tokens, loss mask) of each conversation (segment) of packed rows, row by row."""
    tokens, masks = [], []
    for tokens_t, segments_t, loss_t in zip(rows.tokens_bt, rows.segment_ids_bt, rows.loss_mask_bt):
        for s in np.unique(segments_t[segments_t > 0]):
            tokens.append(np.asarray(tokens_t[segments_t == s], np.int32))
            masks.append(np.asarray(loss_t[segments_t == s], bool))
    return tokens, masks


@dataclasses.dataclass(frozen=True)
class HiddenCache:
    """The --cache-hidden store of some packed rows, and what their examples carry."""

    folder: Path
    num_heads: int
    with_path: bool
    hidden_size: int

    def examples(self) -> HiddenExamples:
        if not listed_shards(self.folder):  # no conversation (an empty held-out split)
            none = np.zeros((0, self.num_heads), np.int32)
            return HiddenExamples(HiddenRows([], width=self.hidden_size), np.zeros((0,), np.int64), none,
                                  none.astype(np.int64), None, none if self.with_path else None)
        return open_store(self.folder).examples(self.num_heads, self.with_path)


def build_hidden_cache(base: CausalLM, rows: PackedRows, num_heads: int, root: str | os.PathLike,
                       batch_rows: int = 8, progress: Callable[[int, int], None] | None = None,
                       with_path: bool = False) -> HiddenCache:
    """Computes (or reuses, or resumes) the store of `rows`'s conversations under `root`: `batch_rows` rows of
    the rows' width per forward. `progress(done_tokens, total_tokens)` is called after each chunk. The examples
    (`num_heads`; `with_path`: Hydra heads' path tokens) are derived from the store when read."""
    width = int(rows.tokens_bt.shape[1]) if rows.num_rows else 1
    tokens, masks = row_conversations(rows)
    total = sum(map(len, tokens))
    config = FeatureStoreConfig(max_tokens=max(total, 1), seq_len=width, rows_per_call=batch_rows,
                                chunk_tokens=CACHE_CHUNK_ROWS * width)
    folder = Path(root) / f"{model_fingerprint(base)}-{rows_fingerprint(rows)}-{CACHE_VERSION}"
    writer = StoreWriter(folder, base.config.hidden_size, FEATURES, build={"build": config.build_key()})
    _, todo = _pending(writer, tokens, config)
    done = [total - sum(len(tokens[i]) for c in todo.values() for i in c)]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    ids = [str(i) for i in range(len(tokens))]
    _append_chunks(writer, base, ids, tokens, masks, todo, config, jnp.asarray, advance)
    return HiddenCache(folder, num_heads, with_path, base.config.hidden_size)
