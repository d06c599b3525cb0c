"""What a generation engine's caller hands it and gets back (`generation_engine.GenerationEngine`): a request's
settings (`RequestParams`), the request itself as the engine tracks it (`Request`), the events that carry its
tokens (`TokenEvent`), and the refusals (`QueueFull`, `EngineClosed`)."""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Callable, Sequence

from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.inference.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RequestParams:
    max_tokens: int = 16
    sampling: SamplingConfig = SamplingConfig()  # temperature 0: greedy
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # tokens that end the reply besides the model's EOS ids
    acceptance: AcceptanceConfig | None = None  # drafted rows' acceptance (None: the engine's, greedy if greedy)


class QueueFull(RuntimeError):
    """The queue holds config.max_queue requests already."""


class EngineClosed(RuntimeError):
    """The engine is shutting down (or failed) and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    request: "Request"
    tokens: tuple[int, ...]  # new tokens
    finish_reason: str | None  # set on the request's last event


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: RequestParams
    on_event: Callable[[TokenEvent], None] | None = None  # called from the engine's thread
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    verify_steps: int = 0  # drafted rows: the tree steps after the first token (to its chunk's end past a stop id)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # drafted rows: each step's accepted drafts
    cancel_requested: bool = False
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)

    def emit(self, tokens: Sequence[int], finish_reason: str | None) -> None:
        event = TokenEvent(self, tuple(tokens), finish_reason)
        (self.on_event or self.events.put)(event)
