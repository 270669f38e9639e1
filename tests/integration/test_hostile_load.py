"""A shard process under hostile input and load: generated malformed requests to every rpc of both services,
stalled client streams, and a stop during every kind of wait.

Bounded: the battery sends PS_FUZZ_EXAMPLES requests per rpc (default 60; the closing
figures used more), the stalled-stream test opens 200 streams for a few seconds, and every
wait has a timeout.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_common import codec
from ps_proto.v1 import parameter_server_pb2 as pb
from tests.helpers.processes import ShardCluster
from worker_client.client import PSClient, RetryPolicy

EXAMPLES = int(os.environ.get("PS_FUZZ_EXAMPLES", "60"))
#: Statuses a malformed or hostile request may get; INTERNAL and UNKNOWN mean a bug.
ALLOWED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
           "UNAVAILABLE", "CANCELLED"}
QUICK = RetryPolicy(attempts=2, initial_backoff=0.05, max_backoff=0.1)
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32),
         "vocab": np.arange(5, dtype=np.int32)}

PS = pb.DESCRIPTOR.services_by_name["ParameterServer"]
ADMIN = pb.DESCRIPTOR.services_by_name["Admin"]
#: Admin rpcs that change state when their request parses: fuzzed only with bytes that do not parse.
STATEFUL_ADMIN = {"Shutdown", "ResetParameters"}


@pytest.fixture(scope="module")
def shard():
    """One sync shard (N=2) with short waits: a push from anyone but a registered worker is never applied."""
    cluster = ShardCluster(1, mode="sync", flags=["--replicas-to-aggregate", "2", "--workers", "2",
                                                  "--wait-timeout", "0.5", "--optimizer", "sgd", "--lr", "0.5"])
    cluster.start()
    try:
        with PSClient(cluster.addresses, worker_id="owner", rpc_timeout=10, retry=QUICK) as client:
            client.wait_ready(20)
            client.initialize(MODEL)
        yield cluster
    finally:
        cluster.stop()


def state_of(address: str) -> tuple:
    """What no refused request may change: the values, the step and the drop count."""
    with PSClient([address], worker_id="observer", rpc_timeout=10, retry=QUICK) as client:
        info = client.cluster_info(0)
        client.fetch_shard_map()
        values = {k: v.tolist() for k, v in sorted(client.pull().items())}
    return info.step, info.dropped_stale, values


# ---------------------------------------------------------------------- the battery

def _valid_unary(method: str) -> bytes:
    """A well-formed request of each unary rpc, to mutate."""
    examples = {
        "Pull": pb.PullRequest(names=["w"], min_step=0, worker_id="owner"),
        "Barrier": pb.BarrierRequest(name="b", participant_id="p", participants=2, timeout_ms=100),
        "RegisterWorker": pb.RegisterWorkerRequest(worker_id="fuzz"),
        "Heartbeat": pb.HeartbeatRequest(worker_id="fuzz"),
        "DeregisterWorker": pb.DeregisterWorkerRequest(worker_id="fuzz"),
        "GetClusterInfo": pb.ClusterInfoRequest(),
        "Checkpoint": pb.CheckpointRequest(),
        "Shutdown": pb.ShutdownRequest(reason="fuzz"),
        "ResetParameters": pb.ResetParametersRequest(),
        "OpenSharedMemory": pb.SharedMemoryRequest(worker_id="fuzz"),
        "OpenDataChannel": pb.DataChannelRequest(worker_id="fuzz"),
        "PullRows": pb.PullRowsRequest(tables=[pb.RowIds(name="w", ids=[0, 3])], worker_id="owner"),
        "ReadState": pb.ReadStateRequest(since_step=0, whole=["w"], wait_timeout_ms=100),
    }
    if method == "PushPull":   # a whole push from an unregistered worker, and the pull after it
        return _valid_push() + codec.message_field(3, pb.PullAfterPush(wait_timeout_ms=100).SerializeToString())
    return examples[method].SerializeToString()


def _valid_push(continued: bool = False) -> bytes:
    """A complete push from a worker that is not registered: refused NOT_FOUND even when it parses. `continued`:
    `w` by rows instead, a row gradient in the header and a piece that continues it (PushRequest.row_gradients)."""
    header = pb.PushHeader(worker_id="stranger", clock=0, read_step=0)
    grads = {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)}
    if continued:
        del grads["w"]
        header.row_gradients.add(name="w", ids=[0], dtype=pb.DTYPE_FLOAT32, data=np.ones(3, np.float32).tobytes())
    chunks = [f for n, g in grads.items() for f in codec.chunk_fields(n, g)]
    raw = b"".join(codec.pack_encoded(chunks, header.SerializeToString()))
    if continued:
        raw += codec.message_field(3, pb.RowGradient(name="w", ids=[2, 3], dtype=pb.DTYPE_FLOAT32,
                                                     data=np.ones(6, np.float32).tobytes()).SerializeToString())
    return raw


def _valid_init() -> bytes:
    header = pb.InitHeader(worker_id="fuzz", parameters=[codec.spec_to_wire("w", "float32", (4, 3))])
    return b"".join(codec.pack_encoded(list(codec.chunk_fields("w", np.ones((4, 3), np.float32))),
                                       header.SerializeToString()))


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, truncations, bit flips, spliced garbage and repeated varint bytes of a valid message."""
    n = len(valid)
    return st.one_of(
        st.binary(max_size=64),
        st.integers(0, max(0, n - 1)).map(lambda k: valid[:k]),
        st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 7)).map(
            lambda p: valid[:p[0]] + bytes([valid[p[0]] ^ (1 << p[1])]) + valid[p[0] + 1:] if n else b"\x80"),
        st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(lambda p: valid[:p[0]] + p[1] + valid[p[0]:]),
        st.integers(1, 12).map(lambda k: b"\x0a" + b"\xff" * k),      # a length varint that never ends
        st.sampled_from([b"\x0a\x03\xff\xfe\xfd", b"\x12\x05\x0a\x03\xc3\x28\x00", b"\x00", b"\x07"]),
    )


