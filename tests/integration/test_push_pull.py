"""Push and pull through real shard processes on port 0: routing, split tensors, idempotent init, retries."""

from __future__ import annotations

import numpy as np

from ps_proto.v1 import parameter_server_pb2 as pb
from worker_client.client import PSClient, RetryPolicy

LR = 0.5
FLAGS = ["--optimizer", "sgd", "--lr", str(LR), "--partition-min-bytes", "4096"]
QUICK_RETRY = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "emb": rng.standard_normal((256, 64)).astype(np.float32),   # 64 KiB: split over both shards
        "dense.weight": rng.standard_normal((64, 10)).astype(np.float32),
        "dense.bias": np.zeros(10, np.float32),
        "scale": np.array(1.5, np.float64),                          # a scalar
        "vocab_ids": np.arange(7, dtype=np.int32),                   # never pushed
    }


def client(cluster, worker_id: str) -> PSClient:
    c = PSClient(cluster.addresses, worker_id=worker_id, rpc_timeout=30, wait_timeout=30, retry=QUICK_RETRY)
    c.wait_ready(30)
    return c


def test_a_model_with_a_tensor_split_over_two_shards_round_trips_through_push_and_pull(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    values = model()
    with client(cluster, "w0") as worker:
        assert worker.initialize(values) is False
        owners = {p.shard for p in worker.shard_map.parts_of("emb")}
        assert owners == {0, 1}, "the test model must split 'emb' over both shards"
        for shard in range(2):   # every shard serves the same map
            info = worker.cluster_info(shard)
            assert info.shard_index == shard and info.num_shards == 2 and info.initialized
            assert [(p.name, p.row_start, p.row_end, p.shard) for p in info.parts] == \
                [(p.name, p.row_start, p.row_end, p.shard) for p in worker.shard_map.parts]

        pulled = worker.pull()
        assert sorted(pulled) == sorted(values)
        for name, value in values.items():
            assert pulled[name].dtype == value.dtype and pulled[name].shape == value.shape
            np.testing.assert_array_equal(pulled[name], value)

        worker.register(heartbeat=False)
        grads = {n: np.full_like(v, 0.25) for n, v in values.items() if v.dtype.kind == "f"}
        report = worker.push(grads)
        assert report.accepted and report.steps == [1, 1] and report.clock == 0
        after = worker.pull()
        for name, value in values.items():
            expected = value - LR * grads[name] if name in grads else value
            np.testing.assert_allclose(after[name], expected, rtol=0, atol=1e-6)
        assert worker.steps == [1, 1]

        subset = worker.pull(["emb", "scale"])
        assert sorted(subset) == ["emb", "scale"]
        np.testing.assert_array_equal(subset["emb"], after["emb"])


def test_a_second_worker_initializing_the_same_model_changes_nothing(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    values = model()
    with client(cluster, "w0") as first, client(cluster, "w1") as second:
        assert first.initialize(values) is False
        other = {n: v + 1 for n, v in values.items()}
        assert second.initialize(other) is True     # same list: already initialized, values ignored
        pulled = second.pull()
        for name, value in values.items():
            np.testing.assert_array_equal(pulled[name], value)


def test_a_retried_push_with_the_same_clock_is_acknowledged_on_every_shard_and_applied_once(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    values = model()
    with client(cluster, "w0") as worker:
        worker.initialize(values)
        worker.register(heartbeat=False)
        grads = {"emb": np.ones_like(values["emb"])}
        first = worker.push(grads, clock=0)
        retry = worker.push(grads, clock=0)
        assert [r.duplicate for r in first.responses] == [False, False]
        assert [r.duplicate for r in retry.responses] == [True, True]
        assert retry.accepted and retry.steps == [1, 1]
        assert [r.clock for r in retry.responses] == [1, 1]
        np.testing.assert_allclose(worker.pull(["emb"])["emb"], values["emb"] - LR, atol=1e-6)


def test_a_worker_that_registers_again_resumes_from_the_clock_the_shards_recorded(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    with client(cluster, "w0") as worker:
        worker.initialize(model())
        worker.register(heartbeat=False)
        for _ in range(3):
            worker.pull()
            worker.push({"dense.bias": np.ones(10, np.float32)})
    with client(cluster, "w0") as restarted:     # a fresh process: it kept nothing
        assert restarted.clock == 0
        assert restarted.register(heartbeat=False) == 3
        restarted.pull()
        report = restarted.push({"dense.bias": np.ones(10, np.float32)})
        assert report.accepted and not any(r.duplicate for r in report.responses)


def test_a_worker_that_stops_heartbeating_leaves_the_sync_quorum_when_its_lease_expires(start_cluster) -> None:
    cluster = start_cluster(1, mode="sync", flags=[*FLAGS, "--replicas-to-aggregate", "2", "--total-replicas", "2",
                                                    "--lease-seconds", "2"])
    floats = {n: v for n, v in model().items() if v.dtype.kind == "f"}   # sync: every part gets a gradient
    with client(cluster, "alive") as alive, client(cluster, "gone") as gone:
        alive.initialize(floats)
        alive.register(heartbeat=True)
        gone.register(heartbeat=False)   # and then never heard from again
        alive.pull()
        first = alive.push({n: np.zeros_like(v) for n, v in floats.items()})
        assert first.accepted and first.responses[0].aggregated == 1
        alive.pull(min_steps=1, timeout=10)   # completes once "gone" is no longer live
        assert alive.steps == [1]
        info = alive.cluster_info()
        assert {w.worker_id: w.live for w in info.workers} == {"alive": True, "gone": False}
        assert info.effective_replicas == 1
        assert info.mode == pb.MODE_SYNC


def test_a_shard_error_reaches_the_client_as_the_same_catalog_class(start_cluster) -> None:
    from ps_common.errors import ServerError, UnknownWorkerError, WaitTimeoutError

    cluster = start_cluster(1, mode="sync", flags=FLAGS)
    with client(cluster, "w0") as worker:
        worker.initialize(model())
        # a heartbeat of a worker that never registered: the shard names the reason, not just NOT_FOUND
        try:
            worker._call(0, "Heartbeat", lambda stub: stub.Heartbeat(pb.HeartbeatRequest(worker_id="ghost"), timeout=10))
        except UnknownWorkerError as exc:
            assert isinstance(exc, ServerError) and exc.code.name == "NOT_FOUND" and "ghost" in str(exc)
        else:
            raise AssertionError("a heartbeat of an unregistered worker was accepted")
        # a pull for a step that never comes: DEADLINE_EXCEEDED, typed as the wait timeout it was
        try:
            worker.pull(min_steps=5, timeout=0.3)
        except WaitTimeoutError as exc:
            assert isinstance(exc, ServerError) and exc.code.name == "DEADLINE_EXCEEDED"
        else:
            raise AssertionError("a pull for step 5 of a shard at step 0 returned")
