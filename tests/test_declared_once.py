"""Issue 39's source targets, read from the code itself (ast, no import):
- the shared options (--model, --heads, --mesh, --tree, --batch-size, --out) are declared once, in
  scripts/options.py: no other add_argument(...) or Option(...) names them;
- every file replacement goes through medusa_jax/atomic.py: no os.replace / os.rename / shutil.move /
  Path.rename / Path.replace call elsewhere;
- training/ has one hidden-state store module (hidden_store.py);
- no measured figures in docstrings.
(bench/ imported by nothing but bench/ and the benchmark commands: tests/test_layers.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("medusa_jax", "inference", "training", "bench", "scripts")
SHARED = ("--model", "--heads", "--mesh", "--tree", "--batch-size", "--out")
OPTIONS = Path("scripts/options.py")
# measurement tools run as `python -m medusa_jax.bench.X` that still declare a shared flag by hand (bench/ sits
# below scripts/, so it cannot use scripts/options.py); no file may join this list
HAND_DECLARED = {("bench/admission_benchmark.py", "--model"), ("bench/admission_benchmark.py", "--out"),
                 ("bench/mixed_tree.py", "--out"), ("bench/merge_calibration.py", "--out")}


def source_files():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT), ast.parse(path.read_text(), str(path))


def called(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else "?"
        return f"{base}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else "?"


def test_shared_options_are_declared_once():
    places = {flag: [] for flag in SHARED}
    for path, tree in source_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and called(node).split(".")[-1] in ("add_argument", "Option") \
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in places:
                places[node.args[0].value].append((str(path), node.lineno))
    for flag, where in places.items():
        declared = [(file, line) for file, line in where if (file, flag) not in HAND_DECLARED]
        assert [file for file, _ in declared] == [str(OPTIONS)], f"{flag} declared at {declared}"
    hand = {(file, flag) for flag, where in places.items() for file, _ in where if file != str(OPTIONS)}
    assert hand == HAND_DECLARED, "a listed file no longer declares it: shorten HAND_DECLARED"


def test_files_are_replaced_through_atomic_only():
    renames = ("os.replace", "os.rename", "os.renames", "shutil.move")
    found = []
    for path, tree in source_files():
        if path == Path("medusa_jax/atomic.py"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = called(node)
            # Path(...).rename(x) / .replace(x): one positional argument (str.replace takes two)
            path_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("rename", "replace") \
                and len(node.args) == 1 and not node.keywords
            if name in renames or path_method:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []


def test_one_hidden_state_store_in_training():
    stores = sorted(p.name for p in (ROOT / "training").glob("*.py")
                    if "store" in p.stem or "cache" in p.stem)
    assert stores == ["hidden_store.py"]


def test_no_measured_figures_in_docstrings():
    """Ratios (0.81x, 5x faster) and throughputs (70 tokens/s) go stale in docstrings: they belong in bench/ and
    docs/. ('8x H100' counts devices, '4 x P' is arithmetic: neither is matched.)"""
    figure = re.compile(r"\d(\.\d+)?x\b(?! ?[A-Z])|\d(\.\d+)?\s*(tokens/s|tok/s)\b")
    found = []
    for path, tree in source_files():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for line in (ast.get_docstring(node) or "").splitlines():
                    if figure.search(line):
                        found.append(f"{path}: {line.strip()}")
    assert found == []
