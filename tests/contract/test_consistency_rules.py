"""Contract: the rules of each consistency mode, as GetClusterInfo states its settings (sync N of M, ssp b, async)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from tests.contract.wire import Target, Workers, expect_status


def _changed(before, after) -> bool:
    return all(not (before.parts[k] == after.parts[k]).all() for k in before.parts)


def _pull_in_thread(target: Target, shard: int, results: dict, **kwargs) -> threading.Thread:
    def run() -> None:
        try:
            results["pull"] = target.pull(shard, **kwargs)
        except grpc.RpcError as exc:
            results["pull"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _live(target: Target, shard: int = 0) -> int:
    return sum(1 for w in target.info(shard).workers if w.live)


# ------------------------------------------------------------------ any mode


def test_a_new_worker_starts_at_the_slowest_live_workers_clock(ready: Target, workers: Workers) -> None:
    shard = ready.shards_with_parts()[0]
    first = workers.new()
    clock = workers.start_clocks[first][shard]
    for _ in range(2):
        response = ready.push(shard, first, clock, ready.info(shard).step)
        clock = response.clock
    live = [w.clock for w in ready.info(shard).workers if w.live]
    late = workers.new()
    assert workers.start_clocks[late][shard] == min(live)


# ------------------------------------------------------------------ sync


def test_sync_n_gradients_for_step_t_advance_it_once_and_a_backups_late_gradient_is_dropped_as_stale(
        sync_ready: Target, workers: Workers) -> None:
    n = sync_ready.info(0).replicas_to_aggregate
    ids = [workers.new() for _ in range(n + 1)]     # N workers and one backup
    assert sync_ready.info(0).effective_replicas == n
    for shard in sync_ready.shards_with_parts():
        t = sync_ready.info(shard).step
        before = sync_ready.pull(shard)
        for k, worker in enumerate(ids[:n], start=1):
            response = sync_ready.push(shard, worker, workers.start_clocks[worker][shard], t)
            assert response.outcome == pb.PUSH_ACCEPTED and response.drop_reason == pb.DROP_REASON_UNSPECIFIED
            if k < n:
                assert (response.step, response.aggregated) == (t, k)
                assert not _changed(before, sync_ready.pull(shard)), "applied before N gradients were in"
            else:
                assert response.step == t + 1
        after = sync_ready.pull(shard)
        assert after.step == t + 1 and _changed(before, after)

        dropped_before = sync_ready.info(shard).dropped_stale
        backup = ids[n]
        late = sync_ready.push(shard, backup, workers.start_clocks[backup][shard], t)
        assert (late.outcome, late.drop_reason, late.step) == (pb.PUSH_DROPPED, pb.DROP_STALE, t + 1)
        assert f"step {t}" in late.message and f"step {t + 1}" in late.message
        assert sync_ready.info(shard).dropped_stale == dropped_before + 1
        assert sync_ready.pull(shard).parts.keys() == after.parts.keys()
        assert not any((sync_ready.pull(shard).parts[k] != after.parts[k]).any() for k in after.parts)


def test_sync_a_second_gradient_from_one_worker_for_the_same_step_is_dropped_as_already_contributed(
        sync_ready: Target, workers: Workers) -> None:
    if sync_ready.info(0).replicas_to_aggregate < 2:
        pytest.skip("with replicas_to_aggregate = 1 every push completes its step")
    a, _ = workers.new(), workers.new()
    for shard in sync_ready.shards_with_parts():
        t = sync_ready.info(shard).step
        clock = workers.start_clocks[a][shard]
        assert sync_ready.push(shard, a, clock, t).aggregated == 1
        again = sync_ready.push(shard, a, clock + 1, t)
        assert (again.outcome, again.drop_reason, again.step, again.aggregated) == \
            (pb.PUSH_DROPPED, pb.DROP_ALREADY_CONTRIBUTED, t, 1)
        assert repr(a) in again.message and f"step {t}" in again.message


def test_sync_a_pull_for_the_next_step_waits_until_the_step_has_all_its_gradients(
        sync_ready: Target, workers: Workers) -> None:
    if sync_ready.info(0).replicas_to_aggregate < 2:
        pytest.skip("with replicas_to_aggregate = 1 every push completes its step")
    a, b = workers.new(), workers.new()
    shard = sync_ready.shards_with_parts()[0]
    t = sync_ready.info(shard).step
    sync_ready.push(shard, a, workers.start_clocks[a][shard], t)
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                  lambda: sync_ready.pull(shard, min_step=t + 1, wait_timeout_ms=300), f"step >= {t + 1}")

    results: dict = {}
    waiter = _pull_in_thread(sync_ready, shard, results, min_step=t + 1, wait_timeout_ms=20_000)
    waiter.join(0.3)
    assert waiter.is_alive(), "the pull for the next step returned before the step completed"
    sync_ready.push(shard, b, workers.start_clocks[b][shard], t)
    waiter.join(20)
    assert not waiter.is_alive()
    assert not isinstance(results["pull"], grpc.RpcError), results["pull"]
    assert results["pull"].step == t + 1


def test_sync_a_push_that_lacks_one_of_the_shards_parts_is_invalid_and_changes_nothing(
        sync_ready: Target, workers: Workers) -> None:
    candidates = [i for i in sync_ready.shards_with_parts() if len(sync_ready.parts_on(i)) >= 2]
    if not candidates:
        pytest.skip("no shard holds two parts of the contract model")
    shard = candidates[0]
    a, _ = workers.new(), workers.new()
    missing = sync_ready.parts_on(shard)[-1]
    before = sync_ready.snapshot(shard, [a])
    chunks = list(sync_ready.chunks_for(shard, sync_ready.grads(1.0), skip=[missing.name]))
    clock = workers.start_clocks[a][shard]
    expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                  lambda: sync_ready.push_raw(shard, sync_ready.push_messages(a, clock, before[0], chunks)),
                  repr(missing.name))
    assert sync_ready.snapshot(shard, [a]) == before
    full = sync_ready.push(shard, a, clock, before[0])
    assert full.outcome == pb.PUSH_ACCEPTED and full.clock == clock + 1


def test_sync_the_quorum_is_n_capped_by_the_live_workers_and_a_leaving_worker_never_holds_a_step(
        sync_ready: Target, workers: Workers) -> None:
    n = sync_ready.info(0).replicas_to_aggregate
    if n < 2:
        pytest.skip("with replicas_to_aggregate = 1 every push completes its step")
    ids = [workers.new() for _ in range(n)]
    for shard in range(sync_ready.num_shards):
        info = sync_ready.info(shard)
        assert info.effective_replicas == max(1, min(n, _live(sync_ready, shard)))
    shard = sync_ready.shards_with_parts()[0]
    t = sync_ready.info(shard).step
    first = sync_ready.push(shard, ids[0], workers.start_clocks[ids[0]][shard], t)
    assert first.step == t and first.aggregated == 1
    for worker in ids[1:]:          # everyone else leaves: the one gradient in is now the quorum
        sync_ready.deregister(worker)
    assert sync_ready.info(shard).step == t + 1
    assert sync_ready.info(shard).effective_replicas == max(1, min(n, _live(sync_ready, shard)))


# ------------------------------------------------------------------ ssp


def test_ssp_applies_each_gradient_as_it_arrives(ssp_ready: Target, workers: Workers) -> None:
    worker = workers.new()
    for shard in ssp_ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        for _ in range(3):
            t = ssp_ready.info(shard).step
            before = ssp_ready.pull(shard)
            response = ssp_ready.push(shard, worker, clock, t)
            assert response.outcome == pb.PUSH_ACCEPTED and response.step == t + 1
            assert _changed(before, ssp_ready.pull(shard))
            clock = response.clock


def _ssp_fast_ahead(target: Target, workers: Workers) -> tuple[int, str, str, int, int]:
    """(shard, fast, slow, fast's clock, b) with fast pushed b + 1 times past slow on that shard."""
    b = target.info(0).staleness
    if b < 0:
        pytest.skip("the staleness bound is unbounded (-1): no pull is ever held")
    fast, slow = workers.new("fast"), workers.new("slow")
    shard = target.shards_with_parts()[0]
    assert workers.start_clocks[fast][shard] == workers.start_clocks[slow][shard]
    clock = workers.start_clocks[fast][shard]
    for _ in range(b + 1):
        clock = target.push(shard, fast, clock, target.info(shard).step).clock
    return shard, fast, slow, clock, b


def test_ssp_holds_a_pull_while_a_live_worker_is_more_than_b_clocks_behind_and_releases_it_when_it_catches_up(
        ssp_ready: Target, workers: Workers) -> None:
    shard, fast, slow, clock, b = _ssp_fast_ahead(ssp_ready, workers)
    # b ahead is allowed
    assert ssp_ready.pull(shard, worker_id=fast, clock=clock - 1, wait_timeout_ms=2000).step >= 0
    # b + 1 ahead is held, and the timeout names the worker it waited for
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                  lambda: ssp_ready.pull(shard, worker_id=fast, clock=clock, wait_timeout_ms=300), slow)

    results: dict = {}
    waiter = _pull_in_thread(ssp_ready, shard, results, worker_id=fast, clock=clock, wait_timeout_ms=20_000)
    waiter.join(0.3)
    assert waiter.is_alive(), "the pull was answered while the slow worker was b + 1 clocks behind"
    started = time.monotonic()
    ssp_ready.push(shard, slow, workers.start_clocks[slow][shard], ssp_ready.info(shard).step)
    waiter.join(20)
    assert not waiter.is_alive() and time.monotonic() - started < 20
    assert not isinstance(results["pull"], grpc.RpcError), results["pull"]


