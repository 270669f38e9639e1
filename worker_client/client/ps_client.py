"""The parameter-server client: push and pull dicts of named numpy arrays; shards stay hidden.

It routes every part of every tensor to the shard that owns it (the shard map), talks to
all shards concurrently, reassembles tensors split over shards, and retries a call only
when it fails with UNAVAILABLE (or OVERLOADED), with bounded exponential backoff
(client/retry.py). Pushes carry the worker's clock, so a retried push is acknowledged by
the shard, never applied twice. PushPull's bytes go through shared memory with shards on
this host, through the data channel (a TCP connection of their own, ps_common/data_channel.py)
with shards on other hosts, and over gRPC where neither can be had; the PushPull frame is
ps_common/frames.py's.

Blocking and threads: every method blocks until all shards answered, or raises. A
client is used by one thread at a time (its heartbeat thread is internal).
"""

from __future__ import annotations

import itertools
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from ps_common import codec, frames, shared_memory
from ps_common import data_channel as dc
from ps_common.access import WORKER_ID_KEY
from ps_common.data_channel import DataChannelUnavailableError, Link, ProtocolError
from ps_common.errors import (InvalidTensorError, NotInitializedError, OverloadedError, ServerError,
                              SharedMemoryUnavailableError, StoppedError, UnknownWorkerError, WaitTimeoutError,
                              error_for_reason)
from ps_common.modes import DropReason, Mode, step_to_wait_for
from ps_common.shard_map import ParamSpec, PartKey, ShardMap, build_shard_map
from ps_common.shared_memory import Layout, Segment
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from worker_client.client import rows as sparse
from worker_client.client.buffers import ReceiveBuffers
from worker_client.client.retry import RetryPolicy, call_with_retries, probe, reason_of

log = logging.getLogger(__name__)
T = TypeVar("T")


class _MovedOn(grpc.RpcError):
    """A call to a replicated shard that ran past its deadline: the client moved to the next replica, and the
    retry loop takes it as UNAVAILABLE (retried there)."""

    def __init__(self, cause: grpc.RpcError) -> None:
        super().__init__(cause.details())
        self.cause = cause

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"no answer within the deadline ({self.cause.details()})"

    def trailing_metadata(self) -> tuple:
        return ()

#: gRPC's reconnect backoff of a channel whose shard went away: first and largest, in milliseconds.
RECONNECT_BACKOFF_MS = (200, 2000)
#: A replicated shard (docs/replication.md, "Clients"): HTTP/2 keepalive pings every this many ms while a call is in
#: flight, and as long to answer one, so a frozen primary's calls fail within about two of them.
KEEPALIVE_MS = 500
#: ... the longest pause between tries on its replicas, and the least time they are tried for (a failover takes
#: LEASE plus a vote: about 2 s).
FAILOVER_BACKOFF = 0.2
#: ... the longest a call to a replicated shard may take beyond its wait, plus its shard's bytes (twice: there and
#: back) at this rate (PSClient._deadline).
REPLICA_RPC_SECONDS = 1.0
REPLICA_MIN_BYTES_PER_SECOND = 50e6
#: ... how long a replica that failed a call is skipped while another is left (about two leases: its backup's
#: election ends within it)
SUSPECT_SECONDS = 3.0
#: ... the longest wait one call to a replicated shard asks for (longer waits go in slices of it)
REPLICA_WAIT_SECONDS = 0.5
#: ... and how long wait_ready gives one replica to connect before it tries the next.
REPLICA_CONNECT_SECONDS = 1.0
FAILOVER_WINDOW = 15.0
#: The most bytes of one shard's parts that PushPull sends inside its gRPC messages; a shard
#: holding more takes Push and Pull (streamed), unless shared memory carries the bytes.
#: Measured on the 784-256-10 MLP (0.8 MB): PushPull over gRPC took 5.8 ms against 4.7 ms
#: for Push + Pull, gRPC Python being slow with large single messages; on a 45 KB model it
#: took 1.2 ms against 2.4 ms.
GRPC_PUSH_PULL_MAX_BYTES = 256 << 10
#: On one host a shard holding fewer parameter bytes than this moves them through the data channel (PSClient's
#: `shared_memory_min_bytes`); every other shard on this host moves them through a shared-memory segment, the
#: call's header over the data channel (or over gRPC where the channel cannot be had). 0: none. Before the header
#: went over the channel, the segment's gRPC call cost more than the channel's socket round trip below about 2 MB
#: a shard, and 2 MiB was the default; with the header over the channel the segment is as fast for a small shard
#: and faster from a few hundred KB up (loopback, 2 cores, one worker, ms a PushPull, channel / segment: 4 KB
#: 1.13 / 1.17, 1 MB 2.87 / 1.79; 16 MB, segment with the rpc / with the channel, 19.7 / 16.0).
SHARED_MEMORY_MIN_BYTES = 0
#: Bytes of a data-channel frame's header kept for its fields other than row gradients (names, ids, the pull).
FRAME_HEADER_ROOM = 1 << 20
#: A Push's row gradients above this many wire bytes go on past its header, in messages of at most ROW_PIECE_BYTES
#: (the header's message also carries up to a chunk of dense gradients, within one gRPC message).
ROWS_IN_HEADER_BYTES = 2 << 20
ROW_PIECE_BYTES = codec.CHUNK_BYTES
#: Where PushPull's bytes go when the data channel cannot be had (its warning says which).
THEN_GRPC = "go over gRPC"
THEN_SHARED_MEMORY = "go through shared memory where the shard shares this host, else over gRPC"
#: A shard that gave no shared-memory segment is asked again after this long (seconds): it may have
#: been restarting; one on another host costs one OpenSharedMemory this often.
SEGMENT_RETRY_SECONDS = 30.0
#: A shard whose data channel could not be opened is asked again after this long (seconds); one that broke is
#: reopened at the next call.
DATA_CHANNEL_RETRY_SECONDS = 30.0
#: The longest single wait of `pull_after`; between two it checks `stop` and `lost_progress` (seconds).
RECHECK_SECONDS = 2.0
#: Longest single wait of a blocking call: between two, the client checks `stop` (seconds).
STOP_POLL_SECONDS = 0.25
#: While waiting for a shard to accept connections, say why at least this often (seconds).
CONNECT_REPORT_SECONDS = 10.0
#: The first such report comes this soon, so a wrong address is named within seconds (seconds).
CONNECT_FIRST_REPORT_SECONDS = 3.0
#: A barrier is awaited in calls of at most this long, so a stop ends it quickly (seconds).
BARRIER_SLICE_SECONDS = 1.0


@dataclass
class PushReport:
    """What every shard said about one push, and the steps it was read at."""

    responses: list[pb.PushResponse]
    clock: int
    read_steps: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        """True when every shard accepted the push."""
        return all(r.outcome == pb.PUSH_ACCEPTED for r in self.responses)

    @property
    def dropped(self) -> list[tuple[int, pb.PushResponse]]:
        """(shard, response) of every shard that dropped it."""
        return [(i, r) for i, r in enumerate(self.responses) if r.outcome == pb.PUSH_DROPPED]

    @property
    def stale(self) -> bool:
        """Whether a shard dropped it as stale."""
        return any(r.drop_reason == DropReason.STALE for _, r in self.dropped)

    @property
    def steps(self) -> list[int]:
        return [r.step for r in self.responses]

    @property
    def wait_steps(self) -> list[int]:
        """Per shard, the step a sync worker's next pull waits for (ps_common.modes.step_to_wait_for)."""
        return [step_to_wait_for(r.outcome == pb.PUSH_ACCEPTED, r.drop_reason, read, r.step)
                for read, r in zip(self.read_steps, self.responses)]

    @property
    def drop_reasons(self) -> list[str]:
        """The reason of each drop, by name (STALE, ALREADY_CONTRIBUTED, STEP_AHEAD), in shard order."""
        return [DropReason(r.drop_reason).name for _, r in self.dropped]

    def drops(self) -> str:
        """The drops for a log line: "shard 1: STALE: why; ..."."""
        return "; ".join(f"shard {i}: {DropReason(r.drop_reason).name}: {r.message}" for i, r in self.dropped)


@dataclass(frozen=True)
class ShardStatus:
    """A shard's job and state as a worker reads them (PSClient.shard_status)."""

    num_shards: int
    mode: Mode
    step: int
    initialized: bool
    workers: frozenset[str]        # every worker the shard knows
    live_workers: frozenset[str]   # ... of those, the ones holding a lease


@dataclass
class ShardState:
    """One shard's trained state, or what changed of it after a step (PSClient.read_state).

    `parts`: whole dense parts {(name, row_start): values}; `rows`: {table: (ids, rows)} for
    tables trained by rows (global row ids, or a dynamic table's keys); `live_rows`: each
    dynamic table's live rows on the shard; `state_id` changes when the shard's state is
    replaced (restart, restore, reset): changes read under another id do not apply.
    """

    shard: int
    step: int
    state_id: str
    parts: dict[PartKey, np.ndarray] = field(default_factory=dict)
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    live_rows: dict[str, int] = field(default_factory=dict)


@dataclass
class _Membership:
    lease_seconds: float = 10.0
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)


#: Data-channel frames of at least this many gradient bytes are sent one shard after another (_SendOrder).
ORDERED_FRAME_BYTES = 1 << 20

#: A PushPull's data-channel frames and answers under this many bytes each go from the calling thread, every frame
#: sent before the first answer is read (PSClient._frames_in_turn).
IN_TURN_FRAME_BYTES = 1 << 20


@dataclass
class _SentFrame:
    """A PushPull frame sent on a shard's data channel (`PSClient._link_send`), its answer not read yet: the
    segment that holds its bytes (None: they travel in the frames), and where the answer's values go (one array
    per value slot; `received`: those of them that are arrays of their own, by part)."""

    segment: tuple[Segment, Layout] | None
    targets: list[np.ndarray] = field(default_factory=list)
    received: dict[PartKey, np.ndarray] = field(default_factory=dict)


class _SendOrder:
    """The data-channel frames of one PushPull to several shards, sent one shard after another.

    Sent at once, the shards' frames share the link and all arrive at the end of the upload, so every
    shard answers then and the answers' bytes follow the upload. One after another, shard 0's frame
    is whole after 1/S of the upload: it answers (sync: once every worker's frame for it is in) while
    the next frames go up, and the link carries both directions at once. Through a 10 Gbit/s veth pair
    between network namespaces, one worker's PushPull to 2 shards took 28.6 -> 24.9 ms at 16 MB and 178
    -> 142 ms at 100 MB. Only frames to shards on another host (Link.remote) of at least
    ORDERED_FRAME_BYTES are ordered: on one host the sends are bound by the CPUs, not a link, and went
    slower one after another (100 MB over loopback 47 -> 58 ms), and a small frame is in the socket's
    buffer at once (1 MB to 2 shards, every frame ordered: 0.9-1.2 -> 1.6-1.7 ms). Shard i's frame waits
    for shard i - 1's to be sent (or to have failed, or to go by shared memory, gRPC or unordered), at
    most `timeout` s, then goes anyway."""

    def __init__(self, shards: int, *, timeout: float) -> None:
        self._sent = [threading.Event() for _ in range(shards)]
        self._timeout = timeout

    def turn(self, shard: int) -> "_Turn":
        return _Turn(self._sent[shard - 1] if shard else None, self._sent[shard], self._timeout)


