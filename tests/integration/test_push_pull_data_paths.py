"""PSClient.push_pull through real shard processes, over gRPC bytes and over shared memory: the same
results as Push then Pull, a clean fallback, and segments only this user can open."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ps_common import shared_memory
from worker_client.client import GRPC_PUSH_PULL_MAX_BYTES, PSClient, RetryPolicy

LR = 0.5
FLAGS = ["--optimizer", "sgd", "--lr", str(LR), "--workers", "1"]
QUICK = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)
needs_shm = pytest.mark.skipif(not shared_memory.available(), reason="no memfd and SCM_RIGHTS on this host")


def model(rows: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"w": rng.standard_normal((rows, 8)).astype(np.float32), "b": np.zeros(8, np.float32),
            "ids": np.arange(4, dtype=np.int64)}


def grads(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: np.full_like(v, 0.25) for n, v in values.items() if v.dtype.kind == "f"}


def client(cluster, *, shm: bool) -> PSClient:
    # shared_memory_min_bytes=0: shared memory for these small shards too (else the data channel comes first)
    c = PSClient(cluster.addresses, worker_id="w0", rpc_timeout=20, wait_timeout=20, retry=QUICK, shared_memory=shm,
                 shared_memory_min_bytes=0)
    c.wait_ready(20)
    return c


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=needs_shm)])
def test_push_pull_gives_what_push_then_pull_gives_on_either_data_path(start_cluster, mode: str, shm: bool) -> None:
    values = model()
    cluster = start_cluster(2, mode=mode, flags=[*FLAGS, "--partition-min-bytes", "256"])
    with client(cluster, shm=shm) as worker:
        worker.initialize(values)
        worker.register(heartbeat=False)
        worker.pull()
        for _ in range(4):
            report, pulled = worker.push_pull(grads(values), wait_for_step=mode == "sync", ssp=mode == "ssp")
            assert report.accepted and pulled is not None
        assert (worker._segments.get(0) is not None) == shm
        # with shared memory the bytes go through the segments and the calls over the data channel
        assert [link.in_segment for link in worker._links.values()] == ([4, 4] if shm else [0, 0])
        assert worker.steps == [4, 4] and worker.clock == 4
        for name, value in values.items():
            expected = value - 4 * LR * 0.25 if value.dtype.kind == "f" else value
            np.testing.assert_allclose(pulled[name], expected, rtol=1e-6)
            np.testing.assert_allclose(worker.pull()[name], expected, rtol=1e-6)


def memfds(pid: int) -> int:
    """How many of the project's anonymous segments process `pid` holds open (each may have several fds)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:" + shared_memory.MEMFD_NAME):
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return len(inodes)


@needs_shm
def test_a_segment_is_anonymous_and_the_shard_closes_it_when_the_worker_leaves(start_cluster) -> None:
    before = set(os.listdir("/dev/shm"))
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    pid = cluster.shards[0].pid
    with client(cluster, shm=True) as worker:
        worker.initialize(model())
        worker.register(heartbeat=False)
        worker.pull()
        worker.push_pull(grads(model()))
        assert worker._segments.get(0) is not None
        assert set(os.listdir("/dev/shm")) == before    # nothing named anywhere
        assert memfds(pid) == 1
        worker.deregister()
        assert memfds(pid) == 0


@needs_shm
def test_after_a_reset_and_a_new_parameter_list_the_client_reopens_or_falls_back(start_cluster) -> None:
    from ps_proto.v1 import parameter_server_pb2 as pb
    from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
    import grpc

    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with client(cluster, shm=True) as worker:
        worker.initialize(model())
        worker.register(heartbeat=False)
        worker.pull()
        worker.push_pull(grads(model()))
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        pb_grpc.AdminStub(channel).ResetParameters(pb.ResetParametersRequest(), timeout=10)
    other = model(rows=32)
    with client(cluster, shm=True) as worker:
        worker.initialize(other)
        worker.register(heartbeat=False)
        worker.pull()
        report, pulled = worker.push_pull(grads(other))
        assert report.accepted and pulled is not None
        np.testing.assert_allclose(pulled["w"], other["w"] - LR * 0.25, rtol=1e-6)


