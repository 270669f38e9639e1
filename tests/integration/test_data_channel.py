"""PushPull through the data channel with real shard processes (shared memory off: the bytes cross a TCP
connection as between hosts): the values gRPC gives, at most once under broken and replayed connections, a
clean fallback, TLS, a shard restart, a shard that forgot the worker, and the push-pull benchmark's wire path.

Shards bind 127.0.0.1 port 0 (their channel too); every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps_common import data_channel as dc
from ps_common import frames
from ps_common.errors import InvalidRequestError
from ps_common.shared_memory import Layout
from ps_common.tls import client_security
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from worker_client.client import GRPC_PUSH_PULL_MAX_BYTES, PSClient, RetryPolicy, ServerError
from worker_client.client import ps_client

LR = 0.5
FLAGS = ["--optimizer", "sgd", "--lr", str(LR), "--workers", "1"]
QUICK = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)
TIMEOUT = 10.0


def model(rows: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"w": rng.standard_normal((rows, 8)).astype(np.float32), "b": np.zeros(8, np.float32),
            "ids": np.arange(4, dtype=np.int64)}


def grads(values: dict[str, np.ndarray], g: float = 0.25) -> dict[str, np.ndarray]:
    return {n: np.full_like(v, g) for n, v in values.items() if v.dtype.kind == "f"}


def client(cluster, worker_id: str = "w0", **options) -> PSClient:
    options.setdefault("shared_memory", False)
    c = PSClient(cluster.addresses, worker_id=worker_id, rpc_timeout=20, wait_timeout=20, retry=QUICK, **options)
    c.wait_ready(20)
    return c


def started(cluster, values: dict[str, np.ndarray], **options) -> PSClient:
    return joined(client(cluster, **options), values)


def joined(worker: PSClient, values: dict[str, np.ndarray]) -> PSClient:
    """`worker`, having initialized the job with `values`, registered and pulled once."""
    worker.initialize(values)
    worker.register(heartbeat=False)
    worker.pull()
    return worker


def state(cluster, worker_id: str = "w0") -> tuple:
    """What a refused or repeated frame must not change: each shard's step and the worker's clock, the values."""
    with client(cluster, "observer", data_channel=False) as observer:
        infos = [observer.cluster_info(i) for i in range(cluster.num_shards)]
        observer.fetch_shard_map()
        values = {k: v.tolist() for k, v in sorted(observer.pull().items())}
    clocks = [next((w.clock for w in info.workers if w.worker_id == worker_id), None) for info in infos]
    return [info.step for info in infos], clocks, values


def channel_of(worker: PSClient, shard: int = 0, names: Sequence[str] = ()) -> tuple[pb.DataChannelResponse, Layout, str]:
    """A ticket for the worker's channel with a shard (OpenDataChannel; of the tensors `names` only when given), its
    layout and the shard's host."""
    with grpc.insecure_channel(worker.addresses[shard]) as ch:
        answer = pb_grpc.ParameterServerStub(ch).OpenDataChannel(
            pb.DataChannelRequest(worker_id=worker.worker_id, names=names), timeout=TIMEOUT)
    layout = Layout.of((p.key, p.dtype, p.shape) for p in worker.shard_map.parts_on(shard)
                       if not names or p.name in names)
    return answer, layout, worker.addresses[shard].rpartition(":")[0]


def frame_bytes(worker_id: str, clock: int, layout: Layout, g: float = 0.25) -> bytes:
    header = frames.encode_request(pb.PushHeader(worker_id=worker_id, clock=clock),
                                   pb.PullAfterPush(wait_timeout_ms=100, shared_memory=True),
                                   gradients_in_shared_memory=True)
    body = dc.region_views(layout.gradients, 0, layout.values_offset,
                           [np.full(s.shape, g, s.dtype) for s in layout.gradients], memoryview(bytearray(64)))
    return dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), dc.gradient_bytes(layout)) + header + \
        b"".join(bytes(v) for v in body)


