"""Contract: dynamic tables (rows keyed by any int64 id) over the wire, on fresh 2-shard clusters of their own:
pull, push and read back rows with huge ids through PSClient, hash routing checked by the shards, sync
averaging over two workers, the bad-input statuses, and the rows and evictions on /metrics."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from ps_common import codec
from ps_common.dynamic_ids import initial_rows, shard_of_ids
from ps_common.errors import REASON_KEY, InvalidTensorError
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.contract.conftest import NUM_SHARDS
from tests.contract.wire import RPC_TIMEOUT, expect_status, rpc_error
from tests.helpers.processes import ShardCluster
from worker_client import PSClient, dynamic_table

LR = 0.5
DIM = 4
IDS = np.array([9_123_456_789_012, -(1 << 62), 7, (1 << 63) - 1, 9_123_456_789_012], np.int64)
FLAGS = ["--optimizer", "sgd", "--lr", str(LR), "--metrics-port", "0", "--lease-seconds", "60",
         "--wait-timeout", "20"]


def table(**settings):
    return dynamic_table("rec.emb", (DIM,), initializer="normal:0.1", seed=11, **settings)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[ShardCluster]:
    if request.config.getoption("--ps-address"):
        pytest.skip("dynamic tables need a fresh cluster of their own (they change the parameter list)")
    with ShardCluster(NUM_SHARDS, mode="async", flags=FLAGS) as shards:
        yield shards


def metric(cluster: ShardCluster, shard: int, name: str) -> float:
    port = cluster.shards[shard].ready["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body = response.read().decode()
    match = re.search(rf'^{name}\{{shard="{shard}",table="rec.emb"\}} (\S+)$', body, re.M)
    assert match, f"{name} for rec.emb not on shard {shard}'s /metrics"
    return float(match.group(1))


def test_rows_with_huge_ids_are_created_pushed_and_read_back_and_counted_on_metrics(cluster) -> None:
    with PSClient(cluster.addresses, worker_id="dyn-a") as client:
        client.wait_ready(30)
        client.initialize({"bias": np.zeros(2, np.float32)}, dynamic=[table(evict_after_steps=1)])
        client.register(heartbeat=False)
        first = client.pull_rows({"rec.emb": IDS})["rec.emb"]
        np.testing.assert_array_equal(first, initial_rows("rec.emb", table().dynamic, IDS, (DIM,), "float32"))
        np.testing.assert_array_equal(first[0], first[4])
        grads = np.arange(len(IDS) * DIM, dtype=np.float32).reshape(len(IDS), DIM)
        report = client.push({}, row_gradients={"rec.emb": (IDS, grads)})
        assert report.accepted
        after = client.pull_rows({"rec.emb": IDS})["rec.emb"]
        expected = first.copy()
        expected[[1, 2, 3]] -= LR * grads[[1, 2, 3]]
        expected[[0, 4]] -= LR * (grads[0] + grads[4])          # a repeated id: its gradients summed
        np.testing.assert_allclose(after, expected, rtol=1e-6)

        owners = shard_of_ids(np.unique(IDS), NUM_SHARDS)
        infos = [client.cluster_info(s) for s in range(NUM_SHARDS)]
        for s in range(NUM_SHARDS):
            assert [(d.name, d.rows) for d in infos[s].dynamic_tables] == [("rec.emb", int((owners == s).sum()))]
            assert metric(cluster, s, "ps_dynamic_table_rows") == (owners == s).sum()
            assert metric(cluster, s, "ps_dynamic_table_created_rows_total") == (owners == s).sum()
        assert any(p.HasField("dynamic") and p.dynamic.evict_after_steps == 1 for p in infos[0].parameters)

        # two more steps on every shard without touching the rows: evicted (t - last touch > 1)
        nothing = (np.zeros(0, np.int64), np.zeros((0, DIM), np.float32))
        for _ in range(2):   # an empty row gradient is a gradient: each shard's step moves
            client.push({}, row_gradients={"rec.emb": nothing})
        for s in range(NUM_SHARDS):
            assert metric(cluster, s, "ps_dynamic_table_rows") == 0
            assert metric(cluster, s, "ps_dynamic_table_evictions_total") == (owners == s).sum()
        again = client.pull_rows({"rec.emb": IDS[:1]})["rec.emb"]
        np.testing.assert_array_equal(again[0], first[0])      # re-created from the initializer


def test_bad_dynamic_rows_get_invalid_argument_with_the_catalog_reason(cluster) -> None:
    with PSClient(cluster.addresses, worker_id="dyn-b") as client:
        client.wait_ready(30)
        client.initialize({"bias": np.zeros(2, np.float32)}, dynamic=[table(evict_after_steps=1)])
        client.register(heartbeat=False)
        channel = grpc.insecure_channel(cluster.addresses[0])
        stub = pb_grpc.ParameterServerStub(channel)
        try:
            foreign = next(i for i in range(1000) if shard_of_ids(np.array([i], np.int64), NUM_SHARDS)[0] == 1)
            exc = rpc_error(lambda: stub.PullRows(pb.PullRowsRequest(tables=[pb.RowIds(name="rec.emb", ids=[foreign])]),
                                                  timeout=RPC_TIMEOUT))
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "hashes to shard 1" in exc.details()
            assert dict(exc.trailing_metadata())[REASON_KEY] == InvalidTensorError.reason
            own = next(i for i in range(1000) if shard_of_ids(np.array([i], np.int64), NUM_SHARDS)[0] == 0)
            dtype, data = codec.rows_to_wire(np.ones((1, DIM), np.float64))
            header = pb.PushHeader(worker_id="dyn-b", clock=client.clock, read_step=client.steps[0],
                                   row_gradients=[pb.RowGradient(name="rec.emb", ids=[own], dtype=dtype, data=data)])
            expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                          lambda: stub.Push(iter([pb.PushRequest(header=header)]), timeout=RPC_TIMEOUT), "float64")
            empty = pb.PullRowsRequest(tables=[pb.RowIds(name="", ids=[own])])
            expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.PullRows(empty, timeout=RPC_TIMEOUT), "empty")
        finally:
            channel.close()
        assert client.pull_rows({"rec.emb": np.array([own], np.int64)})["rec.emb"].shape == (1, DIM)


def test_a_sync_step_averages_dynamic_row_gradients_of_two_workers(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--ps-address"):
        pytest.skip("dynamic tables need a fresh cluster of their own")
    flags = [*FLAGS, "--replicas-to-aggregate", "2", "--total-replicas", "2"]
    with ShardCluster(NUM_SHARDS, mode="sync", flags=flags) as shards:
        a, b = PSClient(shards.addresses, worker_id="w0"), PSClient(shards.addresses, worker_id="w1")
        with a, b:
            a.wait_ready(30)
            a.initialize({}, dynamic=[table()])
            for client in (a, b):
                client.register(heartbeat=False)
            start = a.pull_rows({"rec.emb": IDS[:2]})["rec.emb"]
            b.pull_rows({"rec.emb": IDS[:2]})
            ga = np.full((2, DIM), 2.0, np.float32)
            gb = np.full((1, DIM), 6.0, np.float32)
            a.push({}, row_gradients={"rec.emb": (IDS[:2], ga)})
            b.push({}, row_gradients={"rec.emb": (IDS[:1], gb)})
            got = a.pull_rows({"rec.emb": IDS[:2]}, min_steps=1)["rec.emb"]
            np.testing.assert_allclose(got[0], start[0] - LR * (2.0 + 6.0) / 2, rtol=1e-6)
            np.testing.assert_allclose(got[1], start[1] - LR * 2.0 / 2, rtol=1e-6)
