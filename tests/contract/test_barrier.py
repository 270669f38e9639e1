"""Contract: Barrier releases its participants together, is reusable, times out clearly and refuses bad calls."""

from __future__ import annotations

import threading
import time

import grpc

from ps_proto.v1 import parameter_server_pb2 as pb
from tests.contract.wire import RPC_TIMEOUT, Target, expect_status, new_id


def _arrive(target: Target, shard: int, results: dict, name: str, who: str, participants: int,
            timeout_ms: int) -> threading.Thread:
    def run() -> None:
        try:
            results[who] = target.stubs[shard].Barrier(
                pb.BarrierRequest(name=name, participant_id=who, participants=participants, timeout_ms=timeout_ms),
                timeout=RPC_TIMEOUT)
        except grpc.RpcError as exc:
            results[who] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_barrier_releases_all_participants_together_and_is_reusable_with_a_new_generation(target: Target) -> None:
    name = new_id("contract-barrier")
    for shard in range(target.num_shards):
        for generation in (1, 2):
            results: dict = {}
            threads = [_arrive(target, shard, results, name, who, 3, 20_000) for who in ("a", "b")]
            time.sleep(0.2)
            assert not results, "a participant left the barrier before everyone arrived"
            last = target.stubs[shard].Barrier(
                pb.BarrierRequest(name=name, participant_id="c", participants=3, timeout_ms=20_000), timeout=RPC_TIMEOUT)
            for thread in threads:
                thread.join(RPC_TIMEOUT)
            assert last.generation == generation and last.arrived == 3
            for who in ("a", "b"):
                assert isinstance(results[who], pb.BarrierResponse), results[who]
                assert results[who].generation == generation


def test_a_barrier_of_one_participant_releases_at_once(target: Target) -> None:
    response = target.stubs[0].Barrier(
        pb.BarrierRequest(name=new_id("contract-solo"), participant_id="a", participants=1, timeout_ms=1000),
        timeout=RPC_TIMEOUT)
    assert (response.generation, response.arrived) == (1, 1)


def test_a_barrier_that_times_out_is_deadline_exceeded_naming_it_and_who_arrived(target: Target) -> None:
    name = new_id("contract-lonely")
    started = time.monotonic()
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, lambda: target.stubs[0].Barrier(
        pb.BarrierRequest(name=name, participant_id="early-bird", participants=2, timeout_ms=300), timeout=RPC_TIMEOUT),
        repr(name), "early-bird", "2 participants")
    assert 0.25 <= time.monotonic() - started < 10
    # the arrival was withdrawn: a second participant alone does not release it
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, lambda: target.stubs[0].Barrier(
        pb.BarrierRequest(name=name, participant_id="late", participants=2, timeout_ms=300), timeout=RPC_TIMEOUT),
        "late")


def test_a_barrier_called_with_another_participant_count_than_the_waiting_callers_is_invalid(target: Target) -> None:
    name = new_id("contract-count")
    results: dict = {}
    waiter = _arrive(target, 0, results, name, "a", 2, 20_000)
    time.sleep(0.2)
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: target.stubs[0].Barrier(
        pb.BarrierRequest(name=name, participant_id="b", participants=3, timeout_ms=1000), timeout=RPC_TIMEOUT),
        repr(name), "3", "2")
    released = target.stubs[0].Barrier(
        pb.BarrierRequest(name=name, participant_id="b", participants=2, timeout_ms=5000), timeout=RPC_TIMEOUT)
    waiter.join(RPC_TIMEOUT)
    assert released.generation == 1 and results["a"].generation == 1


def test_a_barrier_without_a_name_or_participant_or_with_no_participants_is_invalid(target: Target) -> None:
    for request in (pb.BarrierRequest(name="", participant_id="a", participants=1, timeout_ms=100),
                    pb.BarrierRequest(name=new_id(), participant_id="", participants=1, timeout_ms=100),
                    pb.BarrierRequest(name=new_id(), participant_id="a", participants=0, timeout_ms=100)):
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: target.stubs[0].Barrier(request, timeout=RPC_TIMEOUT))
