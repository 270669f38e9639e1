"""The boundary's shared-memory segments: one per worker that asked (OpenSharedMemory), for PushPull's bytes.

The segment's layout follows the shard's parts (ps_common.shared_memory.Layout); a
segment whose layout no longer fits (after a reset and a new parameter list) is replaced
when the worker opens it again. Segments are removed when their worker deregisters, when
the worker is no longer known to the shard, and when the shard stops.
"""

from __future__ import annotations

import logging
import threading

from ps_common import shared_memory
from ps_common.errors import ResourceExhaustedError, SharedMemoryUnavailableError
from ps_common.shared_memory import Layout, Segment

log = logging.getLogger(__name__)


class Segments:
    """worker id -> (segment, layout). Thread-safe."""

    def __init__(self, *, limit: int, shard_index: int) -> None:
        self.limit = limit
        self.shard_index = shard_index
        self._lock = threading.Lock()
        self._by_worker: dict[str, tuple[Segment, Layout]] = {}

    def open(self, worker_id: str, layout: Layout, *, known: set[str]) -> tuple[Segment, Layout]:
        """The worker's segment for `layout` (created or replaced as needed); forgets those of unknown workers."""
        if not shared_memory.available():
            raise SharedMemoryUnavailableError(f"shard {self.shard_index}: no shared memory on this host "
                                          f"({shared_memory.SHM_DIR} is missing or not writable); use gRPC bytes")
        with self._lock:
            for gone in [w for w in self._by_worker if w not in known]:
                self._close_locked(gone)
            found = self._by_worker.get(worker_id)
            if found is not None and found[1] == layout:
                return found
            if found is not None:
                self._close_locked(worker_id)
            if len(self._by_worker) >= self.limit:
                raise ResourceExhaustedError(f"shard {self.shard_index} holds {len(self._by_worker)} shared-memory "
                                             f"segments (max_registered_workers={self.limit})")
            segment = Segment.create(layout.size)
            self._by_worker[worker_id] = (segment, layout)
            log.info("shard %d: shared memory %s (%d bytes) for worker %r", self.shard_index, segment.name,
                     layout.size, worker_id)
            return segment, layout

    def get(self, worker_id: str) -> tuple[Segment, Layout] | None:
        with self._lock:
            return self._by_worker.get(worker_id)

    def close(self, worker_id: str) -> None:
        with self._lock:
            self._close_locked(worker_id)

    def close_all(self) -> None:
        with self._lock:
            for worker_id in list(self._by_worker):
                self._close_locked(worker_id)

    def _close_locked(self, worker_id: str) -> None:
        found = self._by_worker.pop(worker_id, None)
        if found is not None:
            found[0].close()
