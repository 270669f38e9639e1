"""The data channel's framing and its listener, with a stand-in for the shard (ps_common/data_channel.py,
ps_server/data_channel.py): round trips, and every kind of bad input closing the connection with nothing served.

Every server binds 127.0.0.1 port 0; every socket has a timeout; the fuzz test's examples are bounded.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_common import data_channel as dc
from ps_common import frames
from ps_common.data_channel import FrameBuffer, Grant, Link, ProtocolError, Tickets
from ps_common.errors import InvalidRequestError, ShuttingDownError
from ps_common.shared_memory import Layout
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_server.data_channel import DataChannelServer, Violation

PARTS = [(("w", 0), np.float32, (5, 3)), (("b", 0), np.float32, (3,)), (("ids", 0), np.int64, (4,)),
         (("h", 0), np.float64, (7,))]
LAYOUT = Layout.of(PARTS)
TIMEOUT = 5.0
EXAMPLES = int(os.environ.get("PS_FUZZ_EXAMPLES", "60"))


class Stand:
    """A stand-in for the shard behind the channel: values = 2 x gradients (ints: 0, 1, 2, ...); records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, pb.PushHeader]] = []
        self.fail: Exception | None = None
        self.fail_after_values: Exception | None = None   # raised once every value is written (and told)
        self.regress = False   # tells a part's bytes, then fewer
        self.pause = 0.0   # seconds to stop for after the first part's first half is told
        self.offered: list[bool] = []   # whether each call was given `written` (values first)
        self.in_segment: list[bool] = []   # whether each call's bytes were in shared memory (no buffer)
        self.segment_body: list[bytes] | None = None   # answers a frame whose bytes are in shared memory with it

    def __call__(self, grant: Grant, raw: bytes, memory: FrameBuffer | None, written=None):
        worker_id, layout = grant.worker_id, grant.layout
        frame = frames.decode_request(raw)
        if frame.header.worker_id != worker_id:
            raise Violation(f"header names {frame.header.worker_id!r}")
        if self.fail is not None:
            raise self.fail
        self.calls.append((worker_id, frame.header))
        self.offered.append(written is not None)
        self.in_segment.append(memory is None)
        if memory is None:   # the bytes are in a segment the stand does not have: the reply alone
            push = pb.PushResponse(outcome=pb.PUSH_ACCEPTED, step=frame.header.clock + 1, clock=frame.header.clock + 1)
            return frames.encode_response(push, ready=True, step=frame.header.clock + 1), self.segment_body
        grads = {slot.key: memory.view(slot) for slot in layout.gradients}
        for slot in reversed(layout.values):   # the last part first: the first ones gate what can go
            target = memory.view(slot)
            target[...] = 2 * grads[slot.key] if slot.key in grads else np.arange(target.size).reshape(slot.shape)
            if written is not None:
                written(slot.key, slot.nbytes // 2)
                time.sleep(self.pause)
                written(slot.key, slot.nbytes)
                if self.regress:
                    written(slot.key, slot.nbytes // 2)
        if self.fail_after_values is not None:
            raise self.fail_after_values
        push = pb.PushResponse(outcome=pb.PUSH_ACCEPTED, step=frame.header.clock + 1, clock=frame.header.clock + 1)
        ready = frame.pull.wait_timeout_ms != 7   # 7 ms: the stand's "wait ran out"
        body = [memory.buffer[layout.values_offset:layout.size]] if ready else None
        return frames.encode_response(push, ready=ready, step=frame.header.clock + 1 if ready else 0), body


@pytest.fixture
def stand() -> Stand:
    return Stand()


@pytest.fixture
def server(stand: Stand) -> Iterator[DataChannelServer]:
    channel = DataChannelServer("127.0.0.1", 0, stand, idle_seconds=5.0).start()
    yield channel
    channel.close()


def gradients(seed: float = 1.0) -> list[np.ndarray]:
    return [np.full(slot.shape, seed * (i + 1), slot.dtype) for i, slot in enumerate(LAYOUT.gradients)]


def empty_values() -> list[np.ndarray]:
    return [np.empty(slot.shape, slot.dtype) for slot in LAYOUT.values]


def request(worker_id: str = "w0", clock: int = 0, wait_ms: int = 100) -> bytes:
    return frames.encode_request(pb.PushHeader(worker_id=worker_id, clock=clock),
                                 pb.PullAfterPush(wait_timeout_ms=wait_ms, shared_memory=True),
                                 gradients_in_shared_memory=True)


def connect(server: DataChannelServer, worker_id: str = "w0") -> Link:
    ticket = server.offer(worker_id, LAYOUT, 1, known={worker_id})
    return Link.connect("127.0.0.1", server.port, ticket, LAYOUT, timeout=TIMEOUT, idle_seconds=5.0)


def raw_connection(server: DataChannelServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = TIMEOUT) -> bool:
    """Whether the server closes the connection (EOF or reset) within `timeout`, whatever it sent before."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def hello(server: DataChannelServer, worker_id: str = "w0") -> socket.socket:
    """A raw connection past the hello."""
    sock = raw_connection(server)
    sock.sendall(dc.HELLO.pack(dc.HELLO_MAGIC, dc.VERSION, 0, server.offer(worker_id, LAYOUT, 1, known={worker_id})))
    assert dc.recv_exactly(sock, dc.WELCOME.size) == dc.WELCOME.pack(dc.WELCOME_OK)
    return sock


def frame_bytes(header: bytes, seed: float = 1.0) -> bytes:
    """A whole request frame: its prefix, `header` and the gradient region (padding zero)."""
    body = bytearray(dc.gradient_bytes(LAYOUT))
    for slot, g in zip(LAYOUT.gradients, gradients(seed)):
        body[slot.offset:slot.offset + slot.nbytes] = g.tobytes()
    return dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), len(body)) + header + bytes(body)


def wait_until(predicate, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---------------------------------------------------------------------- the layout's regions


def test_the_regions_cover_the_layout_with_its_padding() -> None:
    views = dc.region_views(LAYOUT.gradients, 0, LAYOUT.values_offset, gradients(), memoryview(bytearray(64)))
    assert sum(len(v) for v in views) == dc.gradient_bytes(LAYOUT) == LAYOUT.values_offset
    views = dc.region_views(LAYOUT.values, LAYOUT.values_offset, LAYOUT.size, empty_values(),
                            memoryview(bytearray(64)))
    assert sum(len(v) for v in views) == dc.values_bytes(LAYOUT)
    with pytest.raises(ValueError, match="does not fit"):
        dc.region_views(LAYOUT.gradients, 0, LAYOUT.values_offset, [g.astype(np.float64) for g in gradients()],
                        memoryview(bytearray(64)))
    with pytest.raises(ValueError, match="C-contiguous"):
        dc.as_bytes(np.zeros((4, 4), np.float32).T[:, :2])


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_half_size_wire_layout_narrows_float32_parts_only_and_keeps_every_slot(wire: str) -> None:
    from ps_common import codec

    narrow = codec.WIRE_DTYPES[wire]
    half = dc.wire_layout(PARTS, narrow)
    assert dc.wire_layout(PARTS) == LAYOUT
    assert [s.key for s in half.gradients] == [s.key for s in LAYOUT.gradients]
    assert [s.key for s in half.values] == [s.key for s in LAYOUT.values]
    for full, small in zip(LAYOUT.values, half.values):
        assert small.dtype == (narrow if full.dtype == np.float32 else full.dtype)
        assert small.nbytes == (full.nbytes // 2 if full.dtype == np.float32 else full.nbytes)
        assert small.offset % 64 == 0 and small.shape == full.shape
    assert half.size <= LAYOUT.size and half.values[0].offset == half.values_offset


def test_send_and_receive_views_move_every_byte_across_many_buffers() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(TIMEOUT)
        right.settimeout(TIMEOUT)
        pieces = [np.arange(n, dtype=np.uint8) for n in [1, 0, 1000, 3] * 300]   # > MAX_IOV buffers
        into = [np.empty_like(p) for p in pieces]
        sender = threading.Thread(target=dc.send_views, args=(left, [memoryview(p) for p in pieces]))
        sender.start()
        dc.recv_views(right, [memoryview(p) for p in into])
        sender.join(TIMEOUT)
        for sent, got in zip(pieces, into):
            np.testing.assert_array_equal(sent, got)
        left.close()
        with pytest.raises(ProtocolError, match="closed"):
            dc.recv_views(right, [memoryview(bytearray(4))])



def test_a_timeout_kept_by_the_kernel_bounds_every_receive_and_send_as_a_timeout_error() -> None:
    left, right = socket.socketpair()
    with left, right:
        dc.set_timeout(right, 0.2)
        dc.set_timeout(left, 0.2)
        assert right.gettimeout() is None   # a blocking socket: no poll before each call
        for receive in (lambda: dc.recv_exactly(right, 4), lambda: dc.recv_views(right, [memoryview(bytearray(4))]),
                        lambda: dc.recv_checking_finite(right, memoryview(bytearray(8)), [])):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="receive waited past the socket's timeout"):
                receive()
            assert 0.15 < time.monotonic() - started < 2.0
        left.sendall(b"abcd")   # bytes that come in time are read as before
        assert dc.recv_exactly(right, 4) == b"abcd"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="send waited past the socket's timeout"):
            dc.send_views(left, [memoryview(bytearray(64 << 20))])   # nobody reads: the buffers fill
        assert time.monotonic() - started < 5.0
    left, right = socket.socketpair()
    with left, right:
        dc.set_timeout(right, 1e-9)   # below the kernel's microsecond: still a bound, never none
        with pytest.raises(TimeoutError):
            dc.recv_exactly(right, 4)

# ---------------------------------------------------------------------- tickets


def test_a_ticket_is_good_once_and_not_after_it_expires() -> None:
    tickets = Tickets(seconds=0.2)
    grant = Grant("w0", LAYOUT, 3)
    ticket = tickets.issue(grant)
    assert len(ticket) == dc.TICKET_BYTES
    assert tickets.take(b"\0" * dc.TICKET_BYTES) is None
    assert tickets.take(ticket) == grant
    assert tickets.take(ticket) is None                      # used
    late = tickets.issue(grant)
    time.sleep(0.3)
    assert tickets.take(late) is None                        # expired
    full = Tickets(limit=2)
    full.issue(grant)
    full.issue(grant)
    with pytest.raises(OSError, match="outstanding"):
        full.issue(grant)


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("first", [False, True], ids=["one-frame", "values-first"])
def test_a_frame_goes_and_its_answer_comes_back_into_the_destination_arrays(server, stand, first: bool,
                                                                             monkeypatch) -> None:
    if first:   # the values told as they land go ahead of their reply
        monkeypatch.setattr(dc, "VALUES_FIRST_MIN_BYTES", 0)
    link = connect(server)
    try:
        for clock in range(3):
            values = empty_values()
            magic, answer, received = link.exchange(request(clock=clock), gradients(clock + 1), values,
                                                    timeout=TIMEOUT)
            assert magic == dc.REPLY_MAGIC and received
            reply = frames.decode_response(answer)
            assert reply.ready and reply.step == clock + 1 and reply.push.clock == clock + 1
            for slot, value in zip(LAYOUT.values, values):
                grads = dict(zip((s.key for s in LAYOUT.gradients), gradients(clock + 1)))
                expected = 2 * grads[slot.key] if slot.key in grads else np.arange(value.size).reshape(slot.shape)
                np.testing.assert_array_equal(value, expected)
        assert [h.clock for _, h in stand.calls] == [0, 1, 2] and stand.offered == [first] * 3
        assert link.usable() and link.frames == 3 and link.values_first == (3 if first else 0)
    finally:
        link.close()


def test_an_answer_that_is_not_ready_has_no_body(server) -> None:
    link = connect(server)
    try:
        values = empty_values()
        magic, answer, received = link.exchange(request(wait_ms=7), gradients(), values, timeout=TIMEOUT)
        assert magic == dc.REPLY_MAGIC and not received and not frames.decode_response(answer).ready
        assert link.exchange(request(clock=1), gradients(), values, timeout=TIMEOUT)[2]   # in step still
    finally:
        link.close()


def test_a_typed_error_comes_back_as_an_error_frame_and_the_connection_stays(server, stand) -> None:
    link = connect(server)
    try:
        stand.fail = InvalidRequestError("push from 'w0' at clock 0: gradient of 'w' holds NaN or inf")
        magic, answer, received = link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)
        status = pb.DataChannelStatus.FromString(answer)
        assert magic == dc.ERROR_MAGIC and not received
        assert (status.code, status.reason) == ("INVALID_ARGUMENT", "INVALID_REQUEST") and "NaN" in status.message
        stand.fail = ShuttingDownError("shard 0 is stopping")
        status = pb.DataChannelStatus.FromString(link.exchange(request(), gradients(), empty_values(),
                                                               timeout=TIMEOUT)[1])
        assert (status.code, status.reason) == ("UNAVAILABLE", "SHUTTING_DOWN")
        stand.fail = None
        assert link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)[0] == dc.REPLY_MAGIC
    finally:
        link.close()


def test_a_frame_whose_bytes_are_in_shared_memory_carries_its_header_only_and_the_connection_goes_on(
        server, stand) -> None:
    link = connect(server)
    try:
        magic, answer = link.exchange_in_segment(request(clock=3), timeout=TIMEOUT)
        reply = frames.decode_response(answer)
        assert magic == dc.REPLY_MAGIC and reply.ready and reply.step == 4
        assert stand.in_segment == [True] and stand.offered == [False] and stand.calls[0][1].clock == 3
        assert (link.frames, link.in_segment) == (1, 1)
        values = empty_values()   # the same connection then carries the bytes in its frames
        magic, _, received = link.exchange(request(clock=4), gradients(), values, timeout=TIMEOUT)
        assert magic == dc.REPLY_MAGIC and received and stand.in_segment == [True, False]
        np.testing.assert_array_equal(values[0], 2 * gradients()[0])
        stand.segment_body = [memoryview(bytes(dc.values_bytes(LAYOUT)))]   # a shard's bug: a body after all
        magic, answer = link.exchange_in_segment(request(clock=5), timeout=TIMEOUT)
        status = pb.DataChannelStatus.FromString(answer)
        assert magic == dc.ERROR_MAGIC and status.code == "INTERNAL" and "shared memory" in status.message
        assert not link.closed
    finally:
        link.close()


def test_a_frame_in_shared_memory_with_a_body_closes_the_connection_and_nothing_is_served(server, stand) -> None:
    sock = hello(server)
    with sock:
        header = request()
        sock.sendall(dc.FRAME.pack(dc.SEGMENT_MAGIC, len(header), 8) + header + bytes(8))
        assert closed_by_peer(sock)
    assert stand.calls == []


@pytest.mark.parametrize("answer", ["with-body", "values-first", "request"])
def test_a_worker_refuses_an_answer_to_a_frame_in_shared_memory_that_is_not_a_bare_reply_or_error(answer) -> None:
    reply = frames.encode_response(pb.PushResponse(outcome=pb.PUSH_ACCEPTED, step=1, clock=1), ready=True, step=1)
    sent = {"with-body": dc.FRAME.pack(dc.REPLY_MAGIC, len(reply), 8) + reply + bytes(8),
            "values-first": dc.FRAME.pack(dc.VALUES_MAGIC, 0, 8) + bytes(8),
            "request": dc.FRAME.pack(dc.REQUEST_MAGIC, len(reply), 0) + reply}[answer]
    left, right = socket.socketpair()
    with left, right:
        link = Link(left, LAYOUT, idle_seconds=5.0)
        right.sendall(sent)
        with pytest.raises(ProtocolError, match="frame whose bytes are in shared memory"):
            link.exchange_in_segment(request(), timeout=TIMEOUT)
        assert link.closed
        prefix = dc.read_prefix(right)   # what the worker sent: the header, no body
        assert prefix is not None and prefix[0] == dc.SEGMENT_MAGIC and prefix[2] == 0


def test_a_bug_behind_the_channel_is_internal_and_logged(server, stand, caplog) -> None:
    link = connect(server)
    try:
        stand.fail = KeyError("oops")
        with caplog.at_level(logging.ERROR, logger="ps_server.data_channel"):
            status = pb.DataChannelStatus.FromString(link.exchange(request(), gradients(), empty_values(),
                                                                   timeout=TIMEOUT)[1])
        assert status.code == "INTERNAL" and "KeyError" in status.message
        assert any("internal error" in r.getMessage() for r in caplog.records)
    finally:
        link.close()


def test_a_new_connection_of_the_same_worker_ends_its_old_one(server) -> None:
    first = connect(server)
    second = connect(server)
    try:
        assert wait_until(lambda: not first.usable())
        assert second.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)[0] == dc.REPLY_MAGIC
        assert len(server) == 1
        server.close_worker("w0")
        assert wait_until(lambda: not second.usable())
    finally:
        first.close()
        second.close()


# ---------------------------------------------------------------------- bad input: closed, nothing served


def test_a_wrong_or_used_ticket_is_refused_and_the_connection_closed(server, stand, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ps_server.data_channel"):
        with pytest.raises(ProtocolError, match="refused"):
            Link.connect("127.0.0.1", server.port, b"\1" * dc.TICKET_BYTES, LAYOUT, timeout=TIMEOUT)
    assert any("wrong, used or expired ticket" in r.getMessage() for r in caplog.records)
    ticket = server.offer("w0", LAYOUT, 1, known={"w0"})
    Link.connect("127.0.0.1", server.port, ticket, LAYOUT, timeout=TIMEOUT).close()
    with pytest.raises(ProtocolError, match="refused"):                  # a replayed hello
        Link.connect("127.0.0.1", server.port, ticket, LAYOUT, timeout=TIMEOUT)
    assert stand.calls == []


def test_a_frame_before_the_ticket_closes_the_connection(server, stand) -> None:
    with raw_connection(server) as sock:
        header = request()
        sock.sendall(dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), dc.gradient_bytes(LAYOUT)) + header)
        assert closed_by_peer(sock)
    assert stand.calls == []


@pytest.mark.parametrize("what", ["bad magic", "oversized header", "body off the layout", "truncated body",
                                  "truncated header", "another worker's header"])
def test_a_malformed_frame_closes_the_connection_and_nothing_is_served(server, stand, what: str, caplog) -> None:
    header = request(worker_id="someone-else" if what == "another worker's header" else "w0")
    body = b"".join(bytes(v) for v in dc.region_views(LAYOUT.gradients, 0, LAYOUT.values_offset, gradients(),
                                                      memoryview(bytearray(64))))
    prefix = {"bad magic": dc.FRAME.pack(b"XXXX", len(header), len(body)),
              "oversized header": dc.FRAME.pack(dc.REQUEST_MAGIC, dc.MAX_HEADER_BYTES + 1, len(body)),
              "body off the layout": dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), len(body) + 64)}.get(
        what, dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), len(body)))
    data = prefix + header + body
    if what == "truncated body":
        data = data[:-5]
    elif what == "truncated header":
        data = prefix + header[:2]
    with caplog.at_level(logging.INFO, logger="ps_server.data_channel"), hello(server) as sock:
        sock.sendall(data)
        if what.startswith("truncated"):
            sock.shutdown(socket.SHUT_WR)   # the worker went away mid-frame
        assert closed_by_peer(sock)
    assert stand.calls == []
    assert wait_until(lambda: any("closing the connection" in r.getMessage() for r in caplog.records))


def test_an_idle_connection_and_a_stalled_frame_are_cut(stand, caplog) -> None:
    channel = DataChannelServer("127.0.0.1", 0, stand, idle_seconds=0.3).start()
    try:
        with caplog.at_level(logging.INFO, logger="ps_server.data_channel"):
            with hello(channel) as sock:
                assert closed_by_peer(sock, timeout=3)                       # no frame at all
            with hello(channel) as sock:
                header = request()
                sock.sendall(dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), dc.gradient_bytes(LAYOUT)) + header)
                assert closed_by_peer(sock, timeout=3)                       # half a frame, then silence
        messages = " | ".join(r.getMessage() for r in caplog.records)
        assert "sent no frame" in messages and "stalled mid-frame" in messages
        assert stand.calls == []
        link = Link.connect("127.0.0.1", channel.port, channel.offer("w0", LAYOUT, 1, known={"w0"}), LAYOUT,
                            timeout=TIMEOUT, idle_seconds=0.3)
        time.sleep(0.3)
        assert not link.usable()    # the client knows the shard's idle limit and reopens before it
        link.close()
    finally:
        channel.close()


def test_connections_without_a_ticket_are_bounded(server, monkeypatch) -> None:
    from ps_server import data_channel as server_side

    monkeypatch.setattr(server_side, "MAX_PENDING", 2)
    silent = [raw_connection(server) for _ in range(2)]
    try:
        assert wait_until(lambda: server._pending == 2)
        with raw_connection(server) as extra:
            assert closed_by_peer(extra, timeout=2)
    finally:
        for sock in silent:
            sock.close()


def test_a_stopped_listener_refuses_connections_and_closes_its_own(server) -> None:
    link = connect(server)
    server.close()
    assert wait_until(lambda: not link.usable())
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    link.close()


def test_a_taken_port_is_named() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError, match="data-channel-port"):
            DataChannelServer("127.0.0.1", taken.getsockname()[1], Stand())


# ---------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def cert_files(tmp_path_factory):
    from ps_tools.certs import make_files, write_files

    directory = tmp_path_factory.mktemp("certs")
    write_files(directory, make_files(), force=True)
    other = tmp_path_factory.mktemp("stranger")
    write_files(other, make_files(), force=True)
    return directory, other


def test_a_tls_channel_carries_frames_and_a_client_that_does_not_trust_the_shard_is_refused(stand, cert_files):
    certs, stranger = cert_files
    context = dc.server_tls_context(str(certs / "server.crt"), str(certs / "server.key"))
    channel = DataChannelServer("127.0.0.1", 0, stand, tls=context).start()
    try:
        trusted = dc.client_tls_context(certs / "ca.crt")
        link = Link.connect("127.0.0.1", channel.port, channel.offer("w0", LAYOUT, 1, known={"w0"}), LAYOUT,
                            tls=trusted, timeout=TIMEOUT)
        values = empty_values()
        assert link.exchange(request(), gradients(3), values, timeout=TIMEOUT)[2]
        np.testing.assert_array_equal(values[0], 2 * gradients(3)[0])
        link.close()
        with pytest.raises(OSError):   # ssl.SSLCertVerificationError
            Link.connect("127.0.0.1", channel.port, channel.offer("w0", LAYOUT, 1, known={"w0"}), LAYOUT,
                         tls=dc.client_tls_context(stranger / "ca.crt"), timeout=TIMEOUT)
        with pytest.raises((OSError, ProtocolError)):   # plaintext to a TLS port
            Link.connect("127.0.0.1", channel.port, channel.offer("w0", LAYOUT, 1, known={"w0"}), LAYOUT,
                         timeout=2)
    finally:
        channel.close()
    assert len(stand.calls) == 1


def test_mutual_tls_needs_a_client_certificate_of_the_ca(stand, cert_files):
    certs, stranger = cert_files
    context = dc.server_tls_context(str(certs / "server.crt"), str(certs / "server.key"), str(certs / "ca.crt"))
    channel = DataChannelServer("127.0.0.1", 0, stand, tls=context).start()
    try:
        for client_dir, ok in ((certs, True), (stranger, False), (None, False)):
            tls = dc.client_tls_context(certs / "ca.crt", *(() if client_dir is None else
                                                            (client_dir / "worker.crt", client_dir / "worker.key")))
            ticket = channel.offer("w0", LAYOUT, 1, known={"w0"})
            try:
                link = Link.connect("127.0.0.1", channel.port, ticket, LAYOUT, tls=tls, timeout=TIMEOUT)
                link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)
                link.close()
                got = True
            except (OSError, ProtocolError):
                got = False
            assert got == ok, client_dir
    finally:
        channel.close()
    assert len(stand.calls) == 1


# ---------------------------------------------------------------------- fuzz


def _valid_frame() -> bytes:
    header = request()
    body = b"".join(bytes(v) for v in dc.region_views(LAYOUT.gradients, 0, LAYOUT.values_offset, gradients(),
                                                      memoryview(bytearray(64))))
    return dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), len(body)) + header + body


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    n = len(valid)
    return st.one_of(
        st.binary(max_size=64),
        st.integers(0, n - 1).map(lambda k: valid[:k]),
        st.tuples(st.integers(0, dc.FRAME.size + 40), st.integers(0, 7)).map(
            lambda p: valid[:p[0]] + bytes([valid[p[0]] ^ (1 << p[1])]) + valid[p[0] + 1:]),
        st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(lambda p: valid[:p[0]] + p[1] + valid[p[0]:]),
    )


def test_generated_bad_frames_close_the_connection_or_are_answered_and_the_listener_lives(stand) -> None:
    channel = DataChannelServer("127.0.0.1", 0, stand, idle_seconds=0.5).start()
    valid = _valid_frame()
    outcomes: dict[str, int] = {}
    try:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(raw=_mutations(valid), with_ticket=st.booleans())
        def send(raw: bytes, with_ticket: bool) -> None:
            served = len(stand.calls)
            sock = hello(channel) if with_ticket else raw_connection(channel)
            answer = b""
            with sock:
                try:   # the listener may close the connection while the bytes still go
                    sock.sendall(raw)
                    sock.shutdown(socket.SHUT_WR)
                    sock.settimeout(3)
                    while piece := sock.recv(1 << 16):
                        answer += piece
                except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                    assert not isinstance(exc, TimeoutError), "the listener neither answered nor closed"
            kind = answer[:4].decode("ascii", "replace") if answer else "closed"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if not with_ticket:
                assert len(stand.calls) == served and answer in (b"", dc.WELCOME.pack(dc.WELCOME_REFUSED))
            elif len(stand.calls) > served:   # a frame that is still whole and well-formed: answered
                assert answer.startswith(dc.REPLY_MAGIC)
            else:
                assert answer == b"" or answer.startswith(dc.ERROR_MAGIC)

        send()
        print("outcomes:", outcomes)
        link = connect(channel)   # the listener still serves
        assert link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)[0] == dc.REPLY_MAGIC
        link.close()
    finally:
        channel.close()


# ---------------------------------------------------------------------- send order across hosts


class _Peer:
    """A socket's two addresses, as `_remote_peer` reads them."""

    def __init__(self, local: str, peer: str) -> None:
        self.local, self.peer = local, peer

    def getsockname(self):
        return (self.local, 1)

    def getpeername(self):
        return (self.peer, 2)


@pytest.mark.parametrize(("local", "peer", "remote"), [
    ("127.0.0.1", "127.0.0.1", False), ("::1", "::1", False), ("10.0.0.5", "127.0.0.2", False),
    ("10.77.0.2", "10.77.0.2", False), ("10.77.0.2", "10.77.0.1", True), ("fe80::1%eth0", "fe80::2%eth0", True),
    ("10.0.0.1", "not-an-address", False)])
def test_a_link_is_to_another_host_unless_its_peer_is_a_loopback_address_or_its_own(local, peer, remote) -> None:
    assert dc._remote_peer(_Peer(local, peer)) is remote


def test_a_link_over_loopback_and_a_socketpair_are_on_this_host() -> None:
    left, right = socket.socketpair()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), timeout=5)
    try:
        assert not dc._remote_peer(left)
        assert not dc._remote_peer(client)
    finally:
        for s in (left, right, client, server):
            s.close()