@dataclass(frozen=True)
class _Turn:
    """One shard's place in a _SendOrder (ps_common.data_channel.SendTurn)."""

    before: threading.Event | None
    own: threading.Event
    timeout: float

    def wait(self) -> None:
        if self.before is not None:
            self.before.wait(self.timeout)   # a bounded wait: past it the frame goes anyway

    def done(self) -> None:
        self.own.set()


class PSClient:
    """A client of all the shards of one job."""

    def __init__(self, addresses: Sequence[str], *, worker_id: str | None = None, rpc_timeout: float = 120.0,
                 wait_timeout: float = 300.0, retry: RetryPolicy = RetryPolicy(), chunk_bytes: int = codec.CHUNK_BYTES,
                 channel_credentials: grpc.ChannelCredentials | None = None,
                 call_metadata: Sequence[tuple[str, str]] = (),
                 stop: threading.Event | None = None, shared_memory: bool = True,
                 wire_dtype: str = "float32", channel_options: Sequence[tuple[str, object]] = (),
                 data_channel: bool = True, data_channel_tls: ssl.SSLContext | None = None,
                 shared_memory_min_bytes: int = SHARED_MEMORY_MIN_BYTES) -> None:
        """`stop`, once set (e.g. by a SIGTERM handler), ends every wait of this client within about
        STOP_POLL_SECONDS with StoppedError: connecting, retry backoffs and barriers. With
        `shared_memory`, push_pull moves its bytes through a shared-memory segment with each
        shard that shares this host (ps_common/shared_memory.py); with `data_channel`, through a data
        channel (a TCP connection of their own: ps_common/data_channel.py) with each shard that gave no
        segment (another host; or this one with shared_memory off, which is how a benchmark measures the
        wire on one host); over gRPC otherwise. A shard whose channel is TLS needs `data_channel_tls`
        (ps_common.data_channel.client_tls_context, from the files of the gRPC credentials); without it
        the bytes go over gRPC. `channel_options` are added to every channel's (e.g.
        ``("grpc.ssl_target_name_override", NAME)``, also the name a TLS data channel checks).
        On this host, with both on, a shard's bytes go through its segment and the call's header over the
        data channel; a shard holding fewer parameter bytes than `shared_memory_min_bytes` (default 0: none)
        takes the channel's bytes instead (SHARED_MEMORY_MIN_BYTES)."""
        if not addresses:
            raise ValueError("PSClient needs at least one shard address")
        if shared_memory_min_bytes < 0:
            raise ValueError(f"shared_memory_min_bytes must be 0 or more, got {shared_memory_min_bytes}")
        if wire_dtype not in codec.WIRE_DTYPES:
            raise ValueError(f"Invalid wire_dtype: {wire_dtype!r} (choose one of {', '.join(codec.WIRE_DTYPES)})")
        #: float32 gradients and parameters cross gRPC in this dtype (the shards keep float32).
        self.wire_dtype = codec.WIRE_DTYPES[wire_dtype]
        self._wire_value = codec.dtype_to_wire(self.wire_dtype)
        self.stop = stop or threading.Event()
        # A replicated shard is given as its replicas' addresses joined by "|" (docs/replication.md, "Clients"):
        # calls go to one of them, and move to the next when it is unavailable or not the primary.
        self.replicas: list[list[str]] = [[a.strip() for a in str(entry).split("|") if a.strip()]
                                          for entry in addresses]
        if not all(self.replicas):
            raise ValueError(f"PSClient: an empty shard address in {list(addresses)!r}")
        self.addresses = [r[0] for r in self.replicas]   # the replica each shard's calls go to now
        self._switch_lock = threading.Lock()
        self._retired_channels: list[grpc.Channel] = []   # channels to replicas left behind, closed by close()
        self._suspect_until: dict[str, float] = {}            # replica address -> skipped until (monotonic)
        self._replicated = any(len(r) > 1 for r in self.replicas)
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.rpc_timeout = rpc_timeout
        self.wait_timeout = wait_timeout
        self.retry = retry
        self.chunk_bytes = chunk_bytes
        # the worker's id rides with every call, so a shard gives its calls slots of their own (admission)
        self.metadata = (*call_metadata, (WORKER_ID_KEY, self.worker_id.encode("utf-8", "surrogatepass")))
        self._options = [("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
                         ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
                         ("grpc.enable_retries", 0),   # retries are ours (below): streams outgrow gRPC's retry buffer
                         # a restarted shard is found again within a second or two (gRPC's default backoff grows
                         # to 120 s)
                         ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                         ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]), *channel_options]
        self._credentials = channel_credentials
        n = len(self.replicas)
        self._channels: list[grpc.Channel] = [None] * n   # type: ignore[list-item]
        self._stubs: list[pb_grpc.ParameterServerStub] = [None] * n   # type: ignore[list-item]
        self._raw_pulls: list = [None] * n
        self._raw_pushes: list = [None] * n
        self._raw_push_pulls: list = [None] * n
        self._raw_inits: list = [None] * n
        for shard in range(n):
            self._connect(shard)
        self.shared_memory = shared_memory
        self._buffers = ReceiveBuffers()   # the arrays pulls receive into, reused once the caller drops them
        self._narrowed = dc.CastArrays()   # a half-size wire's gradients narrowed, per shard and slot
        self.shared_memory_min_bytes = shared_memory_min_bytes
        self._segments: dict[int, tuple[Segment, Layout]] = {}   # shard -> its open segment
        self._no_segment_until: dict[int, float] = {}             # shard -> when to ask it for one again
        self.data_channel = data_channel
        self.data_channel_tls = data_channel_tls
        self._channel_options = list(channel_options)
        self._links: dict[int, Link] = {}                         # shard -> its open data channel
        self._no_link_until: dict[int, float] = {}                # shard -> when to ask it for one again
        self._link_failures_logged: set[int] = set()              # shards whose channel failure was logged
        self._rows_continue: dict[int, bool] = {}                 # shard -> takes row gradients past a header
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.addresses)), thread_name_prefix="ps-client")
        self.shard_map: ShardMap | None = None
        self.steps: list[int] = [0] * len(self.addresses)   # step of each shard at the last pull
        self.clock = 0                                         # this worker's next push clock
        # Tensor bytes moved (values and gradients at their dtypes, row ids at 8 bytes), for per-step reports
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self._membership = _Membership()

    # ------------------------------------------------------------------ plumbing

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def _connect(self, shard: int) -> None:
        """The gRPC channel, stub and raw callables of `shard`, to the replica self.addresses[shard]."""
        address = self.addresses[shard]
        options = list(self._options)
        if len(self.replicas[shard]) > 1:
            # A frozen or cut-off primary never answers: HTTP/2 pings while a call is in flight find that out
            # within KEEPALIVE_MS + its timeout, and the call fails UNAVAILABLE and moves on to another replica
            # (the replicas permit the pings: ps_server/server.py).
            options += [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
                        ("grpc.http2.max_pings_without_data", 0)]
        channel = (grpc.insecure_channel(address, options=options) if self._credentials is None
                   else grpc.secure_channel(address, self._credentials, options=options))
        self._channels[shard] = channel
        self._stubs[shard] = pb_grpc.ParameterServerStub(channel)
        # Pull without protobuf's parser: the raw messages are walked by codec.decode_pull_response,
        # which leaves tensor bytes where they arrived instead of copying them out.
        self._raw_pulls[shard] = channel.unary_stream("/ps.v1.ParameterServer/Pull",
                                                      request_serializer=pb.PullRequest.SerializeToString,
                                                      response_deserializer=None)
        # Push and init send requests serialized by codec.encode_message: tensor bytes are
        # copied once, from the array into the request, instead of three times via protobuf.
        self._raw_pushes[shard] = channel.stream_unary("/ps.v1.ParameterServer/Push", request_serializer=None,
                                                       response_deserializer=pb.PushResponse.FromString)
        self._raw_push_pulls[shard] = channel.unary_unary("/ps.v1.ParameterServer/PushPull", request_serializer=None,
                                                          response_deserializer=None)
        self._raw_inits[shard] = channel.stream_unary("/ps.v1.ParameterServer/InitParameters",
                                                      request_serializer=None,
                                                      response_deserializer=pb.InitResponse.FromString)

    def _deadline(self, shard: int) -> float:
        """Seconds a call to `shard` may take beyond any wait it asks for: rpc_timeout; for a replicated shard at
        most REPLICA_RPC_SECONDS plus the time its bytes take at REPLICA_MIN_BYTES_PER_SECOND, so a primary that
        froze or was cut off is given up on soon and the call moves to the next replica. (gRPC's keepalive
        cannot do it: its client pings are at least 10 s apart.)"""
        if len(self.replicas[shard]) == 1:
            return self.rpc_timeout
        held = sum(p.nbytes for p in self.shard_map.parts if p.shard == shard) if self.shard_map is not None else 0
        return min(self.rpc_timeout, REPLICA_RPC_SECONDS + 2 * held / REPLICA_MIN_BYTES_PER_SECOND)

    def _next_replica(self, shard: int, failed: str, why: str, *, suspect: bool = True) -> None:
        """Moves `shard`'s calls from replica `failed` to the next of its replicas (unless another thread already
        moved them): a new channel, and the shared memory segment and data channel of the old one dropped.
        A replica that failed (`suspect`: down, frozen, cut off; not one that merely is not the primary) is
        skipped for SUSPECT_SECONDS while another is left, so a backup that is being elected is asked again,
        not a frozen primary that costs a whole deadline per try."""
        now = time.monotonic()
        with self._switch_lock:
            if self.addresses[shard] != failed:
                return
            if suspect:
                self._suspect_until[failed] = now + SUSPECT_SECONDS
            replicas = self.replicas[shard]
            start = replicas.index(failed)
            order = [replicas[(start + k) % len(replicas)] for k in range(1, len(replicas) + 1)]
            chosen = next((a for a in order if self._suspect_until.get(a, 0.0) <= now), order[0])
            if chosen == failed:
                return   # the others are suspect: this one is asked again
            self.addresses[shard] = chosen
            # the old channel stays open: calls still in flight on it (another thread's) end by themselves
            self._retired_channels.append(self._channels[shard])
            self._connect(shard)
        log.info("shard %d: replica %s %s; trying %s", shard, failed, why, self.addresses[shard])
        self._drop_segment(shard)
        self._drop_link(shard)
        self._no_segment_until.pop(shard, None)
        self._no_link_until.pop(shard, None)
        self._rows_continue.pop(shard, None)

    def _call(self, shard: int, what: str, fn: Callable[[pb_grpc.ParameterServerStub], T]) -> T:
        """Runs fn(stub) for one shard, retrying UNAVAILABLE and OVERLOADED with bounded backoff (self.retry); a
        replicated shard's UNAVAILABLE (its replica is down, or not the primary) moves the call to its next
        replica, retried every FAILOVER_BACKOFF s at most, for at least FAILOVER_WINDOW s."""
        if len(self.replicas[shard]) == 1:
            return call_with_retries(lambda: fn(self._stubs[shard]),
                                     what=f"{what} on shard {shard} ({self.addresses[shard]})",
                                     address=self.addresses[shard], policy=self.retry, stop=self.stop)

        def attempt() -> T:
            address = self.addresses[shard]
            try:
                return fn(self._stubs[shard])
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    reason = reason_of(exc)
                    self._next_replica(shard, address, "is not the primary" if reason == "NOT_PRIMARY"
                                       else f"is unavailable ({exc.details()})", suspect=reason != "NOT_PRIMARY")
                elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not reason_of(exc):
                    # gRPC's own deadline (a shard's wait that ran out names its reason): the replica froze or
                    # is cut off. Retried on the next one; a push it took is answered there as a duplicate.
                    self._next_replica(shard, address, f"did not answer within {self._deadline(shard):.1f} s")
                    raise _MovedOn(exc) from exc
                raise

        policy = RetryPolicy(attempts=max(self.retry.attempts, 2), initial_backoff=FAILOVER_BACKOFF / 4,
                             max_backoff=FAILOVER_BACKOFF, window=max(self.retry.window, FAILOVER_WINDOW))
        return call_with_retries(attempt, what=f"{what} on shard {shard} ({'|'.join(self.replicas[shard])})",
                                 address="|".join(self.replicas[shard]), policy=policy, stop=self.stop,
                                 level=logging.INFO)

    def _on_all(self, what: str, fn: Callable[[int, pb_grpc.ParameterServerStub], T]) -> list[T]:
        """fn(shard, stub) on every shard concurrently, each with retries; results in shard order."""
        return self._fan_out(lambda i: self._call(i, what, lambda stub: fn(i, stub)), range(self.num_shards))

    def _fan_out(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """fn over `items` at once, results in their order: the first in the calling thread, the others on the pool.

        Handing every item to the pool cost the caller a wake-up of a pool thread more per call, and a
        wait for it: with two shards, the training step's PushPull is one exchange here and one there."""
        items = list(items)
        if len(items) <= 1:
            return [fn(item) for item in items]
        futures = [self._pool.submit(fn, item) for item in items[1:]]
        try:
            first = fn(items[0])
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [first, *(future.result() for future in futures)]

    @staticmethod
    def _in_turn(fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """fn over `items` one after another in this thread, results in their order; every item's call is made
        even when one before it raised (each reads an answer already asked for), then the first error is raised."""
        results, error = [], None
        for item in items:
            try:
                results.append(fn(item))
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return results

    @staticmethod
    def _frames_in_turn(routes: Mapping[int, tuple[tuple[Segment, Layout] | None, Link | None]]) -> bool:
        """Whether one PushPull's frames go from this thread, all sent before the first answer is read: every
        shard by its data channel (its bytes in the frames or in a segment) and each shard's gradients and values
        under IN_TURN_FRAME_BYTES. Larger ones go from a thread each, so their copies run on several cores."""
        return len(routes) > 1 and all(
            link is not None and max(dc.gradient_bytes(link.layout), dc.values_bytes(link.layout)) < IN_TURN_FRAME_BYTES
            for _, link in routes.values())

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Blocks until every shard's channel connects, at most timeout s (then TimeoutError naming the shard).

        Every CONNECT_REPORT_SECONDS it logs which shard it waits for and why ("waiting for
        shard 0 at HOST:PORT: connection refused, 10 s of 300 s"); `stop` ends it with
        StoppedError.
        """
        started = time.monotonic()
        deadline = started + timeout
        next_report = started + CONNECT_FIRST_REPORT_SECONDS
        for i in range(self.num_shards):
            ready, tried = grpc.channel_ready_future(self._channels[i]), time.monotonic()
            while True:
                try:
                    ready.result(timeout=max(0.0, min(STOP_POLL_SECONDS, deadline - time.monotonic())))
                    break
                except grpc.FutureTimeoutError:
                    pass
                now = time.monotonic()
                if len(self.replicas[i]) > 1 and now - tried > REPLICA_CONNECT_SECONDS:   # another replica, then
                    ready.cancel()
                    self._next_replica(i, self.addresses[i], "does not connect")
                    ready, tried = grpc.channel_ready_future(self._channels[i]), now
                if self.stop.is_set():
                    ready.cancel()
                    raise StoppedError(f"stopped while waiting for shard {i} at {self.addresses[i]} "
                                       f"({now - started:.0f} s of {timeout:.0f} s)")
                if now >= deadline:
                    ready.cancel()
                    raise TimeoutError(f"shard {i} at {self.addresses[i]} not reachable after {timeout:.1f} s: "
                                       f"{probe(self.addresses[i])}; check the address and that the shard runs")
                if now >= next_report:
                    log.warning("waiting for shard %d at %s: %s, %.0f s of %.0f s", i, self.addresses[i],
                                probe(self.addresses[i]), now - started, timeout)
                    next_report = now + CONNECT_REPORT_SECONDS

    # ------------------------------------------------------------------ job setup

    def cluster_info(self, shard: int = 0) -> pb.ClusterInfo:
        """The shard's configuration, step, shard map and workers (does not block)."""
        return self._call(shard, "GetClusterInfo",
                          lambda s: s.GetClusterInfo(pb.ClusterInfoRequest(), timeout=self._deadline(shard), metadata=self.metadata))

    def _check_shards(self, info: pb.ClusterInfo) -> None:
        if info.num_shards != self.num_shards:
            raise ValueError(f"shard at {self.addresses[0]} says the job has {info.num_shards} shards, "
                             f"but this client was given {self.num_shards} addresses")

    def fetch_shard_map(self) -> ShardMap:
        """The shard map as shard 0 serves it (after initialization)."""
        info = self.cluster_info(0)
        self._check_shards(info)
        if not info.initialized:
            raise ServerError.remote(NotInitializedError)(f"shard 0 ({self.addresses[0]}) is not initialized: no shard map yet",
                              grpc.StatusCode.FAILED_PRECONDITION, self.addresses[0])
        specs = [codec.spec_from_wire(s) for s in info.parameters]
        self.shard_map = build_shard_map(specs, self.num_shards, partition_min_bytes=info.partition_min_bytes)
        served = [(p.name, p.row_start, p.row_end, p.shard) for p in info.parts]
        ours = [(p.name, p.row_start, p.row_end, p.shard) for p in self.shard_map.parts]
        if served != ours:
            raise ValueError("the shard map served by shard 0 differs from the one computed here; "
                             "are client and server of different versions?")
        return self.shard_map

    def initialize(self, parameters: Mapping[str, np.ndarray], *, state: Collection[str] = (),
                   dynamic: Collection[ParamSpec] = ()) -> bool:
        """Sets the initial values on every shard (idempotent). True when they were already set.

        The tensors named in `state` are model state (running statistics): a push carries
        their new values, which the shards take as they are (ParameterSpec.state).
        `dynamic` declares dynamic tables (`sparse.dynamic_table(...)`: rows keyed by any
        int64 id, created on first use; no values): use them with pull_rows and push's
        row_gradients, ids routed to shards by their hash (docs/protocol.md, "Dynamic tables")."""
        info = self.cluster_info(0)
        self._check_shards(info)
        specs = [ParamSpec(n, codec.as_wire_array(np.asarray(a)).dtype.name, tuple(np.shape(a)), n in state)
                 for n, a in parameters.items()]
        for spec in dynamic:
            if spec.dynamic is None or spec.name in parameters:
                raise ValueError(f"dynamic table {spec.name!r}: declare it with sparse.dynamic_table(...), once, "
                                 "and not among the parameters with values")
            specs.append(spec)
        shard_map = build_shard_map(specs, self.num_shards, partition_min_bytes=info.partition_min_bytes)
        header = pb.InitHeader(parameters=[codec.param_spec_to_wire(s) for s in specs],
                               worker_id=self.worker_id)

        def send(shard: int, stub: pb_grpc.ParameterServerStub) -> pb.InitResponse:
            messages = codec.pack_encoded(self._part_chunks(shard_map, shard, parameters), header.SerializeToString(),
                                          chunk_bytes=self.chunk_bytes)
            return self._raw_inits[shard](messages, timeout=self._deadline(shard), metadata=self.metadata)

        responses = self._on_all("InitParameters", send)
        self.shard_map = shard_map
        self.steps = [r.step for r in responses]
        return all(r.already_initialized for r in responses)

    def _part_chunks(self, shard_map: ShardMap, shard: int, arrays: Mapping[str, np.ndarray], *,
                     narrow: bool = False) -> Iterator[dict]:
        """The chunk fields of a shard's parts of `arrays`; with `narrow` (gradients), float32 parts in the wire dtype."""
        for part in shard_map.parts_on(shard):
            if part.name not in arrays:
                continue
            array = np.asarray(arrays[part.name])
            piece = array if part.whole else array[part.row_start:part.row_end]
            if narrow and piece.dtype == np.float32 and self.wire_dtype != piece.dtype:
                piece = piece.astype(self.wire_dtype)   # the job's half-size wire (the shard widens it)
            yield from codec.chunk_fields(part.name, piece, row_start=part.row_start, chunk_bytes=self.chunk_bytes,
                                          copy=False)

    def _require_map(self) -> ShardMap:
        if self.shard_map is None:
            self.fetch_shard_map()
        assert self.shard_map is not None
        return self.shard_map

    # ------------------------------------------------------------------ membership

    def register(self, *, heartbeat: bool = True) -> int:
        """Registers this worker on every shard; returns (and adopts) the clock to resume from.

        With heartbeat, a daemon thread renews the lease every third of it, and registers
        again on a shard that forgot the worker (a restarted shard).
        """
        responses = self._on_all("RegisterWorker", lambda i, s: s.RegisterWorker(
            pb.RegisterWorkerRequest(worker_id=self.worker_id), timeout=self.rpc_timeout, metadata=self.metadata))
        self.clock = max(r.clock for r in responses)
        self.steps = [r.step for r in responses]
        self._membership.lease_seconds = min(r.lease_ms for r in responses) / 1000
        if heartbeat and self._membership.thread is None:
            self._membership.stop.clear()
            self._membership.thread = threading.Thread(target=self._heartbeat_loop, name="ps-heartbeat", daemon=True)
            self._membership.thread.start()
        return self.clock

    @property
    def heartbeating(self) -> bool:
        """Whether this client keeps a lease alive (registered with heartbeats, not deregistered since)."""
        return self._membership.thread is not None

    def _heartbeat_loop(self) -> None:
        stop = self._membership.stop
        while not stop.wait(max(0.05, self._membership.lease_seconds / 3)):
            for i, stub in enumerate(self._stubs):
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id), timeout=5, metadata=self.metadata)
                except grpc.RpcError as exc:
                    if reason_of(exc) == UnknownWorkerError.reason:
                        try:
                            stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=self.worker_id), timeout=5,
                                                metadata=self.metadata)
                            log.info("re-registered %s on shard %d", self.worker_id, i)
                        except grpc.RpcError as again:
                            log.warning("re-register on shard %d failed: %s", i, again.details())
                    else:
                        log.debug("heartbeat to shard %d failed: %s", i, exc.details())

    def deregister(self) -> None:
        """Leaves the job on every shard (best effort) and stops heartbeats."""
        self._membership.stop.set()
        if self._membership.thread is not None:
            self._membership.thread.join(timeout=5)
            self._membership.thread = None
        for stub in self._stubs:
            try:
                stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=self.worker_id), timeout=5, metadata=self.metadata)
            except grpc.RpcError as exc:
                log.debug("deregister failed: %s", exc.details())

    def barrier(self, name: str, participants: int, *, timeout: float | None = None) -> int:
        """Blocks until `participants` callers reached barrier `name` on shard 0 (at most timeout s).

        Waits in calls of at most BARRIER_SLICE_SECONDS (a call that times out withdraws this
        caller's arrival, the next one arrives again), so `stop` ends it within a slice
        (StoppedError). Running out of time raises WaitTimeoutError (a ServerError).
        """
        timeout = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.stop.is_set():
                raise StoppedError(f"stopped while waiting at barrier {name!r} for {participants} participants")
            left = deadline - time.monotonic()
            piece = max(0.001, min(BARRIER_SLICE_SECONDS, left))
            try:
                response = self._call(0, f"Barrier {name!r}", lambda s: s.Barrier(
                    pb.BarrierRequest(name=name, participant_id=self.worker_id, participants=participants,
                                      timeout_ms=max(1, int(piece * 1000))),
                    timeout=piece + self.rpc_timeout, metadata=self.metadata))
                return response.generation
            except WaitTimeoutError:
                if time.monotonic() >= deadline:
                    raise

    # ------------------------------------------------------------------ pull / push

    def pull(self, names: Sequence[str] | None = None, *, min_steps: Sequence[int] | int | None = None,
             ssp: bool = False, timeout: float | None = None) -> dict[str, np.ndarray]:
        """The current values of the named tensors (all when None), and records each shard's step.

        Blocks while a shard's step is below min_steps (one per shard, or one for all) or,
        with ssp, while this worker is more than the staleness bound ahead of the slowest
        live worker; at most `timeout` s (default wait_timeout), then ServerError with
        DEADLINE_EXCEEDED. Returned arrays may be read-only views of the received bytes.
        """
        wait = self.wait_timeout if timeout is None else timeout
        if self._replicated and wait > REPLICA_WAIT_SECONDS and (min_steps is not None or ssp):
            # a replicated shard's wait goes in slices (its call's deadline stays short: PSClient._deadline)
            deadline = time.monotonic() + wait
            while True:
                left = deadline - time.monotonic()
                try:
                    return self._pull_once(names, min_steps=min_steps, ssp=ssp,
                                           timeout=max(0.01, min(left, REPLICA_WAIT_SECONDS)))
                except WaitTimeoutError:
                    if left <= REPLICA_WAIT_SECONDS or self.stop.is_set():
                        raise
        return self._pull_once(names, min_steps=min_steps, ssp=ssp, timeout=wait)

    def _pull_once(self, names: Sequence[str] | None, *, min_steps: Sequence[int] | int | None, ssp: bool,
                   timeout: float) -> dict[str, np.ndarray]:
        shard_map = self._require_map()
        names = list(names) if names is not None else []
        unknown = [n for n in names if n not in shard_map.specs]
        if unknown:
            raise InvalidTensorError(f"unknown tensor(s) {unknown}; the model has {sorted(shard_map.specs)[:10]}...")
        mins = self._per_shard(min_steps)
        wait = self.wait_timeout if timeout is None else timeout
        wanted = set(names) or set(shard_map.specs)
        targets = [i for i in range(self.num_shards) if any(p.name in wanted for p in shard_map.parts_on(i))]

        out: dict[str, np.ndarray] = {}
        destination = self._destination(shard_map, out, threading.Lock(), self._buffers)

        def fetch(shard: int) -> tuple[int, dict[tuple[str, int], np.ndarray]]:
            own = sorted({p.name for p in shard_map.parts_on(shard) if p.name in wanted})
            request = pb.PullRequest(names=own if names else [], min_step=mins[shard], wait_timeout_ms=int(wait * 1000),
                                     worker_id=self.worker_id if ssp else "", clock=self.clock if ssp else 0,
                                     wire_dtype=self._wire_value)

            def call(stub: pb_grpc.ParameterServerStub):
                assembler = codec.PartAssembler(destination=destination)
                step = None
                for raw in self._raw_pulls[shard](request, timeout=wait + self._deadline(shard), metadata=self.metadata):
                    message_step, chunks = codec.decode_pull_response(raw)
                    if step is None:
                        step = message_step
                    for chunk in chunks:
                        assembler.add(chunk)
                return step or 0, assembler.finish()

            return self._call(shard, "Pull", call)

        results = self._fan_out(fetch, targets)
        for shard, (step, parts) in zip(targets, results):
            self.steps[shard] = step
            self._place(shard_map, out, parts)
        self.bytes_pulled += sum(p.nbytes for i in targets for p in shard_map.parts_on(i) if p.name in wanted)
        return out

    def read_state(self, shard: int, since: int = -1, *, whole: Sequence[str] = (), min_step: int = 0,
                   timeout: float | None = None) -> ShardState:
        """One shard's trained state at one step (since -1), or what changed of it after step `since`
        (ReadState; the reader role may call it). Waits for `min_step` as `pull` does."""
        shard_map = self._require_map()
        wait = self.wait_timeout if timeout is None else timeout
        request = pb.ReadStateRequest(since_step=since, whole=list(whole), min_step=min_step,
                                      wait_timeout_ms=int(wait * 1000))

        def call(stub: pb_grpc.ParameterServerStub) -> ShardState:
            def expected(name: str, row_start: int) -> tuple[np.dtype, tuple[int, ...]]:
                try:
                    part = shard_map.part(name, row_start)
                except KeyError as exc:
                    raise InvalidTensorError(f"shard {shard} sent {exc.args[0]}") from None
                return np.dtype(part.dtype), part.shape

            assembler = codec.PartAssembler(expected)
            read: ShardState | None = None
            rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
            for message in stub.ReadState(request, timeout=wait + self._deadline(shard), metadata=self.metadata):
                if read is None:
                    read = ShardState(shard, message.step, message.state_id,
                                      live_rows={t.name: t.rows for t in message.dynamic_tables})
                for chunk in message.chunks:
                    assembler.add(chunk)
                for table in message.rows:
                    spec = shard_map.specs.get(table.name)
                    if spec is None:
                        raise InvalidTensorError(f"shard {shard} sent rows of {table.name!r}, not a tensor of the "
                                                 "model")
                    ids = np.array(table.ids, np.int64)
                    rows.setdefault(table.name, []).append(
                        (ids, codec.rows_from_wire(table.name, table.dtype, table.data, len(ids), spec.row_shape,
                                                   want=np.dtype(spec.dtype))))
            if read is None:
                raise InvalidTensorError(f"shard {shard} answered ReadState with no message")
            read.parts = assembler.finish()
            read.rows = {name: (np.concatenate([i for i, _ in got]), np.concatenate([r for _, r in got]))
                         for name, got in rows.items()}
            return read

        return self._call(shard, "ReadState", call)

    def push(self, gradients: Mapping[str, np.ndarray], *, clock: int | None = None,
             read_steps: Sequence[int] | None = None,
             row_gradients: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> PushReport:
        """Sends gradients to every shard; each answers accepted or dropped, with its step.

        clock defaults to this client's clock (then advanced by one); read_steps default to
        the steps recorded by the last pull. A retry of the same clock is safe: the shard
        acknowledges it without applying it again.
        """
        shard_map = self._require_map()
        self._check_gradients(shard_map, gradients)
        rows_by_shard = sparse.row_gradients_by_shard(shard_map, row_gradients or {}, self.wire_dtype)
        fresh = clock is None or clock >= self.clock   # never sent before (not a caller's retry)
        clock = self.clock if clock is None else clock
        steps = list(self.steps if read_steps is None else read_steps)

        def send(shard: int, stub: pb_grpc.ParameterServerStub) -> pb.PushResponse:
            rows = rows_by_shard.get(shard, [])
            response = self._push_to(shard, stub, shard_map, gradients, clock, steps[shard], rows)
            if fresh and response.duplicate and response.clock > clock + 1:
                # The shard's record is ahead of a clock we never sent: it restarted and took
                # this worker back at a later clock. Resend at the shard's clock, or the
                # gradient would be acknowledged and silently not applied.
                log.info("shard %d is at clock %d for %s, ahead of %d: resending there", shard, response.clock,
                         self.worker_id, clock)
                response = self._push_to(shard, stub, shard_map, gradients, response.clock, steps[shard], rows)
            return response

        responses = self._on_all("Push", send)
        self.clock = max(self.clock, clock + 1, *(r.clock for r in responses))
        self.bytes_pushed += sum(np.asarray(g).nbytes for g in gradients.values()) + sum(
            sparse.payload_bytes(grads) for grads in rows_by_shard.values())
        return PushReport(responses, clock, steps)

    def _push_to(self, shard: int, stub: pb_grpc.ParameterServerStub, shard_map: ShardMap,
                 gradients: Mapping[str, np.ndarray], clock: int, read_step: int,
                 rows: Sequence[pb.RowGradient]) -> pb.PushResponse:
        """One streamed Push of the shard's parts of `gradients` and its row gradients `rows` to one shard.

        Row gradients of more than ROWS_IN_HEADER_BYTES go on in messages after the header's (PushRequest.
        row_gradients) when the shard takes that (ClusterInfo.row_gradients_continue); a shard that predates it
        gets them all in the header, as before."""
        continued: list[list[pb.RowGradient]] = []
        if codec.row_gradients_wire_bytes(rows) > ROWS_IN_HEADER_BYTES and self._continues_rows(shard):
            rows, continued = codec.split_row_gradients(rows, header_bytes=ROWS_IN_HEADER_BYTES,
                                                        piece_bytes=ROW_PIECE_BYTES)
        header = pb.PushHeader(worker_id=self.worker_id, clock=clock, read_step=read_step, row_gradients=rows)

        def call() -> pb.PushResponse:
            messages = itertools.chain(
                codec.pack_encoded(self._part_chunks(shard_map, shard, gradients, narrow=True),
                                   header.SerializeToString(), chunk_bytes=self.chunk_bytes),
                (pb.PushRequest(row_gradients=pieces).SerializeToString() for pieces in continued))
            return self._raw_pushes[shard](messages, timeout=self._deadline(shard), metadata=self.metadata)

        try:
            return call()
        except grpc.RpcError as exc:
            # A restarted shard may not know this worker (it registered after the shard's
            # last checkpoint): register again and send once more. The push was not taken.
            if reason_of(exc) != UnknownWorkerError.reason:
                raise
            log.info("shard %d forgot worker %s; registering again", shard, self.worker_id)
            stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=self.worker_id), timeout=self.rpc_timeout,
                                metadata=self.metadata)
            return call()

    def _continues_rows(self, shard: int) -> bool:
        """Whether the shard takes row gradients continued past a push's header (asked once per shard)."""
        known = self._rows_continue.get(shard)
        if known is None:
            known = self._rows_continue[shard] = self.cluster_info(shard).row_gradients_continue
        return known

    def pull_rows(self, rows: Mapping[str, np.ndarray], *, min_steps: Sequence[int] | int | None = None,
                  ssp: bool = False, timeout: float | None = None) -> dict[str, np.ndarray]:
        """The rows `ids` of each named table (global row ids, any order, repeats allowed), from the shards
        that own them, as {name: array of shape (len(ids), *row shape)}. For a dynamic table the ids are any
        int64 values, sent to the shard their hash names.

        One PullRows per shard, or several where its rows are more than one answer carries (4 MiB: the
        shard's bound); each of those may read at a later step than the one before, and the shard's step
        recorded is the earliest. Waits as `pull` does (min_steps, ssp, timeout).
        """
        shard_map = self._require_map()
        mins = self._per_shard(min_steps)
        wait = self.wait_timeout if timeout is None else timeout
        plan = sparse.route_rows(shard_map, rows)   # shard -> [(name, positions, ids)]
        reads = [(shard, asked) for shard in sorted(plan) for asked in sparse.split_asked(
            shard_map, plan[shard], answer_bytes=codec.CHUNK_BYTES, request_bytes=codec.CHUNK_BYTES)]

        def fetch(read: tuple[int, list[tuple[str, np.ndarray, np.ndarray]]]) -> pb.PullRowsResponse:
            shard, asked = read
            request = pb.PullRowsRequest(tables=[pb.RowIds(name=n, ids=ids) for n, _, ids in asked],
                                         min_step=mins[shard], wait_timeout_ms=int(wait * 1000),
                                         worker_id=self.worker_id if ssp else "", clock=self.clock if ssp else 0)
            return self._call(shard, "PullRows", lambda stub: stub.PullRows(
                request, timeout=wait + self._deadline(shard), metadata=self.metadata))

        answers = self._fan_out(fetch, reads)
        steps: dict[int, int] = {}
        for (shard, _), answer in zip(reads, answers):
            steps[shard] = min(steps.get(shard, answer.step), answer.step)
        for shard, step in steps.items():
            self.steps[shard] = step
        return self._received_rows(shard_map, rows, [(asked, answer.tables) for (_, asked), answer in zip(reads, answers)])

    def _received_rows(self, shard_map: ShardMap, rows: Mapping[str, np.ndarray],
                       answered: Iterable[tuple[Sequence[tuple[str, np.ndarray, np.ndarray]], Iterable[pb.RowValues]]],
                       ) -> dict[str, np.ndarray]:
        """The rows `rows` asked for, {name: (len(ids), *row shape)}, put together from the answers to the reads
        they were cut into ((what one read asked: route_rows' entries, its answer's tables)), and counted in
        bytes_pulled with their int64 ids."""
        out = {name: np.empty((len(ids), *shard_map.specs[name].row_shape), dtype=shard_map.specs[name].dtype)
               for name, ids in rows.items()}
        for asked, tables in answered:
            sparse.place_rows(out, asked, tables)
        self.bytes_pulled += sum(v.nbytes + 8 * len(v) for v in out.values())
        return out

    def push_pull(self, gradients: Mapping[str, np.ndarray], *, read_steps: Sequence[int] | None = None,
                  wait_for_step: bool = False, ssp: bool = False, wait: float = 1.0,
                  row_gradients: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                  names: Sequence[str] | None = None) -> tuple[PushReport, dict[str, np.ndarray] | None]:
        """Push, then pull what the next step needs, in one round trip per shard (the PushPull rpc).

        The pull after the push waits as the mode needs: `wait_for_step` (sync: the step
        the push belongs to) or `ssp` (the staleness bound at this worker's new clock), at
        most `wait` s. Returns the push's report and the values, or None for the values when
        a shard's wait ran out (pull again; the push is not undone) or the model is too large
        for PushPull over gRPC without shared memory or a data channel (then this is a plain push).
        Bytes travel through shared memory with shards on this host when `shared_memory` is on, and
        through the data channel with the others when `data_channel` is on.

        `names` pulls only those tensors; `row_gradients` (sparse tables, with `names`: the
        dense tensors, since the tables' rows are pulled by id) ride in the push's header.
        Such a step's dense bytes go through a data channel opened for `names` (rows in its
        frames' headers), else as gRPC bytes (shared memory carries every part of a shard); it is
        a plain push when a shard's bytes are too many for one gRPC message and no channel takes
        them, or when `names` is empty or missing beside row gradients (PushPull would read "no
        names" as every tensor).
        """
        if self._replicated:   # the read after the push waits in short slices (PSClient._deadline)
            wait = min(wait, REPLICA_WAIT_SECONDS)
        report, values, _ = self._push_pull(gradients, read_steps=read_steps, wait_for_step=wait_for_step, ssp=ssp,
                                            wait=wait, row_gradients=row_gradients, names=names)
        return report, values

    def push_pull_rows(self, gradients: Mapping[str, np.ndarray], row_gradients: Mapping[str, tuple[np.ndarray, np.ndarray]],
                       *, names: Sequence[str], rows: Mapping[str, np.ndarray], read_steps: Sequence[int] | None = None,
                       wait_for_step: bool = False, ssp: bool = False, wait: float = 1.0,
                       ) -> tuple[PushReport, dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
        """A sparse step's round trip: `push_pull` with row gradients and the dense tensors `names`, whose pull
        also reads the rows `rows` (table -> ids, as `pull_rows` takes them: the next batch's) at the same
        step. Returns (report, dense values, rows); both None when push_pull's values would be (pull them),
        rows alone None when a shard did not read them (pull_rows them)."""
        return self._push_pull(gradients, read_steps=read_steps, wait_for_step=wait_for_step, ssp=ssp, wait=wait,
                               row_gradients=row_gradients, names=names, rows=rows)

    def _push_pull(self, gradients: Mapping[str, np.ndarray], *, read_steps: Sequence[int] | None,
                   wait_for_step: bool, ssp: bool, wait: float,
                   row_gradients: Mapping[str, tuple[np.ndarray, np.ndarray]] | None, names: Sequence[str] | None,
                   rows: Mapping[str, np.ndarray] | None = None,
                   ) -> tuple[PushReport, dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
        shard_map = self._require_map()
        self._check_gradients(shard_map, gradients)
        clock = self.clock
        steps = list(self.steps if read_steps is None else read_steps)
        rows_by_shard = sparse.row_gradients_by_shard(shard_map, row_gradients or {}, self.wire_dtype)
        wanted_rows = sparse.route_rows(shard_map, rows) if rows else {}   # shard -> [(table, positions, ids)]
        partial_links: dict[int, Link | None] = {}   # a step of some tensors: each shard's channel for them
        paths: dict[int, tuple[tuple[Segment, Layout] | None, Link | None]] = {}   # a whole-shard step's
        if names is not None or row_gradients or rows:
            # a data channel opened for `names`, else gRPC bytes: a shard's segment holds every part of it, a
            # sparse table's included
            if not names:
                return self.push(gradients, read_steps=steps, row_gradients=row_gradients), None, None
            named = frozenset(names)
            for i in range(self.num_shards):
                grads, asked = rows_by_shard.get(i, ()), wanted_rows.get(i, ())
                partial_links[i] = self._link(i, gradients, names=named, shard_map=shard_map) \
                    if self._rows_fit_a_frame(shard_map, grads, asked) else None
                if partial_links[i] is None and not self._small(shard_map, i, names, grads, asked):
                    return self.push(gradients, read_steps=steps, row_gradients=row_gradients), None, None
        else:
            # each shard's path once a call: finding it checks the link's socket (a select), or opens one
            paths = {i: self._bytes_path(i, shard_map, gradients) for i in range(self.num_shards)}
            if not all(any(paths[i]) or self._small(shard_map, i) for i in range(self.num_shards)):
                return self.push(gradients, read_steps=steps), None, None
        wanted = None if names is None else set(names)
        out: dict[str, np.ndarray] = {}
        destination = self._destination(shard_map, out, threading.Lock(), self._buffers)

        routes = {i: paths[i] if wanted is None else (None, partial_links.get(i)) for i in range(self.num_shards)}
        ordered = {i for i, (_, link) in routes.items()
                   if link is not None and link.remote and dc.gradient_bytes(link.layout) >= ORDERED_FRAME_BYTES}
        # (no frame to order, no order: shared memory, gRPC, this host or small frames)
        order = _SendOrder(self.num_shards, timeout=wait + self.rpc_timeout) if ordered else None

        def one(shard: int, sent: _SentFrame | None = None) -> tuple[frames.PushPullReply, dict[PartKey, np.ndarray]]:
            turn = None if order is None else order.turn(shard)
            grads, asked = rows_by_shard.get(shard, []), wanted_rows.get(shard, [])
            try:
                segment, link = routes[shard]
                if turn is not None and shard not in ordered:   # the next shard need not wait for this one
                    turn.done()
                reply, values = self._exchange(shard, shard_map, gradients, clock, steps[shard], segment, link,
                                               wait_for_step, ssp, wait, grads, names, asked, destination,
                                               turn=turn if shard in ordered else None, sent=sent)
            finally:
                if turn is not None:
                    turn.done()
            if reply.push.duplicate and reply.push.clock > clock + 1:
                # The shard restarted and took this worker back at a later clock (see push).
                segment = self._segments.get(shard) if segment is not None else None
                link = self._links.get(shard) if link is not None else None
                reply, values = self._exchange(shard, shard_map, gradients, reply.push.clock, steps[shard], segment,
                                               link, wait_for_step, ssp, wait, grads, names, asked, destination)
            return reply, values

        if order is None and self._frames_in_turn(routes):
            # every frame first, then every answer, all from this thread: no hand-off to a pool thread and back
            sent: list[_SentFrame | None] = []
            try:
                for i in range(self.num_shards):
                    sent.append(self._link_send(i, routes[i][1], shard_map, gradients, clock, steps[i], wait_for_step,
                                                ssp, wait, destination, rows_by_shard.get(i, ()),
                                                wanted_rows.get(i, ()), segment=routes[i][0]))
            except BaseException:
                for i, frame in enumerate(sent):   # answers that will not be read: their channels reopen
                    if frame is not None:
                        self._drop_link(i)
                raise
            for i, frame in enumerate(sent):
                if frame is None:   # its frame could not be sent (_link_send): gRPC takes the call
                    routes[i] = (routes[i][0], None)
            results = self._in_turn(lambda i: one(i, sent[i]), range(self.num_shards))
        else:
            results = self._fan_out(one, range(self.num_shards))
        responses = [reply.push for reply, _ in results]
        self.clock = max(self.clock, clock + 1, *(r.clock for r in responses))
        report = PushReport(responses, clock, steps)
        self.bytes_pushed += sum(np.asarray(g).nbytes for g in gradients.values()) + sum(
            sparse.payload_bytes(grads) for grads in rows_by_shard.values())
        if not all(reply.ready for reply, _ in results):
            return report, None, None
        self.bytes_pulled += sum(p.nbytes for p in shard_map.parts if wanted is None or p.name in wanted)
        for shard, (reply, parts) in enumerate(results):
            self.steps[shard] = reply.step
            self._place(shard_map, out, parts)
        if not rows:
            return report, out, None
        return report, out, self._received_rows(shard_map, rows, [(asked, results[shard][0].rows)
                                                                  for shard, asked in wanted_rows.items()])

    def _exchange(self, shard: int, shard_map: ShardMap, gradients: Mapping[str, np.ndarray], clock: int,
                  read_step: int, segment: tuple[Segment, Layout] | None, link: Link | None, wait_for_step: bool,
                  ssp: bool, wait: float, rows: Sequence[pb.RowGradient], names: Sequence[str] | None,
                  asked: Sequence[tuple[str, np.ndarray, np.ndarray]], destination, turn: dc.SendTurn | None = None,
                  sent: _SentFrame | None = None) -> tuple[frames.PushPullReply, dict[PartKey, np.ndarray]]:
        """One PushPull to one shard by the path given (the data channel, its frame sent in `turn`, else shared
        memory or gRPC bytes; a channel that fails hands the call to gRPC): (its reply, the values not already
        written in place by `destination`; {} when not ready). `sent`: the channel's frame went already
        (`_link_send`); its answer is read."""
        if link is not None:
            answered = self._push_pull_link(shard, link, shard_map, gradients, clock, read_step, wait_for_step,
                                            ssp, wait, destination, rows, asked, turn, segment, sent)
            if answered is not None:
                return answered
        if segment is None and not self._small(shard_map, shard, names, rows, asked):
            # Too many bytes for one gRPC message (the channel that was to take them broke): a streamed Push, and
            # the values are left to the caller's pull, as when a wait runs out.
            response = self._call(shard, "Push", lambda stub: self._push_to(shard, stub, shard_map, gradients, clock,
                                                                             read_step, rows))
            return frames.PushPullReply(response, ready=False), {}
        reply, segment = self._push_pull_once(shard, shard_map, gradients, clock, read_step, segment, wait_for_step,
                                              ssp, wait, rows, names, asked)
        if not reply.ready:
            return reply, {}
        if segment is None:
            assembler = codec.PartAssembler(destination=destination)
            for chunk in reply.chunks:
                assembler.add(chunk)
            return reply, assembler.finish()
        return reply, self._values_from_segment(segment, destination)

    def _values_from_segment(self, segment: tuple[Segment, Layout], destination) -> dict[PartKey, np.ndarray]:
        """The values a ready answer left in the segment, copied into their destinations (split tensors' parts)
        or into arrays of their own (returned): the segment is rewritten by the next call."""
        memory, layout = segment
        values = {}
        for slot, view in zip(layout.values, memory.views(layout.values).values()):
            target = destination(slot.key[0], slot.key[1], slot.dtype, slot.shape)
            if target is None:
                target = values[slot.key] = self._buffers.empty(slot.key, slot.shape, slot.dtype)
            np.copyto(target, view)
        return values

    @staticmethod
    def _gradient_pieces(layout: Layout, shard_map: ShardMap, gradients: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Each gradient slot's piece of its tensor's gradient (a split tensor's rows of the part), in slot order."""
        pieces = []
        for slot in layout.gradients:
            array = np.asarray(gradients[slot.key[0]])
            part = shard_map.part(slot.key[0], slot.key[1])
            pieces.append(array if part.whole else array[part.row_start:part.row_end])
        return pieces

    def _write_gradients(self, segment: tuple[Segment, Layout], shard_map: ShardMap,
                         gradients: Mapping[str, np.ndarray]) -> None:
        """The shard's gradient parts into the segment's gradient region."""
        memory, layout = segment
        memory.write(layout.gradients, self._gradient_pieces(layout, shard_map, gradients))

    def _push_pull_link(self, shard: int, link: Link, shard_map: ShardMap, gradients: Mapping[str, np.ndarray],
                        clock: int, read_step: int, wait_for_step: bool, ssp: bool, wait: float, destination,
                        rows: Sequence[pb.RowGradient] = (), asked: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
                        turn: dc.SendTurn | None = None, segment: tuple[Segment, Layout] | None = None,
                        sent: _SentFrame | None = None,
                        ) -> tuple[frames.PushPullReply, dict[PartKey, np.ndarray]] | None:
        """One PushPull over the shard's data channel: gradients sent from the arrays, values received straight
        into their destinations; a channel opened for some tensors (`link.names`) pulls those, with the row
        gradients `rows` and the rows `asked` in the frames' headers. None: the call goes over gRPC instead
        (the channel broke, the shard is stopping or busy, its layout changed, it forgot this worker); the push
        may have been applied, and the resend with the same clock is then answered as a duplicate, never applied
        twice. The errors gRPC would raise are raised as the same classes. With a `segment` (a shard on this
        host), the bytes go through it and the frame carries the header only. `sent`: the frame was sent
        already (`_link_send`, with these arguments); only its answer is read."""
        if sent is None:
            sent = self._link_send(shard, link, shard_map, gradients, clock, read_step, wait_for_step, ssp, wait,
                                   destination, rows, asked, turn, segment)
            if sent is None:
                return None
        try:
            if sent.segment is not None:
                magic, answer = link.answer_in_segment()
                got_values = False
            else:
                magic, answer, got_values = link.answer(sent.targets)
        except (OSError, ProtocolError) as exc:
            self._link_broke(shard, link, exc)
            return None
        address = self.addresses[shard]
        if magic == dc.REPLY_MAGIC:
            reply = frames.decode_response(answer, rows_asked=len(asked), shard=shard, chunks=False)
            if sent.segment is not None:   # the values, when ready, are in the segment
                return reply, (self._values_from_segment(sent.segment, destination) if reply.ready else {})
            if reply.ready != got_values:   # a ready answer must bring the values, and only a ready one
                self._link_failed(shard, f"the shard's answer says ready={reply.ready} with "
                                  f"{'' if got_values else 'no '}values", retry_now=False)
                return None
            return reply, (sent.received if reply.ready else {})
        status = pb.DataChannelStatus.FromString(answer)
        code = getattr(grpc.StatusCode, status.code, grpc.StatusCode.UNKNOWN)
        error = error_for_reason(status.reason)
        what = f"PushPull on shard {shard} ({address}) over the data channel"
        if status.reason == OverloadedError.reason:
            return None   # gRPC's retries (with backoff) take it; the channel stays
        if sent.segment is not None and error is SharedMemoryUnavailableError:
            # The shard has no segment for this worker (restarted, or reset): nothing was applied; this call's bytes
            # go over the channel, the next call opens a new segment.
            log.info("shard %d: shared memory unavailable (%s); this call's bytes go over the data channel", shard,
                     status.message)
            self._drop_segment(shard)
            return self._push_pull_link(shard, link, shard_map, gradients, clock, read_step, wait_for_step, ssp,
                                        wait, destination, rows, asked, turn)
        if code == grpc.StatusCode.UNAVAILABLE or error is DataChannelUnavailableError:
            self._link_failed(shard, f"{what}: {code.name}: {status.message}", retry_now=True)
            return None
        if error is UnknownWorkerError:
            # A restarted shard may not know this worker: register again; this call goes over gRPC (not taken).
            log.info("shard %d forgot worker %s; registering again", shard, self.worker_id)
            self._call(shard, "RegisterWorker", lambda s: s.RegisterWorker(
                pb.RegisterWorkerRequest(worker_id=self.worker_id), timeout=self.rpc_timeout, metadata=self.metadata))
            self._drop_link(shard)
            return None
        raise ServerError.remote(error)(f"{what} failed: {code.name}: {status.message}", code, address)

    def _link_send(self, shard: int, link: Link, shard_map: ShardMap, gradients: Mapping[str, np.ndarray],
                   clock: int, read_step: int, wait_for_step: bool, ssp: bool, wait: float, destination,
                   rows: Sequence[pb.RowGradient] = (), asked: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
                   turn: dc.SendTurn | None = None, segment: tuple[Segment, Layout] | None = None,
                   ) -> _SentFrame | None:
        """The first half of `_push_pull_link`: the frame sent (its bytes into the segment first, with one), and
        where its answer's values go. None: the channel broke (the call goes over gRPC)."""
        layout = link.layout
        header = pb.PushHeader(worker_id=self.worker_id, clock=clock, read_step=read_step, row_gradients=rows)
        pull = pb.PullAfterPush(names=sorted(link.names or ()), wait_for_step=wait_for_step, ssp=ssp,
                                wait_timeout_ms=max(1, int(wait * 1000)), shared_memory=True,
                                wire_dtype=self._wire_value, rows=[pb.RowIds(name=n, ids=ids) for n, _, ids in asked])
        raw_header = frames.encode_request(header, pull, gradients_in_shared_memory=True)
        sent = _SentFrame(segment)
        try:
            if segment is not None:
                self._write_gradients(segment, shard_map, gradients)
                link.send_in_segment(raw_header, timeout=wait + self.rpc_timeout)
            else:
                # the half-size wire narrows float32 parts (the layout says so), as over gRPC; else as they are
                pieces = [self._narrowed.cast((shard, slot.key), piece.reshape(slot.shape), slot.dtype)
                          if piece.dtype != slot.dtype else np.ascontiguousarray(piece)
                          for slot, piece in zip(layout.gradients, self._gradient_pieces(layout, shard_map, gradients))]
                for slot in layout.values:
                    # straight into the tensor a split part belongs to; whole tensors and half-size parts into their
                    # own arrays (_place widens the latter), as the gRPC path's assembler does
                    target = destination(slot.key[0], slot.key[1], slot.dtype, slot.shape)
                    if target is None:
                        target = sent.received[slot.key] = self._buffers.empty(slot.key, slot.shape, slot.dtype)
                    sent.targets.append(target)
                link.send(raw_header, pieces, timeout=wait + self.rpc_timeout, turn=turn)
        except (OSError, ProtocolError) as exc:
            self._link_broke(shard, link, exc)
            return None
        return sent

    def _push_pull_once(self, shard: int, shard_map: ShardMap, gradients: Mapping[str, np.ndarray], clock: int,
                        read_step: int, segment: tuple[Segment, Layout] | None, wait_for_step: bool, ssp: bool,
                        wait: float, rows: Sequence[pb.RowGradient] = (), names: Sequence[str] | None = None,
                        asked: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
                        ) -> tuple[frames.PushPullReply, tuple[Segment, Layout] | None]:
        """One PushPull to one shard: (its reply, the segment that carried the bytes, None: gRPC bytes)."""
        header = pb.PushHeader(worker_id=self.worker_id, clock=clock, read_step=read_step, row_gradients=rows)
        pull = pb.PullAfterPush(names=names or [], wait_for_step=wait_for_step, ssp=ssp,
                                wait_timeout_ms=max(1, int(wait * 1000)), shared_memory=segment is not None,
                                wire_dtype=self._wire_value, rows=[pb.RowIds(name=n, ids=ids) for n, _, ids in asked])
        if segment is not None:
            self._write_gradients(segment, shard_map, gradients)
            body = frames.encode_request(header, pull, gradients_in_shared_memory=True)
        else:
            body = frames.encode_request(header, pull, self._part_chunks(shard_map, shard, gradients, narrow=True))

        def call(stub: pb_grpc.ParameterServerStub) -> bytes:
            return self._raw_push_pulls[shard](body, timeout=wait + self._deadline(shard), metadata=self.metadata)

        again = (shard, shard_map, gradients, clock, read_step, None, wait_for_step, ssp, wait, rows, names, asked)
        try:
            raw = self._call(shard, "PushPull", call)
        except SharedMemoryUnavailableError as exc:
            # The shard has no segment for this worker (it restarted, or was reset): this call goes over gRPC,
            # and the next one opens a new segment.
            log.info("shard %d: shared memory unavailable (%s); this call goes over gRPC, the next opens a new "
                     "segment", shard, exc)
            self._drop_segment(shard)
            return self._push_pull_once(*again)
        except UnknownWorkerError:
            # A restarted shard may not know this worker: register again and send once more (not taken).
            log.info("shard %d forgot worker %s; registering again", shard, self.worker_id)
            self._call(shard, "RegisterWorker", lambda s: s.RegisterWorker(
                pb.RegisterWorkerRequest(worker_id=self.worker_id), timeout=self.rpc_timeout, metadata=self.metadata))
            self._drop_segment(shard)
            return self._push_pull_once(*again)
        return frames.decode_response(raw, rows_asked=len(asked), shard=shard, chunks=segment is None), segment

    @staticmethod
    def _destination(shard_map: ShardMap, out: dict[str, np.ndarray], lock: threading.Lock, buffers: ReceiveBuffers):
        """A PartAssembler destination: parts of a split tensor go straight into its full array in `out` (one of
        `buffers`)."""

        def destination(name: str, row_start: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
            spec = shard_map.specs.get(name)
            if spec is None or shard_map.parts_of(name)[0].whole or dtype in codec.NARROW_FLOAT32:
                return None   # a half-size part is widened into place by _place
            if (dtype.name, shape[1:]) != (np.dtype(spec.dtype).name, tuple(spec.shape[1:])) or row_start + shape[0] > spec.shape[0]:
                raise InvalidTensorError(f"shard sent {name!r} rows from {row_start} as {dtype}{list(shape)}, "
                                         f"which does not fit the tensor {spec.dtype}{list(spec.shape)}")
            with lock:
                full = out.get(name)
                if full is None:
                    full = out[name] = buffers.empty(name, spec.shape, spec.dtype)
            return full[row_start:row_start + shape[0]]

        return destination

    def _per_shard(self, min_steps: Sequence[int] | int | None) -> list[int]:
        """min_steps as one value per shard (None: 0 everywhere; an int: that, everywhere)."""
        if min_steps is None:
            return [0] * self.num_shards
        if isinstance(min_steps, int):
            return [min_steps] * self.num_shards
        return list(min_steps)

    def _place(self, shard_map: ShardMap, out: dict[str, np.ndarray], parts: Mapping[tuple[str, int], np.ndarray]
               ) -> None:
        """Puts received parts where they belong in `out`: whole tensors as they are, parts that came half-size
        widened to their tensor's dtype, into arrays of the receive buffers (split tensors' other parts were
        written in place by the assembler)."""
        for (name, row_start), value in parts.items():
            spec = shard_map.specs[name]
            narrow = value.dtype in codec.NARROW_FLOAT32 and np.dtype(spec.dtype) == np.float32
            if shard_map.parts_of(name)[0].whole:
                if narrow:
                    wide = out[name] = self._buffers.empty(name, value.shape, np.float32)
                    np.copyto(wide, value, casting="same_kind")
                else:
                    out[name] = value
            elif narrow:
                full = out.get(name)
                if full is None:
                    full = out[name] = self._buffers.empty(name, spec.shape, spec.dtype)
                full[row_start:row_start + value.shape[0]] = value

    @staticmethod
    def _small(shard_map: ShardMap, shard: int, names: Sequence[str] | None = None,
               rows: Sequence[pb.RowGradient] = (), asked: Sequence[tuple[str, np.ndarray, np.ndarray]] = ()) -> bool:
        """Whether a shard's parts (those in `names`; None: all), with its row gradients and the rows asked of
        it, are few enough bytes for PushPull over gRPC (GRPC_PUSH_PULL_MAX_BYTES)."""
        if names is None:
            size = shard_map.shard_bytes(shard)
        else:
            wanted = set(names)
            size = sum(p.nbytes for p in shard_map.parts_on(shard) if p.name in wanted)
        size += codec.row_gradients_wire_bytes(rows) + sparse.asked_bytes(shard_map, asked)
        return size <= GRPC_PUSH_PULL_MAX_BYTES

    @staticmethod
    def _rows_fit_a_frame(shard_map: ShardMap, rows: Sequence[pb.RowGradient],
                          asked: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> bool:
        """Whether a step's row gradients to a shard and the rows asked of it fit a data-channel frame's headers
        (the request's, with the asked ids, within dc.MAX_HEADER_BYTES less room for its other fields; the
        answer's rows within one answer, codec.CHUNK_BYTES, as the shard reads them)."""
        request_bytes = codec.row_gradients_wire_bytes(rows) + codec.ID_WIRE_BYTES * sum(len(ids) for _, _, ids in asked)
        return request_bytes <= dc.MAX_HEADER_BYTES - FRAME_HEADER_ROOM and \
            sparse.asked_bytes(shard_map, asked) <= codec.CHUNK_BYTES

    def _bytes_path(self, shard: int, shard_map: ShardMap, gradients: Mapping[str, np.ndarray],
                    ) -> tuple[tuple[Segment, Layout] | None, Link | None]:
        """How a whole-shard PushPull's bytes travel: (the shared-memory segment, the data channel) -- the bytes
        in the segment, the call's header over the channel --, (the segment, None) -- the call over gRPC --, (None,
        the data channel) -- the bytes over it --, or (None, None) for gRPC bytes. A shard smaller than
        `shared_memory_min_bytes` takes the channel's bytes, else shared memory where it can be had (on a
        half-size wire, over gRPC); each falls back to the other."""
        if self.shared_memory and self.data_channel and shard_map.shard_bytes(shard) < self.shared_memory_min_bytes:
            link = self._link(shard, gradients, then=THEN_SHARED_MEMORY)
            return (None, link) if link is not None else (self._segment(shard), None)
        if self.shared_memory and self.data_channel and self.wire_dtype == np.float32:
            # Both: the bytes in the segment, the call over the channel (a frame of its header only), which costs
            # a fraction of the rpc that otherwise carries the call; a shard on another host has no segment.
            link = self._link(shard, gradients, then=THEN_SHARED_MEMORY)
            if link is not None and link.remote:
                return None, link
            segment = self._segment(shard)
            return (segment, link) if segment is not None else (None, link)
        segment = self._segment(shard)
        return (segment, None) if segment is not None else (None, self._link(shard, gradients))

    def _segment(self, shard: int) -> tuple[Segment, Layout] | None:
        """The shared-memory segment with a shard on this host, opened on first use; None: use gRPC bytes.

        A shard that could not give one is asked again after SEGMENT_RETRY_SECONDS (it may
        have been restarting); one that dropped this worker's segment (`_drop_segment`) is
        asked at once.
        """
        if not self.shared_memory:
            return None
        found = self._segments.get(shard)
        if found is not None or time.monotonic() < self._no_segment_until.get(shard, 0.0):
            return found
        if shared_memory.available():
            shard_map = self._require_map()
            layout = Layout.of((p.key, p.dtype, p.shape) for p in shard_map.parts_on(shard))
            try:
                answer = self._call(shard, "OpenSharedMemory", lambda s: s.OpenSharedMemory(
                    pb.SharedMemoryRequest(worker_id=self.worker_id), timeout=self.rpc_timeout, metadata=self.metadata))
                if (answer.size, answer.values_offset) != (layout.size, layout.values_offset):
                    raise ValueError(f"layout differs: shard says {answer.size} bytes, values at "
                                     f"{answer.values_offset}; computed {layout.size}, {layout.values_offset}")
                if not answer.door:
                    raise ValueError("the shard offers no fd door (a shard of an older version)")
                found = (shared_memory.collect(answer.door, answer.ticket), layout)
                log.info("shard %d: bytes through shared memory (%d bytes, anonymous)", shard, layout.size)
            except (ServerError, OSError, ValueError) as exc:
                log.info("shard %d: no shared memory (%s); bytes go over gRPC, asking again in %g s", shard, exc,
                         SEGMENT_RETRY_SECONDS)
        if found is None:
            self._no_segment_until[shard] = time.monotonic() + SEGMENT_RETRY_SECONDS
        else:
            self._segments[shard] = found
            self._no_segment_until.pop(shard, None)
        return found

    def _link(self, shard: int, gradients: Mapping[str, np.ndarray], *, then: str = THEN_GRPC,
              names: frozenset[str] | None = None, shard_map: ShardMap | None = None) -> Link | None:
        """The data channel with a shard, opened on first use; None: not for this call (gRPC bytes).

        Only for a call whose gradients cover every trainable part of the layout (the frame
        carries its whole gradient region): every part of the shard, or with `names` the parts of
        those tensors (a sparse step's dense ones; the gradients must then name no other tensor
        this shard holds). A channel opened for other names is closed and a new one opened: one
        per worker and shard. A shard that could not give one is asked
        again after DATA_CHANNEL_RETRY_SECONDS; one whose channel broke is asked at the next call.
        The first failure with each shard is logged as a warning, later ones at debug level. A
        replicated shard's bytes go over gRPC, whose keepalive finds a frozen primary (a raw
        socket to one would wait out the call's whole timeout). `then` says, in that log line, where the
        bytes go instead.
        """
        if not self.data_channel or len(self.replicas[shard]) > 1:
            return None
        found = self._links.get(shard)
        if found is not None and (not found.usable() or found.names != names):
            self._drop_link(shard)   # cut as idle by the shard, closed, or for other tensors: a fresh ticket
            found = None
        if found is None and time.monotonic() >= self._no_link_until.get(shard, 0.0):
            found = self._open_link(shard, then, names)
        if found is None:
            return None
        if not all(slot.key[0] in gradients for slot in found.layout.gradients):
            return None
        if names is not None:
            held = {p.name for p in (shard_map or self._require_map()).parts_on(shard)}
            if any(name in held and name not in names for name in gradients):
                return None   # the frame has no room for it
        return found

    def _open_link(self, shard: int, then: str = THEN_GRPC, names: frozenset[str] | None = None) -> Link | None:
        shard_map = self._require_map()
        narrow = None if self.wire_dtype == np.float32 else self.wire_dtype
        layout = dc.wire_layout([(p.key, p.dtype, p.shape) for p in shard_map.parts_on(shard)
                                 if names is None or p.name in names], narrow)
        try:
            answer = self._call(shard, "OpenDataChannel", lambda s: s.OpenDataChannel(
                pb.DataChannelRequest(worker_id=self.worker_id, wire_dtype=self._wire_value,
                                      names=sorted(names or ())), timeout=self.rpc_timeout, metadata=self.metadata))
            if (answer.size, answer.values_offset) != (layout.size, layout.values_offset):
                raise ValueError(f"layout differs: shard says {answer.size} bytes, values at "
                                 f"{answer.values_offset}; computed {layout.size}, {layout.values_offset}")
            if answer.tls and self.data_channel_tls is None:
                raise ValueError("the shard's data channel is TLS: give PSClient data_channel_tls "
                                 "(ps_common.data_channel.client_tls_context with the CA of the gRPC credentials)")
            host, name = dc.endpoint(self.addresses[shard], self._channel_options)
            link = Link.connect(host, answer.port, answer.ticket, layout,
                                tls=self.data_channel_tls if answer.tls else None, server_hostname=name,
                                timeout=min(dc.HANDSHAKE_SECONDS, self.rpc_timeout),
                                idle_seconds=max(0.001, answer.idle_ms / 1000), names=names)
        except (ServerError, OSError, ValueError, ProtocolError) as exc:
            code = getattr(getattr(exc, "code", None), "name", "")
            why = "the shard has no OpenDataChannel (an older version)" if code == "UNIMPLEMENTED" else str(exc)
            self._link_failed(shard, f"no data channel ({why})", then=then)
            return None
        log.info("shard %d: PushPull's bytes through the data channel (port %d%s, %d bytes of layout%s)", shard,
                 answer.port, ", TLS" if answer.tls else "", layout.size,
                 "" if names is None else f" of {len(names)} tensors")
        self._links[shard] = link
        self._no_link_until.pop(shard, None)
        return link

    def _link_broke(self, shard: int, link: Link, exc: BaseException) -> None:
        """The shard's channel failed mid-call (a send or a receive raised `exc`): reopened at the next call, unless
        it never answered a frame (then after a while)."""
        self._link_failed(shard, f"the data channel broke ({exc or type(exc).__name__})", retry_now=link.frames > 0)

    def _link_failed(self, shard: int, why: str, *, retry_now: bool = False, then: str = THEN_GRPC) -> None:
        """Drops the shard's channel and logs why (a warning the first time for this shard, then at debug level):
        the next call reopens it (`retry_now`) or asks again after DATA_CHANNEL_RETRY_SECONDS."""
        self._drop_link(shard)
        if not retry_now:
            self._no_link_until[shard] = time.monotonic() + DATA_CHANNEL_RETRY_SECONDS
        level = logging.DEBUG if shard in self._link_failures_logged else logging.WARNING
        self._link_failures_logged.add(shard)
        log.log(level, "shard %d: %s; PushPull's bytes %s%s", shard, why, then,
                "" if retry_now else f", asking again in {DATA_CHANNEL_RETRY_SECONDS:g} s")

    def _drop_link(self, shard: int) -> None:
        """Closes the shard's data channel; the next call opens a new one."""
        found = self._links.pop(shard, None)
        if found is not None:
            found.close()

    def _drop_segment(self, shard: int) -> None:
        """Unmaps a segment the shard no longer has; the next call asks for a new one at once."""
        found = self._segments.pop(shard, None)
        if found is not None:
            found[0].close()
        self._no_segment_until.pop(shard, None)

    def _check_gradients(self, shard_map: ShardMap, gradients: Mapping[str, np.ndarray]) -> None:
        for name, grad in gradients.items():
            spec = shard_map.specs.get(name)
            if spec is None:
                raise InvalidTensorError(f"gradient for unknown tensor {name!r}")
            if spec.dynamic is not None:
                raise InvalidTensorError(f"gradient for dynamic table {name!r}: push it as row_gradients (ids, rows)")
            if tuple(np.shape(grad)) != tuple(spec.shape) or np.asarray(grad).dtype != np.dtype(spec.dtype):
                raise InvalidTensorError(f"gradient for {name!r} is {np.asarray(grad).dtype}{list(np.shape(grad))}, "
                                         f"the parameter is {spec.dtype}{list(spec.shape)}")

    def pull_after(self, report: PushReport | None, names: Sequence[str] | None = None, *, sync: bool = False,
                   ssp: bool = False, timeout: float | None = None, recheck: float = RECHECK_SECONDS,
                   last_step: int | None = None) -> dict[str, np.ndarray] | None:
        """The parameters a worker computes its next step on after the push `report` tells of (None: its first).

        sync waits for the step each shard's push belongs to (PushReport.wait_steps), ssp for
        the staleness bound at this worker's clock; async and a first pull wait for nothing.
        The wait is cut into waits of at most `recheck` s; between them it returns None when
        `stop` is set, and pulls a shard that lost progress this worker saw (restarted from an
        older checkpoint: `lost_progress`) as it is, without the wait, since the step or
        clocks it waits for would never come. A sync wait also ends, every shard pulled as it
        is, once every shard has reached `last_step` (the job's --steps): the job is over, and
        the other workers, done, may never send the gradients a step past it needs (a shard
        that took this worker's push for its last step while another was still one behind
        waits for a second gradient that no finished worker sends). At most `timeout` s in all
        (default wait_timeout), then WaitTimeoutError saying what it awaited.
        """
        wait = self.wait_timeout if timeout is None else timeout
        mins = report.wait_steps if sync and report is not None else None
        if mins is None and not ssp:
            return self.pull(names, timeout=wait)   # nothing to wait for
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            try:
                return self.pull(names, min_steps=mins, ssp=ssp, timeout=max(0.01, min(left, recheck)))
            except ServerError as exc:
                if not isinstance(exc, WaitTimeoutError) and getattr(exc.code, "name", "") != "DEADLINE_EXCEEDED":
                    raise
                if time.monotonic() >= deadline:
                    what = f"steps {mins} of the shards" if mins is not None else "the SSP staleness bound"
                    raise WaitTimeoutError(f"{'sync' if mins is not None else 'ssp'} pull waited {wait:.1f} s "
                                           f"(wait_timeout) for {what}; the last wait ended with: {exc}") from exc
            if self.stop.is_set():
                return None
            infos = self._cluster_infos()
            if mins is not None and last_step is not None and min(info.step for info in infos) >= last_step:
                log.info("%s: every shard reached step %d, the job's last (steps %s): pulling them as they are "
                         "instead of waiting for steps %s", self.worker_id, last_step, [i.step for i in infos],
                         mins, extra={"worker_id": self.worker_id})
                return self.pull(names, timeout=max(0.01, deadline - time.monotonic()))
            lost = self.lost_progress(infos)
            if lost:
                log.warning("%s: %s; pulling %s as it is now", self.worker_id,
                            "; ".join(f"shard {i} lost progress: {why}" for i, why in sorted(lost.items())),
                            "those shards" if mins is not None else "every shard without the SSP bound",
                            extra={"worker_id": self.worker_id, "lost": {str(i): why for i, why in lost.items()}})
                if mins is not None:
                    mins = [0 if i in lost else m for i, m in enumerate(mins)]
                ssp = False

    def shard_status(self, shard: int = 0) -> ShardStatus:
        """What a worker needs to know of a shard's job and state (one GetClusterInfo; does not block)."""
        info = self.cluster_info(shard)
        return ShardStatus(num_shards=info.num_shards, mode=codec.mode_from_wire(info.mode), step=info.step,
                           initialized=info.initialized, workers=frozenset(w.worker_id for w in info.workers),
                           live_workers=frozenset(w.worker_id for w in info.workers if w.live))

    @property
    def step(self) -> int:
        """The lowest step of the shards at this worker's last pull."""
        return min(self.steps)

    def _cluster_infos(self) -> list:
        """Every shard's GetClusterInfo answer, in shard order."""
        return self._on_all("GetClusterInfo", lambda i, s: s.GetClusterInfo(
            pb.ClusterInfoRequest(), timeout=self._deadline(i), metadata=self.metadata))

    def lost_progress(self, infos: Sequence | None = None) -> dict[int, str]:
        """The shards that lost steps or pushes this worker saw or made, each with why; {} when none did.

        A shard restarted from a checkpoint older than what this worker saw lost progress:
        its step is below the one recorded here at the last pull, it does not know this
        worker, or its clock for this worker is below this client's (the pushes it took
        after the checkpoint are gone). A worker waiting for such a shard's next step or for
        its SSP bound would wait for gradients nobody sends again: it should pull what the
        shard holds now (min_step 0) and push from there. One GetClusterInfo per shard, unless
        `infos` holds their answers already.
        """
        infos = self._cluster_infos() if infos is None else infos
        lost: dict[int, str] = {}
        for i, info in enumerate(infos):
            record = next((w for w in info.workers if w.worker_id == self.worker_id), None)
            if info.step < self.steps[i]:
                lost[i] = f"its step went down to {info.step} from {self.steps[i]}"
            elif record is None:
                lost[i] = f"it does not know worker {self.worker_id!r}"
            elif record.clock < self.clock:
                lost[i] = f"its clock for {self.worker_id!r} went down to {record.clock} from {self.clock}"
        return lost

    def close(self) -> None:
        """Stops heartbeats, unmaps shared memory, closes the data channels and the gRPC channels (does not
        deregister)."""
        self._membership.stop.set()
        self._pool.shutdown(wait=False)
        for shard in list(self._segments):
            self._drop_segment(shard)
        for shard in list(self._links):
            self._drop_link(shard)
        self._buffers.clear()
        for channel in [*self._channels, *self._retired_channels]:
            channel.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
