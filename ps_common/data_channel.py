"""The data channel: PushPull's bytes between a worker and a shard on another host, over a TCP connection of
their own instead of gRPC messages (docs/protocol.md, "The data channel between hosts").

gRPC Python touches every byte of a message in Python-level code (serialization, a copy into
and out of its buffers) and moves a 100 MB push and pull at well under half the speed of a plain
socket. Here the tensors' bytes go from the arrays to the kernel and back with `socket.sendmsg`
(a list of memoryviews, no join) and `recv_into` (straight into preallocated memory or the
destination arrays): nothing per byte runs in Python, and no copy is made but the kernel's.

Both sides use the shared-memory `Layout` of the shard's parts (ps_common/shared_memory.py): a
request's body is the layout's gradient region, an answer's body its values region, padding
included, so the shard receives into a per-connection buffer laid out like a segment and reuses
the shared-memory code path (gradients as views of it, values written into it under the lock).
A connection opened for some tensors only (a sparse step's dense ones) has the layout of their
parts; its frames' headers carry the step's row gradients and the rows read, as over gRPC.

1. The worker asks for a ticket over the authenticated `OpenDataChannel` rpc (`Tickets`: 32
   random bytes, good once, for TICKET_SECONDS, bound to the worker and the layout it was
   issued for); the shard answers its channel port, the layout's sizes, and whether the
   connection is TLS.
2. The worker connects, sends HELLO (magic, version, flags, ticket) and gets WELCOME_OK, or
   WELCOME_REFUSED and a closed connection.
3. Request frames: FRAME (REQUEST_MAGIC, header bytes, body bytes), a serialized
   PushPullRequest without chunks (ps_common/frames.py), then the gradient region. Answers:
   REPLY_MAGIC with a PushPullResponse without chunks and the values region when ready, or
   ERROR_MAGIC with a DataChannelStatus (the status gRPC would have given) and no body.
4. Values first (a worker whose hello has FLAG_VALUES_FIRST, for a values region of at least
   VALUES_FIRST_MIN_BYTES): the shard may answer VALUES_MAGIC (no header, the values region as
   its body), sent while the shard still writes the rest of the region, then REPLY_MAGIC or
   ERROR_MAGIC without a body. The values are the read's, committed before their first byte
   goes; the reply that follows says the rest (an error reply after them: the call failed).
5. Bytes in shared memory (a worker on the shard's host with a shared-memory segment open with it): a frame
   SEGMENT_MAGIC with the request's header and no body says the gradients are in the worker's segment; the
   shard reads them there and writes the values there, and answers REPLY_MAGIC or ERROR_MAGIC without a body.
   The socket carries a call's control only, as gRPC does for the segment, at a fraction of gRPC's cost.

Everything here is framing and sockets, for both sides; what a frame means is the shard's
(ps_server/data_channel.py, ps_server/service.py) and the client's
(worker_client/client/ps_client.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import mmap
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ps_common.codec import MAX_MESSAGE_BYTES, sum_is_finite
from ps_common.errors import PSError
from ps_common.shard_map import PartKey
from ps_common.shared_memory import ALIGN, Layout, Slot, SlotMemory
from ps_common.tls import read_pem

#: The hello a worker sends first: magic, version, flags, two zero bytes, the ticket. (Version 1's hellos had
#: three zero bytes there: a shard that reads no flags ignores them.)
HELLO = struct.Struct("<4sBB2x32s")
HELLO_MAGIC = b"PSDC"
VERSION = 1
#: Hello flag: the worker reads answers whose values come before their reply (VALUES_MAGIC).
FLAG_VALUES_FIRST = 0x01
#: The shard's answer to a hello: WELCOME_OK or WELCOME_REFUSED, then four zero bytes.
WELCOME = struct.Struct("<4s4x")
WELCOME_OK, WELCOME_REFUSED = b"PSOK", b"PSNO"
#: Every frame's prefix: magic, the header's bytes (uint32), the body's bytes (uint64), little-endian.
FRAME = struct.Struct("<4sIQ")
REQUEST_MAGIC, REPLY_MAGIC, ERROR_MAGIC = b"PSPQ", b"PSPR", b"PSPE"
#: An answer's values region sent ahead of its reply (step 4 above).
VALUES_MAGIC = b"PSPV"
#: A request whose bytes are in the worker's shared-memory segment with the shard (step 5 above).
SEGMENT_MAGIC = b"PSPS"
#: The smallest values region a shard sends ahead of its reply: below it, what the overlap saves (the time the
#: shard takes to write the region) is less than the cost of the thread that sends it (at 256 KiB, a push then
#: pull of 1 MB across a 10 Gbit/s link went from 0.77 to 0.55-0.60 GB/s).
VALUES_FIRST_MIN_BYTES = 1 << 20
#: Bytes of a ticket.
TICKET_BYTES = 32
#: A ticket not used within this long is void (seconds).
TICKET_SECONDS = 30.0
#: Tickets outstanding at once (one per worker is the need); more are refused.
MAX_TICKETS = 4096
#: Longest wait of either side for the other during the hello, TLS handshake included (seconds).
HANDSHAKE_SECONDS = 5.0
#: The largest frame header either side takes (bytes): a PushPullRequest or PushPullResponse without chunks, a
#: sparse step's row gradients or rows read in it; gRPC's bound on one message.
MAX_HEADER_BYTES = MAX_MESSAGE_BYTES
#: Buffers per sendmsg/recvmsg_into call (Linux's IOV_MAX is 1024).
MAX_IOV = 512

assert HELLO.size == 40 and WELCOME.size == 8 and FRAME.size == 16


class DataChannelUnavailableError(PSError):
    """A data channel asked for where there is none (the shard serves none, or the connection's layout no longer
    fits the shard's parts): FAILED_PRECONDITION; the client goes on over gRPC bytes."""

    status, reason = "FAILED_PRECONDITION", "DATA_CHANNEL_UNAVAILABLE"


class ProtocolError(Exception):
    """Bytes on a data channel that break its framing (bad magic, sizes off the layout, a closed connection
    mid-frame): the connection is closed and nothing of the frame is applied."""


# ---------------------------------------------------------------------- regions of a layout


def wire_layout(parts: Sequence[tuple[PartKey, np.dtype, tuple[int, ...]]], narrow: np.dtype | None = None) -> Layout:
    """The layout of a shard's parts as they travel on a connection: ps_common.shared_memory.Layout's (the same
    slots, in the same order), with float32 parts in `narrow` (the job's half-size wire) when it is set."""
    base = Layout.of(parts)
    if narrow is None:
        return base

    def slots(of: Sequence[Slot], offset: int) -> tuple[list[Slot], int]:
        made = []
        for slot in of:
            dtype = np.dtype(narrow) if slot.dtype == np.float32 else slot.dtype
            nbytes = int(np.prod(slot.shape, dtype=np.int64)) * dtype.itemsize
            made.append(Slot(slot.key, dtype, slot.shape, offset, nbytes))
            offset = -(-(offset + nbytes) // ALIGN) * ALIGN
        return made, offset

    gradients, values_offset = slots(base.gradients, 0)
    values, end = slots(base.values, values_offset)
    return Layout(tuple(gradients), tuple(values), values_offset, max(end, ALIGN))



def _region(slots: Sequence[Slot], start: int, end: int) -> list[tuple[int, int]]:
    """(slot index or -1 for padding, bytes) pieces covering [start, end) of a layout, in order."""
    pieces, at = [], start
    for i, slot in enumerate(slots):
        if slot.offset > at:
            pieces.append((-1, slot.offset - at))
        pieces.append((i, slot.nbytes))
        at = slot.offset + slot.nbytes
    if end > at:
        pieces.append((-1, end - at))
    return [(i, n) for i, n in pieces if n]


def gradient_bytes(layout: Layout) -> int:
    """A request body's bytes: the layout's gradient region."""
    return layout.values_offset


def values_bytes(layout: Layout) -> int:
    """A ready answer's body bytes: the layout's values region."""
    return layout.size - layout.values_offset


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("a data channel sends and receives C-contiguous arrays only")
    return memoryview(array.reshape(-1).view(np.uint8))


def region_views(slots: Sequence[Slot], start: int, end: int, arrays: Sequence[np.ndarray],
                 padding: memoryview, pieces: Sequence[tuple[int, int]] | None = None) -> list[memoryview]:
    """Byte views of `arrays` (one per slot, its dtype and shape) and of `padding` in the region's order;
    `pieces`: the region's `_region(slots, start, end)` when the caller keeps it (a link, for every frame)."""
    views = []
    for i, n in _region(slots, start, end) if pieces is None else pieces:
        if i < 0:
            views.append(padding[:n])
            continue
        array, slot = arrays[i], slots[i]
        if array.dtype != slot.dtype or tuple(array.shape) != slot.shape:
            raise ValueError(f"{slot.key}: {array.dtype}{list(array.shape)} does not fit the layout's "
                             f"{slot.dtype}{list(slot.shape)}")
        views.append(as_bytes(array))
    return views


# ---------------------------------------------------------------------- moving bytes


def _is_tls(sock: socket.socket) -> bool:
    return isinstance(sock, ssl.SSLSocket)


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """Every later send and receive on `sock` waits at most `seconds` for the peer, then raises TimeoutError.

    A plain socket keeps the bound in the kernel (SO_RCVTIMEO and SO_SNDTIMEO on a blocking socket) and the
    helpers below turn its EAGAIN into TimeoutError: Python's own timeout (`settimeout`) polls the socket before
    every send and receive, four polls a frame on each side, which cost a round trip of a small frame on
    loopback some 30 us of the 60-100 a plain ping-pong takes on these machines. A TLS socket keeps Python's
    timeout: its reads and writes loop inside the ssl module, which a kernel bound would cut short."""
    if _is_tls(sock):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    micros = max(1, round(seconds * 1e6))   # a zero timeval would mean no bound at all
    bound = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)


def _timed_out(doing: str) -> TimeoutError:
    """The TimeoutError of a blocking socket's kernel bound (set_timeout) running out (raised from its EAGAIN)."""
    return TimeoutError(f"{doing} waited past the socket's timeout")


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes]) -> None:
    """Sends every byte of `views`, in order: sendmsg with up to MAX_IOV buffers a call (TLS: one write each)."""
    if _is_tls(sock):   # SSLSocket has no sendmsg; its sendall encrypts from the view
        for view in views:
            if len(view):
                sock.sendall(view)
        return
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        try:
            sent = sock.sendmsg(pending[:MAX_IOV])
        except BlockingIOError as exc:
            raise _timed_out("a send") from exc
        while sent and sent >= len(pending[0]):
            sent -= len(pending[0])
            pending.pop(0)
        if sent:
            pending[0] = pending[0][sent:]


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fills every byte of `views` from the socket; ProtocolError when the peer closes first."""
    if _is_tls(sock):   # SSLSocket has no recvmsg_into
        for view in views:
            _recv_into(sock, view)
        return
    pending = [v for v in views if len(v)]
    while pending:
        try:
            got = sock.recvmsg_into(pending[:MAX_IOV])[0]
        except BlockingIOError as exc:
            raise _timed_out("a receive") from exc
        if not got:
            raise ProtocolError(f"the peer closed the connection with {sum(len(v) for v in pending)} bytes "
                                "of a frame unread")
        while got and got >= len(pending[0]):
            got -= len(pending[0])
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]


#: Bytes of a request body checked for NaN and inf at a time as they arrive (recv_checking_finite).
FINITE_CHUNK_BYTES = 1 << 20


def recv_checking_finite(sock: socket.socket, region: memoryview, slots: Sequence[Slot], *,
                         header: memoryview | None = None) -> frozenset[PartKey]:
    """Fills `region` (a layout's gradient region, `slots` its slots) from the socket as recv_views does, and
    sums each float32 and float64 slot's elements a chunk at a time as they arrive, while they are still in the
    cache and the link brings the next ones: the keys of the slots whose every partial sum is finite, so every
    element is (a NaN or an inf makes its sum NaN or inf). A slot left out, of another dtype or whose sum
    overflowed, is checked whole by the shard as before. ProtocolError when the peer closes first. `header`:
    the frame's header, which comes before the region, filled in the same receive as the region's first chunk
    (one receive less a frame)."""
    summed = [slot for slot in slots if slot.dtype.kind == "f" and slot.nbytes]
    unsure: set[PartKey] = set()
    end = len(region)
    if header is not None and not end:
        _recv_into(sock, header)
    for start in range(0, end, FINITE_CHUNK_BYTES):
        stop = min(start + FINITE_CHUNK_BYTES, end)
        if header is not None:
            recv_views(sock, [header, region[start:stop]])
            header = None
        else:
            _recv_into(sock, region[start:stop], unread_after=end - stop)
        for slot in summed:
            lo, hi = max(slot.offset, start), min(slot.offset + slot.nbytes, stop)
            if lo < hi and slot.key not in unsure:
                piece = np.frombuffer(region, dtype=slot.dtype, count=(hi - lo) // slot.dtype.itemsize, offset=lo)
                if not sum_is_finite(piece):
                    unsure.add(slot.key)
    return frozenset(slot.key for slot in summed if slot.key not in unsure)


def _recv_into(sock: socket.socket, view: memoryview, *, unread_after: int = 0) -> None:
    """Fills `view`; `unread_after`: the frame's bytes after it, for the error when the peer closes first."""
    at = 0
    while at < len(view):
        try:
            got = sock.recv_into(view[at:])
        except BlockingIOError as exc:
            raise _timed_out("a receive") from exc
        if not got:
            raise ProtocolError(f"the peer closed the connection with {len(view) - at + unread_after} bytes of a "
                                "frame unread")
        at += got


def recv_exactly(sock: socket.socket, n: int, *, at_boundary: bool = False) -> bytes | None:
    """`n` bytes; ProtocolError when the peer closes first (None when it closes before the first byte and
    `at_boundary`: a clean end between frames)."""
    data = bytearray(n)
    view = memoryview(data)
    at = 0
    while at < n:
        try:
            got = sock.recv_into(view[at:])
        except BlockingIOError as exc:
            raise _timed_out("a receive") from exc
        if not got:
            if at == 0 and at_boundary:
                return None
            raise ProtocolError(f"the peer closed the connection after {at} of {n} bytes")
        at += got
    return bytes(data)


def read_prefix(sock: socket.socket, *, at_boundary: bool = False) -> tuple[bytes, int, int] | None:
    """A frame's (magic, header bytes, body bytes); None for a clean close between frames (`at_boundary`)."""
    raw = recv_exactly(sock, FRAME.size, at_boundary=at_boundary)
    return None if raw is None else FRAME.unpack(raw)


class CastArrays:
    """Arrays kept per key for a frame's casts on a half-size wire (a worker narrowing its gradients, a shard
    widening them): each is used inside its frame's call and rewritten by the next frame's. A fresh array a
    frame cost its pages' faults: a 1 MB float32 part's cast took 0.7 ms in the training loop, 0.15 alone."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, np.ndarray] = {}

    def cast(self, key: Hashable, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """`array` cast to `dtype` (same kind, any width) in the array kept for `key`."""
        kept = self._kept.get(key)
        if kept is None or kept.shape != array.shape or kept.dtype != dtype:
            kept = self._kept[key] = np.empty(array.shape, dtype)
        np.copyto(kept, array, casting="same_kind")
        return kept


class FrameBuffer(SlotMemory):
    """A connection's memory laid out like a shared-memory segment (anonymous pages, made on first touch).

    A SlotMemory as ps_common.shared_memory.Segment is, so the shard's shared-memory code path reads
    gradients from it and writes values into it.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1))
        super().__init__(memoryview(self._map)[:size])
        #: the gradient slots of the frame now in the buffer found finite as they arrived (recv_checking_finite)
        self.finite: frozenset[PartKey] = frozenset()
        #: a half-size wire's gradients widened to float32, read inside the frame's call
        self.widened = CastArrays()

    def close(self) -> None:
        self._forget_views()
        try:
            self.buffer.release()
            self._map.close()
        except (BufferError, ValueError):   # a view still exported: the memory goes with the last one
            pass