def test_each_shards_frame_waits_for_the_one_before_it_to_be_sent_and_a_turn_not_handed_on_times_out() -> None:
    from worker_client.client.ps_client import _SendOrder

    order = _SendOrder(3, timeout=5.0)
    events: list[str] = []

    def shard(i: int) -> None:
        turn = order.turn(i)
        turn.wait()
        events.append(f"send {i}")
        turn.done()

    threads = [threading.Thread(target=shard, args=(i,)) for i in (2, 1)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert events == []                       # 1 waits for 0, 2 for 1
    shard(0)
    for t in threads:
        t.join(5)
    assert events == ["send 0", "send 1", "send 2"]
    late = _SendOrder(2, timeout=0.2)
    started = time.monotonic()
    late.turn(1).wait()                       # shard 0 never hands its turn on: a bounded wait
    assert 0.15 < time.monotonic() - started < 2.0


# ---------------------------------------------------------------------- values first


def test_on_the_wire_values_first_are_one_frame_of_values_then_the_reply_and_only_for_a_worker_that_asked(
        server, stand, monkeypatch) -> None:
    monkeypatch.setattr(dc, "VALUES_FIRST_MIN_BYTES", 0)
    # on the wire: VALUES_MAGIC with the whole region, then the reply without a body
    sock = raw_connection(server)
    with sock:
        sock.sendall(dc.HELLO.pack(dc.HELLO_MAGIC, dc.VERSION, dc.FLAG_VALUES_FIRST,
                                   server.offer("w0", LAYOUT, 1, known={"w0"})))
        assert dc.recv_exactly(sock, dc.WELCOME.size) == dc.WELCOME.pack(dc.WELCOME_OK)
        sock.sendall(frame_bytes(request(clock=2)))
        assert dc.read_prefix(sock) == (dc.VALUES_MAGIC, 0, dc.values_bytes(LAYOUT))
        dc.recv_exactly(sock, dc.values_bytes(LAYOUT))
        magic, header_bytes, body_bytes = dc.read_prefix(sock)
        assert magic == dc.REPLY_MAGIC and body_bytes == 0
        assert frames.decode_response(dc.recv_exactly(sock, header_bytes)).step == 3
    assert stand.offered == [True]
    # a hello without the flag: one frame, the reply and its values, as before
    sock = hello(server)
    with sock:
        sock.sendall(frame_bytes(request(clock=3)))
        magic, header_bytes, body_bytes = dc.read_prefix(sock)
        assert magic == dc.REPLY_MAGIC and body_bytes == dc.values_bytes(LAYOUT)
    assert stand.offered == [True, False]


def test_a_region_below_the_bound_goes_in_one_frame(server, stand) -> None:
    assert dc.values_bytes(LAYOUT) < dc.VALUES_FIRST_MIN_BYTES
    link = connect(server)
    try:
        assert link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)[2]
        assert stand.offered == [False]
    finally:
        link.close()


