"""The boundary's shared-memory segments: one per worker that asked (OpenSharedMemory), for PushPull's bytes.

A segment is anonymous memory handed to the worker as a file descriptor through the
shard's fd door (ps_common/shared_memory.py): `offer` answers the door's name and a
one-time ticket, and the segment is made when the worker collects it. Its layout follows
the shard's parts (ps_common.shared_memory.Layout); a segment whose layout no longer fits
(after a reset and a new parameter list) is replaced when the worker opens it again.
Segments are closed when their worker deregisters, when the worker is no longer known to
the shard, and when the shard stops; being nameless, a killed shard leaves none behind.
"""

from __future__ import annotations

import logging
import threading

from ps_common import shared_memory
from ps_common.errors import ResourceExhaustedError, SharedMemoryUnavailableError
from ps_common.shared_memory import FdDoor, Layout, Segment

log = logging.getLogger(__name__)


class Segments:
    """worker id -> (segment, layout, the shard's parts generation it was made for), and the door they are
    collected at. Thread-safe."""

    def __init__(self, *, limit: int, shard_index: int) -> None:
        self.limit = limit
        self.shard_index = shard_index
        self._lock = threading.Lock()
        self._by_worker: dict[str, tuple[Segment, Layout, int]] = {}
        self._door: FdDoor | None = None
        self._closed = False

    def offer(self, worker_id: str, layout: Layout, generation: int, *, known: set[str]) -> tuple[str, bytes]:
        """(door name, one-time ticket) for a segment of `layout` (made for the shard's parts `generation`) for
        this worker; forgets unknown workers'."""
        if not shared_memory.available():
            raise SharedMemoryUnavailableError(f"shard {self.shard_index}: this host cannot pass anonymous memory "
                                               "between processes (Linux memfd and SCM_RIGHTS); use gRPC bytes")
        with self._lock:
            if self._closed:
                raise SharedMemoryUnavailableError(f"shard {self.shard_index} is stopping")
            for gone in [w for w in self._by_worker if w not in known]:
                self._close_locked(gone)
            self._check_room(worker_id)
            if self._door is None:
                try:
                    self._door = FdDoor()
                except OSError as exc:
                    raise SharedMemoryUnavailableError(f"shard {self.shard_index}: cannot open its fd door "
                                                       f"({exc}); use gRPC bytes") from exc
            door = self._door
        try:
            return door.name, door.issue(lambda: self._install(worker_id, layout, generation))
        except OSError as exc:
            raise ResourceExhaustedError(f"shard {self.shard_index}: {exc}") from exc

    def _check_room(self, worker_id: str) -> None:
        if worker_id not in self._by_worker and len(self._by_worker) >= self.limit:
            raise ResourceExhaustedError(f"shard {self.shard_index} holds {len(self._by_worker)} shared-memory "
                                         f"segments (max_registered_workers={self.limit})")

    def _install(self, worker_id: str, layout: Layout, generation: int) -> Segment:
        """The worker's new segment (called by the door when the ticket is collected); replaces its old one."""
        with self._lock:
            if self._closed:
                raise OSError(f"shard {self.shard_index} is stopping")
            self._check_room(worker_id)
            self._close_locked(worker_id)
            segment = Segment.create(layout.size)
            self._by_worker[worker_id] = (segment, layout, generation)
        log.info("shard %d: shared memory (%d bytes, anonymous) for worker %r", self.shard_index, layout.size,
                 worker_id)
        return segment

    def get(self, worker_id: str, generation: int) -> tuple[Segment, Layout]:
        """The worker's segment, made for the shard's current parts (`generation`); SharedMemoryUnavailableError
        when it has none, or one made for other parts (after a reset: it is closed, the worker opens another)."""
        with self._lock:
            found = self._by_worker.get(worker_id)
            if found is not None and found[2] != generation:
                self._close_locked(worker_id)
                raise SharedMemoryUnavailableError(
                    f"worker {worker_id!r}: the shared-memory layout no longer fits shard {self.shard_index}'s parts "
                    "(re-initialized?): open it again")
        if found is None:
            raise SharedMemoryUnavailableError(f"worker {worker_id!r} has no shared-memory segment on shard "
                                               f"{self.shard_index}: call OpenSharedMemory first")
        return found[0], found[1]

    def close(self, worker_id: str) -> None:
        with self._lock:
            self._close_locked(worker_id)

    def close_all(self) -> None:
        with self._lock:
            self._closed = True
            for worker_id in list(self._by_worker):
                self._close_locked(worker_id)
            door, self._door = self._door, None
        if door is not None:
            door.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_worker)

    def _close_locked(self, worker_id: str) -> None:
        found = self._by_worker.pop(worker_id, None)
        if found is not None:
            found[0].close()
