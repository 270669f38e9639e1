"""Shared-memory segments for the bulk bytes of PushPull between a worker and a shard on one host.

A segment is anonymous memory (`memfd_create`): it has no name anywhere, so nothing is left
behind when a process is killed (the kernel frees it with the last mapping) and nothing can
be planted for a process to open. It travels as a file descriptor:

1. the worker asks for one over the authenticated `OpenSharedMemory` rpc; the shard answers
   the address of its fd door (an abstract Unix socket: no file either) and a one-time
   ticket (32 random bytes, valid for TICKET_SECONDS), so only the caller of the
   authenticated rpc can collect it (`FdDoor`);
2. the worker connects to the door, sends the ticket, and receives the segment's fd
   (SCM_RIGHTS) with its size in bytes (`collect`), then maps it;
3. the shard seals the segment's size (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before it
   hands it out, and the worker checks the seals: neither side can truncate the memory
   under the other's mapping (which would end the other process with SIGBUS).

A worker that cannot connect (another host, or another network namespace: abstract sockets
belong to one) keeps sending bytes over gRPC: the side channel is an optimization, never a
requirement.

Both sides compute the same `Layout` from the shard map: the gradient region holds the
shard's trainable parts, then the values region every part, each in shard-map order and
aligned to ALIGN bytes. A worker has at most one call in flight per shard, so each region
has one writer at a time: the worker writes gradients before its call; the shard reads
them, then writes the values before it answers.
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import mmap
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ps_common.shard_map import PartKey

log = logging.getLogger(__name__)

#: Every region starts at a multiple of this (bytes): whole cache lines for memcpy.
ALIGN = 64
#: Name of the segments as /proc/PID/fd shows them ("memfd:onnx-ps-segment"), for an operator.
MEMFD_NAME = "onnx-ps-segment"
#: Prefix of the doors' abstract socket names (shown by `ss -x`).
DOOR_PREFIX = "onnx-ps-door-"
#: Bytes of a ticket.
TICKET_BYTES = 32
#: A ticket not collected within this long is void (seconds).
TICKET_SECONDS = 30.0
#: Longest wait of either side of the door for the other (seconds).
DOOR_TIMEOUT_SECONDS = 5.0
#: Tickets a door holds at once (one per worker is the need; more are refused).
MAX_TICKETS = 4096
#: The seals every segment carries before it is handed out.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0



def available() -> bool:
    """Whether this host can make anonymous segments and pass them between processes (Linux)."""
    return (sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
            and bool(SEALS))


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


class SlotMemory:
    """Memory laid out by a Layout -- a shared-memory segment, a data channel connection's buffer -- whose parts'
    bytes are seen as arrays: `view(slot)`, `views(slots)`. The arrays of a slot sequence (a layout's gradients
    or values) are made at its first use and kept until `close`: a frame of a shard with a dozen parts made a
    dozen np.frombuffer arrays each way, each time the same."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self._made: dict[int, tuple[Sequence[Slot], dict[PartKey, np.ndarray]]] = {}

    def view(self, slot: Slot) -> np.ndarray:
        """The part's bytes as an array (a view: valid until the memory is closed)."""
        count = slot.nbytes // slot.dtype.itemsize
        return np.frombuffer(self.buffer, dtype=slot.dtype, count=count, offset=slot.offset).reshape(slot.shape)

    #: Slot sequences whose arrays are kept (a layout's two regions, and room for a caller's own).
    KEPT_SEQUENCES = 4

    def views(self, slots: Sequence[Slot]) -> dict[PartKey, np.ndarray]:
        """{slot key: view} of `slots`, a new dict each call of the same arrays (made once per sequence, for the
        first KEPT_SEQUENCES sequences; others' made each call)."""
        made = self._made.get(id(slots))
        if made is not None and made[0] is slots:   # (an id may be reused once a sequence is gone)
            return dict(made[1])
        views = {slot.key: self.view(slot) for slot in slots}
        if made is not None or len(self._made) < self.KEPT_SEQUENCES:
            self._made[id(slots)] = (slots, views)
        return dict(views)

    def _forget_views(self) -> None:
        """Drops the kept arrays (before the memory is released: each holds an export of it)."""
        self._made = {}