def test_a_model_too_large_for_one_message_without_shared_memory_is_pushed_and_pulled_apart(start_cluster) -> None:
    rows = GRPC_PUSH_PULL_MAX_BYTES // (8 * 4) + 64
    values = model(rows=rows)
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    # gRPC bytes only (with the data channel, one PushPull carries it: tests/integration/test_data_channel.py)
    with PSClient(cluster.addresses, worker_id="w0", rpc_timeout=20, wait_timeout=20, retry=QUICK,
                  shared_memory=False, data_channel=False) as worker:
        worker.wait_ready(20)
        worker.initialize(values)
        worker.register(heartbeat=False)
        worker.pull()
        report, pulled = worker.push_pull(grads(values))
        assert report.accepted and pulled is None        # the push went alone; the caller pulls
        np.testing.assert_allclose(worker.pull()["w"], values["w"] - LR * 0.25, rtol=1e-6)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=needs_shm)])
def test_a_half_size_wire_keeps_float32_on_the_shard_and_rounds_only_what_travels(start_cluster, wire: str,
                                                                                   shm: bool) -> None:
    from ps_common import codec

    values = model()
    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    narrow = codec.WIRE_DTYPES[wire]
    with PSClient(cluster.addresses, worker_id="w0", rpc_timeout=20, retry=QUICK, shared_memory=shm,
                  shared_memory_min_bytes=0, wire_dtype=wire) as worker, \
            PSClient(cluster.addresses, worker_id="exact", rpc_timeout=20, retry=QUICK) as exact:
        worker.wait_ready(20)
        worker.initialize(values)
        worker.register(heartbeat=False)
        pulled = worker.pull()
        assert pulled["w"].dtype == np.float32 and pulled["ids"].dtype == np.int64
        np.testing.assert_array_equal(pulled["w"], values["w"].astype(narrow).astype(np.float32))
        gradient = {"w": np.full((16, 8), 0.3, np.float32), "b": np.full(8, 0.3, np.float32)}
        report, after = worker.push_pull(gradient)
        assert report.accepted
        # the shard applied the gradient, rounded when it crossed gRPC (shared memory carries float32),
        # to its float32 master values
        master = exact.pull()["w"]
        sent = np.float32(0.3) if shm else np.float32(np.float32(0.3).astype(narrow))
        expected = values["w"] - LR * sent
        np.testing.assert_allclose(master, expected, rtol=1e-6)
        if after is not None and not shm:
            np.testing.assert_array_equal(after["w"], master.astype(narrow).astype(np.float32))


def test_push_pull_of_named_tensors_pulls_only_those_and_an_empty_list_is_a_plain_push(start_cluster) -> None:
    values = model()
    cluster = start_cluster(2, mode="async", flags=[*FLAGS, "--partition-min-bytes", "256"])
    with client(cluster, shm=True) as worker:
        worker.initialize(values)
        worker.register(heartbeat=False)
        worker.pull()
        report, pulled = worker.push_pull(grads(values), names=["b"])
        assert report.accepted and sorted(pulled) == ["b"]                 # not w, not ids
        np.testing.assert_allclose(pulled["b"], values["b"] - LR * 0.25, rtol=1e-6)
        assert all(worker._segments.get(i) is None for i in range(2))     # named pulls go over gRPC bytes
        # an empty list must not reach a shard as PushPull's "no names", which means every tensor
        report, pulled = worker.push_pull(grads(values), names=[])
        assert report.accepted and pulled is None
        np.testing.assert_allclose(worker.pull(["w"])["w"], values["w"] - 2 * LR * 0.25, rtol=1e-6)


@needs_shm
def test_after_a_shard_restarts_the_worker_opens_shared_memory_again(start_cluster, tmp_path) -> None:
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--checkpoint-dir", str(tmp_path / "ckpt"),
                                                    "--checkpoint-every-steps", "1"])
    values = model()
    with client(cluster, shm=True) as worker:
        worker.initialize(values)
        worker.register(heartbeat=False)
        worker.pull()
        for _ in range(3):
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and pulled is not None
        first = worker._segments[0][0]
        time.sleep(0.5)   # the checkpoint of step 3
        cluster.kill(0)
        cluster.restart(0)
        steps = []
        for _ in range(3):
            report, pulled = worker.push_pull(grads(values))
            steps.append(report.steps[0])
        assert worker._segments.get(0) is not None and worker._segments[0][0] is not first, \
            "the worker did not open a segment with the restarted shard"
        assert first.closed                                # the old one was unmapped
        assert memfds(cluster.shards[0].pid) == 1
        assert pulled is not None and steps == sorted(steps)


