"""The consistency modes with real worker clients against real shards: sync N of M, SSP's bound, async drops."""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np

from ps_proto.v1 import parameter_server_pb2 as pb
from worker_client.client import PSClient, PushReport, RetryPolicy

FLAGS = ["--optimizer", "sgd", "--lr", "0.01", "--partition-min-bytes", "4096"]
MODEL = {"w": np.zeros((128, 32), np.float32), "b": np.zeros(32, np.float32)}   # w (16 KiB) is split over 2 shards
GRADS = {"w": np.ones((128, 32), np.float32), "b": np.ones(32, np.float32)}
RETRY = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)
#: Longest any single wait in these tests may take; reaching it fails the test, never hangs it.
WAIT = 20.0


def clients(cluster, names) -> list[PSClient]:
    out = [PSClient(cluster.addresses, worker_id=n, rpc_timeout=WAIT, wait_timeout=WAIT, retry=RETRY) for n in names]
    for c in out:
        c.wait_ready(WAIT)
    out[0].initialize(MODEL)
    for c in out:
        c.fetch_shard_map()
        c.register(heartbeat=True)
    return out


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def run_threads(targets, timeout: float) -> None:
    """Runs the callables in threads; re-raises the first error; fails if one outlives timeout."""
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guard(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"a worker thread was still running after {timeout} s"
    if errors:
        raise errors[0]


def test_sync_with_3_workers_and_n_2_never_waits_for_the_slowest_and_drops_its_late_pushes_as_stale(start_cluster) -> None:
    cluster = start_cluster(2, mode="sync", flags=[*FLAGS, "--replicas-to-aggregate", "2", "--total-replicas", "3"])
    fast_a, fast_b, slow = clients(cluster, ["fast-a", "fast-b", "slow"])
    slow_seconds, slow_pushes, min_rounds = 1.5, 2, 10
    slow_done = threading.Event()
    stop = {"now": False, "rounds": 0}

    def decide() -> None:   # run by one fast worker when both reach the top of a round
        stop["now"] = (slow_done.is_set() and stop["rounds"] >= min_rounds) or stop["rounds"] >= 5000
        stop["rounds"] += 1

    rounds = threading.Barrier(2, action=decide, timeout=WAIT)
    fast_log: dict[str, list[tuple[float, list[int], PushReport]]] = {"fast-a": [], "fast-b": []}
    slow_log: list[tuple[float, list[int], PushReport]] = []

    def fast(worker: PSClient) -> None:
        target = [0, 0]
        while True:
            rounds.wait()
            if stop["now"]:
                return
            started = time.monotonic()
            worker.pull(min_steps=target, timeout=WAIT)   # sync: not older than the step after our last push
            read = list(worker.steps)
            report = worker.push(GRADS)
            fast_log[worker.worker_id].append((time.monotonic() - started, read, report))
            target = [s + 1 for s in read]

    def slow_worker() -> None:
        try:
            for _ in range(slow_pushes):
                slow.pull(timeout=WAIT)
                read = list(slow.steps)
                time.sleep(slow_seconds)   # the straggler: computes slowly
                # (never trust a sleep alone: be sure the step has moved on before pushing)
                wait_until(lambda: all(slow.cluster_info(i).step > read[i] for i in range(2)), WAIT, "the fast workers' steps")
                slow_log.append((time.monotonic(), read, slow.push(GRADS)))
        finally:
            slow_done.set()

    started = time.monotonic()
    run_threads([lambda: fast(fast_a), lambda: fast(fast_b), slow_worker], timeout=3 * WAIT)
    elapsed = time.monotonic() - started

    # the slow worker's pushes came back dropped as stale, on every shard, with the step
    assert len(slow_log) == slow_pushes
    for _, read, report in slow_log:
        for shard, response in enumerate(report.responses):
            assert response.outcome == pb.PUSH_DROPPED
            assert response.drop_reason == pb.DROP_STALE
            assert response.step > read[shard]
            assert f"step {read[shard]}" in response.message and f"step {response.step}" in response.message

    # the fast workers' pushes were all taken, and their steps advanced without waiting for it
    steps = len(fast_log["fast-a"])
    assert steps >= min_rounds and len(fast_log["fast-b"]) == steps
    for log in fast_log.values():
        for _, _, report in log:
            assert report.accepted
    assert [fast_a.cluster_info(i).step for i in range(2)] == [steps, steps]
    # had a step waited for the straggler, each would take >= slow_seconds; they took a small fraction of it
    step_times = [t for log in fast_log.values() for t, _, _ in log]
    assert statistics.median(step_times) < slow_seconds / 3, step_times
    assert steps >= slow_pushes * 3, f"only {steps} fast steps in {elapsed:.1f} s"
    assert [slow.cluster_info(i).dropped_stale for i in range(2)] == [slow_pushes, slow_pushes]
    for c in (fast_a, fast_b, slow):
        c.deregister()
        c.close()


def test_ssp_with_b_2_keeps_the_fast_worker_at_most_2_clocks_ahead_of_a_slow_one(start_cluster) -> None:
    cluster = start_cluster(2, mode="ssp", flags=[*FLAGS, "--staleness", "2"])
    fast, slow = clients(cluster, ["fast", "slow"])
    fast_pushes, slow_seconds = 8, 0.5
    # the slow worker's progress: pushes that returned, and whether one is on the wire now
    progress = {"done": 0, "in_flight": False}
    lock = threading.Lock()
    fast_finished = threading.Event()
    gaps: list[tuple[int, int, bool, float]] = []    # (fast clock, slow pushes done, slow push in flight, pull seconds)

    def fast_worker() -> None:
        try:
            for _ in range(fast_pushes):
                started = time.monotonic()
                fast.pull(ssp=True, timeout=WAIT)
                with lock:
                    gaps.append((fast.clock, progress["done"], progress["in_flight"], time.monotonic() - started))
                fast.push(GRADS)
        finally:
            fast_finished.set()

    def slow_worker() -> None:
        deadline = time.monotonic() + 2 * WAIT
        while not fast_finished.is_set() and time.monotonic() < deadline:
            slow.pull(ssp=True, timeout=WAIT)
            time.sleep(slow_seconds)
            with lock:
                progress["in_flight"] = True
            slow.push(GRADS)
            with lock:
                progress["done"] += 1
                progress["in_flight"] = False

    run_threads([fast_worker, slow_worker], timeout=3 * WAIT)

    assert len(gaps) == fast_pushes
    for fast_clock, slow_done, in_flight, _ in gaps:
        # exact when no slow push was on the wire; else the shard may already hold one more slow push
        gap = fast_clock - slow_done - (1 if in_flight else 0)
        assert gap <= 2, f"fast at clock {fast_clock} pulled while slow had {slow_done} pushes done: {gaps}"
    assert max(c - d for c, d, _, _ in gaps) >= 2, f"the bound was never reached: {gaps}"
    # the hold happened: pulls at the bound waited for the slow worker (about slow_seconds each)
    held = [s for c, d, _, s in gaps if c - d >= 2]
    assert held and max(held) > slow_seconds / 3, gaps
    # and the server agrees: every live clock within the bound after the fast worker's last pull
    info = fast.cluster_info(0)
    clocks = {w.worker_id: w.clock for w in info.workers}
    assert clocks["fast"] == fast_pushes and clocks["fast"] - clocks["slow"] <= 3
    for c in (fast, slow):
        c.deregister()
        c.close()


def test_async_drops_a_gradient_older_than_max_staleness_and_applies_the_rest(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=[*FLAGS, "--max-staleness", "2"])
    lagging, busy = clients(cluster, ["lagging", "busy"])
    lagging.pull()
    assert lagging.steps == [0]
    for expected_step in (1, 2, 3):
        busy.pull()
        report = busy.push(GRADS)
        assert report.accepted and report.steps == [expected_step]

    stale = lagging.push(GRADS)               # read at step 0, the shard is at 3: 3 > 2
    [response] = stale.responses
    assert (response.outcome, response.drop_reason, response.step) == (pb.PUSH_DROPPED, pb.DROP_STALE, 3)
    assert "read at step 0" in response.message and "max_staleness 2" in response.message
    assert lagging.cluster_info().dropped_stale == 1

    lagging.pull()
    fresh = lagging.push(GRADS)
    assert fresh.accepted and fresh.steps == [4]
    np.testing.assert_allclose(lagging.pull()["b"], -0.01 * 4 * np.ones(32), rtol=1e-5)
    for c in (lagging, busy):
        c.deregister()
        c.close()


def test_a_sync_wait_for_a_step_past_the_jobs_last_ends_once_every_shard_reached_the_last(start_cluster) -> None:
    """The hang ps-launch hit: a worker whose push for the last step's successor waits on a shard for a second
    gradient, while the other worker, done, stays registered (worker 0 waits for the others to leave before its
    final evaluation). Given the job's last step, the wait ends and the shards are read as they are."""
    cluster = start_cluster(2, mode="sync", flags=[*FLAGS, "--replicas-to-aggregate", "2", "--total-replicas", "2"])
    late, done = clients(cluster, ["late", "done"])
    try:
        for worker in (late, done):
            worker.pull(timeout=WAIT)
        assert late.push(GRADS).accepted and done.push(GRADS).accepted   # both shards complete step 0 -> 1
        late.pull(min_steps=[1, 1], timeout=WAIT)
        report = late.push(GRADS)                 # read at step 1, the job's last: waits for step 2, which needs
        assert report.accepted and report.wait_steps == [2, 2]   # "done"'s gradient too; "done" sends none
        # without the job's last step: waits its whole timeout for step 2
        started = time.monotonic()
        try:
            late.pull_after(report, sync=True, timeout=1.0, recheck=0.2)
            raise AssertionError("the sync wait for step 2 returned without it")
        except Exception as exc:   # noqa: BLE001 - the wait's own error, checked below
            assert "waited 1.0 s" in str(exc) and time.monotonic() - started >= 1.0, exc
        # with it: ends at the first recheck, every shard read at step 1
        started = time.monotonic()
        values = late.pull_after(report, sync=True, timeout=WAIT, recheck=0.2, last_step=1)
        assert time.monotonic() - started < 5.0
        assert values is not None and set(values) == set(MODEL) and late.steps == [1, 1]
        # a last step not yet reached changes nothing: the wait runs out as before
        try:
            late.pull_after(report, sync=True, timeout=1.0, recheck=0.2, last_step=2)
            raise AssertionError("the sync wait for step 2 returned without it")
        except Exception as exc:   # noqa: BLE001
            assert "waited 1.0 s" in str(exc), exc
    finally:
        for worker in (late, done):
            worker.close()
