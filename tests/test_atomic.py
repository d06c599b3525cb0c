"""All-or-nothing writes: an interrupted write leaves the old version; results get normal permissions."""

import os
import stat

import numpy as np
import pytest

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
