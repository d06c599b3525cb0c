"""export_heads.py on first use: --materialize-lm-head for every head kind, --overwrite that deletes only an
earlier export (never the source's checkpoints), and temp folders of a killed export cleaned up."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from medusa_jax.atomic import atomic_folder
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.folder import save_heads
from medusa_jax.hf.load import load_pretrained


@pytest.fixture(scope="module")
def heads_dir(tiny_model_dir, tmp_path_factory):
    folder = tiny_model_dir("llama")
    base = load_pretrained(folder)
    cfg = HeadsConfig(base.config.hidden_size, base.config.vocab_size, 2, lm_head="truncated", truncated_vocab_size=40)
    heads = init_heads(cfg, base, seed=3, token_map=np.arange(40, dtype=np.int32) * 3)
    out = tmp_path_factory.mktemp("export") / "trained"
    save_heads(heads, out)
    (out / "checkpoints" / "7").mkdir(parents=True)  # a training run's checkpoints beside the heads
    (out / "checkpoints" / "7" / "state").write_text("precious")
    return out


def export(capsys, *args: str) -> tuple[int, str]:
    spec = importlib.util.spec_from_file_location("export_script", Path(__file__).parents[1] / "scripts" /
                                                  "export_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(list(args))
    return code, capsys.readouterr().err


def test_materialize_is_a_no_op_for_truncated_heads(heads_dir, tmp_path, capsys):
    code, err = export(capsys, "--heads", str(heads_dir), "--out", str(tmp_path / "a"))
    assert code == 0, err
    code, err = export(capsys, "--heads", str(heads_dir), "--out", str(tmp_path / "b"), "--materialize-lm-head")
    assert code == 0, err
    for name in ("config.json", "medusa_lm_head.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_out_equal_to_heads_is_refused_and_the_source_kept(heads_dir, capsys):
    before = sorted(p.relative_to(heads_dir) for p in heads_dir.rglob("*"))
    code, err = export(capsys, "--heads", str(heads_dir), "--out", str(heads_dir), "--overwrite")
    assert code == 2 and "is the --heads folder" in err
    assert sorted(p.relative_to(heads_dir) for p in heads_dir.rglob("*")) == before
    assert (heads_dir / "checkpoints" / "7" / "state").read_text() == "precious"


def test_overwrite_replaces_only_an_earlier_export(heads_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert export(capsys, "--heads", str(heads_dir), "--out", str(out))[0] == 0
    assert export(capsys, "--heads", str(heads_dir), "--out", str(out), "--overwrite")[0] == 0
    (out / "README.md").write_text("my notes")
    code, err = export(capsys, "--heads", str(heads_dir), "--out", str(out), "--overwrite")
    assert code == 2 and "README.md" in err and (out / "README.md").read_text() == "my notes"


def test_temp_folders_of_a_killed_export_are_removed(tmp_path):
    target = tmp_path / "exported"
    stale = tmp_path / ".exported.4194999.abc123.tmp"  # above the kernel's pid_max: that process is gone
    stale.mkdir()
    (stale / "medusa_lm_head.safetensors").write_bytes(b"half")
    live = tmp_path / f".exported.{os.getpid()}.def456.tmp"  # another export of this process, still running
    live.mkdir()
    with atomic_folder(target) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not stale.exists() and live.exists() and (target / "config.json").exists()
