"""Keeping a shard responsive under load: data-plane admission, and cutting stalled client streams.

Data-plane rpcs (Push, Pull, InitParameters, Barrier) can hold a server thread for long:
a sync or SSP pull waits, a barrier waits, and a client that opens a push stream and stops
sending holds its thread until it sends again. All rpcs share one thread pool, so without a
bound a few hundred stalled streams would leave no thread for health checks and cluster
info, and Kubernetes would restart a healthy shard. So:

- `Admission` lets at most `limit` data-plane calls run at once; one more is refused at once
  with RESOURCE_EXHAUSTED (reason OVERLOADED; the client retries it with backoff) instead of
  queueing silently. The pool's other threads are left to control rpcs (health, cluster
  info, registration, heartbeats, Admin).
- `StreamWatchdog` cuts a client stream whose next message has not come for `idle_seconds`:
  the call is cancelled (the client sees CANCELLED) and its thread and admission slot return.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import grpc

from ps_common.errors import OverloadedError

log = logging.getLogger(__name__)

#: How often the watchdog looks for idle streams (seconds).
WATCHDOG_PERIOD_SECONDS = 0.5


class Admission:
    """At most `limit` data-plane calls at once. Thread-safe; `enter` never blocks."""

    def __init__(self, limit: int, *, shard_index: int = 0) -> None:
        if limit < 1:
            raise ValueError(f"Invalid data-plane admission limit: {limit} (must be >= 1)")
        self.limit = limit
        self._shard_index = shard_index
        self._slots = threading.BoundedSemaphore(limit)

    @contextlib.contextmanager
    def enter(self, rpc: str) -> Iterator[None]:
        """Holds a slot for the block; OverloadedError when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            raise OverloadedError(f"{rpc} refused: shard {self._shard_index} already runs {self.limit} data-plane "
                                  "calls (setting data_plane_calls); retry with backoff")
        try:
            yield
        finally:
            self._slots.release()


class StreamWatchdog:
    """Cancels client streams that stay idle longer than `idle_seconds`. Thread-safe."""

    def __init__(self, idle_seconds: float) -> None:
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[grpc.ServicerContext, str, float]] = {}
        self._next_id = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-watchdog", daemon=True)

    def start(self) -> "StreamWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * WATCHDOG_PERIOD_SECONDS + 1)

    def watch(self, requests: Iterator, context: grpc.ServicerContext, what: str) -> Iterator:
        """`requests`, with the call cancelled when the next message takes longer than idle_seconds."""
        with self._lock:
            key = self._next_id
            self._next_id += 1
            self._streams[key] = (context, what, time.monotonic())
        context.add_callback(lambda: self._forget(key))
        try:
            for request in requests:
                with self._lock:
                    self._streams[key] = (context, what, time.monotonic())
                yield request
        finally:
            self._forget(key)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(WATCHDOG_PERIOD_SECONDS):
            now = time.monotonic()
            with self._lock:
                idle = [(k, c, w, now - t) for k, (c, w, t) in self._streams.items() if now - t > self.idle_seconds]
                for k, *_ in idle:
                    del self._streams[k]
            for _, context, what, seconds in idle:
                log.warning("%s from %s: no message for %.1f s (stream_idle_seconds=%g); cutting the stream",
                            what, context.peer(), seconds, self.idle_seconds)
                context.cancel()
