"""A shard process's data channel under generated bad frames, as tests/integration/test_hostile_load.py fuzzes
its gRPC rpcs: every connection is closed or answered with a documented status, nothing is applied, the shard
lives and its memory stays bounded; on a connection of every part and on one opened for a sparse step's dense
tensors, whose frames carry row gradients and rows to read in their headers.

Bounded: PS_FUZZ_EXAMPLES connections (default 60), each with a fresh ticket and a 3 s limit.
"""

from __future__ import annotations

import collections
import errno
import os
import socket

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_common import data_channel as dc
from ps_common import frames
from ps_common.shared_memory import Layout
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.helpers.processes import ShardCluster
from tests.integration.test_hostile_load import ALLOWED, RSS_GROWTH_LIMIT, rss_bytes
from worker_client.client import PSClient, RetryPolicy

EXAMPLES = int(os.environ.get("PS_FUZZ_EXAMPLES", "60"))
QUICK = RetryPolicy(attempts=2, initial_backoff=0.05, max_backoff=0.1)
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32),
         "vocab": np.arange(5, dtype=np.int32)}
WORKER = "fuzz-worker"


@pytest.fixture(scope="module")
def shard():
    """One sync shard (N=2) with two live workers, the second silent: the fuzzing worker's frames that still parse
    are taken as its pushes (accumulated or dropped as already contributed), and no step is ever applied."""
    cluster = ShardCluster(1, mode="sync", flags=["--replicas-to-aggregate", "2", "--workers", "2",
                                                  "--wait-timeout", "0.5", "--optimizer", "sgd", "--lr", "0.5",
                                                  "--stream-idle-seconds", "1", "--lease-seconds", "120"])
    cluster.start()
    try:
        for worker in (WORKER, "silent"):
            with PSClient(cluster.addresses, worker_id=worker, rpc_timeout=10, retry=QUICK) as client:
                client.wait_ready(20)
                client.initialize(MODEL)
                client.register(heartbeat=False)
        yield cluster
    finally:
        cluster.stop()


def state_of(address: str) -> tuple:
    """What no frame may change here: the step and the values (a well-formed frame's push may be dropped as
    already contributed, which counts in dropped_stale)."""
    with PSClient([address], worker_id="observer", rpc_timeout=10, retry=QUICK) as client:
        info = client.cluster_info(0)
        client.fetch_shard_map()
        values = {k: v.tolist() for k, v in sorted(client.pull().items())}
    return info.step, values


def valid_frame(layout: Layout, names: tuple[str, ...] = ()) -> bytes:
    """A frame the shard takes; with `names` (a connection for those tensors) a sparse step's: "w"'s row gradients
    in the header and two of its rows read."""
    rows, asked = [], []
    if names:
        rows = [pb.RowGradient(name="w", ids=[1, 3], dtype=pb.DTYPE_FLOAT32, data=np.ones((2, 3), np.float32).tobytes())]
        asked = [pb.RowIds(name="w", ids=[0, 2])]
    header = frames.encode_request(pb.PushHeader(worker_id=WORKER, clock=0, read_step=0, row_gradients=rows),
                                   pb.PullAfterPush(names=names, wait_timeout_ms=50, shared_memory=True, rows=asked),
                                   gradients_in_shared_memory=True)
    body = dc.region_views(layout.gradients, 0, layout.values_offset,
                           [np.ones(s.shape, s.dtype) for s in layout.gradients], memoryview(bytearray(64)))
    return dc.FRAME.pack(dc.REQUEST_MAGIC, len(header), dc.gradient_bytes(layout)) + header + \
        b"".join(bytes(v) for v in body)


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, truncations, bit flips in the prefix and header, spliced garbage, and a frame sent twice."""
    n = len(valid)
    reach = min(n - 1, dc.FRAME.size + 48)
    return st.one_of(
        st.binary(max_size=64),
        st.integers(0, n - 1).map(lambda k: valid[:k]),
        st.tuples(st.integers(0, reach), st.integers(0, 7)).map(
            lambda p: valid[:p[0]] + bytes([valid[p[0]] ^ (1 << p[1])]) + valid[p[0] + 1:]),
        st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(lambda p: valid[:p[0]] + p[1] + valid[p[0]:]),
        st.just(valid + valid),
        st.sampled_from([valid[:4] + b"\xff" * 12, valid[:4] + b"\0\0\0\0" + b"\xff" * 8]),   # huge sizes
    )


def read_answers(sock: socket.socket) -> list[tuple[bytes, bytes]]:
    """Every answer frame until the shard closes the connection: (magic, header)."""
    answers = []
    while True:
        prefix = dc.read_prefix(sock, at_boundary=True)
        if prefix is None:
            return answers
        magic, header_bytes, body_bytes = prefix
        assert magic in (dc.REPLY_MAGIC, dc.ERROR_MAGIC) and header_bytes <= dc.MAX_HEADER_BYTES
        header = dc.recv_exactly(sock, header_bytes)
        dc.recv_exactly(sock, body_bytes)
        answers.append((magic, header))


@pytest.mark.parametrize("names", [(), ("b",)], ids=["every-part", "sparse-step"])
def test_generated_bad_frames_on_the_data_channel_change_nothing_and_get_documented_statuses(shard, names) -> None:
    address = shard.addresses[0]
    host = address.rpartition(":")[0]
    before = state_of(address)
    rss_before = rss_bytes(shard.shards[0].pid)
    with PSClient([address], worker_id="layout", rpc_timeout=10, retry=QUICK) as client:
        parts = client.fetch_shard_map().parts_on(0)
    layout = Layout.of((p.key, p.dtype, p.shape) for p in parts if not names or p.name in names)
    valid = valid_frame(layout, names)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ParameterServerStub(channel)
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(raw=mutations(valid))
    def send(raw: bytes) -> None:
        answer = stub.OpenDataChannel(pb.DataChannelRequest(worker_id=WORKER, names=names), timeout=5)
        with socket.create_connection((host, answer.port), timeout=3) as sock:
            sock.sendall(dc.HELLO.pack(dc.HELLO_MAGIC, dc.VERSION, 0, answer.ticket))
            assert dc.recv_exactly(sock, dc.WELCOME.size) == dc.WELCOME.pack(dc.WELCOME_OK)
            try:   # the shard may close the connection while the bytes still go
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                answers = read_answers(sock)
            except (BrokenPipeError, ConnectionResetError, dc.ProtocolError):
                answers = []
            except OSError as exc:   # closed before our shutdown: the kernel says the socket is not connected
                if exc.errno != errno.ENOTCONN:
                    raise
                answers = []
        if not answers:
            outcomes["closed"] += 1
        for magic, header in answers:
            if magic == dc.ERROR_MAGIC:
                status = pb.DataChannelStatus.FromString(header)
                assert status.code in ALLOWED, f"{status.code} {status.reason}: {status.message} for {raw[:40]!r}"
                outcomes[status.code] += 1
            else:
                outcomes["answered"] += 1

    send()
    channel.close()
    print("outcomes:", dict(outcomes))
    assert sum(outcomes.values()) >= EXAMPLES
    assert shard.shards[0].alive(), "the shard died"
    assert state_of(address) == before
    growth = rss_bytes(shard.shards[0].pid) - rss_before
    print(f"shard memory growth over the battery: {growth / 1e6:.1f} MB")
    assert growth < RSS_GROWTH_LIMIT