def test_ssp_a_worker_that_leaves_no_longer_holds_anyones_pull(ssp_ready: Target, workers: Workers) -> None:
    shard, fast, slow, clock, _ = _ssp_fast_ahead(ssp_ready, workers)
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                  lambda: ssp_ready.pull(shard, worker_id=fast, clock=clock, wait_timeout_ms=200))
    ssp_ready.deregister(slow)
    assert ssp_ready.pull(shard, worker_id=fast, clock=clock, wait_timeout_ms=5000).step == ssp_ready.info(shard).step


def test_ssp_a_pull_without_a_worker_id_is_never_held(ssp_ready: Target, workers: Workers) -> None:
    shard, _, _, _, _ = _ssp_fast_ahead(ssp_ready, workers)
    assert ssp_ready.pull(shard, wait_timeout_ms=2000).step == ssp_ready.info(shard).step


# ------------------------------------------------------------------ async


def test_async_applies_each_gradient_as_it_arrives(async_ready: Target, workers: Workers) -> None:
    worker = workers.new()
    for shard in async_ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        for _ in range(3):
            t = async_ready.info(shard).step
            before = async_ready.pull(shard)
            response = async_ready.push(shard, worker, clock, t)
            assert response.outcome == pb.PUSH_ACCEPTED and response.step == t + 1
            assert _changed(before, async_ready.pull(shard))
            clock = response.clock


