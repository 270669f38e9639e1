"""Prometheus metrics of one shard, on the shard server's own registry, and their HTTP endpoint.

Counts and histograms come from the shard's events (`Shard.events`) and from a gRPC
interceptor that times every ps.v1 rpc; state (step, clocks, live workers, effective
replicas, bytes held) is read from the shard at scrape time, so it is never out of date.
Every metric carries a `shard` label. Each ShardServer has its own CollectorRegistry, so
several shards in one process (tests, ps-launch) never share or collide.

Metric names (all prefixed `ps_`):
  pushes_total{outcome,reason}          pushes taken: outcome accepted|dropped, reason none|stale|already_contributed
  duplicate_pushes_total                retried pushes answered without being applied
  replicas_capped_total                 sync: times an expired lease shrank the quorum below replicas_to_aggregate
  pulls_total                           pulls answered
  received_bytes_total                  gradient bytes taken by pushes (duplicates excluded)
  sent_bytes_total                      parameter bytes served by pulls
  push_staleness_steps                  histogram of t - read_step when a push arrives
  rpc_duration_seconds{rpc}             histogram of rpc latency, incl. waits (Pull, Barrier)
  rpcs_total{rpc,code}                  finished rpcs by gRPC status code
                                        (both: a PushPull frame answered on the data channel counts as a
                                        PushPull, timed from the frame read whole to its answer made)
  step, initialized, parts, parameter_bytes, workers_registered, workers_live,
  worker_clock{worker}, effective_replicas (sync only)   gauges read at scrape time
  dynamic_table_rows{table}             live rows of each dynamic table on this shard (read at scrape time)
  dynamic_table_created_rows_total{table}, dynamic_table_evictions_total{table}
                                        rows created / evicted since the shard started (read at scrape time)
  process_resident_memory_bytes, process_peak_resident_memory_bytes
                                        resident and peak resident memory of the shard's process, read at scrape
                                        time (Linux: /proc/self/status VmRSS, VmHWM; elsewhere only the peak,
                                        from getrusage); shards sharing one process report the same figures.
                                        The standard process_* metrics carry no `shard` label: a dashboard
                                        filtered by shard reads these.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common.modes import DropReason, Mode

if TYPE_CHECKING:
    from ps_server.shard import Shard

log = logging.getLogger(__name__)

# No `_created` series: one per counter and histogram (25 a shard) that no dashboard or alert
# reads. prometheus_client keeps this switch process-wide.
disable_created_metrics()

#: Only rpcs of this service are timed (not health checks or reflection).
RPC_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name + "/"

#: Latency buckets in seconds: fast pushes through long sync and SSP waits.
LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300)

#: Staleness buckets in steps (t - read_step).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)

#: DropReason -> the `reason` label (the series that exist from the start).
REASONS = {
    DropReason.NONE: "none",
    DropReason.STALE: "stale",
    DropReason.ALREADY_CONTRIBUTED: "already_contributed",
}


class ShardMetrics:
    """The metrics of one shard: a registry, the event listener, the rpc interceptor, the HTTP endpoint.

    Thread-safe. Creating it subscribes to `shard.events`; `serve` starts the endpoint
    and `close` stops it.
    """

    def __init__(self, shard: "Shard", *, process: bool = True) -> None:
        self.shard = shard
        self.label = str(shard.config.shard_index)
        self.registry = CollectorRegistry()
        r = self.registry
        self.pushes = Counter("ps_pushes", "Pushes taken, by outcome and drop reason (duplicates excluded)",
                              ["shard", "outcome", "reason"], registry=r)
        self.duplicates = Counter("ps_duplicate_pushes", "Retried pushes acknowledged without being applied again",
                                  ["shard"], registry=r).labels(self.label)
        self.replicas_capped = Counter(
            "ps_replicas_capped", "sync: times the quorum shrank below replicas_to_aggregate because a worker's "
            "lease expired (workers that deregistered do not count)", ["shard"], registry=r).labels(self.label)
        self.pulls = Counter("ps_pulls", "Pulls answered", ["shard"], registry=r).labels(self.label)
        self.received_bytes = Counter("ps_received_bytes", "Gradient bytes taken by pushes", ["shard"],
                                      registry=r).labels(self.label)
        self.sent_bytes = Counter("ps_sent_bytes", "Parameter bytes served by pulls", ["shard"],
                                  registry=r).labels(self.label)
        self.staleness = Histogram("ps_push_staleness_steps", "Steps between a push's read_step and the shard's step "
                                   "when it arrived", ["shard"], buckets=STALENESS_BUCKETS, registry=r).labels(self.label)
        self.rpc_seconds = Histogram("ps_rpc_duration_seconds", "Latency of ps.v1 rpcs, including waits",
                                     ["shard", "rpc"], buckets=LATENCY_BUCKETS, registry=r)
        self.rpcs = Counter("ps_rpcs", "Finished ps.v1 rpcs by status code", ["shard", "rpc", "code"], registry=r)
        # labelled series already looked up: (accepted, reason) -> pushes; (rpc, code) -> (rpc_seconds, rpcs)
        self._pushes: dict[tuple[bool, int], Any] = {}
        self._rpc_series: dict[tuple[str, str], tuple[Any, Any]] = {}
        # Every push series exists from the start (at 0), so rates and alerts work before the first drop.
        self.pushes.labels(self.label, "accepted", "none")
        for reason, label in REASONS.items():
            if reason != DropReason.NONE:
                self.pushes.labels(self.label, "dropped", label)
        r.register(_ShardStateCollector(shard, self.label))
        r.register(_MemoryCollector(self.label))
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            r.register(GC_COLLECTOR)
        self.interceptor = RpcMetricsInterceptor(self.observe_rpc)
        self._http = None
        self._http_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        shard.events.subscribe(self.on_event)

    # ------------------------------------------------------------------ events

    def on_event(self, event: str, **fields) -> None:
        """The shard listener; cheap, never blocks (some events fire under the shard's lock)."""
        if event == "push":
            accepted, reason = bool(fields.get("accepted")), fields.get("reason", 0)
            pushes = self._pushes.get((accepted, reason))
            if pushes is None:   # labels() builds and looks up its key under a lock: once per series
                pushes = self._pushes[accepted, reason] = self.pushes.labels(
                    self.label, "accepted" if accepted else "dropped", _reason_label(reason))
            pushes.inc()
            self.received_bytes.inc(fields.get("nbytes", 0))
            staleness = fields.get("staleness")
            if staleness is not None:
                self.staleness.observe(max(0, staleness))
        elif event == "pull":
            self.pulls.inc()
            self.sent_bytes.inc(fields.get("nbytes", 0))
        elif event == "duplicate":
            self.duplicates.inc()
        elif event == "replicas_capped" and fields.get("shrunk"):
            self.replicas_capped.inc()

    def watch_replica(self, status: Callable[[], object]) -> None:
        """Adds a replicated shard's replica metrics (role, epoch, failovers, backups' lag), read from `status()`."""
        self.registry.register(_ReplicaCollector(status, self.label))

    def observe_rpc(self, rpc: str, code: str, seconds: float) -> None:
        series = self._rpc_series.get((rpc, code))
        if series is None:   # every frame of the data channel comes here: the labelled series once each
            series = self._rpc_series[rpc, code] = (self.rpc_seconds.labels(self.label, rpc),
                                                    self.rpcs.labels(self.label, rpc, code))
        series[0].observe(seconds)
        series[1].inc()

    # ------------------------------------------------------------------ endpoint

    @property
    def port(self) -> int | None:
        """The bound port of the HTTP endpoint, or None when it is not serving."""
        return None if self._http is None else self._http.server_address[1]

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP endpoint on a daemon thread; returns the bound port (port 0 picks one).

        Raises OSError naming the address when it cannot bind. Calling it again while
        serving returns the port already bound.
        """
        with self._lock:
            if self._http is not None:
                return self.port  # type: ignore[return-value]
            bind = host.strip("[]") or "0.0.0.0"
            try:
                self._http, self._http_thread = start_http_server(port, addr=bind, registry=self.registry)
            except OSError as exc:
                raise OSError(f"shard {self.label}: cannot bind the metrics endpoint {host}:{port}: "
                              f"{exc.strerror or exc}; choose another --metrics-port (0 picks a free one)") from exc
            log.info("shard %s metrics on http://%s:%d/metrics", self.label, host, self.port)
            return self.port  # type: ignore[return-value]

    def close(self) -> None:
        """Stops the HTTP endpoint (if serving) and unsubscribes from the shard; waits up to 5 s."""
        with self._lock:
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
                if self._http_thread is not None:
                    self._http_thread.join(timeout=5)
                self._http = self._http_thread = None
        self.shard.events.unsubscribe(self.on_event)


def _reason_label(reason: int) -> str:
    """The `reason` label of a DropReason value (one without a fixed label gets its lower-case name)."""
    if reason in REASONS:
        return REASONS[reason]
    try:
        return DropReason(reason).name.lower()
    except ValueError:
        return str(reason)


# ---------------------------------------------------------------------- state read at scrape time

class _ShardStateCollector(Collector):
    """Gauges read from the shard's view at each scrape (one consistent read under its lock)."""

    def __init__(self, shard: "Shard", label: str) -> None:
        self.shard = shard
        self.label = label

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("ps_step", "The shard's global step t", labels=["shard"]),
            GaugeMetricFamily("ps_initialized", "1 once the parameters are initialized", labels=["shard"]),
            GaugeMetricFamily("ps_parts", "Tensor parts held by this shard", labels=["shard"]),
            GaugeMetricFamily("ps_parameter_bytes", "Bytes of parameter values held by this shard", labels=["shard"]),
            GaugeMetricFamily("ps_workers_registered", "Workers this shard knows (live or not)", labels=["shard"]),
            GaugeMetricFamily("ps_workers_live", "Workers holding an unexpired lease", labels=["shard"]),
            GaugeMetricFamily("ps_worker_clock", "Pushes taken from each worker (its clock c_w)",
                              labels=["shard", "worker"]),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        view = self.shard.view()
        step, initialized, parts, nbytes, registered, live, clocks = self._families()
        step.add_metric([self.label], view.step)
        initialized.add_metric([self.label], 1 if view.initialized else 0)
        parts.add_metric([self.label], view.parts_held)
        nbytes.add_metric([self.label], view.bytes_held)
        registered.add_metric([self.label], len(view.workers))
        live.add_metric([self.label], sum(1 for w in view.workers if w.live))
        for w in view.workers:
            clocks.add_metric([self.label, w.worker_id], w.clock)
        yield from (step, initialized, parts, nbytes, registered, live, clocks)
        if view.policy.mode is Mode.SYNC:
            effective = GaugeMetricFamily("ps_effective_replicas", "sync: gradients a step waits for, "
                                          "min(N, live workers), at least 1", labels=["shard"])
            effective.add_metric([self.label], view.policy.effective_replicas)
            yield effective
        if view.dynamic:
            rows = GaugeMetricFamily("ps_dynamic_table_rows", "Live rows of a dynamic table on this shard",
                                     labels=["shard", "table"])
            created = CounterMetricFamily("ps_dynamic_table_created_rows", "Rows of a dynamic table created from its "
                                          "initializer (first use, or use after eviction)", labels=["shard", "table"])
            evicted = CounterMetricFamily("ps_dynamic_table_evictions", "Rows of a dynamic table evicted after "
                                          "evict_after_steps untouched steps", labels=["shard", "table"])
            for d in view.dynamic:
                rows.add_metric([self.label, d.name], d.rows)
                created.add_metric([self.label, d.name], d.created)
                evicted.add_metric([self.label, d.name], d.evicted)
            yield from (rows, created, evicted)


# ---------------------------------------------------------------------- a replicated shard's replica

class _ReplicaCollector(Collector):
    """A replica's role, epoch, failovers and (on a primary) each backup's lag, read from `status()` (a
    ps.v1.ReplicaStatus: ps_server/replication/replica.py) at each scrape."""

    def __init__(self, status: Callable[[], object], label: str) -> None:
        self.status = status
        self.label = label

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    @staticmethod
    def _families() -> tuple:
        return (
            GaugeMetricFamily("ps_replica_role", "1 for this replica's role now (PRIMARY, BACKUP, JOINING, STALE)",
                              labels=["shard", "replica", "role"]),
            GaugeMetricFamily("ps_replica_epoch", "The epoch this replica knows", labels=["shard", "replica"]),
            CounterMetricFamily("ps_failovers", "Times this replica became its shard's primary by an election",
                                labels=["shard", "replica"]),
            GaugeMetricFamily("ps_replication_lag_ops", "A primary's operations not yet confirmed by each backup",
                              labels=["shard", "replica", "follower"]),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self.status()
        role, epoch, failovers, lag = self._families()
        replica = str(status.replica)
        role.add_metric([self.label, replica, status.role], 1)
        epoch.add_metric([self.label, replica], status.epoch)
        failovers.add_metric([self.label, replica], status.failovers)
        for follower in status.followers:
            lag.add_metric([self.label, replica, follower.replica], max(0, status.seq - follower.confirmed))
        yield from (role, epoch, failovers, lag)


# ---------------------------------------------------------------------- the process's memory, by shard

#: Where Linux tells a process its memory (VmRSS: resident now; VmHWM: the peak resident).
PROC_STATUS = "/proc/self/status"


def process_memory(status_path: str = PROC_STATUS) -> tuple[int | None, int | None]:
    """(resident, peak resident) bytes of this process; None for a figure this platform does not give.

    Linux: VmRSS and VmHWM of `status_path`. Elsewhere (no such file): no resident figure,
    and the peak from getrusage (ru_maxrss: bytes on macOS, KiB on the other Unixes); on a
    platform without the resource module, neither.
    """
    try:
        with open(status_path, "rb") as f:
            fields = dict(line.split(b":", 1) for line in f if b":" in line)
    except OSError:
        fields = {}
    rss, peak = _kib_field(fields.get(b"VmRSS")), _kib_field(fields.get(b"VmHWM"))
    if rss is not None or peak is not None:
        return rss, peak if peak is not None else rss
    try:
        import resource
    except ImportError:   # Windows
        return None, None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return None, int(maxrss if sys.platform == "darwin" else maxrss * 1024) or None


def _kib_field(raw: bytes | None) -> int | None:
    """Bytes of a /proc/self/status field such as b"   123456 kB"; None when absent or malformed."""
    parts = raw.split() if raw else []
    if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
        return None
    return int(parts[0]) * 1024


class _MemoryCollector(Collector):
    """The process's resident and peak resident memory, with the shard's label, read at each scrape."""

    def __init__(self, label: str) -> None:
        self.label = label

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("ps_process_resident_memory_bytes", "Resident memory of the shard's process "
                              "(Linux VmRSS)", labels=["shard"]),
            GaugeMetricFamily("ps_process_peak_resident_memory_bytes", "Peak resident memory of the shard's "
                              "process since it started (Linux VmHWM; elsewhere getrusage's ru_maxrss)",
                              labels=["shard"]),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        resident, peak = self._families()
        rss, hwm = process_memory()
        if rss is not None:
            resident.add_metric([self.label], rss)
            yield resident
        if hwm is not None:
            peak.add_metric([self.label], hwm)
            yield peak


# ---------------------------------------------------------------------- rpc latency

class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Times every ps.v1 rpc (a streamed response until its last message) and records its status code."""

    def __init__(self, observe: Callable[[str, str, float], None]) -> None:
        self._observe = observe

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(RPC_PREFIX):
            return handler
        rpc = method[len(RPC_PREFIX):]
        io = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._timed(rpc, handler.unary_unary), **io)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._timed(rpc, handler.stream_unary), **io)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._timed_stream(rpc, handler.unary_stream), **io)
        return grpc.stream_stream_rpc_method_handler(self._timed_stream(rpc, handler.stream_stream), **io)

    def _timed(self, rpc: str, behavior: Callable) -> Callable:
        def timed(request, context):
            start = time.perf_counter()
            code = None
            try:
                return behavior(request, context)
            except BaseException:
                code = _code(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                self._observe(rpc, code or _code(context, grpc.StatusCode.OK), time.perf_counter() - start)

        return timed

    def _timed_stream(self, rpc: str, behavior: Callable) -> Callable:
        def timed(request, context):
            start = time.perf_counter()
            code = None
            try:
                yield from behavior(request, context)
            except GeneratorExit:   # the client went away mid-stream
                code = grpc.StatusCode.CANCELLED.name
                raise
            except BaseException:
                code = _code(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                self._observe(rpc, code or _code(context, grpc.StatusCode.OK), time.perf_counter() - start)

        return timed


def _code(context, default: grpc.StatusCode) -> str:
    """The status code the handler set (abort or set_code), else default, as its name."""
    try:
        code = context.code()
    except Exception:   # a context without code() (older grpc, test doubles)
        code = None
    return (code if isinstance(code, grpc.StatusCode) else default).name
