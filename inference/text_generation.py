"""Text prompts in, text results and JSON rows out: tokenize (optionally with the chat template), run a decoder
batch by batch, time each call with its compile time apart, decode the new tokens.

A decoder is any callable with `engine.generate`'s signature after the model:
    decoder(prompts: list[list[int]], *, max_new_tokens, sampling, seed, eos_ids, pad_id, batch_size)
        -> list[GenerationResult]
`plain_decoder(model)` is plain decoding; Medusa decoding passes its own (see scripts/generate.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterator, Sequence

import jax

from medusa_jax.backbone import CausalLM
from medusa_jax.text import decode_tokens, encode_prompt
from medusa_jax.inference.engine import GenerationResult, generate
from medusa_jax.inference.sampling import SamplingConfig

Decoder = Callable[..., list[GenerationResult]]

_COMPILE_EVENT_PREFIX = "/jax/core/compile/"
_active: list[list[float]] = []


def _on_event(name: str, seconds: float, **_) -> None:
    if name.startswith(_COMPILE_EVENT_PREFIX):
        for acc in _active:
            acc.append(seconds)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def compile_seconds() -> Iterator[list[float]]:
    """Collects the seconds JAX spends tracing, lowering and compiling inside the block (`sum()` them)."""
    acc: list[float] = []
    _active.append(acc)
    try:
        yield acc
    finally:
        _active.remove(acc)


def plain_decoder(model: CausalLM) -> Decoder:
    def decode(prompts, **kwargs):
        return generate(model, prompts, **kwargs)

    return decode


@dataclasses.dataclass
class TextResult:
    prompt: str
    prompt_tokens: int
    result: GenerationResult  # token_ids, steps, tokens_per_step; result.text is the decoded answer
    seconds: float  # the batch call's wall time, its compile time subtracted (rows of a batch share it)
    compile_seconds: float  # JAX tracing + compilation inside the call (0 once the shapes were seen)
    batch: int  # index of the decoder call that produced it

    @property
    def tokens_per_s(self) -> float:
        return self.result.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def row(self) -> dict:
        """The JSON object `scripts/generate.py` prints / writes for this prompt."""
        r = self.result
        return {"text": r.text, "token_ids": r.token_ids, "new_tokens": r.new_tokens, "steps": r.steps,
                "tokens_per_step": round(r.tokens_per_step, 4), "prompt_tokens": self.prompt_tokens,
                "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 2),
                "compile_seconds": round(self.compile_seconds, 3)}


def generate_texts(decoder: Decoder, tokenizer, texts: Sequence[str], *, chat: bool, max_new_tokens: int = 128,
                   sampling: SamplingConfig = SamplingConfig(), seed: int = 0, eos_ids: Sequence[int] = (),
                   pad_id: int = 0, batch_size: int = 1,
                   progress: Callable[[int, int], None] | None = None) -> list[TextResult]:
    """Generates an answer for every text, `batch_size` prompts per decoder call, results in input order.
    Batch i samples with seed + i, so a run is reproducible and batches do not repeat each other's draws."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    encoded = [encode_prompt(tokenizer, t, chat=chat) for t in texts]
    results: list[TextResult] = []
    for i, start in enumerate(range(0, len(encoded), batch_size)):
        chunk = encoded[start: start + batch_size]
        with compile_seconds() as compiled:
            begin = time.perf_counter()
            out = decoder(chunk, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed + i,
                          eos_ids=tuple(eos_ids), pad_id=pad_id, batch_size=batch_size)
            wall = time.perf_counter() - begin
        compile_s = min(sum(compiled), wall)
        for j, res in enumerate(out):
            res.text = decode_tokens(tokenizer, res.token_ids)
            results.append(TextResult(texts[start + j], len(chunk[j]), res, wall - compile_s, compile_s, i))
        if progress is not None:
            progress(len(results), len(encoded))
    return results


def summary(results: Sequence[TextResult]) -> dict:
    """Totals over all prompts: tokens, decode seconds (each batch once), tokens/s, compile seconds."""
    calls = {r.batch: (r.seconds, r.compile_seconds) for r in results}  # rows of a batch share one call
    seconds = sum(s for s, _ in calls.values())
    tokens = sum(r.result.new_tokens for r in results)
    return {"prompts": len(results), "new_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "compile_seconds": sum(c for _, c in calls.values())}
