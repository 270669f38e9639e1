"""One shard's domain without sockets: init, push, pull, retries, rejected input, membership and barriers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec
from ps_common.errors import (
    InitMismatchError,
    InvalidRequestError,
    InvalidTensorError,
    NotInitializedError,
    ShuttingDownError,
    UnknownTensorError,
    UnknownWorkerError,
    WaitTimeoutError,
)
from ps_common.shard_map import ParamSpec
from tests.helpers.domain import FakeClock, LR, clocks, cluster_info, decode, init_shard, initialize, make_shard, own_chunks, pull_values, push, values

W0 = np.arange(12, dtype=np.float32).reshape(4, 3)
B0 = np.zeros(3, np.float32)
MODEL = {"w": W0, "b": B0}


def ready_shard(mode: str = "async", **overrides):
    shard = make_shard(mode, **overrides)
    init_shard(shard, MODEL)
    shard.register("a")
    return shard


def snapshot(shard) -> tuple:
    """Everything a rejected request must leave alone."""
    return (shard.step, shard.dropped, clocks(shard), {k: v.tolist() for k, v in values(shard).items()},
            {w: list(r.outcomes) for w, r in shard.membership.workers.items()})


# ------------------------------------------------------------------ init


def test_init_installs_the_values_and_a_pull_returns_them() -> None:
    shard = make_shard()
    already, step, nparts = init_shard(shard, MODEL)
    assert (already, step, nparts) == (False, 0, 2)
    step, pulled = pull_values(shard)
    assert step == 0
    np.testing.assert_array_equal(pulled["w"], W0)
    np.testing.assert_array_equal(pulled["b"], B0)


def test_init_again_with_the_same_parameter_list_is_idempotent_and_keeps_the_values() -> None:
    shard = make_shard()
    init_shard(shard, MODEL)
    shard.register("a")
    push(shard, "a", 0, 0, {"w": np.ones_like(W0), "b": np.ones_like(B0)})
    already, step, _ = init_shard(shard, {"w": W0 + 100, "b": B0 + 100})
    assert already and step == 1
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0 - LR)


def test_init_with_a_different_parameter_list_is_refused_naming_the_tensor() -> None:
    shard = make_shard()
    init_shard(shard, MODEL)
    before = snapshot(shard)
    with pytest.raises(InitMismatchError, match=r"'w' is initialized as float32\[4, 3\], re-init asks for float32\[4, 4\]"):
        init_shard(shard, {"w": np.zeros((4, 4), np.float32), "b": B0})
    with pytest.raises(InitMismatchError, match="'extra'"):
        init_shard(shard, {**MODEL, "extra": np.zeros(2, np.float32)})
    assert snapshot(shard) == before


def test_init_whose_chunks_miss_a_part_is_refused_and_leaves_the_shard_uninitialized() -> None:
    shard = make_shard()
    specs = [ParamSpec("w", "float32", (4, 3)), ParamSpec("b", "float32", (3,))]
    with pytest.raises(InvalidTensorError, match=r"'b' rows from 0"):
        initialize(shard, specs, list(codec.part_chunks("w", W0)))
    assert not shard.store.initialized
    with pytest.raises(InvalidTensorError, match="got 8 bytes, expected 12"):
        initialize(shard, specs, [*codec.part_chunks("w", W0),
                                 pb.TensorChunk(name="b", dtype=pb.DTYPE_FLOAT32, shape=[3], data=B0[:2].tobytes())])
    assert not shard.store.initialized


def test_a_shard_takes_exactly_its_own_row_range_of_a_split_tensor() -> None:
    big = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)  # 8 KiB, split over 2 shards at 1 KiB
    shard = make_shard(shard_index=1, num_shards=2, partition_min_bytes=1024)
    init_shard(shard, {"big": big})
    [(name, row_start)] = shard.store.parts
    assert name == "big" and 0 < row_start < 64
    _, pulled = pull_values(shard)
    np.testing.assert_array_equal(pulled["big"], big[row_start:])
    # the other shard's rows are refused, naming the owner
    other = make_shard(shard_index=1, num_shards=2, partition_min_bytes=1024)
    with pytest.raises(InvalidTensorError, match="belong to shard 0"):
        initialize(other, [ParamSpec("big", "float32", (64, 32))], list(codec.part_chunks("big", big[:row_start])))


# ------------------------------------------------------------------ push


def test_push_before_init_is_refused_as_not_initialized() -> None:
    shard = make_shard()
    shard.register("a")
    with pytest.raises(NotInitializedError, match="before InitParameters"):
        push(shard, "a", 0, 0, MODEL)
    with pytest.raises(NotInitializedError):
        pull_values(shard)


def test_push_from_an_unregistered_worker_is_refused_as_unknown() -> None:
    shard = ready_shard()
    with pytest.raises(UnknownWorkerError, match="'ghost'"):
        push(shard, "ghost", 0, 0, MODEL)


def test_a_retried_push_is_acknowledged_as_a_duplicate_and_not_applied_again() -> None:
    shard = ready_shard()
    g = {"w": np.ones_like(W0), "b": np.ones_like(B0)}
    first = push(shard, "a", 0, 0, g)
    assert first.accepted and not first.duplicate and first.step == 1 and first.clock == 1
    after_first = values(shard)

    retry = push(shard, "a", 0, 0, g)
    assert retry.duplicate and retry.accepted
    assert (retry.step, retry.clock) == (1, 1)
    assert shard.step == 1 and clocks(shard)["a"] == 1 and shard.applied_gradients == 1
    for key, value in values(shard).items():
        np.testing.assert_array_equal(value, after_first[key])


def test_a_retried_push_that_was_dropped_is_answered_with_its_first_outcome() -> None:
    shard = ready_shard(max_staleness=1)
    shard.register("b")
    push(shard, "b", 0, 0, MODEL)
    push(shard, "b", 1, 1, MODEL)
    dropped = push(shard, "a", 0, 0, MODEL)
    assert not dropped.accepted
    retry = push(shard, "a", 0, 0, MODEL)
    assert retry.duplicate and not retry.accepted and retry.drop_reason == pb.DROP_STALE
    assert shard.dropped == 1


def test_a_push_with_one_good_and_one_bad_tensor_changes_nothing() -> None:
    shard = ready_shard()
    before = snapshot(shard)
    with pytest.raises(InvalidTensorError, match=r"'b' rows from 0: dtype float64 does not match the parameter's float32"):
        push(shard, "a", 0, 0, {"w": np.ones_like(W0), "b": np.ones(3, np.float64)})
    assert snapshot(shard) == before
    with pytest.raises(InvalidTensorError, match=r"'b' rows from 0: shape \[4\] does not match the part's shape \[3\]"):
        push(shard, "a", 0, 0, {"w": np.ones_like(W0), "b": np.ones(4, np.float32)})
    assert snapshot(shard) == before


def test_a_push_whose_chunks_miss_bytes_is_refused_with_the_byte_counts() -> None:
    shard = ready_shard()
    before = snapshot(shard)
    short = pb.TensorChunk(name="w", dtype=pb.DTYPE_FLOAT32, shape=[4, 3], data=np.ones(11, np.float32).tobytes())
    with pytest.raises(InvalidTensorError, match=r"'w' rows from 0: got 44 bytes, expected 48"):
        decode([short], shard.push_layout())
    overlong = pb.TensorChunk(name="w", dtype=pb.DTYPE_FLOAT32, shape=[4, 3], byte_offset=40, data=bytes(16))
    with pytest.raises(InvalidTensorError, match=r"\[40, 56\) fall outside the part's 48 bytes"):
        decode([overlong], shard.push_layout())
    assert snapshot(shard) == before


def test_a_push_for_an_unknown_tensor_is_refused_as_not_found() -> None:
    shard = ready_shard()
    chunk = next(codec.part_chunks("nope", np.ones(3, np.float32)))
    with pytest.raises(UnknownTensorError, match="'nope'"):
        decode([chunk], shard.push_layout())


def test_a_push_holding_nan_is_refused_and_changes_nothing() -> None:
    shard = ready_shard()
    before = snapshot(shard)
    bad = np.ones_like(W0)
    bad[2, 1] = np.nan
    with pytest.raises(InvalidRequestError, match="NaN or inf"):
        push(shard, "a", 0, 0, {"w": bad, "b": np.ones_like(B0)})
    assert snapshot(shard) == before


def test_a_push_read_at_a_step_from_the_future_is_dropped_as_step_ahead_with_both_steps() -> None:
    shard = ready_shard()
    before_values = {k: v.tolist() for k, v in values(shard).items()}
    result = push(shard, "a", 0, 5, MODEL)
    assert (result.accepted, result.drop_reason, result.step, result.clock) == (False, pb.DROP_STEP_AHEAD, 0, 1)
    assert "read at step 5" in result.message and "at step 0" in result.message
    assert {k: v.tolist() for k, v in values(shard).items()} == before_values and shard.step == 0


def test_a_push_with_an_empty_worker_or_negative_clock_is_refused_and_changes_nothing() -> None:
    shard = ready_shard()
    before = snapshot(shard)
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        push(shard, "", 0, 0, MODEL)
    with pytest.raises(InvalidRequestError, match="clock -1"):
        push(shard, "a", -1, 0, MODEL)
    assert snapshot(shard) == before


# ------------------------------------------------------------------ pull


def test_pull_of_named_tensors_returns_only_those() -> None:
    shard = ready_shard()
    _, pulled = pull_values(shard, ["b"])
    assert list(pulled) == ["b"]


def test_pull_of_an_unknown_tensor_is_refused_as_not_found() -> None:
    shard = ready_shard()
    with pytest.raises(UnknownTensorError, match="'nope'"):
        pull_values(shard, ["w", "nope"])


def test_pull_with_a_negative_min_step_or_wait_is_refused() -> None:
    shard = ready_shard()
    with pytest.raises(InvalidRequestError, match="min_step must be >= 0, got -1"):
        pull_values(shard, min_step=-1)
    with pytest.raises(InvalidRequestError, match="wait_timeout_ms must be >= 0, got -5"):
        shard.wait_timeout(-5, None)


def test_the_wait_bound_is_the_smallest_of_request_shard_maximum_and_rpc_deadline() -> None:
    shard = ready_shard(wait_timeout_seconds=30.0)
    assert shard.wait_timeout(0, None) == 30.0
    assert shard.wait_timeout(2000, None) == 2.0
    assert shard.wait_timeout(60_000, None) == 30.0
    assert shard.wait_timeout(2000, 0.5) == 0.5


def test_pull_for_a_future_step_times_out_even_when_the_lease_clock_stands_still() -> None:
    shard = ready_shard()   # a FakeClock that never moves
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=r"waited 0.2 s for step >= 3"):
        pull_values(shard, [], min_step=3, worker_id="", clock=0, timeout=0.2)
    assert time.monotonic() - start < 5


def test_stopping_a_shard_wakes_a_waiting_pull_with_shutting_down() -> None:
    shard = ready_shard()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pull_values(shard, [], min_step=5, worker_id="", clock=0, timeout=20.0)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(0.2)
    shard.stop()
    waiter.join(5.0)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ShuttingDownError)
    with pytest.raises(ShuttingDownError):
        shard.register("b")


# ------------------------------------------------------------------ membership


def test_a_new_worker_starts_at_the_slowest_live_workers_clock() -> None:
    shard = ready_shard()
    shard.register("b")
    for clock in range(3):
        push(shard, "a", clock, shard.step, MODEL)
    push(shard, "b", 0, shard.step, MODEL)
    clock, step, lease = shard.register("late")
    assert (clock, step, lease) == (1, 4, 10.0)


def test_re_registering_keeps_the_workers_clock() -> None:
    shard = ready_shard()
    push(shard, "a", 0, 0, MODEL)
    push(shard, "a", 1, 1, MODEL)
    assert shard.register("a")[0] == 2


def test_heartbeat_renews_a_lease_and_an_unknown_worker_must_register() -> None:
    now = FakeClock()
    shard = make_shard(now=now)
    shard.register("a")
    now.advance(9)
    assert shard.heartbeat("a") == (10.0, 0)
    now.advance(9)
    [info] = cluster_info(shard).workers
    assert info.live and info.lease_remaining_ms == 1000
    now.advance(2)
    [info] = cluster_info(shard).workers
    assert not info.live and info.lease_remaining_ms == 0
    with pytest.raises(UnknownWorkerError, match="'ghost'.*RegisterWorker"):
        shard.heartbeat("ghost")


def test_register_or_heartbeat_with_an_empty_worker_id_is_refused() -> None:
    shard = make_shard()
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        shard.register("")
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        shard.heartbeat("")


def test_deregister_is_idempotent_and_ends_the_lease_at_once() -> None:
    shard = ready_shard()
    shard.deregister("a")
    shard.deregister("a")
    shard.deregister("never-registered")
    [info] = cluster_info(shard).workers
    assert not info.live


# ------------------------------------------------------------------ barrier


def _arrive(shard, results: dict, who: str, participants: int, timeout: float, name: str = "start") -> threading.Thread:
    def run() -> None:
        try:
            results[who] = shard.barrier(name, who, participants, timeout)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            results[who] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_barrier_releases_every_participant_once_all_arrived_and_can_be_reused() -> None:
    shard = make_shard()
    for generation in (1, 2):
        results: dict = {}
        threads = [_arrive(shard, results, w, 3, 10.0) for w in ("a", "b")]
        time.sleep(0.1)
        assert all(t.is_alive() for t in threads)
        assert shard.barrier("start", "c", 3, 10.0) == (generation, 3)
        for t in threads:
            t.join(10.0)
        assert results == {"a": (generation, 3), "b": (generation, 3)}


def test_arriving_twice_at_a_barrier_counts_once() -> None:
    shard = make_shard()
    results: dict = {}
    first = _arrive(shard, results, "a", 2, 10.0)
    time.sleep(0.05)
    second = _arrive(shard, results, "a", 2, 0.3)
    second.join(5.0)
    assert isinstance(results["a"], WaitTimeoutError)   # a second "a" does not make two
    assert shard.barrier("start", "b", 2, 5.0)[0] == 1
    first.join(5.0)


def test_a_barrier_that_times_out_names_who_arrived_and_withdraws_the_arrival() -> None:
    shard = make_shard()
    with pytest.raises(WaitTimeoutError, match=r"barrier 'start': waited 0.2 s for 2 participants; 1 arrived \(a\)"):
        shard.barrier("start", "a", 2, 0.2)
    # "a" is no longer counted: "b" alone cannot release it
    with pytest.raises(WaitTimeoutError, match=r"1 arrived \(b\)"):
        shard.barrier("start", "b", 2, 0.2)


def test_a_barrier_called_with_a_different_participant_count_is_refused() -> None:
    shard = make_shard()
    results: dict = {}
    waiter = _arrive(shard, results, "a", 2, 10.0)
    time.sleep(0.1)
    with pytest.raises(InvalidRequestError, match="participants=3 while 1 waiting callers said 2"):
        shard.barrier("start", "b", 3, 1.0)
    assert shard.barrier("start", "b", 2, 1.0) == (1, 2)
    waiter.join(5.0)
    assert results["a"] == (1, 2)


@pytest.mark.parametrize("name, who, participants, message", [
    ("", "a", 1, "name must not be empty"),
    ("x", "", 1, "participant_id must not be empty"),
    ("x", "a", 0, r"participants must be in \[1, max_registered_workers=\d+\], got 0"),
])
def test_a_malformed_barrier_call_is_refused(name: str, who: str, participants: int, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        make_shard().barrier(name, who, participants, 1.0)


# ------------------------------------------------------------------ info


def test_cluster_info_describes_the_configuration_map_and_workers() -> None:
    shard = make_shard("sync", replicas_to_aggregate=2, total_replicas=3, shard_index=0, num_shards=1)
    info = cluster_info(shard)
    assert not info.initialized and not info.parameters and not info.parts
    init_shard(shard, MODEL)
    shard.register("a")
    info = cluster_info(shard)
    assert (info.mode, info.replicas_to_aggregate, info.total_replicas) == (pb.MODE_SYNC, 2, 3)
    assert info.initialized and info.optimizer == "sgd" and info.effective_replicas == 1
    assert sorted((p.name, p.row_start, p.row_end, p.shard) for p in info.parts) == [("b", 0, 3, 0), ("w", 0, 4, 0)]
    assert [(w.worker_id, w.clock, w.live) for w in info.workers] == [("a", 0, True)]


def test_a_part_sent_in_many_small_chunks_is_reassembled_exactly() -> None:
    shard = make_shard()
    big = np.arange(3000, dtype=np.float32)
    initialize(shard, [ParamSpec("big", "float32", (3000,))], own_chunks(shard, {"big": big}, chunk_bytes=1024))
    _, pulled = pull_values(shard)
    np.testing.assert_array_equal(pulled["big"], big)