def _unparseable(message_type, raw: bytes) -> bool:
    try:
        message_type.FromString(raw)
    except Exception:  # noqa: BLE001 - any parser complaint counts
        return True
    return False


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


#: How much a shard's memory may grow over the battery (bytes): caches and allocator slack, not leaks.
RSS_GROWTH_LIMIT = 64 << 20


def test_generated_malformed_requests_to_every_rpc_get_documented_statuses_and_change_nothing(shard) -> None:
    address = shard.addresses[0]
    before = state_of(address)
    rss_before = rss_bytes(shard.shards[0].pid)
    channel = grpc.insecure_channel(address)
    statuses: collections.Counter[tuple[str, str]] = collections.Counter()
    for service in (PS, ADMIN):
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            request_type = getattr(pb, method.input_type.name)
            if method.client_streaming:
                valid = _valid_push(continued=True) if method.name == "Push" else _valid_init()
                call = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            elif method.server_streaming:
                valid = _valid_unary(method.name)
                call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            else:
                valid = _valid_unary(method.name)
                call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(raw=mutations(valid))
            def send(raw: bytes) -> None:
                if method.name in STATEFUL_ADMIN and not _unparseable(request_type, raw):
                    return
                if method.name == "InitParameters" and raw == valid:
                    return
                try:
                    if method.client_streaming:
                        call(iter([raw]), timeout=5)
                    elif method.server_streaming:
                        list(call(raw, timeout=5))
                    else:
                        call(raw, timeout=5)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                statuses[(method.name, code)] += 1
                assert code in ALLOWED, f"{method.name}: {code} for {raw[:40]!r}"

            send()
    channel.close()
    print("status histogram:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= EXAMPLES * 4
    assert all(code in ALLOWED for (_, code) in statuses)
    assert shard.shards[0].alive(), "the shard died"
    assert state_of(address) == before
    growth = rss_bytes(shard.shards[0].pid) - rss_before
    print(f"shard memory growth over the battery: {growth / 1e6:.1f} MB")
    assert growth < RSS_GROWTH_LIMIT


def test_a_mixed_dtype_push_from_a_registered_worker_is_refused_and_changes_nothing(shard) -> None:
    address = shard.addresses[0]
    before = state_of(address)
    with PSClient([address], worker_id="mixed", rpc_timeout=10, retry=QUICK) as client:
        client.fetch_shard_map()
        client.register()
        header = pb.PushHeader(worker_id="mixed", clock=client.clock, read_step=before[0]).SerializeToString()
        grads = {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32), "vocab": np.ones(5, np.int32)}
        chunks = [f for n, g in grads.items() for f in codec.chunk_fields(n, g)]
        raw = grpc.insecure_channel(address).stream_unary(
            f"/{PS.full_name}/Push", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            raw(codec.pack_encoded(chunks, header), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'vocab'" in info.value.details()
        client.deregister()
    assert state_of(address) == before


def test_a_multi_tib_parameter_list_on_an_empty_shard_is_refused_without_allocating(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=["--max-shard-bytes", str(1 << 30)])
    header = pb.InitHeader(worker_id="x", parameters=[codec.spec_to_wire("emb", "float32", (1 << 40, 64))])
    data = list(codec.chunk_fields("emb", np.ones((1, 64), np.float32)))
    raw = grpc.insecure_channel(cluster.addresses[0]).stream_unary(
        f"/{PS.full_name}/InitParameters", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        raw(codec.pack_encoded(data, header.SerializeToString()), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "max_shard_bytes" in info.value.details()
    assert cluster.shards[0].alive()


# ---------------------------------------------------------------------- stalled streams

def test_health_and_cluster_info_answer_within_a_second_while_200_push_streams_stall(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=["--stream-idle-seconds", "4"])
    address = cluster.addresses[0]
    with PSClient([address], worker_id="owner", rpc_timeout=10, retry=QUICK) as client:
        client.wait_ready(20)
        client.initialize(MODEL)
    channel = grpc.insecure_channel(address)
    push = channel.stream_unary(f"/{PS.full_name}/Push", request_serializer=None, response_deserializer=None)
    release = threading.Event()
    header = pb.PushHeader(worker_id="staller", clock=0, read_step=0).SerializeToString()
    first = codec.encode_message(header, [])

    def stalled():
        yield first
        release.wait(30)    # half-sent: the stream stays open without another message

    calls = [push.future(stalled(), timeout=30) for _ in range(200)]
    try:
        time.sleep(1.0)
        health = health_pb2_grpc.HealthStub(channel)
        ps = channel.unary_unary(f"/{PS.full_name}/GetClusterInfo", request_serializer=None,
                                 response_deserializer=pb.ClusterInfo.FromString)
        latencies = []
        for _ in range(10):
            started = time.monotonic()
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
            ps(pb.ClusterInfoRequest().SerializeToString(), timeout=5)
            latencies.append(time.monotonic() - started)
            time.sleep(0.2)
        print("health + cluster info latencies (s):", [round(x, 3) for x in latencies])
        assert max(latencies) < 1.0
        # refused at once (admission full) or cut by the watchdog after 4 s idle: nothing waits for the client
        outcomes = collections.Counter()
        for call in calls:
            try:
                call.result(timeout=15)
                outcomes["OK"] += 1
            except grpc.RpcError as exc:
                outcomes[exc.code().name] += 1
        print("stalled push outcomes:", dict(outcomes))
        assert set(outcomes) <= {"RESOURCE_EXHAUSTED", "CANCELLED"} and outcomes["RESOURCE_EXHAUSTED"] > 0
    finally:
        release.set()
        for call in calls:
            call.cancel()
        channel.close()
    assert cluster.shards[0].alive()


STALLERS = 200


def _stallers(channel: grpc.Channel, kind: str, release: threading.Event) -> list:
    """STALLERS calls of one hostile kind, each holding a call open on the shard until `release` (at most 30 s)."""
    push = channel.stream_unary(f"/{PS.full_name}/Push", request_serializer=None, response_deserializer=None)
    # a unary rpc called as a client stream: the request message never arrives (half-sent unary call)
    push_pull = channel.stream_unary(f"/{PS.full_name}/PushPull", request_serializer=None,
                                     response_deserializer=None)
    pull = channel.unary_stream(f"/{PS.full_name}/Pull", request_serializer=None, response_deserializer=None)
    header = codec.encode_message(pb.PushHeader(worker_id="staller", clock=0, read_step=0).SerializeToString(), [])

    def messages(*first: bytes):
        yield from first
        release.wait(30)

    if kind == "half-sent push streams":
        return [push.future(messages(header), timeout=30) for _ in range(STALLERS)]
    if kind == "anonymous push streams":
        return [push.future(messages(), timeout=30) for _ in range(STALLERS)]
    if kind == "half-sent unary calls":
        return [push_pull.future(messages(), timeout=30) for _ in range(STALLERS)]
    if kind == "anonymous pulls waiting for a step":
        request = pb.PullRequest(min_step=10**9, wait_timeout_ms=30_000).SerializeToString()
        return [pull(request, timeout=30) for _ in range(STALLERS)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["half-sent push streams", "anonymous push streams", "half-sent unary calls",
                                  "anonymous pulls waiting for a step"])
def test_a_registered_workers_pull_and_push_pull_are_served_within_a_second_while_200_calls_stall(
        start_cluster, kind: str) -> None:
    cluster = start_cluster(1, mode="async", flags=["--stream-idle-seconds", "30", "--wait-timeout", "30"])
    address = cluster.addresses[0]
    channel = grpc.insecure_channel(address)
    release = threading.Event()
    # Every byte over gRPC (no shared memory, no data channel): the rpcs the stalled calls compete with.
    with PSClient([address], worker_id="w0", rpc_timeout=10, retry=QUICK, shared_memory=False,
                  data_channel=False) as worker:
        worker.wait_ready(20)
        worker.initialize(MODEL)
        worker.register()
        worker.pull()
        calls = _stallers(channel, kind, release)
        try:
            time.sleep(1.5)   # every staller has reached the shard
            latencies = {"Pull": [], "PushPull": []}
            for _ in range(10):
                started = time.monotonic()
                worker.pull()
                latencies["Pull"].append(time.monotonic() - started)
                started = time.monotonic()
                report, values = worker.push_pull({"w": np.full((4, 3), 0.01, np.float32),
                                                   "b": np.zeros(3, np.float32)})
                latencies["PushPull"].append(time.monotonic() - started)
                assert report.accepted and values is not None
            print(f"{kind}: latencies (s)", {k: [round(x, 3) for x in v] for k, v in latencies.items()})
            assert max(latencies["Pull"]) < 1.0 and max(latencies["PushPull"]) < 1.0, latencies
            health = health_pb2_grpc.HealthStub(channel)
            started = time.monotonic()
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - started < 1.0
        finally:
            release.set()
            for call in calls:
                call.cancel()
            channel.close()
    assert cluster.shards[0].alive()


# ---------------------------------------------------------------------- stop during every wait

def _wait_then_sigterm(cluster: ShardCluster, start_wait) -> float:
    """Starts a blocking call (start_wait(address)) on a thread, SIGTERMs the shard, returns its exit time."""
    address = cluster.addresses[0]
    thread = threading.Thread(target=start_wait, args=(address,), daemon=True)
    thread.start()
    time.sleep(1.0)
    process = cluster.shards[0].process
    started = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)
    process.wait(timeout=10)
    return time.monotonic() - started


def _quiet(fn):
    def run(address: str) -> None:
        try:
            fn(address)
        except Exception:  # noqa: BLE001 - the call fails when the shard stops; that is the point
            pass
    return run


@pytest.mark.parametrize("kind", ["barrier", "sync step", "ssp hold"])
def test_sigterm_ends_a_shard_within_three_seconds_whatever_it_waits_for(start_cluster, kind: str) -> None:
    mode = {"barrier": "async", "sync step": "sync", "ssp hold": "ssp"}[kind]
    flags = ["--wait-timeout", "60", "--replicas-to-aggregate", "2", "--workers", "2", "--staleness", "0"]
    cluster = start_cluster(1, mode=mode, flags=flags)
    address = cluster.addresses[0]
    with PSClient([address], worker_id="w0", rpc_timeout=60, wait_timeout=60, retry=QUICK) as client:
        client.wait_ready(20)
        client.initialize({"w": np.ones(3, np.float32)})
    other = PSClient([address], worker_id="w1", rpc_timeout=60, wait_timeout=60, retry=QUICK)
    other.fetch_shard_map()
    other.register()

    def wait(address: str) -> None:
        with PSClient([address], worker_id="w0", rpc_timeout=60, wait_timeout=60, retry=QUICK) as c:
            c.fetch_shard_map()
            c.register()
            if kind == "barrier":
                c.barrier("start", 2, timeout=60)
            elif kind == "sync step":
                c.push({"w": np.ones(3, np.float32)})
                c.pull(min_steps=1, timeout=60)
            else:
                c.push({"w": np.ones(3, np.float32)})
                c.pull(ssp=True, timeout=60)

    seconds = _wait_then_sigterm(cluster, _quiet(wait))
    other.close()
    print(f"{kind}: exited {seconds:.2f} s after SIGTERM")
    assert seconds < 3.0
