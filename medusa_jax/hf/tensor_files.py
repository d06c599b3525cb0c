"""Reading and writing tensor files: safetensors (own reader over a memory map, so a slice reads only its
bytes and bf16 works without torch), sharded safetensors indexes, and `pytorch_model.bin` via torch."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np

from medusa_jax.atomic import atomic_file

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A weights file or folder is missing, truncated, corrupt, or does not match the model."""


class SafetensorsFile:
    """Lazy view of one .safetensors file: `names`, `metadata`, `array(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise CheckpointError(
                    f"{self.path}: truncated or corrupt safetensors file (header says {header_len} bytes, "
                    f"file has {size})")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
            if end > data_len:
                raise CheckpointError(
                    f"{self.path}: truncated file: tensor {name!r} ends at byte {end} of the data section, "
                    f"which has only {data_len} bytes")
            expected = int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(_ST_DTYPES[entry["dtype"]]).itemsize
            if end - begin != expected:
                raise CheckpointError(f"{self.path}: corrupt entry for tensor {name!r} (size mismatch)")
        self._mmap = None

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def array(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of the whole tensor (slicing it reads only those bytes)."""
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + begin: self._data_start + end]
        return raw.view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes a .safetensors file atomically (a temp file renamed into place)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, value in tensors.items():
        arr = np.ascontiguousarray(value)
        if arr.dtype not in _NP_TO_ST:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def load_torch_bin(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a PyTorch state dict with `torch.load(weights_only=True)` (never unpickles code)."""
    try:
        import torch
    except ImportError as e:  # torch is an optional dependency (the [test] / [torch] extras)
        raise CheckpointError(f"{path}: reading .bin/.pt weights needs PyTorch (pip install torch==2.13.0)") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read PyTorch weights ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict, found {type(state).__name__}")

    def numpy(t):
        t = t.detach().cpu().contiguous()
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()

    return {name: numpy(t) for name, t in state.items()}


class TensorSource:
    """All tensors of a weights folder or file, by name, whatever the format."""

    def __init__(self, arrays: dict[str, np.ndarray], origin: str):
        self._arrays = arrays
        self.origin = origin

    @property
    def names(self) -> list[str]:
        return list(self._arrays)

    def array(self, name: str) -> np.ndarray:
        return self._arrays[name]

    @classmethod
    def from_files(cls, files: Iterable[Path]) -> "TensorSource":
        arrays: dict[str, np.ndarray] = {}
        files = list(files)
        for path in files:
            if path.suffix == ".safetensors":
                st = SafetensorsFile(path)
                arrays.update({name: st.array(name) for name in st.names})
            else:
                arrays.update(load_torch_bin(path))
        return cls(arrays, ", ".join(str(p) for p in files))


def find_model_weights(folder: Path) -> list[Path]:
    """The weight files of a HF model folder: model.safetensors, a sharded index, or pytorch_model.bin."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [folder / s for s in shards]
    if (folder / "pytorch_model.bin").exists():
        return [folder / "pytorch_model.bin"]
    raise CheckpointError(
        f"{folder}: no weights found (expected model.safetensors, model.safetensors.index.json or pytorch_model.bin)")
