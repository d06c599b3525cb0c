"""No committed text file names a path of a developer's machine (reports name paths relative to the repository
or to $MEDUSA_JAX_CACHE; examples use ~/ or placeholders)."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# an absolute path under a home, scratch or workspace folder: /root/x, /home/x, /work/x, /check/x, /tmp/x
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|home|work|check|tmp)/[\w.-]")
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # spells the prefixes in its pattern


def committed_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in out.stdout.decode().split("\0") if name and name != THIS_FILE]


def machine_paths(text: str) -> list[str]:
    return [line.strip()[:160] for line in text.splitlines() if MACHINE_PATH.search(line)]


def test_no_committed_file_names_a_machine_path():
    found = []
    for name in committed_text_files():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (safetensors, PNG)
        found += [f"{name}: {line}" for line in machine_paths(data.decode("utf-8", errors="replace"))]
    assert not found, "absolute paths of a developer machine in committed files:\n" + "\n".join(found)


@pytest.mark.parametrize("line, bad", [
    ("wrote /root/.cache/medusa_jax/x.json", True),
    ('"model": "/work/main/heads"', True),
    ("cp /tmp/a b", True),
    ("folder: ~/.cache/medusa_jax/SmolLM2-135M-Instruct", False),
    ("see docs/design.md and bench/medusa/results.md", False),
    ("https://example.com/home/page", False),
])
def test_machine_path_pattern(line, bad):
    assert bool(machine_paths(line)) == bad


def _named_modules() -> dict[str, set[str]]:
    """`medusa_jax.x.y` names in the README, docs and shell scripts -> the files naming them."""
    found: dict[str, set[str]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").glob("*.sh"))]:
        for name in re.findall(r"\bmedusa_jax(?:\.[A-Za-z_]\w*)+", path.read_text()):
            found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_modules_named_in_docs_and_scripts_exist():
    """A module or name that moved breaks the commands users copy (demo.sh once imported a question loader from
    where it no longer was; the loader is product data now, medusa_jax.mtbench). No shell script reaches into
    bench/, which is measurement only."""
    named = _named_modules()
    assert "medusa_jax.training.run" in named  # the scan sees the docs' names
    assert [name for name, files in named.items() if name.startswith("medusa_jax.bench")
            and any(f.endswith(".sh") for f in files)] == []
    missing = []
    for name, files in sorted(named.items()):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, the rest are attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{name} ({', '.join(sorted(files))})")
            break
        else:
            missing.append(f"{name} ({', '.join(sorted(files))})")
    assert missing == []
