"""Sparse rows through real shard processes: PSClient.pull_rows and row gradients routed by the shard map."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_common.errors import ServerError
from worker_client.client import PSClient, RetryPolicy

LR = 0.5
FLAGS = ["--optimizer", "sgd", "--lr", str(LR), "--partition-min-bytes", "4096"]
QUICK_RETRY = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)
ROWS, DIM = 256, 16


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32),   # 16 KiB: split over both shards
            "bias": np.zeros(4, np.float32)}


def client(cluster, worker_id: str) -> PSClient:
    c = PSClient(cluster.addresses, worker_id=worker_id, rpc_timeout=30, wait_timeout=30, retry=QUICK_RETRY)
    c.wait_ready(30)
    return c


def test_rows_of_both_shards_are_pulled_in_order_and_a_sync_step_averages_their_gradients(start_cluster) -> None:
    cluster = start_cluster(2, mode="sync", flags=[*FLAGS, "--replicas-to-aggregate", "2", "--total-replicas", "2"])
    values = model()
    first, last = 3, ROWS - 2          # one row on each shard
    with client(cluster, "w0") as w0, client(cluster, "w1") as w1:
        w0.initialize(values)
        assert {int(s) for s in (w0.shard_map.parts_of("emb")[0].shard, w0.shard_map.parts_of("emb")[-1].shard)} == {0, 1}
        for w in (w0, w1):
            w.register(heartbeat=False)
        ids = np.array([last, first, last], np.int64)
        np.testing.assert_array_equal(w0.pull_rows({"emb": ids})["emb"], values["emb"][ids])
        bias = {"bias": np.zeros(4, np.float32)}
        # w0 touches `first` twice (summed) and `last`; w1 touches only `first`
        grads = {w0: (np.array([first, last, first], np.int64), np.ones((3, DIM), np.float32)),
                 w1: (np.array([first], np.int64), np.full((1, DIM), 4.0, np.float32))}
        reports = {}
        threads = [threading.Thread(target=lambda w=w: reports.__setitem__(w, w.push(bias, row_gradients={"emb": grads[w]})))
                   for w in (w0, w1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r.accepted for r in reports.values()), reports
        after = w0.pull_rows({"emb": np.array([first, last, 0], np.int64)}, min_steps=1)["emb"]
        np.testing.assert_allclose(after[0], values["emb"][first] - LR * (2 + 4) / 2, atol=1e-6)
        np.testing.assert_allclose(after[1], values["emb"][last] - LR * 1 / 2, atol=1e-6)
        np.testing.assert_array_equal(after[2], values["emb"][0])   # untouched
        assert w0.steps == [1, 1]


def test_push_pull_rows_reads_the_next_rows_of_both_shards_after_the_push_as_pull_rows_would(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    values = model()
    first, last = 3, ROWS - 2          # one row on each shard
    with client(cluster, "w0") as w0:
        w0.initialize(values)
        w0.register(heartbeat=False)
        asked = np.array([last, first, last, 7], np.int64)
        report, dense, rows = w0.push_pull_rows(
            {"bias": np.ones(4, np.float32)}, {"emb": (np.array([first, last], np.int64), np.ones((2, DIM), np.float32))},
            names=["bias"], rows={"emb": asked})
        assert report.accepted and sorted(dense) == ["bias"]
        np.testing.assert_allclose(dense["bias"], -LR * np.ones(4), atol=1e-6)
        want = values["emb"][asked].copy()
        want[[0, 1, 2]] -= LR                                   # rows first and last were pushed before the read
        np.testing.assert_allclose(rows["emb"], want, atol=1e-6)
        np.testing.assert_array_equal(rows["emb"], w0.pull_rows({"emb": asked})["emb"])


def test_push_pull_rows_whose_new_dynamic_rows_would_pass_the_shard_limit_keeps_the_push_and_reads_nothing(
        start_cluster) -> None:
    from worker_client.client.rows import dynamic_table

    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--max-shard-bytes", str(16 + 2000)])
    with client(cluster, "w0") as w0:
        w0.initialize({"bias": np.zeros(4, np.float32)}, dynamic=[dynamic_table("emb", (DIM,))])
        w0.register(heartbeat=False)
        report, dense, rows = w0.push_pull_rows(
            {"bias": np.ones(4, np.float32)}, {"emb": (np.array([5], np.int64), np.ones((1, DIM), np.float32))},
            names=["bias"], rows={"emb": np.arange(1000, dtype=np.int64)})   # 1000 new rows: far past the limit
        assert report.accepted and dense is None and rows is None           # the push stands; nothing was read
        assert w0.cluster_info(0).step == 1
        with pytest.raises(ServerError, match="max_shard_bytes") as err:
            w0.pull_rows({"emb": np.arange(1000, dtype=np.int64)})          # ... and PullRows says why
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