def test_an_error_after_the_values_went_ahead_is_the_calls_answer(server, stand, monkeypatch) -> None:
    monkeypatch.setattr(dc, "VALUES_FIRST_MIN_BYTES", 0)
    link = connect(server)
    try:
        stand.fail_after_values = ShuttingDownError("shard 0 is stopping")
        magic, answer, received = link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)
        status = pb.DataChannelStatus.FromString(answer)
        assert magic == dc.ERROR_MAGIC and not received and status.reason == "SHUTTING_DOWN"
        stand.fail_after_values = None
        assert link.exchange(request(clock=1), gradients(), empty_values(), timeout=TIMEOUT)[:3:2] == \
            (dc.REPLY_MAGIC, True)   # the connection stays
    finally:
        link.close()


def test_values_told_again_with_fewer_bytes_close_the_connection_without_a_reply(server, stand, monkeypatch,
                                                                                caplog) -> None:
    monkeypatch.setattr(dc, "VALUES_FIRST_MIN_BYTES", 0)
    stand.regress = True
    link = connect(server)
    with caplog.at_level(logging.INFO, logger="ps_server.data_channel"):
        with pytest.raises(ProtocolError):
            link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)
        assert link.closed
        assert wait_until(lambda: any("told" in r.getMessage() for r in caplog.records))


