"""Text prompts through batch generation (`inference.batch`): tokenize, generate on the mesh, decode, and
build the JSON rows `scripts/generate.py --input` writes (input order, per-row stats)."""

from __future__ import annotations

from typing import Sequence

from medusa_jax.text import decode_tokens, encode_prompt
from medusa_jax.inference.batch import BatchRun, BatchSettings, RowResult, generate_batch
from medusa_jax.inference.prompts_jsonl import PromptRecord
from medusa_jax.inference.sharded import ShardedModel


def result_row(record: PromptRecord, result: RowResult, text: str) -> dict:
    """One output row. `seconds` is the row's batch call without compilation (rows of a batch share it)."""
    seconds = result.batch_seconds - result.batch_compile_seconds
    row = {"id": record.id, "prompt": record.text, "text": text, "token_ids": result.token_ids,
           "new_tokens": result.new_tokens, "steps": result.steps,
           "tokens_per_step": round(result.tokens_per_step, 4), "prompt_tokens": result.prompt_tokens,
           "finish_reason": result.finish_reason, "batch": result.batch, "seconds": round(seconds, 4),
           "tokens_per_s": round(result.new_tokens / seconds, 2) if seconds > 0 else None,
           "compile_seconds": round(result.batch_compile_seconds, 3)}
    if result.accept_lengths is not None:
        row["accept_lengths"] = result.accept_lengths
    return row


def generate_rows(model: ShardedModel, tokenizer, records: Sequence[PromptRecord], settings: BatchSettings, *,
                  chat: bool, progress: bool = True) -> tuple[list[dict], BatchRun]:
    """Every prompt record -> (output rows in input order, the run with its totals)."""
    prompts = [encode_prompt(tokenizer, r.text, chat=chat) for r in records]
    run = generate_batch(model, prompts, settings, progress=progress)
    rows = [result_row(rec, res, decode_tokens(tokenizer, res.token_ids)) for rec, res in zip(records, run.results)]
    return rows, run
