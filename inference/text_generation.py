"""Text in, JSON rows out, for `scripts/generate.py`: prompt files read (JSONL: a JSON string, or an object with
"prompt" and an "id" (default: its index), per line; blank lines skipped), prompts tokenized and generated on the mesh
(`api.generate_batch`), one row per prompt in input order (`result_row`), written atomically."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from medusa_jax.atomic import atomic_file
from medusa_jax.text import decode_tokens, encode_prompt
from medusa_jax.inference.api import BatchRun, BatchSettings, GenerationResult, generate_batch
from medusa_jax.inference.sharded import ShardedModel


class PromptFileError(ValueError):
    """A prompt file that is missing, empty or malformed (the message names the line)."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: Any
    text: str


def read_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file does not exist")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # JSON strings may hold other line breaks
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path}: not UTF-8 text ({e})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e})") from None
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise PromptFileError(f'{where}: expected a JSON string or an object with a "prompt" string')
        if not row["prompt"]:
            raise PromptFileError(f"{where}: empty prompt")
        records.append(PromptRecord(row.get("id", len(records)), row["prompt"]))
    if not records:
        raise PromptFileError(f"{path}: no prompts found")
    return records


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """Writes all rows to `path` atomically (`atomic.atomic_file`: a temporary sibling, then rename)."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def result_row(record: PromptRecord, result: GenerationResult) -> dict:
    """One output row. `seconds` is the row's batch call without compilation (rows of a batch share it);
    `accept_lengths` only for Medusa decoding."""
    seconds = result.seconds
    row = {"id": record.id, "prompt": record.text, "text": result.text, "token_ids": result.token_ids,
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
    for result in run.results:
        result.text = decode_tokens(tokenizer, result.token_ids)
    return [result_row(rec, res) for rec, res in zip(records, run.results)], run
