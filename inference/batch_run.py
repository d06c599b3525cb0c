"""What `api.generate_batch` returns: one `GenerationResult` per prompt (with the stats of the batch that ran it)
and the run's `BatchRun`, whichever way the prompts were decoded (the generation engine's sorted batches or
refilled slots, or the direct batches of `direct_batches`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.trees.policy.choose import ChosenTree


@dataclasses.dataclass
class GenerationResult:
    """One prompt's generation, with the stats of the batch call that produced it."""

    token_ids: list[int]  # the new tokens, EOS included when one was produced
    steps: int  # forward passes that produced them, prefill included (plain decoding: one per token)
    prompt_tokens: int = 0
    finish_reason: str = "length"  # "eos" or "length"
    index: int = 0  # position in the input list
    batch: int = 0  # which batch of the plan ran it
    batch_seconds: float = 0.0  # wall-clock time of that batch (all its rows together), compilation included
    batch_compile_seconds: float = 0.0  # of which tracing and compiling (0 once the batch shape was seen)
    accept_lengths: list[int] | None = None  # Medusa: candidates accepted at each verify step (0..tree depth)
    text: str | None = None  # the decoded new tokens, when a tokenizer was at hand (text_generation)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def seconds(self) -> float:
        """The batch call without compilation (rows of a batch share it)."""
        return self.batch_seconds - self.batch_compile_seconds

    def accept_histogram(self, depth: int) -> list[int]:
        """Medusa: how many verify steps accepted 0, 1, ..., depth candidates."""
        return np.bincount(np.asarray(self.accept_lengths or [], int), minlength=depth + 1).tolist()


@dataclasses.dataclass
class BatchRun:
    results: list[GenerationResult]  # in input order
    seconds: float  # wall-clock time of all batches, compilation included
    compile_seconds: float  # of which tracing and compiling (`compile_cache.CompileCounter`)
    num_batches: int  # sorted batches; refill: engine iterations (a decode chunk each)
    num_shapes: int  # distinct jitted call shapes (sorted batches: (prompt width, cache size) pairs; refill: the
    # executables the run asked XLA for)
    tree_choice: ChosenTree | None = None  # Medusa: the tree used (None: plain) and its origin / why plain
    compiles: CompileCounter | None = None  # executables compiled afresh / read from the persistent cache
    engine: str = "batches"  # which engine ran: "batches" or "refill"

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Throughput without the one-off compilation time."""
        return self.new_tokens / max(self.seconds - self.compile_seconds, 1e-9)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(sum(r.steps for r in self.results), 1)
