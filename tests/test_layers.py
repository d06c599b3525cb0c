"""The package's layers, from the bottom:

    core root (medusa_jax/*.py: atomic, paths, text, assets, hub, demo_model, compile_cache, mtbench)
      <- model (medusa_jax/model/)  <- hf (medusa_jax/hf/)  <- trees (medusa_jax/trees/: tree structures)
      <- heads (medusa_jax/heads/)  <- inference/ + tree policy (medusa_jax/trees/policy/)
      <- training/ + tree search (medusa_jax/trees/search/)  <- bench/  <- scripts/

A module imports only modules of its own layer or the layers below it, and no module reaches itself again
through its imports. Every import counts: module level and inside functions (a function-level import hides a
cycle, it does not remove it). bench/ is measurement only: besides bench/ itself only the benchmark commands
(scripts/benchmark*.py) import it. The lazy table of medusa_jax/__init__.py is the documented facade over the
product's layers and is not walked, but it names no bench/ module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (folder, package, layer rank, layer name); a module may import modules of its own rank or lower only. A folder's
# own files (not its subfolders) form its layer; the root folder's are the bottom one. The tree package spans three
# floors (medusa_jax/trees/__init__.py says why).
LAYERS = (("medusa_jax", "medusa_jax", 0, "core root"), ("medusa_jax/model", "medusa_jax.model", 1, "model"),
          ("medusa_jax/hf", "medusa_jax.hf", 2, "hf"), ("medusa_jax/trees", "medusa_jax.trees", 3, "trees"),
          ("medusa_jax/heads", "medusa_jax.heads", 4, "heads"),
          ("inference", "medusa_jax.inference", 5, "inference"),
          ("medusa_jax/trees/policy", "medusa_jax.trees.policy", 5, "tree policy"),
          ("training", "medusa_jax.training", 6, "training"),
          ("medusa_jax/trees/search", "medusa_jax.trees.search", 6, "tree search"),
          ("bench", "medusa_jax.bench", 7, "bench"), ("scripts", "medusa_jax.scripts", 8, "scripts"))
LAYER_NAMES = {rank: " / ".join(name for _, _, r, name in LAYERS if r == rank) for _, _, rank, _ in LAYERS}
# measurement (bench/) is imported by bench/ and by these commands only
BENCH_USERS = ("medusa_jax.bench", "medusa_jax.scripts.benchmark")


def project_modules() -> dict[str, tuple[Path, int]]:
    """Dotted module name -> (file, layer rank) for every project .py file."""
    modules = {}
    for folder, package, rank, _ in LAYERS:
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in sorted(base.glob("*.py")):
            if folder == "medusa_jax" and path.name == "__init__.py":
                continue  # the lazy facade (PEP 562 table): documented, exempt
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            modules[name] = (path, rank)
    return modules


def test_every_python_file_has_a_layer():
    """A new subfolder of the core must be given its place in LAYERS (else its imports go unchecked)."""
    walked = {path for path, _ in project_modules().values()} | {ROOT / "medusa_jax" / "__init__.py"}
    on_disk = {p for folder, *_ in LAYERS for p in (ROOT / folder).rglob("*.py")}
    assert sorted(map(str, on_disk - walked)) == []


def imported_names(path: Path, module: str) -> set[str]:
    """Every module `path` imports, anywhere in the file, as absolute dotted names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def project_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {}
    for name, (path, _) in modules.items():
        graph[name] = {m for m in imported_names(path, name) if m in modules and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_every_layer_and_function_level_imports(tmp_path):
    modules = project_modules()
    assert {rank for _, rank in modules.values()} == set(LAYER_NAMES)
    graph = project_graph()
    assert "medusa_jax.model.backbone" in graph["medusa_jax.heads.medusa"]
    assert "medusa_jax.hf.tensor_files" in graph["medusa_jax.heads.load"]
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from medusa_jax.hf import save\n")
    assert "medusa_jax.hf.save" in imported_names(path, "medusa_jax.training.mod")


def test_no_layer_imports_a_layer_above_it():
    modules = project_modules()
    upward = []
    for name, targets in project_graph().items():
        rank = modules[name][1]
        for target in sorted(targets):
            if modules[target][1] > rank:
                upward.append(f"{name} ({LAYER_NAMES[rank]}) imports {target} ({LAYER_NAMES[modules[target][1]]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_only_the_benchmarks_import_bench():
    """bench/ sits at the top and is measurement only: no product module, no command but the benchmarks, and no
    entry of the public lazy table reaches it."""
    users = [f"{name} imports {target}" for name, targets in project_graph().items()
             for target in sorted(targets) if target.startswith("medusa_jax.bench")
             and not name.startswith(BENCH_USERS)]
    assert not users, "bench/ imported outside the benchmarks:\n" + "\n".join(users)
    facade = imported_names(ROOT / "medusa_jax" / "__init__.py", "medusa_jax")
    table = {node.value for node in ast.walk(ast.parse((ROOT / "medusa_jax" / "__init__.py").read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("medusa_jax.")}
    assert sorted(m for m in facade | table if m.startswith("medusa_jax.bench")) == []


def test_no_import_cycles():
    cycles = find_cycles(project_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_hidden_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("source, expected", [
    ("from medusa_jax.training import losses", {"medusa_jax.training", "medusa_jax.training.losses"}),
    ("def f():\n    import medusa_jax.inference.medusa as m", {"medusa_jax.inference.medusa"}),
    ("from . import tree", {"medusa_jax.heads", "medusa_jax.heads.tree"}),
    ("from ..model import kv_cache", {"medusa_jax.model", "medusa_jax.model.kv_cache"}),
])
def test_imported_names(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert imported_names(path, "medusa_jax.heads.mod") == expected
