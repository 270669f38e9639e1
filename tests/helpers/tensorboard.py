"""Reading TensorBoard event files back in tests (tensorboardX writes them; its protobuf classes parse them)."""

from __future__ import annotations

import struct
from pathlib import Path


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of `directory`: tag -> [(step, value)], read record by record.

    An event file is a sequence of records: length (8 bytes), its CRC (4), the Event
    protobuf, the data's CRC (4).
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event file in {directory}: {list(directory.iterdir())}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
