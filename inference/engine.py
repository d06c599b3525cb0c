"""The shapes of a generation call: prompts right-padded to a short ladder of bucketed widths, cache sizes
that follow them, and the checks that a prompt plus its budget fits (positions, cache slots). The generation
front-end (`inference.api`) builds every batch with these; `check_prompts` is the one validation of prompts
that every generation path (sorted batches, refilled slots) runs."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from medusa_jax.model.backbone import CausalLM

PROMPT_BUCKET = 64  # the smallest padded prompt width; wider prompts climb `width_ladder`


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def width_ladder(smallest: int = PROMPT_BUCKET) -> Iterator[int]:
    """The padded prompt widths, ascending without end: smallest * 2**k and 1.5 times each (64, 96, 128, 192, 256,
    384, 512, 768, ...): a prompt longer than smallest pads by less than half its length. The one rule of both the
    engine's admission widths (bucket_length) and the widths a decode call's prefill may run at
    (autoregressive.prefill_widths). A prefill costs about its width on a CPU (bench/mixed_drafts/prefill_widths),
    and each width is one compile per decoder, kept in the persistent cache: the half steps at most double the
    shapes a run meets."""
    size = smallest
    while True:
        yield size
        if size // 2:
            yield size + size // 2
        size *= 2


def bucket_length(n: int, smallest: int = PROMPT_BUCKET) -> int:
    """The narrowest of `width_ladder(smallest)` that holds n: prompt widths come from this short fixed ladder
    (batch generation starts at 128) and cache sizes follow them (cache_size_for), so a run compiles each decoder
    for a few shapes only (3 for 64 MT-Bench prompts at batch 8), and a later run with other prompts but the same
    settings meets the same shapes in the persistent compilation cache."""
    return next(width for width in width_ladder(smallest) if width >= n)


def check_prompts(prompts: Sequence[Sequence[int]], max_positions: int | None = None,
                  max_new_tokens: int = 0) -> None:
    """The one check of token-id prompts that every generation path runs (sorted batches, refilled slots, the
    one-batch calls): at least one prompt, none empty, and, given the model's max_position_embeddings, each
    prompt's tokens plus max_new_tokens within them (no silent truncation)."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if max_positions is None:
        return
    prompt_lengths = [len(p) for p in prompts]
    longest = max(prompt_lengths)
    if max_new_tokens >= max_positions:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no position for a prompt: the model has "
                         f"max_position_embeddings={max_positions}; lower max_new_tokens below that, by the prompt's "
                         f"length at least")
    if longest + max_new_tokens > max_positions:
        index = prompt_lengths.index(longest)
        raise ValueError(f"prompt {index} has {longest} tokens; with max_new_tokens={max_new_tokens} it needs "
                         f"{longest + max_new_tokens} positions, but the model has max_position_embeddings="
                         f"{max_positions}: shorten the prompt to at most {max_positions - max_new_tokens} tokens "
                         f"or lower max_new_tokens")


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    tokens_bt: np.ndarray  # int32, right-padded with pad_id
    lengths_b: np.ndarray  # int32; rows past the prompts given are filler (copies of row 0) that callers drop


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, batch_size: int | None = None,
                bucket: int = PROMPT_BUCKET) -> PaddedBatch:
    check_prompts(prompts)
    batch_size = batch_size or len(prompts)
    if len(prompts) > batch_size:
        raise ValueError(f"{len(prompts)} prompts do not fit a batch of {batch_size}")
    rows = list(prompts) + [prompts[0]] * (batch_size - len(prompts))
    width = bucket_length(max(len(p) for p in rows), bucket)
    tokens = np.full((batch_size, width), pad_id, np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    return PaddedBatch(tokens, np.asarray([len(p) for p in rows], np.int32))


def cache_size_for(prompt_width: int, max_new_tokens: int, extra: int = 0, bucket: int = PROMPT_BUCKET) -> int:
    """Slots for the padded prompt, the new tokens and `extra` scratch slots (a Medusa tree block); with a
    bucketed prompt width, one cache size per width for given settings."""
    return prompt_width + round_up(max_new_tokens + extra, bucket)


def check_fits(batch: PaddedBatch, max_new_tokens: int, extra: int, cache_size: int | None) -> int:
    """Returns the cache size to use; raises a clear error when a prompt plus its budget does not fit."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = int(batch.tokens_bt.shape[1]) + max_new_tokens + extra
    if cache_size is None:
        return cache_size_for(batch.tokens_bt.shape[1], max_new_tokens, extra)
    if needed > cache_size:
        longest = int(batch.lengths_b.max())
        raise ValueError(
            f"prompt of {longest} tokens (padded to {batch.tokens_bt.shape[1]}) + max_new_tokens={max_new_tokens}"
            f" + {extra} scratch slots needs {needed} cache slots, but cache_size is {cache_size}")
    return cache_size


def resolve_eos(model: CausalLM, eos_ids: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(int(t) for t in (model.config.eos_token_ids if eos_ids is None else eos_ids))
