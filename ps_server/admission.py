"""Keeping a shard responsive under load: data-plane admission, and cutting stalled client streams.

Data-plane rpcs (Push, Pull, PushPull, PullRows, InitParameters, Barrier) can hold a thread
for long: a sync or SSP pull waits, a barrier waits, a client that opens a push stream and
stops sending holds its thread until it sends again, and a unary call whose request never
arrives holds one before any handler code runs (gRPC Python reads the request on the pool's
thread). So:

- Data-plane rpcs run on a thread pool of their own (`rpc_threads`, threads made as
  needed); control rpcs (health, cluster info, registration, heartbeats, Admin) on a small
  one (CONTROL_THREADS) that no data-plane call can take, so they answer whatever the data
  plane does.
- `Admission` tells callers apart. A call that names a registered, live worker (the
  `ps-worker-id-bin` metadata every PSClient sends) takes one of that worker's
  WORKER_CALLS slots; any other call takes one of `limit` shared anonymous slots. One more
  is refused at once with RESOURCE_EXHAUSTED (reason OVERLOADED; the client retries it with
  backoff) instead of queueing. Hundreds of stalled anonymous or half-sent calls therefore
  fill the anonymous slots and nothing else: a registered worker's Pull and PushPull are
  still served at once.
- `StreamWatchdog` cuts a client stream whose next message has not come for `idle_seconds`:
  the call is cancelled (the client sees CANCELLED) and its thread and admission slot return.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from ps_common.access import WORKER_ID_KEY
from ps_common.errors import OverloadedError

log = logging.getLogger(__name__)

#: How often the watchdog looks for idle streams (seconds).
WATCHDOG_PERIOD_SECONDS = 0.5
#: Data-plane calls one registered worker may have running on a shard at once (a worker has one in
#: flight per shard; evaluation and heartbeat threads add a few).
WORKER_CALLS = 8
#: Threads of the control rpcs' pool (health, cluster info, membership, Admin): never taken by the data plane.
CONTROL_THREADS = 16


def caller_of(context: grpc.ServicerContext) -> str:
    """The worker id the call's metadata names, or "" for an anonymous caller."""
    for key, value in context.invocation_metadata() or ():
        if key == WORKER_ID_KEY:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return ""


class Admission:
    """At most `limit` anonymous data-plane calls at once, and WORKER_CALLS per registered live worker.

    `is_live(worker_id)` says whether a worker is registered and holds a lease. Thread-safe;
    `enter` never blocks.
    """

    def __init__(self, limit: int, *, shard_index: int = 0, is_live: Callable[[str], bool] = lambda _: False,
                 worker_calls: int = WORKER_CALLS) -> None:
        if limit < 1:
            raise ValueError(f"Invalid data-plane admission limit: {limit} (must be >= 1)")
        if worker_calls < 1:
            raise ValueError(f"Invalid calls per worker: {worker_calls} (must be >= 1)")
        self.limit = limit
        self.worker_calls = worker_calls
        self._shard_index = shard_index
        self._is_live = is_live
        self._slots = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._by_worker: dict[str, int] = {}

    @contextlib.contextmanager
    def enter(self, rpc: str, worker_id: str = "") -> Iterator[None]:
        """Holds a slot for the block: the worker's own when `worker_id` is registered and live, else an
        anonymous one; OverloadedError when none is free."""
        if worker_id and self._is_live(worker_id):
            with self._lock:
                running = self._by_worker.get(worker_id, 0)
                if running >= self.worker_calls:
                    raise OverloadedError(f"{rpc} refused: worker {worker_id!r} already runs {running} data-plane "
                                          f"calls on shard {self._shard_index} (at most {self.worker_calls}); retry "
                                          "with backoff")
                self._by_worker[worker_id] = running + 1
            try:
                yield
            finally:
                with self._lock:
                    left = self._by_worker[worker_id] - 1
                    if left:
                        self._by_worker[worker_id] = left
                    else:
                        del self._by_worker[worker_id]
            return
        if not self._slots.acquire(blocking=False):
            raise OverloadedError(f"{rpc} refused: shard {self._shard_index} already runs {self.limit} data-plane "
                                  "calls of callers that are not registered workers (setting data_plane_calls); "
                                  "retry with backoff")
        try:
            yield
        finally:
            self._slots.release()


class DataPlanePool(grpc.ServerInterceptor):
    """Runs the named rpcs (full method names) on `pool` instead of the server's own pool (the control rpcs').

    gRPC Python picks a handler's pool from its behavior's `experimental_thread_pool`; being
    the first interceptor, this one sees the final behavior and marks it.
    """

    def __init__(self, pool: futures.ThreadPoolExecutor, methods: frozenset[str]) -> None:
        self.pool = pool
        self.methods = methods

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:
            return handler
        kind = ("stream_" if handler.request_streaming else "unary_") + \
            ("stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)

        def behavior(request, context):
            return inner(request, context)

        behavior.experimental_thread_pool = self.pool
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(behavior, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


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
