"""Plain greedy batch generation with finished rows refilled (continuous batching), to measure against the
front-end's length-sorted batches (`inference.api.generate_batch`).

The machinery is self-distillation's (training/distill_decode.py): `batch_size` decode slots over one KV
cache run in jitted chunks of `chunk_steps` plain steps; between chunks every finished slot is given the next
prompt (`admit_prompts` prefills it into that row). Prompts are admitted in input order, as a server takes
requests. A slot-step is one row of one decode step; `slot_use` = new tokens / slot-steps run, about the
fraction of the batch's work that produced a token (the rest is rows idling at the end of a chunk or past their
EOS; each prompt's first token comes from its prefill, so the ratio can slightly exceed the true fraction).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Sequence

import jax
from flax import nnx

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.model.backbone import CausalLM
from medusa_jax.inference.engine import PROMPT_BUCKET, round_up
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.training.distill_decode import Slots, admit_prompts, run_chunk


@dataclasses.dataclass(frozen=True)
class RefillRun:
    token_ids: list[list[int]]  # per prompt, in input order (EOS included when emitted, as generate_batch)
    seconds: float
    compile_seconds: float
    slot_steps: int  # batch_size x decode steps run
    chunks: int

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def slot_use(self) -> float:
        return self.new_tokens / max(self.slot_steps, 1)


def refill_generate(model: CausalLM, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
                    eos_ids: tuple[int, ...], pad_id: int, chunk_steps: int = 32) -> RefillRun:
    """Greedy decoding of every prompt (at most max_new_tokens each) with slot refill; see the module doc."""
    if batch_size < 1 or max_new_tokens < 1 or chunk_steps < 1:
        raise ValueError(f"batch_size, max_new_tokens and chunk_steps must be >= 1, got {batch_size}, "
                         f"{max_new_tokens}, {chunk_steps}")
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("refill_generate needs at least one prompt and no empty prompt")
    graphdef, params = nnx.split(model)
    cache_size = round_up(max(len(p) for p in prompts) + max_new_tokens, PROMPT_BUCKET)
    greedy = SamplingConfig()
    out: list[list[int]] = [[] for _ in prompts]
    row_prompt: list[int | None] = [None] * batch_size
    todo = deque(range(len(prompts)))
    key = jax.random.key(0)  # unused by greedy sampling, but part of the step's signature
    slot_steps = chunks = 0

    def finished(i: int) -> bool:
        return len(out[i]) >= max_new_tokens or (bool(out[i]) and out[i][-1] in eos_ids)

    with CompileCounter() as compiles:
        start = time.perf_counter()
        slots = Slots.empty(model.config, batch_size, cache_size)
        while True:
            free = [r for r in range(batch_size) if row_prompt[r] is None]
            admitted = [(r, todo.popleft()) for r in free[: len(todo)]]
            if admitted:
                slots, first, _ = admit_prompts(graphdef, params, slots, [r for r, _ in admitted],
                                                [list(prompts[i]) for _, i in admitted], key, pad_id=pad_id,
                                                sampling=greedy, eos_ids=eos_ids)
                for j, (r, i) in enumerate(admitted):
                    out[i].append(int(first[j]))
                    row_prompt[r] = None if finished(i) else i
            if all(i is None for i in row_prompt):
                if not todo:
                    break
                continue
            slots, tokens_bo, _, emitted_b = run_chunk(graphdef, params, slots, key, steps=chunk_steps,
                                                       max_new_tokens=max_new_tokens, sampling=greedy,
                                                       eos_ids=eos_ids, pad_id=pad_id)
            tokens_bo, emitted_b = jax.device_get((tokens_bo, emitted_b))
            chunks += 1
            slot_steps += batch_size * int(emitted_b.max(initial=0))
            for r, i in enumerate(row_prompt):
                if i is not None:
                    out[i].extend(tokens_bo[r, : int(emitted_b[r])].tolist())
                    if finished(i):
                        row_prompt[r] = None
        seconds = time.perf_counter() - start
    return RefillRun([list(t) for t in out], seconds, compiles.compile_seconds, slot_steps, chunks)
