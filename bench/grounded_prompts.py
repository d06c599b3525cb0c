"""An input-grounded prompt set (rewrite, summarise or edit a given text or code), built from MT-Bench's GPT-4
reference answers; `python -m medusa_jax.bench.grounded_prompts REFERENCE_FILE OUT` rebuilds it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIN_WORDS = 90
COUNT = 16
CODE_IDS = range(121, 131)
PROSE_TASKS = (
    ("rewrite", "Rewrite the following text in plain, simple English, keeping every step and number:"),
    ("summarise", "Summarise the following text in three or four sentences:"),
    ("edit", "Proofread the following text and return it in full with any mistakes corrected:"),
)
CODE_TASKS = (
    ("comment", "Return the following answer in full, with a short comment added above each function:"),
    ("rename", "Return the following answer in full, with the variable names made more descriptive:"),
)
SOURCE = "MT-Bench reference answer gpt-4.jsonl, question {id}, turn 1"


def build(reference_file: str | Path) -> list[dict]:
    rows = [json.loads(line) for line in Path(reference_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [(r["question_id"], r["choices"][0]["turns"][0]) for r in sorted(rows, key=lambda r: r["question_id"])]
    out, prose, code = [], 0, 0
    for qid, text in texts:
        if len(text.split()) < MIN_WORDS:
            continue
        if qid in CODE_IDS:
            task, instruction = CODE_TASKS[code % len(CODE_TASKS)]
            code += 1
        else:
            task, instruction = PROSE_TASKS[prose % len(PROSE_TASKS)]
            prose += 1
        out.append({"id": qid, "task": task, "source": SOURCE.format(id=qid), "prompt": f"{instruction}\n\n{text}"})
        if len(out) == COUNT:
            break
    return out


def default_file() -> Path:
    return Path(__file__).resolve().parent / "mixed_drafts" / "grounded_prompts.jsonl"


def load(path: str | Path | None = None) -> list[dict]:
    path = Path(path) if path is not None else default_file()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


if __name__ == "__main__":
    reference, target = sys.argv[1:3]
    Path(target).write_text("".join(json.dumps(r) + "\n" for r in build(reference)), encoding="utf-8")
