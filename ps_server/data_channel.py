"""The shard's data channel: a TCP port of its own where workers on other hosts send PushPull's bytes.

The framing is ps_common/data_channel.py's (docs/protocol.md, "The data channel between
hosts"). `offer` (the OpenDataChannel handler's) issues a one-time ticket bound to the worker
and the layout of the shard's parts; a connection that shows it gets a buffer of that layout
(ps_common.data_channel.FrameBuffer) and a thread of its own, which reads whole frames and hands
each to `serve` -- ParameterServerServicer.push_pull_on_channel, which makes the same domain
call as the gRPC PushPull, with the buffer standing for a shared-memory segment -- then sends
the answer from the same buffer.

Bad input closes the connection with a logged reason and applies nothing: a hello that is not
one, a wrong, used or expired ticket, a frame before the ticket, a bad magic, a header over
MAX_HEADER_BYTES or a body other than the layout's gradient region (both checked before
anything is allocated for them), a frame cut short, a header naming another worker. A
connection idle for `idle_seconds` (stream_idle_seconds) between frames, or stalled that long
mid-frame, is closed too. Errors of a frame that was read whole are answered as gRPC would
answer them: an error frame with the status, the catalog reason and the message.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

import numpy as np

from ps_common import data_channel as dc
from ps_common.boundary import status_of
from ps_common.data_channel import DataChannelUnavailableError, FrameBuffer, Grant, ProtocolError, Tickets
from ps_common.errors import PSError, ResourceExhaustedError, shorten
from ps_common.shard_map import PartKey
from ps_common.shared_memory import Layout
from ps_proto.v1 import parameter_server_pb2 as pb

log = logging.getLogger(__name__)

#: Connections that have not shown a ticket yet, at once; more are closed at once.
MAX_PENDING = 64
#: How long `close` waits for the accepting thread (seconds).
CLOSE_SECONDS = 2.0

#: serve(grant, raw request header, buffer, written) -> (response header, the answer's body: the layout's values
#: region as byte views, or None when the values are not ready); written(part key, bytes), when not None, is to
#: be told as the values land in the buffer (ValuesAhead.written). A None buffer: the bytes are in the worker's
#: shared-memory segment (a SEGMENT_MAGIC frame), and the answer has no body.
Serve = Callable[[Grant, bytes, "FrameBuffer | None", "Callable[[PartKey, int], None] | None"],
                 tuple[bytes, "list[memoryview] | None"]]
#: observe(rpc, status code name, seconds): a frame answered, as the metrics interceptor records a gRPC call
Observe = Callable[[str, str, float], None]


class Violation(Exception):
    """A frame read whole that breaks the channel's rules (a header naming another worker): the connection is
    closed, nothing applied."""


class _Connection:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.worker_id = ""
        self.values_first = False   # the worker's hello has FLAG_VALUES_FIRST

    def shut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class DataChannelServer:
    """The listener, its tickets and its connections (one per worker at most). Thread-safe."""

    def __init__(self, host: str, port: int, serve: Serve, *, shard_index: int = 0, limit: int = 4096,
                 idle_seconds: float = 30.0, tls: ssl.SSLContext | None = None,
                 observe: Observe | None = None) -> None:
        self.serve = serve
        self.observe = observe   # each answered frame counts as a PushPull call in the shard's metrics
        self.shard_index = shard_index
        self.limit = limit
        self.idle_seconds = idle_seconds
        self.tls = tls
        self.tickets = Tickets()
        bind_host = host.strip("[]")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        try:
            self._sock = socket.create_server((bind_host, port), family=family, backlog=128)
        except OSError as exc:
            raise OSError(f"shard {shard_index}: cannot bind its data channel on {host}:{port}: "
                          f"{exc.strerror or exc}; choose another --data-channel-port (0 picks a free one), or "
                          "--no-data-channel") from exc
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._by_worker: dict[str, _Connection] = {}
        self._pending = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"shard{shard_index}-data-channel", daemon=True)

    def start(self) -> "DataChannelServer":
        self._thread.start()
        return self

    # ------------------------------------------------------------------ tickets

    def offer(self, worker_id: str, layout: Layout, generation: int, *, known: set[str],
              narrow: np.dtype | None = None, names: frozenset[str] | None = None) -> bytes:
        """A one-time ticket for `worker_id`'s connection with `layout` (the shard's parts `generation`, of the
        tensors `names` when set, float32 parts in `narrow` when set); closes the connections of workers no longer
        `known`."""
        if self._stop.is_set():
            raise DataChannelUnavailableError(f"shard {self.shard_index} is stopping")
        with self._lock:
            gone = [w for w in self._by_worker if w not in known]
            if worker_id not in self._by_worker and len(self._by_worker) >= self.limit:
                raise ResourceExhaustedError(f"shard {self.shard_index} holds {len(self._by_worker)} data-channel "
                                             f"connections (max_registered_workers={self.limit})")
        for worker in gone:
            self.close_worker(worker)
        try:
            return self.tickets.issue(Grant(worker_id, layout, generation, narrow, names))
        except OSError as exc:
            raise ResourceExhaustedError(f"shard {self.shard_index}: {exc}") from exc

    def close_worker(self, worker_id: str) -> None:
        """Closes the worker's connection (it left, or was forgotten)."""
        with self._lock:
            conn = self._by_worker.pop(worker_id, None)
        if conn is not None:
            conn.shut()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_worker)

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                full = self._pending >= MAX_PENDING
                if not full:
                    self._pending += 1
            if full:
                log.info("shard %d data channel: %s refused: %d connections have not shown a ticket yet",
                         self.shard_index, _peer(peer), MAX_PENDING)
                sock.close()
                continue
            conn = _Connection(sock, _peer(peer))
            threading.Thread(target=self._run, args=(conn,), name=f"shard{self.shard_index}-data-conn",
                             daemon=True).start()

    def _run(self, conn: _Connection) -> None:
        buffer = None
        admitted = False
        try:
            grant = self._hello(conn)
            with self._lock:
                self._pending -= 1
                admitted = True
            if grant is None:
                return
            buffer = FrameBuffer(grant.layout.size)
            conn.sock.sendall(dc.WELCOME.pack(dc.WELCOME_OK))
            log.info("shard %d: data channel for worker %r from %s (%d bytes of layout%s)", self.shard_index,
                     grant.worker_id, conn.peer, grant.layout.size, ", TLS" if self.tls is not None else "")
            self._frames(conn, grant, buffer)
        except (OSError, ProtocolError) as exc:
            if not self._stop.is_set():
                log.info("shard %d data channel: closing the connection of %s: %s", self.shard_index,
                         conn.worker_id or conn.peer, _why(exc))
        except Exception:  # a bug: log it; the listener goes on
            log.exception("shard %d data channel: internal error on the connection of %s", self.shard_index,
                          conn.worker_id or conn.peer)
        finally:
            if not admitted:
                with self._lock:
                    self._pending -= 1
            with self._lock:
                if conn.worker_id and self._by_worker.get(conn.worker_id) is conn:
                    del self._by_worker[conn.worker_id]
            try:
                conn.sock.close()
            except OSError:
                pass
            if buffer is not None:
                buffer.close()

    def _hello(self, conn: _Connection) -> Grant | None:
        """The grant of the connection's ticket (TLS handshake first when on); None when refused (logged)."""
        conn.sock.settimeout(dc.HANDSHAKE_SECONDS)
        dc.no_delay(conn.sock)
        if self.tls is not None:
            conn.sock = self.tls.wrap_socket(conn.sock, server_side=True)
        first = dc.recv_exactly(conn.sock, len(dc.HELLO_MAGIC))   # anything else is refused without waiting
        if first != dc.HELLO_MAGIC:
            raise ProtocolError(f"the first bytes are not a hello (magic {first!r})")
        magic, version, flags, ticket = dc.HELLO.unpack(first + dc.recv_exactly(conn.sock,
                                                                                 dc.HELLO.size - len(first)))
        if version != dc.VERSION:
            raise ProtocolError(f"a hello of version {version} (this shard speaks {dc.VERSION})")
        conn.values_first = bool(flags & dc.FLAG_VALUES_FIRST)
        grant = self.tickets.take(ticket)
        if grant is None:
            log.warning("shard %d data channel: %s showed a wrong, used or expired ticket; closing",
                        self.shard_index, conn.peer)
            try:
                conn.sock.sendall(dc.WELCOME.pack(dc.WELCOME_REFUSED))
            except OSError:
                pass
            return None
        conn.worker_id = grant.worker_id
        with self._lock:
            old = self._by_worker.get(grant.worker_id)
            self._by_worker[grant.worker_id] = conn
        if old is not None:
            old.shut()   # the worker opened a new connection: its old one ends
        return grant

    def _frames(self, conn: _Connection, grant: Grant, buffer: FrameBuffer) -> None:
        layout = grant.layout
        gradients = buffer.buffer[:dc.gradient_bytes(layout)]
        dc.set_timeout(conn.sock, self.idle_seconds)
        while not self._stop.is_set():
            try:
                prefix = dc.read_prefix(conn.sock, at_boundary=True)
            except TimeoutError:
                log.info("shard %d data channel: worker %r sent no frame for %g s (stream_idle_seconds); closing",
                         self.shard_index, grant.worker_id, self.idle_seconds)
                return
            if prefix is None:
                return   # the worker closed it between frames
            magic, header_bytes, body_bytes = prefix
            in_segment = magic == dc.SEGMENT_MAGIC
            if magic != dc.REQUEST_MAGIC and not in_segment:
                raise ProtocolError(f"a frame with magic {magic!r}, not a request")
            if header_bytes > dc.MAX_HEADER_BYTES:
                raise ProtocolError(f"a {header_bytes}-byte frame header (at most {dc.MAX_HEADER_BYTES})")
            if body_bytes != (0 if in_segment else dc.gradient_bytes(layout)):
                raise ProtocolError(f"a frame of {body_bytes} body bytes; " + (
                    "one whose bytes are in shared memory has none" if in_segment else
                    f"the layout's gradient region holds {dc.gradient_bytes(layout)}"))
            try:
                if in_segment:
                    header = dc.recv_exactly(conn.sock, header_bytes)
                else:   # the header with the body's first bytes, in one receive
                    head = bytearray(header_bytes)
                    buffer.finite = dc.recv_checking_finite(conn.sock, gradients, layout.gradients,
                                                            header=memoryview(head))
                    header = bytes(head)
            except TimeoutError as exc:
                raise ProtocolError(f"stalled mid-frame for {self.idle_seconds:g} s (stream_idle_seconds)") from exc
            close_after = False
            code, started = "OK", time.perf_counter()
            ahead = ValuesAhead(conn.sock, layout, buffer, self.idle_seconds) if conn.values_first and \
                not in_segment and dc.values_bytes(layout) >= dc.VALUES_FIRST_MIN_BYTES else None
            try:
                answer, body = self.serve(grant, header, None if in_segment else buffer,
                                          None if ahead is None else ahead.written)
                body = body or []
                if in_segment and body:
                    raise RuntimeError("an answer with a body to a frame whose bytes are in shared memory")
                if body and sum(len(v) for v in body) != dc.values_bytes(layout):
                    raise RuntimeError(f"an answer of {sum(len(v) for v in body)} value bytes for a values region "
                                       f"of {dc.values_bytes(layout)}")
                frame = [dc.FRAME.pack(dc.REPLY_MAGIC, len(answer), sum(len(v) for v in body)), answer, *body]
            except Violation as exc:
                if ahead is not None:
                    ahead.abandon()
                raise ProtocolError(str(exc)) from exc
            except PSError as exc:
                close_after = isinstance(exc, DataChannelUnavailableError)
                code = status_of(exc).name
                frame = _error_frame(code, exc.reason, str(exc))
            except Exception as exc:  # a bug: logged, answered INTERNAL as gRPC would, the connection kept
                log.exception("internal error in the data channel's PushPull")
                code = "INTERNAL"
                frame = _error_frame(code, "", f"internal error in PushPull: {type(exc).__name__}: {exc}")
            if self.observe is not None:
                self.observe("PushPull", code, time.perf_counter() - started)
            if ahead is not None and ahead.started:
                # the values went (or are going) ahead: the rest of the region, then the reply without a body
                ahead.finish()
                if frame[0][:4] == dc.REPLY_MAGIC:
                    frame = [dc.FRAME.pack(dc.REPLY_MAGIC, len(answer), 0), answer]
            dc.send_views(conn.sock, frame)
            if close_after:
                return

    def close(self) -> None:
        """Stops accepting, closes every connection (a call in flight ends; its worker goes on over gRPC)."""
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_SECONDS)
        with self._lock:
            conns, self._by_worker = list(self._by_worker.values()), {}
        for conn in conns:
            conn.shut()