class Segment(SlotMemory):
    """One mapped anonymous segment. Not thread-safe: one call in flight per worker and shard.

    The shard's holds its file descriptor (to hand it out, `fd`) until `close`; a worker's
    keeps only the mapping (`fd` is -1).
    """

    def __init__(self, fd: int, size: int, *, keep_fd: bool = True) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size)   # holds a descriptor of its own
        super().__init__(memoryview(self._map))
        if not keep_fd:
            os.close(fd)
            fd = -1
        self.fd = fd
        self.closed = False

    @classmethod
    def create(cls, size: int) -> "Segment":
        """A new sealed segment of `size` bytes (zeros); OSError when the host cannot make one."""
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, size: int) -> "Segment":
        """Maps a segment received from a shard (takes the fd); ValueError when it is not a sealed segment of
        `size` bytes (the fd is closed then)."""
        try:
            found = os.fstat(fd).st_size
            if found != size:
                raise ValueError(f"the received segment holds {found} bytes, {size} were announced")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise ValueError(f"the received descriptor is not a sealable segment ({exc.strerror})") from exc
            if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
                raise ValueError(f"the received segment's size is not sealed (seals {seals:#x})")
            return cls(fd, size, keep_fd=False)   # a worker hands nothing on: the mapping is enough
        except BaseException:
            os.close(fd)
            raise

    def write(self, slots: Sequence[Slot], arrays: Sequence[np.ndarray]) -> None:
        """Copies each array into its slot (dtype and shape must match the slot's)."""
        for view, array in zip(self.views(slots).values(), arrays):
            np.copyto(view, array, casting="no")

    def close(self) -> None:
        """Unmaps and closes the fd; the memory goes when no process maps it any more."""
        if self.closed:
            return
        self.closed = True
        self._forget_views()
        try:
            self.buffer.release()
            self._map.close()
        except (BufferError, ValueError):   # a view still exported: the mapping goes with the last one
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------------- the door: fds for tickets


def _abstract(name: str) -> str:
    return "\0" + name


class FdDoor:
    """The shard's side of fd passing: an abstract Unix socket that hands a segment to whoever shows a ticket.

    `issue(make)` returns a one-time ticket; the first connection that sends it gets the
    segment `make()` returns (made then, so a ticket never collected costs nothing), with its
    size. A ticket is good once, for TICKET_SECONDS. Thread-safe; one daemon thread accepts.
    """

    def __init__(self) -> None:
        self.name = DOOR_PREFIX + secrets.token_hex(12)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind(_abstract(self.name))
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[float, Callable[[], Segment]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fd-door", daemon=True)
        self._thread.start()

    def issue(self, make: Callable[[], Segment]) -> bytes:
        """A fresh ticket for the segment `make()` will return when it is collected."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for old in [t for t, (expiry, _) in self._tickets.items() if expiry < now]:
                del self._tickets[old]
            if len(self._tickets) >= MAX_TICKETS:
                raise OSError(f"fd door {self.name}: {len(self._tickets)} tickets outstanding")
            self._tickets[ticket] = (now + TICKET_SECONDS, make)
        return ticket

    def _take(self, ticket: bytes) -> Callable[[], Segment] | None:
        now = time.monotonic()
        with self._lock:
            for known in list(self._tickets):
                if hmac.compare_digest(known, ticket):
                    expiry, make = self._tickets.pop(known)
                    return make if expiry >= now else None
        return None

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    self._answer(conn)
                except Exception as exc:  # noqa: BLE001 -- one bad caller must not end the door
                    log.info("fd door %s: a caller got nothing: %s", self.name, exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(DOOR_TIMEOUT_SECONDS)
        ticket = b""
        while len(ticket) < TICKET_BYTES:
            piece = conn.recv(TICKET_BYTES - len(ticket))
            if not piece:
                return
            ticket += piece
        make = self._take(ticket)
        if make is None:
            conn.sendall(b"\0" * 8)   # size 0: no segment for that ticket
            return
        segment = make()
        socket.send_fds(conn, [segment.size.to_bytes(8, "little")], [segment.fd])

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)
        with self._lock:
            self._tickets.clear()


def collect(door: str, ticket: bytes, *, timeout: float = DOOR_TIMEOUT_SECONDS) -> Segment:
    """The worker's side: shows `ticket` at the shard's `door` and maps the segment it gets.

    OSError when the door cannot be reached (another host or network namespace) or hangs
    up; ValueError when the answer is not a sealed segment or the ticket was refused.
    """
    if not door.startswith(DOOR_PREFIX) or len(door) > 100 or "\0" in door:
        raise ValueError(f"{door!r} is not a shared-memory door name of this project")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(_abstract(door))
        sock.sendall(ticket)
        data, fds, _, _ = socket.recv_fds(sock, 8, 1)
    if len(data) < 8 or not fds:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"door {door} refused the ticket (it was used, expired, or never issued)")
    size = int.from_bytes(data[:8], "little")
    for extra in fds[1:]:
        os.close(extra)
    return Segment.adopt(fds[0], size)
