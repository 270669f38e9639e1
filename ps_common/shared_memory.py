"""Shared-memory segments for the bulk bytes of PushPull between a worker and a shard on one host.

The shard creates a segment per worker (`Segment.create`: a file under /dev/shm, mode 0600,
a random name), answers its name over the authenticated OpenSharedMemory rpc, and the
worker maps it (`Segment.attach`). A worker that cannot map it (another host, another user
or container without the same /dev/shm) keeps sending bytes over gRPC: the side channel is
an optimization, never a requirement.

Both sides compute the same `Layout` from the shard map: the gradient region holds the
shard's trainable parts, then the values region every part, each in shard-map order and
aligned to ALIGN bytes. A worker has at most one call in flight per shard, so each region
has one writer at a time: the worker writes gradients before its call; the shard reads
them, then writes the values before it answers.

Why /dev/shm and mmap rather than multiprocessing.shared_memory: before Python 3.13 every
process that merely attaches a SharedMemory registers it with its resource tracker, which
unlinks the segment when that process exits (CPython issue 82300), so a worker's exit
would delete the shard's segment. A named file and mmap have no tracker.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Where POSIX shared memory lives on Linux; without it there is no shared-memory path.
SHM_DIR = Path("/dev/shm")
#: Every region starts at a multiple of this (bytes): whole cache lines for memcpy.
ALIGN = 64
#: Name prefix of the segments, so an operator can tell them in /dev/shm.
PREFIX = "onnx-ps-"

PartKey = tuple[str, int]


def available() -> bool:
    """Whether this host has a POSIX shared-memory directory this process can write."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one part's bytes lie in a segment."""

    key: PartKey
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The gradient region (trainable parts) and the values region (every part), in shard-map order."""

    gradients: tuple[Slot, ...]
    values: tuple[Slot, ...]
    values_offset: int
    size: int

    @classmethod
    def of(cls, parts: Iterable[tuple[PartKey, np.dtype, tuple[int, ...]]]) -> "Layout":
        """The layout of a shard's parts ((name, row_start), dtype, shape), given in shard-map order."""
        parts = [(key, np.dtype(dtype), tuple(shape)) for key, dtype, shape in parts]
        gradients, offset = [], 0
        for key, dtype, shape in parts:
            if dtype.kind == "f":
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                gradients.append(Slot(key, dtype, shape, offset, nbytes))
                offset = _aligned(offset + nbytes)
        values_offset = offset
        values = []
        for key, dtype, shape in parts:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            values.append(Slot(key, dtype, shape, offset, nbytes))
            offset = _aligned(offset + nbytes)
        return cls(tuple(gradients), tuple(values), values_offset, max(offset, ALIGN))


class Segment:
    """One mapped shared-memory segment. Not thread-safe: one call in flight per worker and shard."""

    def __init__(self, path: Path, size: int, *, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError(f"shared-memory segment {path} holds {os.fstat(fd).st_size} bytes, "
                                 f"{size} expected")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buffer = memoryview(self._map)

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, size: int) -> "Segment":
        """A new segment of `size` bytes under a random name, readable and writable by this user only."""
        path = SHM_DIR / f"{PREFIX}{secrets.token_hex(16)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(path, size, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "Segment":
        """Maps the segment a shard created; OSError (or ValueError) when it is not there or not ours."""
        if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a shared-memory segment name of this project")
        return cls(SHM_DIR / name, size, owner=False)

    def view(self, slot: Slot) -> np.ndarray:
        """The part's bytes in the segment as an array (a view: valid until the segment is closed)."""
        count = slot.nbytes // slot.dtype.itemsize
        return np.frombuffer(self.buffer, dtype=slot.dtype, count=count, offset=slot.offset).reshape(slot.shape)

    def write(self, slots: Sequence[Slot], arrays: Sequence[np.ndarray]) -> None:
        """Copies each array into its slot (dtype and shape must match the slot's)."""
        for slot, array in zip(slots, arrays):
            np.copyto(self.view(slot), array, casting="no")

    def close(self) -> None:
        """Unmaps; the creator also removes the file."""
        try:
            self.buffer.release()
            self._map.close()
        except (BufferError, ValueError):   # a view still exported: the mapping goes with the last one
            pass
        if self.owner:
            self.path.unlink(missing_ok=True)