class ValuesAhead:
    """One answer's values region sent while the shard still writes it (docs/protocol.md, "Values first").

    The shard's read tells `written(part key, bytes)` as each part's leading bytes take their final values
    (Read.written); the first call starts a thread that sends VALUES_MAGIC's prefix, then every byte of the
    region up to the first one not yet written, in order, padding included. `finish` (once the domain call
    returned: every value is written) sends the rest and waits for the last byte. Nothing here raises into the
    shard's locked section: a send that fails, or a part told fewer bytes than before (its values changed
    after they went), is raised by `finish`, which closes the connection without a reply.
    """

    def __init__(self, sock: socket.socket, layout: Layout, buffer: FrameBuffer, idle_seconds: float) -> None:
        self.sock = sock
        self.idle_seconds = idle_seconds
        self.region = buffer.buffer[layout.values_offset:layout.size]
        self.slots = layout.values
        self.base = layout.values_offset
        self.index = {slot.key: i for i, slot in enumerate(layout.values)}
        self.told = [0] * len(layout.values)
        self.first_open = 0   # the first slot not yet written whole
        self.ready = 0        # bytes of the region written
        self.sent = 0
        self.complete = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self.thread is not None

    def written(self, key: PartKey, nbytes: int) -> None:
        """Part `key`'s first `nbytes` bytes hold their final values (Read.written)."""
        with self.cond:
            i = self.index.get(key)
            if i is None or not self.told[i] <= nbytes <= self.slots[i].nbytes:
                if self.error is None:
                    told = None if i is None else self.told[i]
                    self.error = RuntimeError(f"the shard told {nbytes} bytes of part {key} written (before: {told})")
                self.cond.notify_all()
                return
            self.told[i] = nbytes
            while self.first_open < len(self.slots) and \
                    self.told[self.first_open] == self.slots[self.first_open].nbytes:
                self.first_open += 1
            if self.first_open == len(self.slots):
                ready = len(self.region)
            else:
                slot = self.slots[self.first_open]
                ready = slot.offset - self.base + self.told[self.first_open]
            if ready > self.ready:
                self.ready = ready
                self.cond.notify_all()
            if self.thread is None:
                self.thread = threading.Thread(target=self._send, name="data-channel-values-ahead", daemon=True)
                self.thread.start()

    def finish(self) -> None:
        """Every value is written: sends the rest of the region and waits for it to go. OSError or ProtocolError
        when it cannot (the connection is then closed without a reply)."""
        with self.cond:
            self.complete = True
            self.cond.notify_all()
        assert self.thread is not None
        # the socket's timeout (stream_idle_seconds) bounds each send; the slack covers the region's last send
        self.thread.join(timeout=self.idle_seconds + 5.0)
        if self.thread.is_alive():
            raise ProtocolError(f"values sent ahead: {len(self.region) - self.sent} of {len(self.region)} bytes "
                                f"still unsent after {self.idle_seconds + 5.0:g} s")
        if self.error is not None:
            raise ProtocolError(f"values sent ahead: {str(self.error) or type(self.error).__name__}")

    def abandon(self) -> None:
        """The answer will not be sent (the connection closes): the sending thread, if any, stops."""
        with self.cond:
            self.error = self.error or ProtocolError("the answer was abandoned")
            self.cond.notify_all()

    def _send(self) -> None:
        try:
            dc.send_views(self.sock, [dc.FRAME.pack(dc.VALUES_MAGIC, 0, len(self.region))])
            while self.sent < len(self.region):
                with self.cond:
                    if not self.cond.wait_for(lambda: self.error is not None or self.complete or self.ready > self.sent,
                                              timeout=self.idle_seconds):
                        raise TimeoutError(f"no values written for {self.idle_seconds:g} s")
                    if self.error is not None:
                        return
                    stop = len(self.region) if self.complete else self.ready
                dc.send_views(self.sock, [self.region[self.sent:stop]])
                self.sent = stop
        except BaseException as exc:   # told by finish
            with self.cond:
                self.error = self.error or exc


def _error_frame(code: str, reason: str, message: str) -> list[bytes]:
    status = pb.DataChannelStatus(code=code, reason=reason, message=shorten(message)).SerializeToString()
    return [dc.FRAME.pack(dc.ERROR_MAGIC, len(status), 0), status]


def _peer(address) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
