"""All-or-nothing writes: an interrupted write leaves the old version; results get normal permissions."""

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from medusa_jax import atomic
from medusa_jax.atomic import atomic_file, atomic_folder
from medusa_jax.hf.tensor_files import SafetensorsFile, write_safetensors


def test_interrupted_folder_write_keeps_the_previous_folder(tmp_path):
    target = tmp_path / "heads"
    with atomic_folder(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as tmp:
            (tmp / "a.txt").write_text("new, half")
            raise RuntimeError("killed mid-write")
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # no temp folder left behind
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~_umask()


def test_interrupted_file_write_leaves_nothing(tmp_path):
    target = tmp_path / "x.bin"
    with pytest.raises(ValueError):
        with atomic_file(target) as f:
            f.write(b"partial")
            raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


def test_safetensors_round_trip_has_normal_permissions(tmp_path):
    target = tmp_path / "t.safetensors"
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int32)}
    write_safetensors(target, arrays, metadata={"k": "v"})
    st = SafetensorsFile(target)
    for name, value in arrays.items():
        np.testing.assert_array_equal(st.array(name), value)
    assert st.metadata == {"k": "v"}
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_committed_entries_replace_their_namesakes_and_the_last_one_goes_in_last(tmp_path, monkeypatch):
    out, staging = tmp_path / "out", tmp_path / "out" / ".staging"
    (out / "base_model").mkdir(parents=True)
    (out / "base_model" / "old.bin").write_text("old")
    (out / "keep.txt").write_text("not staged")
    (out / "config.json").write_text("old config")
    (staging / "base_model").mkdir(parents=True)
    (staging / "base_model" / "new.bin").write_text("new")
    (staging / "config.json").write_text("new config")
    moved = []
    real = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda src, dst: (moved.append(Path(dst).name), real(src, dst)))
    atomic.commit_entries(staging, out, "config.json")
    assert moved == ["base_model", "config.json"]
    assert sorted(p.name for p in (out / "base_model").iterdir()) == ["new.bin"]  # a folder replaced whole
    assert (out / "keep.txt").read_text() == "not staged" and (out / "config.json").read_text() == "new config"
    assert not staging.exists()