@pytest.mark.parametrize("answer", ["header", "short", "reply-with-body", "request"])
def test_a_worker_refuses_values_first_that_break_the_framing(answer: str) -> None:
    """The worker's side: values ahead with a header or of another size than the values region, or not followed
    by a reply or error without a body, close the link (ProtocolError)."""
    values = bytes(dc.values_bytes(LAYOUT))
    reply = frames.encode_response(pb.PushResponse(outcome=pb.PUSH_ACCEPTED, step=1, clock=1), ready=True, step=1)
    ahead = dc.FRAME.pack(dc.VALUES_MAGIC, 0, len(values)) + values
    sent = {"header": dc.FRAME.pack(dc.VALUES_MAGIC, 4, len(values)) + b"abcd" + values,
            "short": dc.FRAME.pack(dc.VALUES_MAGIC, 0, len(values) - 64) + values[64:],
            "reply-with-body": ahead + dc.FRAME.pack(dc.REPLY_MAGIC, len(reply), len(values)) + reply + values,
            "request": ahead + dc.FRAME.pack(dc.REQUEST_MAGIC, len(reply), 0) + reply}[answer]
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(TIMEOUT)
        link = Link(left, LAYOUT, idle_seconds=5.0)
        right.sendall(sent)
        with pytest.raises(ProtocolError, match="values sent ahead"):
            link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)
        assert link.closed


