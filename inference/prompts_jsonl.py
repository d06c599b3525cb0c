"""Prompt files in, result files out, for batch generation (`scripts/generate.py --input/--output`).

Input JSONL: one prompt per line, either a JSON string or an object with "prompt" (text) and optionally
"id" (any JSON value, echoed back; default: the line's 0-based index among the prompts). Blank lines are
skipped. Output JSONL: one object per prompt, in input order, with the id, the generated text and per-row
stats. The output file is written to a temporary sibling and renamed, so it is complete or absent.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable


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
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
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
    """Writes all rows to `path` atomically (temporary sibling, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