def closed_by_peer(sock: socket.socket, timeout: float = TIMEOUT) -> bytes:
    """Everything the shard sends until it closes the connection (bounded)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while piece := sock.recv(1 << 16):
            got += piece
    except ConnectionResetError:
        pass
    return got


# ---------------------------------------------------------------------- the values


LARGE_ROWS = 80_000   # 2.56 MB of w: each of 2 shards' values region passes dc.VALUES_FIRST_MIN_BYTES


@pytest.mark.parametrize("rows", [16, LARGE_ROWS], ids=["small", "values-first"])
@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_push_pull_through_the_channel_gives_what_grpc_gives(start_cluster, mode: str, rows: int) -> None:
    # past 1 MiB of a shard's values they go ahead of their reply (values first); past one gRPC message the gRPC
    # path pushes and the caller pulls
    values = model(rows)
    runs = {}
    for path in ("channel", "grpc"):
        cluster = start_cluster(2, mode=mode, flags=[*FLAGS, "--partition-min-bytes", "256"])
        with started(cluster, values, data_channel=path == "channel") as worker:
            for step in range(4):
                report, pulled = worker.push_pull(grads(values, 0.25 * (step + 1)), wait_for_step=mode == "sync",
                                                  ssp=mode == "ssp")
                assert report.accepted and (pulled is not None or (path == "grpc" and rows == LARGE_ROWS))
                pulled = worker.pull() if pulled is None else pulled
            assert sorted(worker._links) == ([0, 1] if path == "channel" else [])
            if path == "channel":
                assert [worker._links[i].values_first for i in (0, 1)] == [4 if rows == LARGE_ROWS else 0] * 2
            assert not worker._segments
            assert worker.steps == [4, 4] and worker.clock == 4
            runs[path] = {name: np.array(value) for name, value in pulled.items()}
            np.testing.assert_array_equal(runs[path]["w"], worker.pull()["w"])
    for name, value in values.items():
        np.testing.assert_array_equal(runs["channel"][name], runs["grpc"][name])
        expected = value - LR * 0.25 * (1 + 2 + 3 + 4) if value.dtype.kind == "f" else value
        np.testing.assert_allclose(runs["channel"][name], expected, rtol=1e-6)


def test_values_sent_ahead_to_workers_pushing_at_once_are_each_the_state_after_that_push(start_cluster) -> None:
    # Two workers push 0.25 at once, async, SGD with lr 0.5: after step t every value is its start - 0.125 t, exact
    # in float32; each answer's values must be the state of the step it names, never a mix of two steps.
    start = {"w": (np.arange(LARGE_ROWS * 8, dtype=np.float32) % 5).reshape(LARGE_ROWS, 8),
             "b": np.zeros(8, np.float32)}
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--workers", "2"])
    workers = [started(cluster, start)] + [joined(client(cluster, "w1"), start)]
    failures: list[str] = []
    answered = [0, 0]

    def train(i: int) -> None:
        worker = workers[i]
        try:
            for _ in range(12):
                report, pulled = worker.push_pull(grads(start), wait_for_step=False)
                step = worker.steps[0]
                for name, value in start.items():
                    if not np.array_equal(pulled[name], value - 0.125 * step):
                        failures.append(f"worker {i}: {name} is not the state of step {step}")
                answered[i] += 1
        except Exception as exc:   # reported below
            failures.append(f"worker {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in (0, 1)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "the workers did not finish within 60 s"
        assert not failures, failures[:3]
        assert answered == [12, 12]
        assert [w._links[0].values_first for w in workers] == [12, 12]
        np.testing.assert_array_equal(workers[0].pull()["w"], start["w"] - 0.125 * 24)
    finally:
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("remote", [True, False], ids=["shards-on-another-host", "this-host"])
def test_frames_to_shards_on_another_host_go_one_after_another_and_give_the_same_values(start_cluster, monkeypatch,
                                                                                        remote: bool) -> None:
    """ps_client._SendOrder: across hosts each shard's frame (of at least ORDERED_FRAME_BYTES) is sent once the one
    before it is, so the first shards answer while the rest go up; on this host they go at once. Shards here are
    on loopback, so "another host" is what the link is told."""
    monkeypatch.setattr(dc, "_remote_peer", lambda sock: remote)
    rows = ps_client.ORDERED_FRAME_BYTES // (8 * 4) * 8      # two shards' parts of 4x the ordered size
    values = model(rows=rows)
    sends: list[tuple[tuple, float, float]] = []
    plain_send = dc.send_views

    def timed_send(sock, views):
        started = time.monotonic()
        plain_send(sock, views)
        if sum(len(v) for v in views) >= ps_client.ORDERED_FRAME_BYTES:
            sends.append((sock.getpeername(), started, time.monotonic()))

    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    with started(cluster, values) as worker:
        monkeypatch.setattr(dc, "send_views", timed_send)
        for step in range(3):
            report, pulled = worker.push_pull(grads(values, 0.25 * (step + 1)))
            assert report.accepted and pulled is not None
        monkeypatch.setattr(dc, "send_views", plain_send)
        assert sorted(worker._links) == [0, 1] and all(link.remote is remote for link in worker._links.values())
        peers = [worker._links[i].sock.getpeername() for i in (0, 1)]
        np.testing.assert_array_equal(pulled["w"], worker.pull()["w"])
    for name, value in values.items():
        expected = value - LR * 0.25 * (1 + 2 + 3) if value.dtype.kind == "f" else value
        np.testing.assert_allclose(pulled[name], expected, rtol=1e-6)
    assert len(sends) == 6 and {s[0] for s in sends} == set(peers), sends
    for step in range(3):
        first, second = sorted(sends[2 * step:2 * step + 2], key=lambda s: peers.index(s[0]))
        if remote:
            assert first[2] <= second[1], f"shard 1's frame started at {second[1]}, before shard 0's was sent ({first[2]})"


def recorded_link_calls(monkeypatch) -> list[tuple[str, int, str]]:
    """(send or answer, the shard's channel port, the thread's name) of every Link.send and Link.answer from now on."""
    calls: list[tuple[str, int, str]] = []
    send, answer = dc.Link.send, dc.Link.answer

    def recorded_send(link, *args, **kwargs):
        calls.append(("send", link.sock.getpeername()[1], threading.current_thread().name))
        return send(link, *args, **kwargs)

    def recorded_answer(link, *args, **kwargs):
        calls.append(("answer", link.sock.getpeername()[1], threading.current_thread().name))
        return answer(link, *args, **kwargs)

    monkeypatch.setattr(dc.Link, "send", recorded_send)
    monkeypatch.setattr(dc.Link, "answer", recorded_answer)
    return calls


@pytest.mark.parametrize("large", [False, True], ids=["small-frames", "frames-of-IN_TURN_FRAME_BYTES"])
def test_small_frames_to_several_shards_all_go_from_the_calling_thread_before_the_first_answer_is_read(
        start_cluster, monkeypatch, large: bool) -> None:
    """ps_client.PSClient._frames_in_turn: a step's frames under IN_TURN_FRAME_BYTES go from the caller's thread,
    every frame sent before an answer is read (no hand-off to a pool thread); larger ones from a thread each."""
    rows = ps_client.IN_TURN_FRAME_BYTES // (8 * 4) * 2 + 64 if large else 16   # "w" split over the two shards
    values = model(rows=rows)
    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    with started(cluster, values) as worker:
        worker.push_pull(grads(values, 0.25))   # opens both channels
        ports = sorted(link.sock.getpeername()[1] for link in worker._links.values())
        calls = recorded_link_calls(monkeypatch)
        for step in range(2, 4):
            report, pulled = worker.push_pull(grads(values, 0.25 * step))
            assert report.accepted and pulled is not None
        monkeypatch.undo()
        assert len(calls) == 8 and sorted({port for _, port, _ in calls}) == ports, calls
        if large:
            assert len({thread for _, _, thread in calls}) == 2, calls
        else:
            assert {thread for _, _, thread in calls} == {threading.current_thread().name}, calls
            for step in range(2):
                assert [what for what, _, _ in calls[4 * step:4 * step + 4]] == ["send", "send", "answer", "answer"]
        np.testing.assert_array_equal(pulled["w"], worker.pull()["w"])
        np.testing.assert_allclose(pulled["w"], values["w"] - LR * 0.25 * (1 + 2 + 3), rtol=1e-6)


def test_a_frame_that_cannot_be_sent_in_turn_goes_over_grpc_and_the_other_shards_answer_is_read(
        start_cluster, monkeypatch) -> None:
    values = model()
    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    with started(cluster, values) as worker:
        worker.push_pull(grads(values))
        first, second = worker._links[0], worker._links[1]
        send = dc.Link.send

        def broken_on_shard_1(link, *args, **kwargs):
            if link is second:
                link.close()
                raise OSError("connection reset before the frame went")
            return send(link, *args, **kwargs)

        monkeypatch.setattr(dc.Link, "send", broken_on_shard_1)
        report, pulled = worker.push_pull(grads(values))   # shard 1's share over gRPC
        monkeypatch.undo()
        assert report.accepted and pulled is not None and not report.responses[1].duplicate
        assert worker._links[0] is first and first.frames == 2 and second.closed
        report, pulled = worker.push_pull(grads(values))   # a new channel to shard 1
        assert worker._links[0] is first and first.frames == 3 and worker._links[1] is not second
        np.testing.assert_allclose(pulled["w"], values["w"] - 3 * LR * 0.25, rtol=1e-6)   # each push once
        np.testing.assert_array_equal(pulled["w"], worker.pull()["w"])


@pytest.mark.parametrize("fails", ["an-error-answer", "a-frame-not-made"])
def test_a_step_in_turn_that_fails_on_one_shard_leaves_every_channel_in_step(start_cluster, monkeypatch,
                                                                            fails: str) -> None:
    """The error is raised after every frame sent has been answered (the channels stay in step), or, when a frame
    could not be made, with the channels whose answers were not read closed; the next step applies each push once."""
    values = model()
    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    with started(cluster, values) as worker:
        worker.push_pull(grads(values))
        first, second = worker._links[0], worker._links[1]
        if fails == "an-error-answer":
            answer = dc.Link.answer

            def refused_on_shard_0(link, targets):
                magic, raw, received = answer(link, targets)   # read whole, then seen as a refusal
                if link is not first:
                    return magic, raw, received
                status = pb.DataChannelStatus(code="INVALID_ARGUMENT", reason="", message="refused for the test")
                return dc.ERROR_MAGIC, status.SerializeToString(), False

            monkeypatch.setattr(dc.Link, "answer", refused_on_shard_0)
            with pytest.raises(ServerError, match="refused for the test"):
                worker.push_pull(grads(values))
            assert not first.closed and not second.closed and (first.frames, second.frames) == (2, 2)
        else:
            link_send = ps_client.PSClient._link_send

            def unmade_on_shard_1(self, shard, *args, **kwargs):
                if shard == 1:
                    raise ValueError("no frame for shard 1")
                return link_send(self, shard, *args, **kwargs)

            monkeypatch.setattr(ps_client.PSClient, "_link_send", unmade_on_shard_1)
            with pytest.raises(ValueError, match="no frame for shard 1"):
                worker.push_pull(grads(values))
            assert first.closed and 0 not in worker._links and worker._links[1] is second and not second.closed
        monkeypatch.undo()
        # the failed step's push is on the shards that took it; its resend at the same clock is not applied twice
        report, pulled = worker.push_pull(grads(values))
        assert report.accepted and pulled is not None
        np.testing.assert_allclose(pulled["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)
        np.testing.assert_array_equal(pulled["w"], worker.pull()["w"])


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_half_size_wire_halves_the_channels_float32_bytes_as_it_does_grpcs(start_cluster, monkeypatch,
                                                                           wire: str) -> None:
    from ps_common import codec

    narrow = codec.WIRE_DTYPES[wire]
    values = model()
    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    answers = []   # (magic, header bytes, body bytes) of each answer the worker reads

    def read_prefix(sock, **kwargs):
        answers.append(real_read_prefix(sock, **kwargs))
        return answers[-1]

    real_read_prefix = dc.read_prefix
    with started(cluster, values, wire_dtype=wire) as worker, client(cluster, "exact", data_channel=False) as exact:
        gradient = {"w": np.full((16, 8), 0.3, np.float32), "b": np.full(8, 0.3, np.float32)}
        monkeypatch.setattr(dc, "read_prefix", read_prefix)
        report, after = worker.push_pull(gradient)
        monkeypatch.undo()
        assert report.accepted and sorted(worker._links) == [0, 1]
        # the values travel once, in the answers' bodies: the reply headers carry no copy of them
        replies = [a for a in answers if a[0] == dc.REPLY_MAGIC]
        assert len(replies) == 2 and all(body > 0 and header < 64 for _, header, body in replies), answers
        assert worker._links[0].layout.values[-1].dtype == narrow        # "w" travels half-size
        master = exact.pull()["w"]
        np.testing.assert_allclose(master, values["w"] - LR * np.float32(np.float32(0.3).astype(narrow)), rtol=1e-6)
        assert after["w"].dtype == np.float32 and after["ids"].dtype == np.int64
        np.testing.assert_array_equal(after["w"], master.astype(narrow).astype(np.float32))
        np.testing.assert_array_equal(after["ids"], values["ids"])
        # the next step's arrays (narrowed, widened) are those of the first, rewritten: each step's own values
        held = after["w"].copy()
        report, again = worker.push_pull({"w": np.full((16, 8), -0.5, np.float32), "b": np.full(8, 0.1, np.float32)})
        master = exact.pull()["w"]
        np.testing.assert_allclose(master, values["w"] - LR * (np.float32(np.float32(0.3).astype(narrow)) -
                                                               np.float32(np.float32(0.5).astype(narrow))), rtol=1e-6)
        np.testing.assert_array_equal(again["w"], master.astype(narrow).astype(np.float32))
        assert not np.array_equal(again["w"], held)


def test_a_model_too_large_for_one_grpc_message_is_one_push_pull_through_the_channel(start_cluster) -> None:
    values = model(rows=GRPC_PUSH_PULL_MAX_BYTES // (8 * 4) * 3)
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with started(cluster, values) as worker:
        report, pulled = worker.push_pull(grads(values))
        assert report.accepted and pulled is not None        # not a plain push: the channel took it all
        assert worker._links[0].frames == 1
        np.testing.assert_allclose(pulled["w"], values["w"] - LR * 0.25, rtol=1e-6)
        np.testing.assert_array_equal(pulled["w"], worker.pull()["w"])


@pytest.mark.parametrize("applied", [False, True], ids=["broke-before-the-shard-read-it", "broke-after"])
def test_a_channel_that_breaks_under_a_model_too_large_for_one_grpc_message_falls_back_to_a_streamed_push(
        start_cluster, applied: bool, caplog) -> None:
    from ps_common.codec import MAX_MESSAGE_BYTES

    values = model(rows=MAX_MESSAGE_BYTES // (8 * 4) + 1024)      # "w" alone is more than gRPC's message limit
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with started(cluster, values) as worker:
        report, pulled = worker.push_pull(grads(values))
        assert report.accepted and pulled is not None and worker._links[0].frames == 1
        link = worker._links[0]
        send = link.send

        def broken(*args, **kwargs):
            if applied:
                send(*args, **kwargs)     # the shard takes the frame; its answer is lost
            link.close()
            raise OSError("connection reset mid-frame")

        link.send = broken
        with caplog.at_level(logging.WARNING, logger="worker_client.client.ps_client"):
            report, pulled = worker.push_pull(grads(values))
        # not an oversized gRPC message: a streamed Push (a duplicate when the frame was applied), values left to
        # the caller's pull
        assert report.accepted and pulled is None and report.responses[0].duplicate == applied
        assert any("the data channel broke" in r.getMessage() for r in caplog.records)
        np.testing.assert_allclose(worker.pull()["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)   # applied once
        report, pulled = worker.push_pull(grads(values))              # a new channel for the next step
        assert report.accepted and pulled is not None and worker._links[0].frames == 1
        np.testing.assert_allclose(pulled["w"], values["w"] - 3 * LR * 0.25, rtol=1e-6)


def test_the_shards_metrics_count_each_answered_frame_as_a_push_pull() -> None:
    from ps_server.config import ServerConfig
    from ps_server.server import create_server

    server = create_server(ServerConfig(mode="async", optimizer="sgd", optimizer_params={"lr": LR}))[0]
    values = model()
    try:
        with joined(PSClient([server.address], worker_id="w0", shared_memory=False, retry=QUICK), values) as worker:
            for _ in range(2):
                assert worker.push_pull(grads(values))[0].accepted
            with pytest.raises(ServerError):
                worker.push_pull({**grads(values), "w": np.full((16, 8), np.nan, np.float32)})
            assert worker._links[0].frames == 3                  # all three went through the channel

        def sample(name: str, **labels: str) -> float:
            return server.metrics.registry.get_sample_value(name, {"shard": "0", "rpc": "PushPull", **labels}) or 0.0

        assert sample("ps_rpcs_total", code="OK") == 2
        assert sample("ps_rpcs_total", code="INVALID_ARGUMENT") == 1
        assert sample("ps_rpc_duration_seconds_count") == 3
    finally:
        server.stop()


def test_the_shards_typed_errors_are_raised_as_over_grpc(start_cluster) -> None:
    values = model()
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with started(cluster, values) as worker, started(cluster, values, worker_id="w1", data_channel=False) as other:
        bad = {**grads(values), "w": np.full((16, 8), np.nan, np.float32)}
        errors = []
        for c in (worker, other):
            with pytest.raises(ServerError) as info:
                c.push_pull(bad)
            errors.append(info.value)
        assert worker._links                                  # the first went through the channel
        assert all(isinstance(e, InvalidRequestError) and e.code == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
        assert "NaN" in str(errors[0]) and "NaN" in str(errors[1])
        report, pulled = worker.push_pull(grads(values))     # and the channel goes on
        assert report.accepted and worker._links[0].frames == 2


# ---------------------------------------------------------------------- sparse steps

#: A table trained by rows beside dense tensors too many bytes for one gRPC PushPull per shard.
SPARSE_ROWS, DIM = 256, 16


def sparse_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {"emb": rng.standard_normal((SPARSE_ROWS, DIM)).astype(np.float32),
            "w": rng.standard_normal((GRPC_PUSH_PULL_MAX_BYTES // 16, 8)).astype(np.float32),
            "b": np.zeros(8, np.float32)}


def test_a_sparse_step_is_one_frame_per_shard_with_its_rows_and_gives_what_grpc_gives(start_cluster) -> None:
    values = sparse_model()
    dense = ["b", "w"]
    first, last = 3, SPARSE_ROWS - 2
    asked = np.array([last, first, 7, last], np.int64)
    finals = {}
    for path in ("channel", "grpc"):
        cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "4096"])
        with started(cluster, values, data_channel=path == "channel") as worker:
            assert all(worker.shard_map.shard_bytes(i) > GRPC_PUSH_PULL_MAX_BYTES for i in (0, 1))
            for step in range(3):
                row_grads = {"emb": (np.array([first, last, first], np.int64), np.full((3, DIM), step + 1.0, np.float32))}
                report, pulled, rows = worker.push_pull_rows({n: np.full_like(values[n], 0.25) for n in dense},
                                                             row_grads, names=dense, rows={"emb": asked})
                assert report.accepted
                if path == "grpc":                       # too many bytes for one gRPC PushPull: a plain push
                    assert pulled is None and rows is None and not worker._links
                    continue
                assert sorted(pulled) == dense and [l.names for l in worker._links.values()] == [frozenset(dense)] * 2
                assert [l.frames for l in worker._links.values()] == [step + 1] * 2
                np.testing.assert_array_equal(pulled["w"], worker.pull(["w"])["w"])
                np.testing.assert_array_equal(rows["emb"], worker.pull_rows({"emb": asked})["emb"])
            finals[path] = worker.pull()
            if path == "channel":                        # a whole step next: a connection for every part
                report, pulled = worker.push_pull(grads(values, 0.0))
                assert report.accepted and [l.names for l in worker._links.values()] == [None, None]
                np.testing.assert_array_equal(pulled["emb"], finals[path]["emb"])
    for name in values:
        np.testing.assert_array_equal(finals["channel"][name], finals["grpc"][name])
    emb = values["emb"].copy()
    emb[first] -= LR * 2 * (1 + 2 + 3)                   # row `first` twice in each step's gradient
    emb[last] -= LR * (1 + 2 + 3)
    np.testing.assert_allclose(finals["channel"]["emb"], emb, rtol=1e-6)
    np.testing.assert_allclose(finals["channel"]["w"], values["w"] - 3 * LR * 0.25, rtol=1e-6)


def test_a_connection_for_some_tensors_refuses_frames_of_others_and_unknown_names(start_cluster) -> None:
    values = sparse_model()
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with started(cluster, values) as worker:
        with grpc.insecure_channel(cluster.addresses[0]) as ch, pytest.raises(grpc.RpcError) as info:
            pb_grpc.ParameterServerStub(ch).OpenDataChannel(
                pb.DataChannelRequest(worker_id="w0", names=["b", "nope"]), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()
        before = state(cluster)
        answer, layout, host = channel_of(worker, names=["b"])
        assert [s.key for s in layout.values] == [("b", 0)] and answer.size == layout.size
        link = dc.Link.connect(host, answer.port, answer.ticket, layout, timeout=TIMEOUT)
        try:
            gradient = [np.full(s.shape, 0.25, s.dtype) for s in layout.gradients]
            targets = [np.empty(s.shape, s.dtype) for s in layout.values]
            for names in ([], ["b", "w"], ["w"]):        # every part, more tensors, other tensors
                header = frames.encode_request(pb.PushHeader(worker_id="w0", clock=0),
                                               pb.PullAfterPush(names=names, wait_timeout_ms=100, shared_memory=True),
                                               gradients_in_shared_memory=True)
                magic, raw, received = link.exchange(header, gradient, targets, timeout=TIMEOUT)
                status = pb.DataChannelStatus.FromString(raw)
                assert magic == dc.ERROR_MAGIC and not received and status.code == "INVALID_ARGUMENT", status
                assert "pull.names" in status.message
            assert state(cluster) == before              # nothing applied
            header = frames.encode_request(pb.PushHeader(worker_id="w0", clock=0),
                                           pb.PullAfterPush(names=["b"], wait_timeout_ms=100, shared_memory=True),
                                           gradients_in_shared_memory=True)
            magic, raw, received = link.exchange(header, gradient, targets, timeout=TIMEOUT)
            reply = frames.decode_response(raw)
            assert magic == dc.REPLY_MAGIC and received and reply.push.outcome == pb.PUSH_ACCEPTED, reply
            np.testing.assert_allclose(targets[0], values["b"] - LR * 0.25, rtol=1e-6)
        finally:
            link.close()


# ---------------------------------------------------------------------- at most once


def test_a_frame_cut_mid_way_applies_nothing_and_a_replay_applies_nothing_again(start_cluster) -> None:
    values = model()
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with started(cluster, values) as worker:
        report, _ = worker.push_pull(grads(values))            # clock 0 applied, through the channel
        assert report.accepted and worker._links
        before = state(cluster)
        answer, layout, host = channel_of(worker)
        frame = frame_bytes("w0", 1, layout)
        hello = dc.HELLO.pack(dc.HELLO_MAGIC, dc.VERSION, 0, answer.ticket)
        with socket.create_connection((host, answer.port), timeout=TIMEOUT) as sock:
            sock.sendall(hello)
            assert dc.recv_exactly(sock, dc.WELCOME.size) == dc.WELCOME.pack(dc.WELCOME_OK)
            sock.sendall(frame[:len(frame) - 100])              # the connection breaks mid-frame
        time.sleep(0.3)
        assert state(cluster) == before
        # a worker's retry of the push it made (clock 0): acknowledged as a duplicate, applied once only
        answer, layout, host = channel_of(worker)
        link = dc.Link.connect(host, answer.port, answer.ticket, layout, timeout=TIMEOUT)
        targets = [np.empty(s.shape, s.dtype) for s in layout.values]
        magic, raw, received = link.exchange(frame_bytes_header("w0", 0), [np.full(s.shape, 0.25, s.dtype)
                                                                           for s in layout.gradients],
                                             targets, timeout=TIMEOUT)
        link.close()
        reply = frames.decode_response(raw)
        assert magic == dc.REPLY_MAGIC and received and reply.push.duplicate and reply.push.clock == 1
        assert state(cluster) == before
        # the recorded bytes of a whole connection, replayed on a new one: the ticket is used up
        with socket.create_connection((host, answer.port), timeout=TIMEOUT) as sock:
            sock.sendall(dc.HELLO.pack(dc.HELLO_MAGIC, dc.VERSION, 0, answer.ticket) + frame_bytes("w0", 1, layout))
            assert closed_by_peer(sock) == dc.WELCOME.pack(dc.WELCOME_REFUSED)
        assert state(cluster) == before
        # a header naming another worker on this worker's connection: closed, nothing applied
        answer, layout, host = channel_of(worker)
        with socket.create_connection((host, answer.port), timeout=TIMEOUT) as sock:
            sock.sendall(dc.HELLO.pack(dc.HELLO_MAGIC, dc.VERSION, 0, answer.ticket) + frame_bytes("w1", 1, layout))
            assert closed_by_peer(sock) == dc.WELCOME.pack(dc.WELCOME_OK)
        assert state(cluster) == before
        report, pulled = worker.push_pull(grads(values))        # the worker reopens and goes on at clock 1
        assert report.accepted and not report.responses[0].duplicate and worker.clock == 2
        np.testing.assert_allclose(pulled["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)


def frame_bytes_header(worker_id: str, clock: int) -> bytes:
    return frames.encode_request(pb.PushHeader(worker_id=worker_id, clock=clock),
                                 pb.PullAfterPush(wait_timeout_ms=100, shared_memory=True),
                                 gradients_in_shared_memory=True)


def test_a_tickets_connection_is_bound_to_its_worker_and_to_a_registered_one(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with started(cluster, model()):
        with grpc.insecure_channel(cluster.addresses[0]) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenDataChannel(pb.DataChannelRequest(worker_id="stranger"), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenDataChannel(pb.DataChannelRequest(worker_id=""), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_frame_beyond_the_workers_admission_slots_is_overloaded_and_goes_to_grpcs_retries(caplog) -> None:
    import contextlib
    import threading

    from ps_server.config import ServerConfig
    from ps_server.server import create_server

    server, _ = create_server(ServerConfig(optimizer="sgd", optimizer_params={"lr": LR}))
    values = model()
    try:
        with PSClient([server.address], worker_id="w0", rpc_timeout=10, shared_memory=False,
                      retry=RetryPolicy(attempts=40, initial_backoff=0.05, max_backoff=0.1)) as worker:
            worker.initialize(values)
            worker.register(heartbeat=False)
            worker.pull()
            worker.push_pull(grads(values))
            link = worker._links[0]
            admission = server.data_channel.serve.__self__.admission
            slots = contextlib.ExitStack()
            for _ in range(admission.worker_calls):   # every slot of the worker's own, taken
                slots.enter_context(admission.enter("PushPull", "w0"))
            threading.Timer(0.5, slots.close).start()
            with caplog.at_level(logging.WARNING, logger="worker_client.client.retry"):
                report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is not None
            assert any("overloaded" in r.getMessage() for r in caplog.records)   # gRPC's retries took it
            assert worker._links[0] is link and link.frames == 2                 # the channel answered, and stays
            np.testing.assert_allclose(pulled["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)
    finally:
        server.stop(grace=0.5)


# ---------------------------------------------------------------------- fallback


def test_when_the_channel_port_refuses_the_bytes_go_over_grpc_and_it_is_logged_once(start_cluster, monkeypatch,
                                                                                      caplog) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        closed = probe.getsockname()[1]                        # a port nothing listens on once closed
    connect = dc.Link.connect

    def refused(host, port, *args, **kwargs):
        return connect(host, closed, *args, **kwargs)

    monkeypatch.setattr(ps_client.Link, "connect", staticmethod(refused))
    monkeypatch.setattr(ps_client, "DATA_CHANNEL_RETRY_SECONDS", 0.2)
    values = model(rows=GRPC_PUSH_PULL_MAX_BYTES // (8 * 4) + 64)   # too large for one gRPC message
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with caplog.at_level(logging.DEBUG, logger="worker_client.client.ps_client"), started(cluster, values) as worker:
        for step in range(3):
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is None          # a plain push, as without a channel
            time.sleep(0.25)                                   # past the retry: it is asked again, and fails again
        assert not worker._links
        np.testing.assert_allclose(worker.pull()["w"], values["w"] - 3 * LR * 0.25, rtol=1e-6)
    failures = [r for r in caplog.records if "no data channel" in r.getMessage()]
    assert len(failures) >= 2 and [r.levelno for r in failures].count(logging.WARNING) == 1
    assert "refused" in failures[0].getMessage().lower()


def test_a_shard_without_a_channel_answers_failed_precondition_and_the_worker_keeps_grpc(start_cluster) -> None:
    values = model()
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--no-data-channel"])
    assert "data_channel_port" not in cluster.shards[0].ready
    with started(cluster, values) as worker:
        for _ in range(2):
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is not None
        assert not worker._links and 0 in worker._no_link_until
        with grpc.insecure_channel(cluster.addresses[0]) as ch, pytest.raises(grpc.RpcError) as info:
            pb_grpc.ParameterServerStub(ch).OpenDataChannel(pb.DataChannelRequest(worker_id="w0"), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("ps-error-reason", "DATA_CHANNEL_UNAVAILABLE") in info.value.trailing_metadata()


# ---------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    from ps_tools.certs import make_files, write_files

    directory = tmp_path_factory.mktemp("certs")
    write_files(directory, make_files(), force=True)
    return directory


@pytest.mark.parametrize("mutual", [False, True])
def test_a_tls_shard_serves_a_tls_channel_to_a_worker_that_trusts_it(start_cluster, certs: Path,
                                                                     mutual: bool) -> None:
    flags = [*FLAGS, "--tls-cert", certs / "server.crt", "--tls-key", certs / "server.key"]
    if mutual:
        flags += ["--tls-client-ca", certs / "ca.crt"]
    client_files = (certs / "worker.crt", certs / "worker.key") if mutual else ()
    creds, metadata = client_security(certs / "ca.crt", *client_files)
    values = model()
    cluster = start_cluster(1, mode="async", flags=flags)
    with started(cluster, values, channel_credentials=creds, call_metadata=metadata,
                 data_channel_tls=dc.client_tls_context(certs / "ca.crt", *client_files)) as worker:
        for _ in range(2):
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is not None
        assert worker._links[0].frames == 2 and worker._links[0].sock.version() is not None   # TLS
        np.testing.assert_allclose(pulled["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)


@pytest.mark.parametrize("mutual", [False, True])
def test_a_worker_process_of_a_tls_job_moves_its_bytes_through_the_tls_channel(start_cluster, certs: Path,
                                                                               mutual: bool) -> None:
    """ps-worker and the pipeline stages build their client from the job (client_for_job): the channel's TLS
    comes from the same --tls-* files as the gRPC credentials, so a TLS job's bytes do not fall back to gRPC."""
    import argparse

    from ps_common import jobconfig
    from worker_client.client.from_job import client_for_job

    flags = [*FLAGS, "--tls-cert", certs / "server.crt", "--tls-key", certs / "server.key"]
    if mutual:
        flags += ["--tls-client-ca", certs / "ca.crt"]
    cluster = start_cluster(1, mode="async", flags=flags)
    parser = argparse.ArgumentParser()
    jobconfig.add_arguments(parser, scope="worker")
    argv = ["--servers", cluster.addresses[0], "--tls-ca", str(certs / "ca.crt"), "--rpc-timeout", "20"]
    if mutual:
        argv += ["--tls-cert", str(certs / "worker.crt"), "--tls-key", str(certs / "worker.key")]
    job = jobconfig.load_config(parser.parse_args(argv), scope="worker", env={})
    values = model()
    with client_for_job(job, worker_id="w0") as worker:
        worker.wait_ready(20)
        joined(worker, values)
        for _ in range(2):
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is not None
        # on this host the bytes go through shared memory, the calls over the TLS channel
        assert worker._links[0].frames == 2 and worker._links[0].sock.version() is not None   # TLS
        assert worker._links[0].in_segment == 2 and worker._segments
        np.testing.assert_allclose(pulled["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)


def test_a_tls_channel_without_the_workers_tls_context_falls_back_to_grpc(start_cluster, certs: Path,
                                                                          caplog) -> None:
    flags = [*FLAGS, "--tls-cert", certs / "server.crt", "--tls-key", certs / "server.key"]
    creds, _ = client_security(certs / "ca.crt")
    values = model()
    cluster = start_cluster(1, mode="async", flags=flags)
    with caplog.at_level(logging.WARNING, logger="worker_client.client.ps_client"), \
            started(cluster, values, channel_credentials=creds) as worker:
        report, pulled = worker.push_pull(grads(values))
        assert report.accepted and pulled is not None and not worker._links
    assert any("data_channel_tls" in r.getMessage() for r in caplog.records)
    # and plaintext to the TLS channel port is refused
    answer, layout, host = channel_of_tls(cluster, certs, creds)
    with pytest.raises((OSError, dc.ProtocolError)):
        dc.Link.connect(host, answer.port, answer.ticket, layout, timeout=3)


def channel_of_tls(cluster, certs: Path, creds) -> tuple[pb.DataChannelResponse, Layout, str]:
    with PSClient(cluster.addresses, worker_id="w0", channel_credentials=creds, rpc_timeout=10) as worker:
        worker.fetch_shard_map()
        with grpc.secure_channel(cluster.addresses[0], creds) as ch:
            answer = pb_grpc.ParameterServerStub(ch).OpenDataChannel(pb.DataChannelRequest(worker_id="w0"),
                                                                     timeout=TIMEOUT)
        layout = Layout.of((p.key, p.dtype, p.shape) for p in worker.shard_map.parts_on(0))
    assert answer.tls
    return answer, layout, "127.0.0.1"


# ---------------------------------------------------------------------- restarts and forgotten workers


def test_after_a_shard_restarts_the_worker_opens_a_new_channel(start_cluster, tmp_path) -> None:
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--checkpoint-dir", str(tmp_path / "ckpt"),
                                                    "--checkpoint-every-steps", "1"])
    values = model()
    with started(cluster, values) as worker:
        for _ in range(3):
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is not None
        first = worker._links[0]
        time.sleep(0.5)   # the checkpoint of step 3
        cluster.kill(0)
        cluster.restart(0)
        steps = []
        for _ in range(3):
            report, pulled = worker.push_pull(grads(values))
            steps.append(report.steps[0])
        assert worker._links.get(0) is not None and worker._links[0] is not first, \
            "the worker did not open a channel with the restarted shard"
        assert first.closed and worker._links[0].frames >= 1
        assert pulled is not None and steps == sorted(steps)
        np.testing.assert_array_equal(pulled["w"], worker.pull()["w"])