@needs_shm
@pytest.mark.parametrize("offered", [True, False])
def test_on_one_host_the_bytes_go_through_shared_memory_and_the_call_over_the_channel(start_cluster, offered: bool,
                                                                                      caplog) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="worker_client.client.ps_client")
    values = model()
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, *([] if offered else ["--no-data-channel"])])
    shard_bytes = sum(v.nbytes for v in values.values())
    with PSClient(cluster.addresses, worker_id="default", rpc_timeout=20, retry=QUICK) as default, \
            PSClient(cluster.addresses, worker_id="bounded", rpc_timeout=20, retry=QUICK,
                     shared_memory_min_bytes=shard_bytes + 1) as bounded:
        default.wait_ready(20)
        default.initialize(values)
        for worker in (default, bounded):
            worker.register(heartbeat=False)
            worker.pull()
            for _ in range(2):
                report, pulled = worker.push_pull(grads(values))
                assert report.accepted and pulled is not None
        # by default: the segment's bytes with the call over the channel when the shard offers one, else over gRPC
        assert (sorted(default._links), default._segments.get(0) is not None) == (([0], True) if offered else ([], True))
        assert default._links[0].in_segment == 2 if offered else not default._links
        # below the bound: the bytes in the channel's frames when the shard offers one, else shared memory
        assert (sorted(bounded._links), bounded._segments.get(0) is not None) == (([0], False) if offered else ([], True))
        assert bounded._links[0].in_segment == 0 if offered else not bounded._links
        # the warning names where the bytes went instead of the channel
        warned = [r.getMessage() for r in caplog.records if "no data channel" in r.getMessage()]
        assert (not warned) if offered else \
            (len(warned) == 2 and all("shared memory where the shard shares this host" in w for w in warned)), warned
        np.testing.assert_allclose(bounded.pull()["w"], values["w"] - 4 * LR * 0.25, rtol=1e-6)


def test_a_frame_in_shared_memory_without_a_segment_or_on_a_half_size_wire_is_refused_and_nothing_applied(
        start_cluster) -> None:
    from ps_common import data_channel as dc
    from ps_common import frames
    from ps_proto.v1 import parameter_server_pb2 as pb

    values = model()
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    for wire in ("float32", "bfloat16"):
        with PSClient(cluster.addresses, worker_id=f"w-{wire}", rpc_timeout=20, retry=QUICK, shared_memory=False,
                      wire_dtype=wire) as worker:
            worker.wait_ready(20)
            if wire == "float32":
                worker.initialize(values)
            worker.register(heartbeat=False)
            link = worker._link(0, grads(values))
            assert link is not None
            header = frames.encode_request(
                pb.PushHeader(worker_id=worker.worker_id, clock=0),
                pb.PullAfterPush(wait_timeout_ms=100, shared_memory=True, wire_dtype=worker._wire_value),
                gradients_in_shared_memory=True)
            magic, answer = link.exchange_in_segment(header, timeout=20)
            status = pb.DataChannelStatus.FromString(answer)
            assert magic == dc.ERROR_MAGIC
            assert (status.code, status.reason) == (("FAILED_PRECONDITION", "SHARED_MEMORY_UNAVAILABLE")
                                                    if wire == "float32" else ("INVALID_ARGUMENT", "INVALID_REQUEST"))
            assert ("no shared-memory segment" if wire == "float32" else "half-size wire") in status.message
            assert not link.closed   # the connection goes on, its next frame carries the bytes
            report, pulled = worker.push_pull(grads(values))
            assert report.accepted and link.frames == 2 and link.in_segment == 1
    np.testing.assert_allclose(pulled["w"], values["w"] - 2 * LR * 0.25, rtol=1e-2)   # two pushes, none twice