def test_async_drops_a_gradient_older_than_max_staleness_and_takes_one_at_the_bound(
        async_ready: Target, workers: Workers) -> None:
    m = async_ready.info(0).max_staleness
    if m == 0:
        pytest.skip("max_staleness is 0: this server never drops a gradient for its age")
    lagging, busy = workers.new("lagging"), workers.new("busy")
    for shard in async_ready.shards_with_parts():
        t0 = async_ready.info(shard).step
        busy_clock = workers.start_clocks[busy][shard]
        for _ in range(m):
            busy_clock = async_ready.push(shard, busy, busy_clock, async_ready.info(shard).step).clock
        clock = workers.start_clocks[lagging][shard]
        at_bound = async_ready.push(shard, lagging, clock, t0)            # t - s = m
        assert at_bound.outcome == pb.PUSH_ACCEPTED and at_bound.step == t0 + m + 1

        before = async_ready.snapshot(shard)
        over = async_ready.push(shard, lagging, clock + 1, t0)            # t - s = m + 1
        assert (over.outcome, over.drop_reason, over.step) == (pb.PUSH_DROPPED, pb.DROP_STALE, t0 + m + 1)
        assert f"step {t0}" in over.message and f"step {t0 + m + 1}" in over.message and str(m) in over.message
        step, dropped, initialized, _, pulled_step, values = async_ready.snapshot(shard)
        assert (step, dropped, initialized, pulled_step, values) == \
            (before[0], before[1] + 1, before[2], before[4], before[5])


def test_async_without_max_staleness_applies_a_gradient_of_any_age(unbounded_async_ready: Target, workers: Workers) -> None:
    if unbounded_async_ready.info(0).max_staleness != 0:
        pytest.skip(f"max_staleness is {unbounded_async_ready.info(0).max_staleness}: old gradients are dropped by design")
    lagging, busy = workers.new("lagging"), workers.new("busy")
    shard = unbounded_async_ready.shards_with_parts()[0]
    t0 = unbounded_async_ready.info(shard).step
    clock = workers.start_clocks[busy][shard]
    for _ in range(5):
        clock = unbounded_async_ready.push(shard, busy, clock, unbounded_async_ready.info(shard).step).clock
    old = unbounded_async_ready.push(shard, lagging, workers.start_clocks[lagging][shard], t0)
    assert old.outcome == pb.PUSH_ACCEPTED and old.step == t0 + 6