def test_a_shard_that_stops_writing_values_it_sent_ahead_for_longer_than_the_idle_bound_closes_the_connection(
        stand, monkeypatch, caplog) -> None:
    monkeypatch.setattr(dc, "VALUES_FIRST_MIN_BYTES", 0)
    stand.pause = 0.6
    channel = DataChannelServer("127.0.0.1", 0, stand, idle_seconds=0.3).start()
    try:
        link = connect(channel)
        with caplog.at_level(logging.INFO, logger="ps_server.data_channel"):
            with pytest.raises(ProtocolError):
                link.exchange(request(), gradients(), empty_values(), timeout=TIMEOUT)
            assert wait_until(lambda: any("no values written for 0.3 s" in r.getMessage() for r in caplog.records))
    finally:
        channel.close()


# ---------------------------------------------------------------------- finite as they arrive

CHECKED_PARTS = [(("a", 0), np.float32, (300_000,)), (("i", 0), np.int64, (10,)), (("d", 0), np.float64, (200_000,)),
                 (("h", 0), np.float16, (8,)), (("z", 0), np.float32, (0,))]


@pytest.mark.parametrize("case", ["finite", "nan-late", "inf-early", "overflowing-sum", "pieces"])
def test_a_request_body_is_checked_for_nan_and_inf_as_it_arrives(case: str, monkeypatch) -> None:
    """recv_checking_finite: every float32 and float64 slot whose partial sums are all finite is known finite; a
    NaN or an inf anywhere (here past the first chunks), or a sum that overflows, leaves its slot to the shard's
    own check; other dtypes are never vouched for. The bytes land as recv_views would put them."""
    layout = Layout.of(CHECKED_PARTS)
    by_key = {slot.key: np.linspace(-1, 1, int(np.prod(slot.shape))).astype(slot.dtype).reshape(slot.shape)
              for slot in layout.gradients}
    if case == "nan-late":
        by_key[("a", 0)][-3] = np.nan
    elif case == "inf-early":
        by_key[("d", 0)][5] = -np.inf
    elif case == "overflowing-sum":
        by_key[("a", 0)][:] = 3e38   # finite, but a sum of them is not
    arrays = [by_key[slot.key] for slot in layout.gradients]
    if case == "pieces":
        monkeypatch.setattr(dc, "FINITE_CHUNK_BYTES", 4096)   # many chunks, and sends cut off them
    body = b"".join(bytes(v) for v in dc.region_views(layout.gradients, 0, layout.values_offset, arrays,
                                                       memoryview(bytearray(64))))
    region = memoryview(bytearray(len(body)))
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(TIMEOUT)

        def send() -> None:
            for at in range(0, len(body), 77_777):
                left.sendall(body[at:at + 77_777])

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        finite = dc.recv_checking_finite(right, region, layout.gradients)
        sender.join(TIMEOUT)
    assert bytes(region) == body
    expected = {"finite": {("a", 0), ("d", 0)}, "pieces": {("a", 0), ("d", 0)}, "nan-late": {("d", 0)},
                "inf-early": {("a", 0)}, "overflowing-sum": {("d", 0)}}[case]
    assert finite == expected


def test_a_body_cut_short_while_checked_is_a_protocol_error() -> None:
    layout = Layout.of(CHECKED_PARTS)
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(TIMEOUT)
        left.sendall(bytes(1000))
        left.close()
        with pytest.raises(ProtocolError, match="closed the connection with"):
            dc.recv_checking_finite(right, memoryview(bytearray(layout.values_offset)), layout.gradients)