@needs_shm
def test_a_shard_without_the_workers_segment_gets_the_calls_bytes_over_the_channel_and_a_new_segment_next(
        start_cluster, monkeypatch) -> None:
    from ps_common import data_channel as dc
    from ps_proto.v1 import parameter_server_pb2 as pb

    values = model()
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with PSClient(cluster.addresses, worker_id="w0", rpc_timeout=20, retry=QUICK) as worker:
        worker.wait_ready(20)
        worker.initialize(values)
        worker.register(heartbeat=False)
        worker.pull()
        worker.push_pull(grads(values))
        first = worker._segments[0][0]
        real_send, real_answer = dc.Link.send_in_segment, dc.Link.answer_in_segment
        answered = []

        def kept_once(link, header, *, timeout):   # the first frame never reaches the shard...
            if answered:
                real_send(link, header, timeout=timeout)

        def unavailable_once(link):   # ... which answers it as a shard that lost the worker's segment would
            if answered:
                return real_answer(link)
            answered.append(True)
            status = pb.DataChannelStatus(code="FAILED_PRECONDITION", reason="SHARED_MEMORY_UNAVAILABLE",
                                          message="worker 'w0' has no shared-memory segment on shard 0")
            return dc.ERROR_MAGIC, status.SerializeToString()

        monkeypatch.setattr(dc.Link, "send_in_segment", kept_once)
        monkeypatch.setattr(dc.Link, "answer_in_segment", unavailable_once)
        report, pulled = worker.push_pull(grads(values))   # its bytes over the channel, applied once
        assert report.accepted and pulled is not None and first.closed and 0 not in worker._segments
        link = worker._links[0]
        assert (link.frames, link.in_segment) == (2, 1)
        report, pulled = worker.push_pull(grads(values))   # a new segment
        assert worker._segments[0][0] is not first and link.in_segment == 2
        np.testing.assert_allclose(pulled["w"], values["w"] - 3 * LR * 0.25, rtol=1e-6)


def test_a_negative_shared_memory_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="shared_memory_min_bytes must be 0 or more, got -1"):
        PSClient(["127.0.0.1:1"], shared_memory_min_bytes=-1)


@pytest.mark.parametrize("path", ["channel", pytest.param("shm", marks=needs_shm), "grpc-split"])
def test_received_values_held_by_the_caller_are_never_rewritten_and_dropped_ones_are_reused(start_cluster,
                                                                                           path: str) -> None:
    from worker_client.client.buffers import MIN_BYTES

    rows = 2 * MIN_BYTES // (4 * 8)   # "w": 2 MiB, so its arrays are kept for reuse (split over 2 shards: 1 MiB each)
    values = model(rows)
    shards = 2 if path == "grpc-split" else 1
    cluster = start_cluster(shards, mode="async", flags=[*FLAGS, "--partition-min-bytes", str(MIN_BYTES)])
    options = {"channel": {"shared_memory": False}, "shm": {"shared_memory_min_bytes": 0},
               "grpc-split": {"shared_memory": False, "data_channel": False}}[path]
    with PSClient(cluster.addresses, worker_id="w0", rpc_timeout=20, retry=QUICK, **options) as worker:
        worker.wait_ready(20)
        worker.initialize(values)
        worker.register(heartbeat=False)
        worker.pull()
        report, first = worker.push_pull(grads(values))
        if path == "grpc-split":   # past one message: push then pull, the split tensor assembled in place
            first = worker.pull()
        kept = first["w"].copy()
        report, second = worker.push_pull(grads(values))
        if path == "grpc-split":
            second = worker.pull()
        np.testing.assert_array_equal(first["w"], kept)                       # held: untouched
        np.testing.assert_allclose(second["w"], kept - LR * 0.25, rtol=1e-6)
        assert second["w"].ctypes.data != first["w"].ctypes.data
        address = first["w"].ctypes.data
        del first
        report, third = worker.push_pull(grads(values))
        if path == "grpc-split":
            third = worker.pull()
        assert third["w"].ctypes.data == address                              # dropped: reused
        np.testing.assert_allclose(third["w"], kept - 2 * LR * 0.25, rtol=1e-6)
        np.testing.assert_allclose(second["w"], kept - LR * 0.25, rtol=1e-6)  # still held: untouched
