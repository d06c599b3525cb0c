"""A warm Token Recycling table from the base model's own logits over chat text (teacher-forced), with the
rank acceptance the templates come from; docs/modules.md."""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.hf.load import load_pretrained
from medusa_jax.text import eos_token_ids, load_tokenizer
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.recycle import DEFAULT_TOP_K, empty_table
from medusa_jax.heads.recycle_file import model_fingerprint, save_table
from medusa_jax.inference.autoregressive import prefill_states
from medusa_jax.training.data import tokenize_messages
from medusa_jax.training.sharegpt import read_conversations


@dataclasses.dataclass(frozen=True)
class TableBuildConfig:
    conversations: int = 300  # conversations read (those without an assistant turn are skipped by the reader)
    seq_len: int = 512  # tokens of a conversation used, at most
    batch_size: int = 4  # conversations per prefill
    top_k: int = DEFAULT_TOP_K  # table width r
    warmup: int = 50  # conversations before the rank acceptance is counted (the table starts empty)


@dataclasses.dataclass
class TableBuild:
    table_vr: np.ndarray  # [V, r] int32
    rank_hits_r: np.ndarray  # [r] assistant positions whose greedy next token sat at rank r of the row
    counted: int  # assistant positions counted (after the warm-up)
    tokens: int  # positions written into the table

    @property
    def rank_acceptance(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self.rank_hits_r / max(self.counted, 1))


@partial(jax.jit, static_argnames=("graphdef", "top_k"))
def _top_ids(graphdef, params, tokens_bt, lens_b, *, top_k: int):
    """[b, t, r] top-r ids of the base's logits at every position (one prefill)."""
    base: CausalLM = nnx.merge(graphdef, params)
    b, t = tokens_bt.shape
    cache = KVCache.zeros(base.config, b, t)
    _, _, hidden_btd = prefill_states(base, tokens_bt, lens_b, cache)
    return jax.lax.top_k(base.logits(hidden_btd), top_k)[1].astype(jnp.int32)


def build_table(base: CausalLM, tokenizer, conversations: list[dict], eos_ids: tuple[int, ...],
                config: TableBuildConfig = TableBuildConfig(), progress: Callable[[int], None] | None = None,
                start_vr: np.ndarray | None = None) -> TableBuild:
    """The table after teacher-forcing `conversations` (ShareGPT records, training.sharegpt) through `base`,
    starting from `start_vr` (default: empty)."""
    sequences = [tokenize_messages(tokenizer, record["messages"], eos_ids, f"conversation {i}")
                 for i, record in enumerate(conversations)]
    return table_from_sequences(base, sequences, config, progress, start_vr)


def build_table_file(folder, data: str | None, output, config: TableBuildConfig = TableBuildConfig()) -> dict:
    """The table of the model at `folder` after `config.conversations` conversations of `data` (None: the packaged
    ShareGPT file), saved to `output` with a note of how it was built; returns a summary. Progress on stderr."""
    conversations, report = read_conversations(data, config.conversations)
    tokenizer, base = load_tokenizer(folder), load_pretrained(folder)
    done = [0]

    def progress(n):
        done[0] += n
        print(f"\r{done[0]}/{len(conversations)} conversations", end="", file=sys.stderr, flush=True)

    built = build_table(base, tokenizer, conversations, tuple(eos_token_ids(folder, tokenizer)),
                        dataclasses.replace(config, conversations=len(conversations)), progress)
    print(file=sys.stderr)
    acceptance = [round(x, 4) for x in built.rank_acceptance]
    save_table(output, built.table_vr, model=model_fingerprint(base), note=(
        f"{len(conversations)} conversations of {report.source.split('/')[-1]}, at most {config.seq_len} tokens "
        f"each, teacher-forced ({built.tokens} positions); rank acceptance {acceptance} over {built.counted} "
        f"assistant positions"))
    return {"output": str(output), "conversations": len(conversations), "positions": built.tokens,
            "counted": built.counted, "rank_acceptance": acceptance,
            "rows_seen": int((built.table_vr != empty_table(*built.table_vr.shape)).any(axis=1).sum())}


def table_from_sequences(base: CausalLM, sequences: list[tuple[list[int], list[int]]],
                         config: TableBuildConfig = TableBuildConfig(),
                         progress: Callable[[int], None] | None = None, start_vr: np.ndarray | None = None
                         ) -> TableBuild:
    """`build_table` on (token ids, 0/1 assistant mask) pairs; rank acceptance is counted where the mask is 1."""
    vocab = base.config.vocab_size
    table_vr = empty_table(vocab, config.top_k) if start_vr is None else np.array(start_vr, np.int32)
    hits_r, counted, written = np.zeros(config.top_k, np.int64), 0, 0
    graphdef, params = nnx.split(base)
    for start in range(0, len(sequences), config.batch_size):
        chunk = [(ids[: config.seq_len], mask[: config.seq_len]) for ids, mask in
                 sequences[start: start + config.batch_size]]
        tokens_bt = np.zeros((config.batch_size, config.seq_len), np.int32)
        lens_b = np.ones((config.batch_size,), np.int32)
        for row, (ids, _) in enumerate(chunk):
            tokens_bt[row, : len(ids)], lens_b[row] = ids, max(len(ids), 1)
        top_btr = np.asarray(_top_ids(graphdef, params, tokens_bt, lens_b, top_k=config.top_k))
        for row, (ids, mask) in enumerate(chunk):
            count = start + row >= config.warmup
            for p, token in enumerate(ids):
                if count and mask[p]:
                    rank = np.nonzero(table_vr[token] == top_btr[row, p, 0])[0]
                    counted += 1
                    if rank.size:
                        hits_r[rank[0]] += 1
                table_vr[token] = top_btr[row, p]
            written += len(ids)
        if progress is not None:
            progress(len(chunk))
    return TableBuild(table_vr, hits_r, counted, written)