def test_a_shard_that_forgot_the_worker_has_it_register_again_as_over_grpc(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--lease-seconds", "0.3",
                                                    "--worker-retention-seconds", "0.3"])
    values = model()
    with started(cluster, values) as worker:
        report, _ = worker.push_pull(grads(values))
        assert report.accepted and worker._links
        link = worker._links[0]
        deadline = time.monotonic() + 10
        while state(cluster)[1] != [None] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state(cluster)[1] == [None], "the shard did not forget the worker"
        assert link.usable()                                   # the connection itself is still open
        report, pulled = worker.push_pull(grads(values))      # UNKNOWN_WORKER on the channel: registers again
        assert report.accepted and pulled is not None
        assert state(cluster)[1][0] is not None and link.closed
        report, pulled = worker.push_pull(grads(values))      # a new channel for the worker registered again
        assert report.accepted and worker._links[0] is not link and worker._links[0].frames == 1


# ---------------------------------------------------------------------- the benchmark


@pytest.mark.timeout(120)
def test_the_push_pull_benchmark_measures_the_channel_beside_grpc_and_raw_tcp(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "ps_bench.pushpull_bench", "--no-torch", "--sizes-mb", "1",
                           "--rounds", "2", "--repeats", "2", "--data-path", "channel,grpc", "--raw-tcp"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [(r["system"], r["metric"], r.get("data_path")) for r in records] == [
        ("onnx-ps", "pushpull_gbps", "channel"), ("onnx-ps", "pushpull_gbps", "grpc"),
        ("raw-tcp", "pushpull_gbps", None), ("onnx-ps/raw-tcp", "pushpull_ratio", "channel"),
        ("onnx-ps/raw-tcp", "pushpull_ratio", "grpc")]
    assert all(r["value"] > 0 and len(r["runs"]) == 2 for r in records)
