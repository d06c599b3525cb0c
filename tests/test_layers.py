"""The package's layers, from the bottom: core (medusa_jax/*.py) <- inference/ <- training/ <- bench/ <- scripts/.

A layer imports only the layers below it, and no module reaches itself again through its imports. Every import
counts: module level and inside functions (a function-level import hides a cycle, it does not remove it). The
lazy table of medusa_jax/__init__.py is the documented facade over all layers and is not walked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> (package prefix, layer rank); a module may import modules of its own rank or lower only
LAYERS = {"medusa_jax": ("medusa_jax", 0), "inference": ("medusa_jax.inference", 1),
          "training": ("medusa_jax.training", 2), "bench": ("medusa_jax.bench", 3),
          "scripts": ("medusa_jax.scripts", 4)}
LAYER_NAMES = {rank: folder for folder, (_, rank) in LAYERS.items()}


def project_modules() -> dict[str, tuple[Path, int]]:
    """Dotted module name -> (file, layer rank) for every project .py file (core: the top folder only)."""
    modules = {}
    for folder, (package, rank) in LAYERS.items():
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in sorted(base.glob("*.py")):
            if folder == "medusa_jax" and path.name == "__init__.py":
                continue  # the lazy facade (PEP 562 table): documented, exempt
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            modules[name] = (path, rank)
    return modules


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


def test_the_walk_sees_every_layer_and_function_level_imports():
    modules = project_modules()
    assert {rank for _, rank in modules.values()} >= {0, 1, 2, 4}
    graph = project_graph()
    assert "medusa_jax.backbone" in graph["medusa_jax.heads"]
    # run.py imports hf_export inside a function only: the walk must still see it
    assert "medusa_jax.hf_export" in graph["medusa_jax.training.run"]


def test_no_layer_imports_a_layer_above_it():
    modules = project_modules()
    upward = []
    for name, targets in project_graph().items():
        rank = modules[name][1]
        for target in sorted(targets):
            if modules[target][1] > rank:
                upward.append(f"{name} ({LAYER_NAMES[rank]}) imports {target} ({LAYER_NAMES[modules[target][1]]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    cycles = find_cycles(project_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_hidden_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("source, expected", [
    ("from medusa_jax.training import losses", {"medusa_jax.training", "medusa_jax.training.losses"}),
    ("def f():\n    import medusa_jax.inference.medusa as m", {"medusa_jax.inference.medusa"}),
    ("from . import tree", {"medusa_jax", "medusa_jax.tree"}),
])
def test_imported_names(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert imported_names(path, "medusa_jax.mod") == expected
