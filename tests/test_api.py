"""The public API (`from medusa_jax import ...`) and the console commands of pyproject.toml."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import medusa_jax
from medusa_jax.assets import is_default_model
from medusa_jax.demo_model import resolve_model_dir

ROOT = Path(__file__).resolve().parents[1]
USER_FACING = ("load_pretrained", "save_pretrained", "load_heads", "save_heads", "export_heads", "generate",
               "generate_medusa", "load_tree", "ModelConfig", "HeadsConfig", "MeshConfig", "SamplingConfig")


def test_every_api_name_resolves_to_its_definition():
    assert set(USER_FACING) <= set(medusa_jax.__all__)
    for name in medusa_jax.__all__:
        value = getattr(medusa_jax, name)
        assert getattr(importlib.import_module(medusa_jax._API[name]), name) is value
        assert inspect.isclass(value) or callable(value), name
    assert set(medusa_jax.__all__) <= set(dir(medusa_jax))


def test_from_import_works_and_unknown_names_fail():
    from medusa_jax import generate_medusa, load_heads, load_pretrained  # noqa: F401

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        medusa_jax.nope  # noqa: B018


def test_the_legend_is_in_the_package_docstring():
    doc = medusa_jax.__doc__
    for entry in ("b  batch rows", "k  KV heads", "m  Medusa / Hydra heads", "r  top-k ranks",
                  "c  candidate paths", "e  depth along a path"):
        assert entry in doc


def test_importing_core_modules_loads_no_decoder_or_trainer():
    """Every module of the core (its root and the model, hf, trees and heads packages) imports without inference/,
    training/, bench/ or scripts/, and so does `import medusa_jax`. The tree package's policy and search floors sit
    with inference and training (medusa_jax/trees/__init__.py) and are not core."""
    upper = (ROOT / "medusa_jax" / "trees" / "policy", ROOT / "medusa_jax" / "trees" / "search")
    core = sorted(".".join(p.relative_to(ROOT / "medusa_jax").with_suffix("").parts)
                  for p in (ROOT / "medusa_jax").rglob("*.py") if p.name != "__init__.py" and p.parent not in upper)
    assert {"model.backbone", "hf.load", "heads.medusa", "atomic"} <= set(core)
    code = ("import sys, importlib\n"
            f"for m in {core!r}: importlib.import_module('medusa_jax.' + m)\n"
            "import medusa_jax\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['medusa_jax', 'inference'], "
            "['medusa_jax', 'training'], ['medusa_jax', 'bench'], ['medusa_jax', 'scripts']))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_console_commands_name_each_scripts_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    commands = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"medusa-generate", "medusa-train-heads", "medusa-export-heads", "medusa-self-distill",
            "medusa-build-tree", "medusa-plan", "medusa-prepare-model"} <= set(commands)
    for command, target in commands.items():
        module, _, func = target.partition(":")
        assert module.startswith("medusa_jax.scripts.") and func == "main", command
        assert (ROOT / "scripts" / (module.rpartition(".")[2] + ".py")).is_file(), command
        source = (ROOT / "scripts" / (module.rpartition(".")[2] + ".py")).read_text()
        assert "\ndef main(argv=None)" in source, command
    out = subprocess.run([sys.executable, "-m", "medusa_jax.scripts.export_heads", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and "--heads" in out.stdout, out.stderr


def test_default_model_names(tmp_path):
    assert is_default_model("default") and is_default_model("smollm2")
    assert not is_default_model(tmp_path)
    assert resolve_model_dir(tmp_path) == tmp_path
