"""Reads TensorBoard event files back for the tests: TFRecord framing (length, masked CRC32C of the length,
data, masked CRC32C of the data), each record an Event protobuf (tensorboardX's generated classes parse it),
scalars from its Summary values. With the `tensorboard` package installed its EventAccumulator reads them too."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: Path):
    data = Path(path).read_bytes()
    pos = 0
    while pos < len(data):
        header = data[pos: pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8: pos + 12])
        assert length_crc == _masked(header), f"{path}: bad length CRC at byte {pos}"
        body = data[pos + 12: pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length: pos + 16 + length])
        assert body_crc == _masked(body), f"{path}: bad data CRC at byte {pos}"
        yield body
        pos += 16 + length


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} over every event file under `logdir`, in file and record order."""
    from tensorboardX.proto import event_pb2

    out = defaultdict(list)
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        for body in records(path):
            event = event_pb2.Event.FromString(body)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out[value.tag].append((event.step, value.simple_value))
    return dict(out)