# ---------------------------------------------------------------------- tickets


@dataclass(frozen=True)
class Grant:
    """What a ticket opens: a connection for one worker, with the layout of the shard's parts `generation` (float32
    parts in `narrow`, the job's half-size wire, when set), of the tensors `names` only when set."""

    worker_id: str
    layout: Layout
    generation: int
    narrow: np.dtype | None = None
    names: frozenset[str] | None = None


class Tickets:
    """One-time tickets for data-channel connections: `issue` makes one, `take` uses it up. Thread-safe."""

    def __init__(self, *, seconds: float = TICKET_SECONDS, limit: int = MAX_TICKETS) -> None:
        self.seconds = seconds
        self.limit = limit
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[float, Grant]] = {}

    def issue(self, grant: Grant) -> bytes:
        """A fresh ticket for `grant`; OSError when too many are outstanding."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for old in [t for t, (expiry, _) in self._tickets.items() if expiry < now]:
                del self._tickets[old]
            if len(self._tickets) >= self.limit:
                raise OSError(f"{len(self._tickets)} data-channel tickets outstanding")
            self._tickets[ticket] = (now + self.seconds, grant)
        return ticket

    def take(self, ticket: bytes) -> Grant | None:
        """The grant of a valid ticket, which is then void; None for a wrong, used or expired one. Every known
        ticket is compared in constant time."""
        now = time.monotonic()
        found = None
        with self._lock:
            for known in list(self._tickets):
                if hmac.compare_digest(known, ticket):
                    found = known
            if found is None:
                return None
            expiry, grant = self._tickets.pop(found)
        return grant if expiry >= now else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._tickets)


# ---------------------------------------------------------------------- TLS


def server_tls_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The shard's side: its certificate and key (the gRPC port's), and client certificates required when
    `client_ca` is set (mutual TLS). ValueError naming a file that cannot be used."""
    for path, what in ((cert, "tls_cert"), (key, "tls_key")):
        read_pem(path, what)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
        if client_ca is not None:
            read_pem(client_ca, "tls_client_ca")
            context.load_verify_locations(cafile=client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        raise ValueError(f"the data channel cannot use tls_cert {cert!r} and tls_key {key!r}: {exc}") from exc
    return context


def client_tls_context(ca_path: str | os.PathLike[str] | None = None, cert_path: str | os.PathLike[str] | None = None,
                       key_path: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """The worker's side, from the same files as its gRPC credentials (ps_common.tls.client_security): trust
    `ca_path` (None: the system's roots), check the shard's host name, and present cert/key when both are
    given (mutual TLS). Give it to PSClient as `data_channel_tls`."""
    if (cert_path is None) != (key_path is None):
        raise ValueError(f"a client certificate needs both cert_path and key_path (got cert_path={cert_path!r}, "
                         f"key_path={key_path!r})")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_path is not None:
        read_pem(ca_path, "CA certificate (tls_ca)")
        context.load_verify_locations(cafile=os.fspath(ca_path))
    if cert_path is not None and key_path is not None:
        read_pem(cert_path, "client certificate (tls_cert)")
        read_pem(key_path, "client key (tls_key)")
        context.load_cert_chain(os.fspath(cert_path), os.fspath(key_path))
    return context


class SendTurn(Protocol):
    """A frame's place in an order of sends (the client's: one shard's frame after another's)."""

    def wait(self) -> None:
        """Returns when this frame may be sent (bounded)."""

    def done(self) -> None:
        """This frame is sent (or failed): the next may go."""


def _remote_peer(sock: socket.socket) -> bool:
    """Whether `sock`'s peer is on another host: not a loopback address and not this end's own address (a
    connection to one of this host's interfaces comes from that address)."""
    try:
        local, peer = sock.getsockname()[0], sock.getpeername()[0]
    except (OSError, IndexError, TypeError):   # not an IP socket (a test's socketpair)
        return False
    try:
        return not ipaddress.ip_address(peer.split("%")[0]).is_loopback and peer != local
    except ValueError:
        return False


def no_delay(sock: socket.socket) -> None:
    """Frames go out at once (a prefix and a small header must not wait for Nagle's timer)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


# ---------------------------------------------------------------------- the worker's side


class Link:
    """A worker's open data channel with one shard: `exchange` sends a frame and receives its answer (`send`,
    then `answer`: a worker with several shards sends every frame before it reads the first answer).

    Not thread-safe: one call in flight per worker and shard, as with shared memory. Any
    OSError or ProtocolError leaves it closed; the caller goes on over gRPC.
    """

    def __init__(self, sock: socket.socket, layout: Layout, *, idle_seconds: float,
                 names: frozenset[str] | None = None) -> None:
        self.sock = sock
        self.layout = layout
        self.names = names   # the tensors the layout holds (None: every part of the shard)
        self.idle_seconds = idle_seconds
        self.closed = False
        self.frames = 0   # answered frames: a link that never answered one is not reopened at once
        self.values_first = 0   # of them, answers whose values came ahead of their reply (VALUES_MAGIC)
        self.in_segment = 0     # of them, frames whose bytes were in a shared-memory segment (SEGMENT_MAGIC)
        self._last_used = time.monotonic()
        self._timeout: float | None = None   # the socket's timeout as set_timeout last set it
        self._padding = memoryview(bytearray(64))   # pads are < ALIGN bytes: read into, or sent from, here
        # the gradient and values regions' pieces (slot or padding, bytes), the same for every frame
        self._gradient_pieces = _region(layout.gradients, 0, layout.values_offset)
        self._value_pieces = _region(layout.values, layout.values_offset, layout.size)
        #: whether the shard is on another host: its address is neither a loopback one nor this end's own
        self.remote = _remote_peer(sock)

    @classmethod
    def connect(cls, host: str, port: int, ticket: bytes, layout: Layout, *, tls: ssl.SSLContext | None = None,
                server_hostname: str | None = None, timeout: float = HANDSHAKE_SECONDS,
                idle_seconds: float = 30.0, names: frozenset[str] | None = None) -> "Link":
        """Connects, shows the ticket and waits for the welcome; OSError (ssl.SSLError, a timeout) when the port
        cannot be reached or TLS fails, ProtocolError when the shard refuses the ticket. `names`: the tensors the
        ticket's layout holds (None: every part)."""
        raw = socket.create_connection((host, port), timeout=timeout)
        sock: socket.socket = raw
        try:
            no_delay(raw)
            if tls is not None:
                sock = tls.wrap_socket(raw, server_hostname=server_hostname or host)
            sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION, FLAG_VALUES_FIRST, ticket))
            answer = recv_exactly(sock, WELCOME.size)
            (magic,) = WELCOME.unpack(answer)
            if magic != WELCOME_OK:
                raise ProtocolError(f"the shard refused the ticket ({magic!r}): used, expired, or never issued")
            return cls(sock, layout, idle_seconds=idle_seconds, names=names)
        except BaseException:
            sock.close()
            raise

    def usable(self) -> bool:
        """Whether a frame may go now: open, used recently enough that the shard has not cut it as idle, and
        nothing unasked-for waiting to be read (the shard closed it)."""
        if self.closed:
            return False
        margin = min(1.0, self.idle_seconds / 4)
        if time.monotonic() - self._last_used > self.idle_seconds - margin:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def exchange(self, header: bytes, gradients: Sequence[np.ndarray], values: Sequence[np.ndarray], *,
                 timeout: float, turn: SendTurn | None = None) -> tuple[bytes, bytes, bool]:
        """Sends a request frame (`header`, then `gradients`, one per gradient slot of the layout) and reads its
        answer, its values straight into `values` (one per value slot) when ready: `send`, then `answer`.

        Returns (magic, answer header, whether the values were received). OSError or ProtocolError
        close the link: the frame may or may not have been applied (a resend with the same clock is safe).
        """
        self.send(header, gradients, timeout=timeout, turn=turn)
        return self.answer(values)

    def send(self, header: bytes, gradients: Sequence[np.ndarray], *, timeout: float,
             turn: SendTurn | None = None) -> None:
        """Sends a request frame (`header`, then `gradients`, one per gradient slot of the layout); its answer is
        read by `answer`, before the next frame. `timeout` bounds each of the socket's sends and receives until
        then. With a `turn`, the frame is sent when the turn comes, and the turn handed on once it is sent
        (whether or not that went well). OSError or ProtocolError close the link."""
        layout = self.layout
        try:
            self._bound(timeout)
            body = region_views(layout.gradients, 0, layout.values_offset, gradients, self._padding,
                                self._gradient_pieces)
            if turn is not None:
                turn.wait()
            try:
                send_views(self.sock, [FRAME.pack(REQUEST_MAGIC, len(header), gradient_bytes(layout)), header, *body])
            finally:
                if turn is not None:
                    turn.done()
        except BaseException:
            self.close()
            raise

    def answer(self, values: Sequence[np.ndarray]) -> tuple[bytes, bytes, bool]:
        """Reads the answer to the frame `send` sent, its values straight into `values` (one per value slot) when
        ready: (magic, answer header, whether the values were received). OSError or ProtocolError close the
        link: the frame may or may not have been applied (a resend with the same clock is safe)."""
        layout = self.layout
        try:
            magic, header_bytes, body_bytes = read_prefix(self.sock)
            ahead = magic == VALUES_MAGIC
            if ahead:   # the values first, then their reply without a body
                if header_bytes or body_bytes != values_bytes(layout):
                    raise ProtocolError(f"values sent ahead with a {header_bytes}-byte header and {body_bytes} body "
                                        f"bytes; the layout's values region holds {values_bytes(layout)}")
                recv_views(self.sock, region_views(layout.values, layout.values_offset, layout.size, values,
                                                   self._padding, self._value_pieces))
                magic, header_bytes, body_bytes = read_prefix(self.sock)
                if magic not in (REPLY_MAGIC, ERROR_MAGIC) or header_bytes > MAX_HEADER_BYTES or body_bytes:
                    raise ProtocolError(f"values sent ahead of a frame with magic {magic!r}, a {header_bytes}-byte "
                                        f"header and {body_bytes} body bytes (a reply or an error without a body)")
            elif magic not in (REPLY_MAGIC, ERROR_MAGIC) or header_bytes > MAX_HEADER_BYTES:
                raise ProtocolError(f"an answer frame with magic {magic!r} and a {header_bytes}-byte header")
            elif body_bytes not in (0, values_bytes(layout)) or (magic == ERROR_MAGIC and body_bytes):
                raise ProtocolError(f"an answer of {body_bytes} body bytes; the layout's values region holds "
                                    f"{values_bytes(layout)}")
            if body_bytes:   # the header and the values in one receive
                head = bytearray(header_bytes)
                recv_views(self.sock, [memoryview(head), *region_views(
                    layout.values, layout.values_offset, layout.size, values, self._padding, self._value_pieces)])
                answer = bytes(head)
            else:
                answer = recv_exactly(self.sock, header_bytes)
            self._last_used = time.monotonic()
            self.frames += 1
            self.values_first += ahead
            return magic, answer, bool(body_bytes) or (ahead and magic == REPLY_MAGIC)
        except BaseException:
            self.close()
            raise

    def exchange_in_segment(self, header: bytes, *, timeout: float) -> tuple[bytes, bytes]:
        """Sends a frame whose bytes are in the worker's shared-memory segment with the shard (SEGMENT_MAGIC: the
        request's `header`, no body) and reads its answer, which has no body either: `send_in_segment`, then
        `answer_in_segment`."""
        self.send_in_segment(header, timeout=timeout)
        return self.answer_in_segment()

    def send_in_segment(self, header: bytes, *, timeout: float) -> None:
        """Sends a frame whose bytes are in the worker's shared-memory segment with the shard (SEGMENT_MAGIC: the
        request's `header`, no body); the gradients must be in the segment before. Its answer is read by
        `answer_in_segment`. OSError or ProtocolError close the link."""
        try:
            self._bound(timeout)
            send_views(self.sock, [FRAME.pack(SEGMENT_MAGIC, len(header), 0), header])
        except BaseException:
            self.close()
            raise

    def answer_in_segment(self) -> tuple[bytes, bytes]:
        """The answer to the frame `send_in_segment` sent, which has no body: (magic, answer header); the values
        are in the segment after a ready reply. OSError or ProtocolError close the link, as answer's do."""
        try:
            magic, header_bytes, body_bytes = read_prefix(self.sock)
            if magic not in (REPLY_MAGIC, ERROR_MAGIC) or header_bytes > MAX_HEADER_BYTES or body_bytes:
                raise ProtocolError(f"an answer to a frame whose bytes are in shared memory with magic {magic!r}, "
                                    f"a {header_bytes}-byte header and {body_bytes} body bytes (a reply or an error "
                                    "without a body)")
            answer = recv_exactly(self.sock, header_bytes)
            self._last_used = time.monotonic()
            self.frames += 1
            self.in_segment += 1
            return magic, answer
        except BaseException:
            self.close()
            raise

    def _bound(self, timeout: float) -> None:
        """The socket's timeout for the next call, set only when it changes (a setsockopt each)."""
        if timeout != self._timeout:
            set_timeout(self.sock, timeout)
            self._timeout = timeout

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def endpoint(address: str, channel_options: Sequence[tuple[str, Any]] = ()) -> tuple[str, str]:
    """(host to connect to, name the shard's certificate must carry) for a shard's gRPC HOST:PORT; the name is
    gRPC's "grpc.ssl_target_name_override" when given, as for the gRPC channel."""
    host = address.rpartition(":")[0].strip("[]") or address
    override = next((str(v) for k, v in channel_options if k == "grpc.ssl_target_name_override"), None)
    return host, override or host
