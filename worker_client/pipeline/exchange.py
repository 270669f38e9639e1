"""The transport between pipeline stages: a stage's inbox server (StageServer) and its link to a peer (StageLink).

Every stage worker serves ps.v1.StageExchange (protos/ps/v1/stage_exchange.proto) on a port
of its own. Stage k sends its output activations for each micro-batch to stage k + 1 of
the same replica; stage k + 1 sends the cotangents back to stage k. A message is all the
tensors of one kind for one micro-batch of one step; the receiver holds it until its stage
takes it by (kind, step, micro_batch), in any order of arrival.

Security is the shards': the job's worker token, TLS and mutual TLS (ps_common.access on the
serving side, ps_common.tls on the calling side); plaintext only on loopback unless the job
says insecure. Tensor bytes go through ps_common.codec only.

Guarantees:

- At most once: a (kind, step, micro_batch) the inbox holds or handed out is answered as a
  duplicate and dropped, so a retried send is never taken twice.
- An abandoned step stays abandoned: after ``discard_through(s)`` nothing of a step <= s is
  held, and what arrives for one later is dropped (answered ``stale``).
- Bounded memory: at most ``max_held_messages`` messages and ``max_held_bytes`` tensor bytes
  held (RESOURCE_EXHAUSTED beyond), each message at most ``max_message_bytes`` of tensor bytes
  and ``max_tensors`` tensors, each gRPC message at most ``max_receive_message_bytes``.
- Every wait has a timeout, and a set ``stop`` event ends it within STOP_POLL_SECONDS.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np

from ps_common import access, codec
from ps_common.boundary import translate_errors
from ps_common.errors import (InvalidRequestError, InvalidTensorError, PSError, ResourceExhaustedError,
                              StageTimeoutError, StoppedError)
from ps_common.tls import client_security
from ps_proto.v1 import stage_exchange_pb2 as spb
from worker_client.client.retry import RetryPolicy, call_with_retries

log = logging.getLogger(__name__)

#: The rpc's full name, for raw channels and the server's handler.
SERVICE = "ps.v1.StageExchange"
SEND_METHOD = f"/{SERVICE}/Send"
#: Longest single wait of a blocking call: between two, take and send check `stop` (seconds).
STOP_POLL_SECONDS = 0.2
#: Defaults of a StageServer's limits (docs/protocol.md, "Stage exchange").
MAX_HELD_MESSAGES = 256
MAX_HELD_BYTES = 2 << 30
MAX_MESSAGE_BYTES = 1 << 30
MAX_TENSORS = 1024
MAX_NAME_BYTES = 1024
#: How many handed-out (kind, step, micro_batch) keys the inbox remembers to answer retries as duplicates.
MAX_REMEMBERED_TAKEN = 65536
#: Steps are below this on the wire, as the shards' (docs/protocol.md).
MAX_STEP = 1 << 62
#: A send's retries of UNAVAILABLE: the first pause doubles up to this (seconds).
MAX_BACKOFF_SECONDS = 1.0
#: The shortest time a send's last try gets, even when its timeout has nearly run out (seconds).
MIN_CALL_SECONDS = 0.5
#: gRPC's reconnect backoff of a link whose peer went away: first and largest, in milliseconds.
RECONNECT_BACKOFF_MS = (100, 1000)


class Kind(enum.IntEnum):
    """What a stage message carries (ps.v1.StageKind)."""

    ACTIVATIONS = spb.ACTIVATIONS
    COTANGENTS = spb.COTANGENTS
    COMMIT = spb.COMMIT
    END = spb.END

    def sender(self, to_stage: int) -> int:
        """The stage a message of this kind comes from, for the stage that receives it."""
        return to_stage + 1 if self is Kind.COTANGENTS else to_stage - 1


@dataclass(frozen=True)
class StageSecurity:
    """The job's security settings as a stage worker uses them: serving its inbox and calling its peers.

    `token` is the job's worker token: required of callers when set, and sent on every call.
    Serving: `server_cert` + `server_key` serve TLS, `client_ca` adds mutual TLS; plaintext
    is refused off loopback unless `insecure`. Calling: TLS when any of `ca`, `cert`, `key` is
    given (`ca` None: the system's roots), `cert` + `key` present a client certificate, and
    `server_name` overrides the name checked against the peer's certificate.
    """

    token: str | None = None
    server_cert: str | None = None
    server_key: str | None = None
    client_ca: str | None = None
    insecure: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def policy(self) -> access.AccessPolicy:
        """Who may call this worker's StageExchange: the worker role when a token is set (as on a shard)."""
        return access.AccessPolicy(worker_token=self.token, admin_token=None, mutual_tls=self.client_ca is not None)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        return access.server_credentials(self.server_cert, self.server_key, self.client_ca)

    def check_bind(self, host: str) -> None:
        """ValueError for plaintext on a non-loopback host unless `insecure` (a shard's rule)."""
        if self.server_cert is None and not access.is_loopback(host) and not self.insecure:
            raise ValueError(f"refusing to serve plaintext stage exchange on {host}, a non-loopback address: give "
                             "the stage worker a certificate (--tls-cert, --tls-key) or pass --insecure "
                             "(insecure = true under [worker]) to accept plaintext")

    def channel(self, address: str, options: list[tuple[str, object]]) -> grpc.Channel:
        creds, _ = client_security(self.ca, self.cert, self.key)
        if creds is None:
            return grpc.insecure_channel(address, options=options)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(address, creds, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return client_security(token=self.token)[1]


# ---------------------------------------------------------------------- the inbox

Key = tuple[Kind, int, int]   # (kind, step, micro_batch)


@dataclass
class _Held:
    tensors: dict[str, np.ndarray]
    nbytes: int
    micro_batches: int


@dataclass
class InboxStats:
    """What an inbox holds and has done (for logs and tests)."""

    held: int = 0
    held_bytes: int = 0
    taken: int = 0
    duplicates: int = 0
    stale: int = 0
    discarded_through: int = -1
    keys: list[Key] = field(default_factory=list)


class Inbox:
    """The messages a stage has received and not yet taken, keyed by (kind, step, micro_batch). Thread-safe.

    Pure (no gRPC): the servicer puts, the stage worker takes. Memory is reserved before a
    message's tensors are allocated (`reserve`), so concurrent sends cannot overcommit it.
    """

    def __init__(self, *, replica: int, stage: int, max_held_messages: int = MAX_HELD_MESSAGES,
                 max_held_bytes: int = MAX_HELD_BYTES) -> None:
        if max_held_messages < 1 or max_held_bytes < 1:
            raise ValueError(f"Invalid inbox limits: max_held_messages {max_held_messages}, "
                             f"max_held_bytes {max_held_bytes} (both must be >= 1)")
        self.replica, self.stage = replica, stage
        self.max_held_messages, self.max_held_bytes = max_held_messages, max_held_bytes
        self._cond = threading.Condition()
        self._held: dict[Key, _Held] = {}
        self._taken: OrderedDict[Key, None] = OrderedDict()
        self._reserved = 0
        self._bytes = 0
        self._floor = -1   # the newest discarded step
        self._closed = False
        self._duplicates = self._stale = self._taken_count = 0

    # -- the receiving side (the servicer)

    def seen(self, key: Key) -> str | None:
        """'stale', 'duplicate' or None for a key about to arrive; also refuses a full inbox early."""
        with self._cond:
            verdict = self._verdict(key)
            if verdict is None and len(self._held) >= self.max_held_messages:
                raise ResourceExhaustedError(self._full_message(key, "messages"))
            return verdict

    def _verdict(self, key: Key) -> str | None:
        if key[1] <= self._floor:
            self._stale += 1
            return "stale"
        if key in self._held or key in self._taken:
            self._duplicates += 1
            return "duplicate"
        return None

    def reserve(self, key: Key, nbytes: int) -> None:
        """Reserves `nbytes` more for a message being received; RESOURCE_EXHAUSTED when the inbox cannot hold them."""
        with self._cond:
            if self._bytes + self._reserved + nbytes > self.max_held_bytes:
                raise ResourceExhaustedError(self._full_message(key, "bytes", nbytes))
            self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes

    def put(self, key: Key, tensors: dict[str, np.ndarray], nbytes: int, micro_batches: int) -> str | None:
        """Holds a received message; 'stale' or 'duplicate' when dropped instead.

        Its `nbytes` were reserved before (`reserve`); put releases the reservation whatever
        it answers or raises.
        """
        with self._cond:
            self._reserved -= nbytes
            verdict = self._verdict(key)
            if verdict is not None:
                return verdict
            if len(self._held) >= self.max_held_messages:
                raise ResourceExhaustedError(self._full_message(key, "messages"))
            self._held[key] = _Held(tensors, nbytes, micro_batches)
            self._bytes += nbytes
            self._cond.notify_all()
            return None

    def _full_message(self, key: Key, what: str, nbytes: int = 0) -> str:
        kind, step, micro = key
        return (f"stage {self.stage} of replica {self.replica}: inbox full, cannot hold {kind.name} of step {step} "
                f"micro-batch {micro}" + (f" ({nbytes} more bytes)" if nbytes else "") +
                f": it holds {len(self._held)} messages (most {self.max_held_messages}) and "
                f"{self._bytes + self._reserved} bytes (most {self.max_held_bytes}); the stage takes them in turn")

    @property
    def discarded_through(self) -> int:
        with self._cond:
            return self._floor

    # -- the stage's side

    def take(self, kind: Kind, step: int, micro_batch: int, *, timeout: float,
             stop: threading.Event | None = None) -> dict[str, np.ndarray]:
        """The tensors of that exact message, once it arrived; blocks at most `timeout` seconds.

        Waits in slices of at most STOP_POLL_SECONDS: a set `stop`, or a closed inbox, raises
        StoppedError within one. Running out raises StageTimeoutError naming the kind, step,
        micro-batch, replica, the peer stage and the seconds waited. A step already discarded
        is a ValueError at once: its message will never be held.
        """
        kind = Kind(kind)
        key = (kind, int(step), int(micro_batch))
        started = time.monotonic()
        deadline = started + timeout
        what = (f"{kind.name} of step {step} micro-batch {micro_batch} for stage {self.stage} of replica "
                f"{self.replica} from stage {kind.sender(self.stage)}")
        with self._cond:
            while True:
                held = self._held.pop(key, None)
                if held is not None:
                    self._bytes -= held.nbytes
                    self._taken[key] = None
                    self._taken_count += 1
                    while len(self._taken) > MAX_REMEMBERED_TAKEN:
                        self._taken.popitem(last=False)
                    return held.tensors
                if key[1] <= self._floor:
                    raise ValueError(f"take {what}: step {step} was discarded (discard_through({self._floor}))")
                if key in self._taken:
                    raise ValueError(f"take {what}: already taken")
                if self._closed:
                    raise StoppedError(f"take {what}: the stage server was closed")
                if stop is not None and stop.is_set():
                    raise StoppedError(f"take {what}: stopped after {time.monotonic() - started:.1f} s")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageTimeoutError(f"no {what} after {time.monotonic() - started:.1f} s (timeout "
                                            f"{timeout:g} s); the inbox holds {self._describe()}")
                self._cond.wait(min(left, STOP_POLL_SECONDS))

    def next_step(self, kinds: tuple[Kind, ...], after: int, *, timeout: float,
                  stop: threading.Event | None = None) -> tuple[Kind, int] | None:
        """The (kind, step) of the earliest held micro-batch 0 of one of `kinds` with a step
        above `after` (left held: `take` it), waiting at most `timeout` s; None when none came.

        A stage that does not choose its steps (every stage but the first) learns the next one
        here. A set `stop` or a closed inbox raises StoppedError within STOP_POLL_SECONDS.
        """
        wanted = {Kind(k) for k in kinds}
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [(s, k) for (k, s, m) in self._held if k in wanted and m == 0 and s > after]
                if found:
                    step, kind = min(found)
                    return kind, step
                if self._closed:
                    raise StoppedError(f"stage {self.stage} of replica {self.replica}: the stage server was closed")
                if stop is not None and stop.is_set():
                    raise StoppedError(f"stage {self.stage} of replica {self.replica}: stopped while waiting for "
                                       f"the next step after {after}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, STOP_POLL_SECONDS))

    def _describe(self) -> str:
        if not self._held:
            return "nothing"
        keys = sorted(self._held, key=lambda k: (k[1], k[0], k[2]))
        shown = ", ".join(f"{k.name} step {s} micro {m}" for k, s, m in keys[:8])
        return f"{len(keys)} messages: {shown}" + (", ..." if len(keys) > 8 else "")

    def discard_through(self, step: int) -> int:
        """Drops every held message of a step <= `step` (an abandoned step); later arrivals for them are dropped too.

        Returns how many held messages were dropped. The floor only rises: a smaller `step`
        than an earlier call's changes nothing.
        """
        with self._cond:
            self._floor = max(self._floor, int(step))
            old = [k for k in self._held if k[1] <= self._floor]
            for k in old:
                self._bytes -= self._held.pop(k).nbytes
            for k in [k for k in self._taken if k[1] <= self._floor]:
                del self._taken[k]   # refused as stale from now on anyway
            self._cond.notify_all()
            return len(old)

    def close(self) -> None:
        """Wakes every take with StoppedError; holds nothing more."""
        with self._cond:
            self._closed = True
            self._held.clear()
            self._bytes = 0
            self._cond.notify_all()

    def stats(self) -> InboxStats:
        with self._cond:
            return InboxStats(len(self._held), self._bytes, self._taken_count, self._duplicates, self._stale,
                              self._floor, sorted(self._held, key=lambda k: (k[1], k[0], k[2])))


# ---------------------------------------------------------------------- the service boundary


class StageExchangeServicer:
    """ps.v1.StageExchange over one Inbox: check the stream, assemble its tensors (codec), hold them."""

    def __init__(self, inbox: Inbox, *, max_message_bytes: int = MAX_MESSAGE_BYTES, max_tensors: int = MAX_TENSORS,
                 max_name_bytes: int = MAX_NAME_BYTES) -> None:
        self.inbox = inbox
        self.max_message_bytes, self.max_tensors, self.max_name_bytes = max_message_bytes, max_tensors, max_name_bytes

    @translate_errors
    def Send(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> spb.StageAck:
        return self._send(requests)

    def _ack(self, verdict: str | None) -> spb.StageAck:
        return spb.StageAck(duplicate=verdict == "duplicate", stale=verdict == "stale",
                            discarded_through=self.inbox.discarded_through)

    def _send(self, requests: Iterator[bytes]) -> spb.StageAck:
        first = next(requests, None)
        header_bytes, chunks = codec.decode_message(first) if first is not None else (None, [])
        if not isinstance(header_bytes, memoryview):
            raise InvalidRequestError("StageExchange.Send: the first message must carry a header")
        try:
            header = spb.StageHeader.FromString(bytes(header_bytes))
        except Exception as exc:  # protobuf's DecodeError
            raise InvalidRequestError(f"StageExchange.Send: malformed header: {exc}") from exc
        key = self._check(header)
        verdict = self.inbox.seen(key)
        if verdict is not None:
            log.debug("StageExchange.Send: %s %s dropped (%s)", key[0].name, key[1:], verdict)
            return self._ack(verdict)   # the rest of the stream is not read
        reserved = 0
        try:
            assembler = codec.PartAssembler()
            for chunk in self._chunks(chunks, requests):
                if (chunk.name, chunk.row_start) not in assembler.keys():
                    nbytes = self._declared(chunk, len(assembler.keys()), reserved)
                    self.inbox.reserve(key, nbytes)
                    reserved += nbytes
                assembler.add(chunk)
            parts = assembler.finish()
            tensors = {name: value for (name, _), value in parts.items()}
            held, reserved = reserved, 0   # put releases the reservation, whatever it answers
            verdict = self.inbox.put(key, tensors, held, header.micro_batches)
        finally:
            if reserved:
                self.inbox.release(reserved)
        return self._ack(verdict)

    @staticmethod
    def _chunks(chunks: list[codec.ChunkView], requests: Iterator[bytes]) -> Iterator[codec.ChunkView]:
        yield from chunks
        for raw in requests:
            yield from codec.decode_message(raw)[1]

    def _check(self, header: spb.StageHeader) -> Key:
        """The message's key, after checking the header against this receiver (InvalidRequestError naming the field)."""
        inbox = self.inbox
        if header.kind not in set(Kind):
            raise InvalidRequestError(f"StageExchange.Send: unknown kind {header.kind} ("
                                      + ", ".join(f"{k.name} = {k.value}" for k in Kind) + ")")
        kind = Kind(header.kind)
        if header.replica != inbox.replica or header.to_stage != inbox.stage:
            raise InvalidRequestError(f"StageExchange.Send: a message for stage {header.to_stage} of replica "
                                      f"{header.replica} reached stage {inbox.stage} of replica {inbox.replica}")
        if header.from_stage != kind.sender(inbox.stage):
            raise InvalidRequestError(f"StageExchange.Send: {kind.name} for stage {inbox.stage} come from stage "
                                      f"{kind.sender(inbox.stage)}, not stage {header.from_stage}")
        if header.step >= MAX_STEP:
            raise InvalidRequestError(f"StageExchange.Send: step {header.step} is not below 2^62")
        if not header.micro_batch < header.micro_batches:
            raise InvalidRequestError(f"StageExchange.Send: micro_batch {header.micro_batch} is not below "
                                      f"micro_batches {header.micro_batches}")
        return kind, int(header.step), int(header.micro_batch)

    def _declared(self, chunk: codec.ChunkView, seen: int, so_far: int) -> int:
        """The bytes a new tensor declares, checked against the per-message limits before anything is allocated."""
        name_bytes = len(chunk.name.encode("utf-8"))
        if not chunk.name or name_bytes > self.max_name_bytes:
            raise InvalidTensorError(f"StageExchange.Send: tensor name of {name_bytes} bytes (1 to "
                                     f"{self.max_name_bytes}): {chunk.name[:64]!r}")
        if chunk.row_start != 0:
            raise InvalidTensorError(f"StageExchange.Send: tensor {chunk.name!r}: row_start {chunk.row_start}; "
                                     "stage messages carry whole tensors (row_start 0)")
        if seen + 1 > self.max_tensors:
            raise ResourceExhaustedError(f"StageExchange.Send: more than {self.max_tensors} tensors in one message")
        dtype = codec.dtype_from_wire(chunk.dtype, name=chunk.name)
        if any(d < 0 for d in chunk.shape):
            raise InvalidTensorError(f"tensor {chunk.name!r}: negative dimension in shape {list(chunk.shape)}")
        nbytes = math.prod(int(d) for d in chunk.shape) * dtype.itemsize
        if so_far + nbytes > self.max_message_bytes:
            raise ResourceExhaustedError(f"StageExchange.Send: tensor {chunk.name!r} (shape {list(chunk.shape)}, "
                                         f"{dtype.name}, {nbytes} bytes) takes the message past its "
                                         f"{self.max_message_bytes} bytes")
        return nbytes


# ---------------------------------------------------------------------- the server


class StageServer:
    """A stage worker's inbox, served over ps.v1.StageExchange on `bind` (port 0 picks a free one).

    `replica` and `stage` say which messages it accepts (for itself only). `security` is the
    job's (StageSecurity: token, TLS, mutual TLS). Its own small thread pool (`threads`);
    at most `max_concurrent_rpcs` sends at once, one more gets RESOURCE_EXHAUSTED. `.address`
    is the host:port actually bound. Starts serving on construction; `close()` stops it.
    """

    def __init__(self, bind: str = "127.0.0.1:0", *, replica: int, stage: int,
                 security: StageSecurity = StageSecurity(), threads: int = 4, max_concurrent_rpcs: int = 16,
                 max_receive_message_bytes: int = codec.MAX_MESSAGE_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_tensors: int = MAX_TENSORS, max_held_messages: int = MAX_HELD_MESSAGES,
                 max_held_bytes: int = MAX_HELD_BYTES) -> None:
        if replica < 0 or stage < 0:
            raise ValueError(f"Invalid replica {replica} or stage {stage} (both must be >= 0)")
        host, sep, port = bind.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"Invalid bind address {bind!r}: expected HOST:PORT (port 0 picks a free one)")
        security.check_bind(host)
        credentials = security.server_credentials()
        self.inbox = Inbox(replica=replica, stage=stage, max_held_messages=max_held_messages,
                           max_held_bytes=max_held_bytes)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"stage{replica}.{stage}"),
            options=[("grpc.max_receive_message_length", max_receive_message_bytes), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            interceptors=access.policy_interceptors(security.policy()))
        servicer = StageExchangeServicer(self.inbox, max_message_bytes=max_message_bytes, max_tensors=max_tensors)
        handlers = {"Send": grpc.stream_unary_rpc_method_handler(
            servicer.Send, request_deserializer=None, response_serializer=spb.StageAck.SerializeToString)}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            bound = (self.server.add_insecure_port(bind) if credentials is None
                     else self.server.add_secure_port(bind, credentials))
        except RuntimeError:   # grpc's "Failed to bind"
            bound = 0
        if bound == 0:
            raise OSError(f"stage {stage} of replica {replica}: cannot bind {bind}: the port is in use or the host "
                          "is not an address of this machine")
        self.address = f"{host}:{bound}"
        self.server.start()
        log.info("stage %d of replica %d: stage exchange on %s (%s)", stage, replica, self.address,
                 "TLS" if credentials is not None else "plaintext")
        if credentials is None and not access.is_loopback(host):
            log.warning("stage %d of replica %d serves its stage exchange PLAINTEXT on %s, a non-loopback address "
                        "(insecure): anyone who can reach the port reads the activations and any token sent",
                        stage, replica, self.address)

    def take(self, kind: Kind, step: int, micro_batch: int, *, timeout: float,
             stop: threading.Event | None = None) -> dict[str, np.ndarray]:
        """Inbox.take: blocks until that exact message arrived, at most `timeout` s, ended by `stop`."""
        return self.inbox.take(kind, step, micro_batch, timeout=timeout, stop=stop)

    def discard_through(self, step: int) -> int:
        """Inbox.discard_through: drops held messages of steps <= `step`, and later arrivals for them."""
        return self.inbox.discard_through(step)

    def next_step(self, kinds: tuple[Kind, ...], after: int, *, timeout: float,
                  stop: threading.Event | None = None) -> tuple[Kind, int] | None:
        """Inbox.next_step: the earliest held step above `after` of one of `kinds` (micro-batch 0)."""
        return self.inbox.next_step(kinds, after, timeout=timeout, stop=stop)

    def close(self, grace: float = 1.0) -> None:
        """Stops serving (sends in progress get `grace` seconds) and wakes every take with StoppedError."""
        self.server.stop(grace).wait(grace + 1)
        self.inbox.close()

    def __enter__(self) -> "StageServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close(0)


# ---------------------------------------------------------------------- the link


class StageLink:
    """The sending end of one edge of the pipeline: a channel to a peer stage's StageServer.

    `resolve`, when given, tells the peer's current address (e.g. a rendezvous lookup): a
    peer that stays UNAVAILABLE for `resolve_after` seconds is looked up again, so a
    restarted peer on a new port is found. Thread-safe for sends to different keys.
    """

    def __init__(self, address: str, *, replica: int, from_stage: int, to_stage: int,
                 security: StageSecurity = StageSecurity(), rpc_timeout: float = 60.0,
                 resolve: Callable[[], str] | None = None, resolve_after: float = 1.0,
                 chunk_bytes: int = codec.CHUNK_BYTES) -> None:
        if abs(from_stage - to_stage) != 1 or min(from_stage, to_stage, replica) < 0:
            raise ValueError(f"Invalid link: replica {replica}, stage {from_stage} -> {to_stage} (stages must be "
                             "neighbours, all values >= 0)")
        if not rpc_timeout > 0:
            raise ValueError(f"Invalid rpc_timeout: {rpc_timeout}")
        self.replica, self.from_stage, self.to_stage = replica, from_stage, to_stage
        self.security, self.rpc_timeout, self.chunk_bytes = security, rpc_timeout, chunk_bytes
        self.resolve, self.resolve_after = resolve, resolve_after
        self._metadata = security.metadata()
        self._lock = threading.Lock()
        self._connect(address)

    def _connect(self, address: str) -> None:
        options = [("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0),   # retries are ours: a stream outgrows gRPC's retry buffer
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]
        self.address = address
        self._channel = self.security.channel(address, options)
        self._send = self._channel.stream_unary(SEND_METHOD, request_serializer=None,
                                                response_deserializer=spb.StageAck.FromString)

    def _messages(self, kind: Kind, step: int, micro_batch: int, micro_batches: int,
                  tensors: Mapping[str, np.ndarray]) -> list[bytes]:
        header = spb.StageHeader(replica=self.replica, from_stage=self.from_stage, to_stage=self.to_stage,
                                 kind=int(kind), step=step, micro_batch=micro_batch, micro_batches=micro_batches)
        chunks = (f for name, array in tensors.items()
                  for f in codec.chunk_fields(name, array, chunk_bytes=self.chunk_bytes, copy=False))
        return list(codec.pack_encoded(chunks, header.SerializeToString(), chunk_bytes=self.chunk_bytes))

    def send(self, kind: Kind, step: int, micro_batch: int, micro_batches: int, tensors: Mapping[str, np.ndarray], *,
             timeout: float, stop: threading.Event | None = None) -> spb.StageAck:
        """Sends one message to the peer; returns its StageAck (duplicate / stale say it was dropped there).

        Blocks at most about `timeout` seconds: UNAVAILABLE (the peer not up yet, restarting)
        is retried with backoff until then, then ServerError naming the address, the attempts
        and the last status. Any other error status raises at once, as the catalog's class for
        the peer's reason (also a ServerError). A set `stop` raises StoppedError within
        STOP_POLL_SECONDS. Encoded once, before the first try (tensors of a dtype the wire does
        not carry are InvalidTensorError here).
        """
        kind = Kind(kind)
        if not 0 <= micro_batch < micro_batches:
            raise ValueError(f"Invalid micro_batch {micro_batch} of {micro_batches}")
        if not 0 <= step < MAX_STEP:
            raise ValueError(f"Invalid step {step} (0 to 2^62)")
        messages = self._messages(kind, int(step), int(micro_batch), int(micro_batches), tensors)
        what = (f"send {kind.name} of step {step} micro-batch {micro_batch} to stage {self.to_stage} of replica "
                f"{self.replica}")
        deadline = time.monotonic() + timeout

        def send_once() -> spb.StageAck:
            call_timeout = min(self.rpc_timeout, max(deadline - time.monotonic(), MIN_CALL_SECONDS))
            return self._call(messages, call_timeout, stop, what)

        def unavailable(seconds: float) -> None:
            if self.resolve is not None and seconds >= self.resolve_after:
                self._re_resolve(what)   # a restarted peer may serve on a new port

        # until the deadline: UNAVAILABLE retried with backoff (from 0.05 s), nothing else
        policy = RetryPolicy(attempts=1, initial_backoff=0.05, max_backoff=MAX_BACKOFF_SECONDS, window=timeout)
        return call_with_retries(send_once, what=f"{what} at {self.address}", address=self.address, policy=policy,
                                 stop=stop, on_unavailable=unavailable, level=logging.DEBUG)

    def _call(self, messages: list[bytes], timeout: float, stop: threading.Event | None, what: str) -> spb.StageAck:
        with self._lock:
            send = self._send
        future = send.future(iter(messages), timeout=timeout, metadata=self._metadata)
        while True:
            try:
                return future.result(timeout=STOP_POLL_SECONDS)
            except grpc.FutureTimeoutError:
                if stop is not None and stop.is_set():
                    future.cancel()
                    raise StoppedError(f"{what} at {self.address}: stopped while sending") from None

    def _re_resolve(self, what: str) -> None:
        try:
            address = self.resolve()
        except PSError as exc:
            log.debug("%s: looking the peer up again failed: %s", what, exc)
            return
        with self._lock:
            if address != self.address:
                log.info("%s: the peer moved from %s to %s", what, self.address, address)
                old = self._channel
                self._connect(address)
                old.close()

    def reachable(self, timeout: float) -> bool:
        """Whether the peer's server accepts a connection within `timeout` s (looked up again
        first when a `resolve` was given: a restarted peer may serve on a new port)."""
        if self.resolve is not None:
            self._re_resolve(f"stage {self.from_stage} -> {self.to_stage}: reachability check")
        with self._lock:
            channel = self._channel
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        with self._lock:
            self._channel.close()

    def __enter__(self) -> "StageLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
