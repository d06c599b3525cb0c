"""Each Medusa head's top-k accuracy on held-out text: the table build_tree turns into a tree. (An EAGLE
drafter's "head" m is its depth m + 1; each kind teacher-forces itself: `teacher_forced_top_k`.)

The text is self-distilled: the base model's own greedy continuation of held-out prompts, so a head's guess
counts as right exactly when greedy acceptance would accept it. For a continuation position p (the last
prompt token and after), head m's rank-r guess from the hidden state at p is right when it equals the token at
p + 2 + m. accuracy_mr[m, r] = P(rank-r guess right) = hits / positions where p + 2 + m is still in the text.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.inference.api import generate
from medusa_jax.inference.engine import PROMPT_BUCKET, round_up


@dataclasses.dataclass(frozen=True)
class HeadAccuracy:
    accuracy_mr: np.ndarray  # [num_heads, top_k] P(head m's rank-r guess is right)
    positions_m: np.ndarray  # [num_heads] positions counted per head
    # [sequences, num_heads, top_k]: each sequence's own table (a head with no position in a sequence gets the
    # pooled row), for predictions over a batch of rows (`tree_choice.batch_tokens_per_step`)
    per_sequence_smr: np.ndarray | None = None

    @property
    def top1_m(self) -> np.ndarray:
        return self.accuracy_mr[:, 0]

    def topk_cumulative(self) -> np.ndarray:
        """[num_heads, top_k] P(right token among the first r+1 guesses)."""
        return np.cumsum(self.accuracy_mr, axis=1)


@partial(jax.jit, static_argnames=("graphdef", "top_k"))
def _top_k_along(graphdef, params, tokens_bt, *, top_k: int):
    """[M, B, T, R] every head's top-k at every position of full sequences (one causal forward)."""
    base, heads = nnx.merge(graphdef, params)
    b, t = tokens_bt.shape
    cache = KVCache.zeros(base.config, b, t)
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    taps = heads.feature_layers  # () for every kind but EAGLE-3
    hidden_btd, _, taps_btf = base.forward_taps(tokens_bt, positions_bt,
                                                attention_mask(cache.lengths_b, causal_block(t), t), cache, taps)
    features = taps_btf if taps else hidden_btd  # what the kind's decode reads: EAGLE-3 its fused taps
    return heads.teacher_forced_top_k(features, tokens_bt, base, top_k)  # each kind: its own teacher forcing


def count_hits_by_sequence(top_k_mbtr: np.ndarray, sequences: Sequence[Sequence[int]], starts: Sequence[int]):
    """(hits [B, M, R], positions [B, M]) of each sequence of a batch: sequence b's positions from starts[b]
    on."""
    num_heads, _, _, k = top_k_mbtr.shape
    hits = np.zeros((len(sequences), num_heads, k), np.int64)
    counted = np.zeros((len(sequences), num_heads), np.int64)
    for b, (seq, start) in enumerate(zip(sequences, starts)):
        seq = np.asarray(seq)
        for m in range(num_heads):
            last = len(seq) - 3 - m  # the last position p whose target p + 2 + m exists
            if last < start:
                continue
            guesses_tr = top_k_mbtr[m, b, start: last + 1]
            targets_t = seq[start + 2 + m: last + 3 + m]
            hits[b, m] = (guesses_tr == targets_t[:, None]).sum(axis=0)
            counted[b, m] = last + 1 - start
    return hits, counted


def count_hits(top_k_mbtr: np.ndarray, sequences: Sequence[Sequence[int]], starts: Sequence[int]):
    """(hits [M, R], positions [M]) over a batch: sequence b's positions from starts[b] on."""
    hits, counted = count_hits_by_sequence(top_k_mbtr, sequences, starts)
    return hits.sum(axis=0), counted.sum(axis=0)


def measure_head_accuracy(base: CausalLM, heads: MedusaHeads, sequences: Sequence[Sequence[int]],
                          starts: Sequence[int], *, top_k: int = 10, batch_size: int = 8,
                          progress: Callable[[str], None] | None = None) -> HeadAccuracy:
    """Accuracy table over `sequences` (token ids), counting positions from starts[i] (the index of the
    last prompt token) on."""
    if len(sequences) != len(starts) or not sequences:
        raise ValueError("need one start index per sequence, and at least one sequence")
    graphdef, params = nnx.split((base, heads))
    hits, counted = [], []
    for i in range(0, len(sequences), batch_size):
        chunk, chunk_starts = list(sequences[i: i + batch_size]), list(starts[i: i + batch_size])
        width = round_up(max(len(s) for s in chunk), PROMPT_BUCKET)
        tokens = np.zeros((batch_size, width), np.int32)  # filler rows stay zero and are not counted
        for b, s in enumerate(chunk):
            tokens[b, : len(s)] = s
        top = np.asarray(_top_k_along(graphdef, params, jnp.asarray(tokens), top_k=top_k))
        h, c = count_hits_by_sequence(top, chunk, chunk_starts)
        hits.append(h)
        counted.append(c)
        if progress:
            progress(f"head accuracy: {min(i + batch_size, len(sequences))}/{len(sequences)} sequences")
    hits_smr, counted_sm = np.concatenate(hits), np.concatenate(counted)
    total_mr, total_m = hits_smr.sum(axis=0), counted_sm.sum(axis=0)
    if total_m.min() == 0:
        raise ValueError("the held-out text is too short: some head has no position to score; use longer "
                         "continuations or more prompts")
    pooled_mr = total_mr / total_m[:, None]
    per_sequence = np.where(counted_sm[..., None] > 0, hits_smr / np.maximum(counted_sm, 1)[..., None],
                            pooled_mr[None])
    return HeadAccuracy(pooled_mr, total_m, per_sequence)


def self_distill(base: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids,
                 pad_id: int, batch_size: int = 8) -> tuple[list[list[int]], list[int]]:
    """The base model's greedy continuations: (prompt + continuation per prompt, index of the last prompt
    token per prompt)."""
    sequences, starts = [], []
    for i in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[i: i + batch_size]]
        results = generate(base, chunk, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                           batch_size=batch_size)
        for prompt, result in zip(chunk, results):
            sequences.append(prompt + list(result.token_ids))
            starts.append(len(prompt) - 1)
    return sequences, starts
