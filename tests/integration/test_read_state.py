"""ReadState through real shard processes: the whole state at one step, then only what changed after a step
(dense parts whole, sparse and dynamic tables by row, with their ids), and a new state id after a restart."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.errors import ServerError
from ps_proto.v1 import parameter_server_pb2 as pb
from worker_client.client import PSClient, RetryPolicy
from worker_client.client.rows import dynamic_table

LR = 0.5
FLAGS = ["--optimizer", "sgd", "--lr", str(LR), "--partition-min-bytes", "4096"]
QUICK_RETRY = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)
ROWS, DIM = 256, 16


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32),   # 16 KiB: split over both shards
            "w": rng.standard_normal((8, 4)).astype(np.float32),
            "bias": np.zeros(4, np.float32)}


def client(cluster, worker_id: str) -> PSClient:
    c = PSClient(cluster.addresses, worker_id=worker_id, rpc_timeout=30, wait_timeout=30, retry=QUICK_RETRY)
    c.wait_ready(30)
    return c


def whole_model(reads) -> tuple[dict[str, np.ndarray], dict[str, dict[int, np.ndarray]]]:
    """Dense tensors put together from every shard's parts, and each dynamic table's rows by key."""
    dense: dict[str, list[tuple[int, np.ndarray]]] = {}
    dynamic: dict[str, dict[int, np.ndarray]] = {}
    for read in reads:
        for (name, row_start), value in read.parts.items():
            dense.setdefault(name, []).append((row_start, value))
        for name, (ids, rows) in read.rows.items():
            dynamic.setdefault(name, {}).update(zip(ids.tolist(), rows))
    return {n: np.concatenate([v for _, v in sorted(p, key=lambda x: x[0])]) for n, p in dense.items()}, dynamic


def test_read_state_gives_the_whole_state_then_only_the_rows_and_parts_changed_after_a_step(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    values = model()
    with client(cluster, "w0") as w0, client(cluster, "reader") as reader:
        w0.initialize(values, dynamic=[dynamic_table("ids", (DIM,))])
        w0.register(heartbeat=False)
        reads = [reader.read_state(i) for i in range(2)]
        dense, dynamic = whole_model(reads)
        for name in values:
            np.testing.assert_array_equal(dense[name], values[name])
        assert dynamic.get("ids", {}) == {} and all(r.live_rows == {"ids": 0} for r in reads)
        since = [r.step for r in reads]
        assert since == [0, 0]

        # one push: two rows of the split table (one per shard), `w`, and two new dynamic rows
        first, last = 3, ROWS - 2
        keys = np.array([10**12 + 7, -5], np.int64)
        report = w0.push({"w": np.ones((8, 4), np.float32), "bias": np.zeros(4, np.float32)},
                         row_gradients={"emb": (np.array([first, last], np.int64), np.ones((2, DIM), np.float32)),
                                        "ids": (keys, np.ones((2, DIM), np.float32))})
        assert report.accepted
        changes = [reader.read_state(i, since[i], min_step=1) for i in range(2)]
        assert all(c.state_id == r.state_id for c, r in zip(changes, reads))
        changed_rows = {}
        for c in changes:
            for name, (ids, rows) in c.rows.items():
                changed_rows.setdefault(name, {}).update(zip(ids.tolist(), rows))
        assert sorted(changed_rows["emb"]) == [first, last]
        np.testing.assert_allclose(changed_rows["emb"][first], values["emb"][first] - LR, atol=1e-6)
        assert sorted(changed_rows["ids"]) == sorted(keys.tolist())
        np.testing.assert_allclose(changed_rows["ids"][-5], -LR * np.ones(DIM), atol=1e-6)
        changed_parts = {key[0] for c in changes for key in c.parts}
        assert "w" in changed_parts and "emb" not in changed_parts   # the table came by rows
        assert sum(c.live_rows["ids"] for c in changes) == 2

        # nothing changed after the step read: no parts, no rows; `whole` sends a table whole anyway
        again = [reader.read_state(i, changes[i].step) for i in range(2)]
        assert all(not a.parts and all(len(ids) == 0 for ids, _ in a.rows.values()) for a in again)
        full = [reader.read_state(i, changes[i].step, whole=["emb", "ids"]) for i in range(2)]
        dense_full, dynamic_full = whole_model(full)
        assert dense_full["emb"].shape == (ROWS, DIM) and sorted(dynamic_full["ids"]) == sorted(keys.tolist())


def test_read_state_errors_name_the_problem(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with client(cluster, "reader") as reader:
        stub = reader._stubs[0]
        with pytest.raises(grpc.RpcError) as before:
            list(stub.ReadState(pb.ReadStateRequest(since_step=-1), timeout=10))
        assert before.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "InitParameters" in before.value.details()
        reader.initialize(model())
        with pytest.raises(grpc.RpcError) as unknown:
            list(stub.ReadState(pb.ReadStateRequest(since_step=-1, whole=["nope"]), timeout=10))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.ReadState(pb.ReadStateRequest(since_step=-2), timeout=10))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "-2" in bad.value.details()
        with pytest.raises(ServerError) as late:
            reader.read_state(0, min_step=5, timeout=0.3)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_restarted_shard_has_a_new_state_id(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with client(cluster, "w0") as w0:
        w0.initialize(model())
        before = w0.read_state(0)
        cluster.restart(0)
        w0.wait_ready(30)
        w0.initialize(model())
        after = w0.read_state(0)
        assert after.state_id != before.state_id
