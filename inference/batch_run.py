"""What `api.generate_batch` takes and returns: its `BatchSettings`, one `GenerationResult` per prompt (with the
stats of the batch that ran it) and the run's `BatchRun`, whichever admission of the generation engine decoded
the prompts (sorted batches or refilled slots)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.inference.acceptance import AcceptanceConfig, DecodeConfig
from medusa_jax.trees.policy.calibration import check_mode
from medusa_jax.trees.policy.choose import ChosenTree, HeadsOwnTree
from medusa_jax.inference.engine import PROMPT_BUCKET
from medusa_jax.inference.sampling import SamplingConfig

ENGINES = ("auto", "batches", "refill")


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    batch_size: int = 8
    max_new_tokens: int = 128
    # None: plain decoding; a tree (static TreeBuffers or a DynamicTree): Medusa (the model needs heads); DraftSizes:
    # mixed drafts (the model's heads a heads.mixed.MixedDrafter); HEADS_TREE: the heads' own tree for this backend
    # and batch_size, or plain decoding where none pays (`choose.choose_tree`)
    tree: TreeBuffers | DynamicTree | DraftSizes | HeadsOwnTree | None = None
    acceptance: AcceptanceConfig = AcceptanceConfig()  # tree decoding: how candidates are accepted
    sampling: SamplingConfig = SamplingConfig()  # plain and tree decoding (greedy at temperature 0)
    seed: int = 0  # prompt i samples with seed + i
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    bucket: int = 2 * PROMPT_BUCKET  # the narrowest prompt width (engine.bucket_length: 128, 192, 256, 384, ...)
    cache_size: int | None = None  # KV cache slots per row; None: sized per prompt width (engine.cache_size_for)
    engine: str = "auto"  # "batches" (sorted), "refill" (plain decoding on one device) or "auto" (`uses_refill`)
    # HEADS_TREE only: "auto" (step costs measured on this machine on first use, then cached), "redo" (measured
    # again), "skip" (the shipped trees.json as it is); None: $MEDUSA_JAX_CALIBRATION or "auto" (`calibration`)
    calibration: str | None = None

    def __post_init__(self):
        if not isinstance(self.tree, (TreeBuffers, DynamicTree, DraftSizes, HeadsOwnTree, type(None))):
            raise ValueError(f"tree must be TreeBuffers, None (plain), a DynamicTree, DraftSizes (mixed drafts) or "
                             f"HEADS_TREE, got {self.tree!r}")
        if self.calibration is not None:
            check_mode(self.calibration)
        if self.tree is not None:  # an acceptance that cannot honour the sampling: ValueError now
            DecodeConfig(self.sampling, self.acceptance)
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.bucket < 1:
            raise ValueError(f"batch_size, max_new_tokens and bucket must be >= 1, got {self.batch_size}, "
                             f"{self.max_new_tokens}, {self.bucket}")

    @property
    def decode(self) -> DecodeConfig:
        """The one decode config of a tree decoder: the sampling settings and the acceptance."""
        return DecodeConfig(self.sampling, self.acceptance)


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


def report_batch(batch: list[GenerationResult], on_batch, bar, new_tokens: int, start: float, number: int,
                 batches: int) -> None:
    """A finished batch handed to `on_batch` and to the progress bar (its running tokens/s since `start`)."""
    if on_batch is not None:
        on_batch(batch)
    if bar is not None:
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}", batch=f"{number + 1}/{batches}")
