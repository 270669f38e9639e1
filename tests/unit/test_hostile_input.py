"""Hostile and buggy input to one shard, without sockets: every refusal is a catalog error, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import codec
from ps_common.errors import (
    CorruptCheckpointError,
    InvalidRequestError,
    InvalidTensorError,
    ResourceExhaustedError,
    ShuttingDownError,
)
from ps_common.shard_map import ParamSpec
from ps_server.checkpoints import decode, encode
from ps_server.config import MAX_COUNTER
from tests.helpers.domain import FakeClock, clocks, decode as assemble, init_shard, make_shard, push, values

FLOATS = {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}
WITH_IDS = {**FLOATS, "vocab": np.arange(5, dtype=np.int32)}


def snapshot(shard) -> tuple:
    """Everything a refused request must leave alone."""
    return (shard.step, shard.dropped, clocks(shard), {k: v.tolist() for k, v in values(shard).items()},
            {w: list(r.outcomes) for w, r in shard.membership.workers.items()})


def ready(mode: str = "async", model=WITH_IDS, **overrides):
    shard = make_shard(mode, **overrides)
    init_shard(shard, model)
    shard.register("a")
    return shard


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_a_push_with_a_float_and_an_integer_gradient_is_refused_whole(mode: str) -> None:
    shard = ready(mode)
    before = snapshot(shard)
    with pytest.raises(InvalidTensorError, match=r"'vocab' rows from 0 is int32: only floating-point parameters"):
        push(shard, "a", 0, 0, {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32),
                                "vocab": np.ones(5, np.int32)})
    assert snapshot(shard) == before


def test_a_sync_step_completes_without_gradients_for_integer_tensors() -> None:
    shard = ready("sync", replicas_to_aggregate=1)
    result = push(shard, "a", 0, 0, {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)})
    assert result.accepted and result.step == 1
    np.testing.assert_array_equal(values(shard)[("vocab", 0)], np.arange(5))


@pytest.mark.parametrize("clock", [2**63 - 1, MAX_COUNTER, -1])
def test_a_clock_out_of_range_is_refused_and_leaves_the_shard_serving(clock: int) -> None:
    shard = ready()
    before = snapshot(shard)
    with pytest.raises(InvalidRequestError, match=f"clock {clock}"):
        push(shard, "a", clock, 0, {"w": np.ones((4, 3), np.float32)})
    assert snapshot(shard) == before
    assert push(shard, "a", 0, 0, {"w": np.ones((4, 3), np.float32)}).accepted


def test_a_clock_far_ahead_of_the_workers_record_is_refused() -> None:
    shard = ready(max_clock_ahead=10)
    before = snapshot(shard)
    with pytest.raises(InvalidRequestError, match="max_clock_ahead=10"):
        push(shard, "a", 11, 0, {"w": np.ones((4, 3), np.float32)})
    assert snapshot(shard) == before
    assert push(shard, "a", 10, 0, {"w": np.ones((4, 3), np.float32)}).accepted


@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_a_push_without_gradients_moves_only_the_workers_clock_never_the_step(mode: str) -> None:
    shard = ready(mode)
    before = values(shard)
    result = push(shard, "a", 0, 0, {})
    assert result.accepted and result.step == 0 and "nothing was applied" in result.message
    assert clocks(shard)["a"] == 1 and shard.step == 0
    assert {k: v.tolist() for k, v in values(shard).items()} == {k: v.tolist() for k, v in before.items()}


def test_a_sync_push_without_gradients_is_refused_by_a_shard_holding_trainable_parts() -> None:
    shard = ready("sync")
    before = snapshot(shard)
    with pytest.raises(InvalidTensorError, match="needs a gradient for every part"):
        push(shard, "a", 0, 0, {})
    assert snapshot(shard) == before


@pytest.mark.parametrize("worker_id", ["x" * 257, "é" * 129])
def test_a_worker_id_over_the_limit_is_refused_without_echoing_it_whole(worker_id: str) -> None:
    shard = make_shard()
    with pytest.raises(InvalidRequestError, match="over max_id_bytes=256") as info:
        shard.register(worker_id)
    assert len(str(info.value)) < 400
    assert shard.membership.workers == {}


def test_a_tensor_name_over_the_limit_is_refused_at_init() -> None:
    shard = make_shard(max_name_bytes=16)
    with pytest.raises(InvalidRequestError, match="max_name_bytes=16"):
        shard.init_layout([ParamSpec("n" * 17, "float32", (2,))])
    assert not shard.store.initialized


def test_a_parameter_list_larger_than_the_shard_may_hold_is_refused_before_allocating() -> None:
    shard = make_shard(max_shard_bytes=1 << 20)
    huge = [ParamSpec("emb", "float32", (1 << 40, 64))]   # 256 TiB declared
    with pytest.raises(ResourceExhaustedError, match=r"over its limit of 1048576 bytes"):
        shard.init_layout(huge)
    assert not shard.store.initialized


def test_an_empty_parameter_list_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="parameter list is empty"):
        make_shard().init_layout([])


def test_registering_more_workers_than_the_limit_is_refused_and_gone_ones_are_forgotten() -> None:
    now = FakeClock()
    shard = make_shard(now=now, max_registered_workers=2, worker_retention_seconds=5.0)
    shard.register("a")
    shard.register("b")
    with pytest.raises(ResourceExhaustedError, match="max_registered_workers=2"):
        shard.register("c")
    shard.deregister("a")
    now.advance(6.0)           # "a" left 6 s ago, past the 5 s retention ("b"'s lease expired too)
    shard.tick()
    assert "a" not in shard.membership.workers
    shard.register("c")
    assert "c" in shard.membership.workers


def test_barriers_beyond_the_limit_are_refused_and_idle_ones_make_room() -> None:
    shard = make_shard(max_barriers=2)
    shard.barrier("one", "a", 1, 1.0)
    shard.barrier("two", "a", 1, 1.0)
    shard.barrier("three", "a", 1, 1.0)   # "one" and "two" are idle: dropped to make room
    assert sorted(shard.barriers._barriers) == ["three"]


def test_stopping_the_shard_wakes_a_barrier_waiter_at_once() -> None:
    import threading
    import time

    shard = make_shard()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            shard.barrier("start", "a", 2, 60.0)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    shard.stop()
    waiter.join(5.0)
    assert not waiter.is_alive() and time.monotonic() - started < 1.0
    assert len(errors) == 1 and isinstance(errors[0], ShuttingDownError)


@pytest.mark.parametrize("raw, message", [
    (b"\x12\x80", "varint runs past the end"),                       # field 2, length varint cut short
    (b"\x12\x05\x0a\x03\xff\xfe\xfd", "not UTF-8"),                  # a chunk whose name is not UTF-8
    (b"\x12\x03\x0a\x09a", "runs past the end"),                     # a name longer than its chunk
    (b"\x09\x01\x02", "runs past the end"),                          # a fixed64 cut short
    (b"\x02\x00", "field number 0"),
])
def test_bytes_that_do_not_parse_are_an_invalid_request(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        codec.decode_message(raw)


def test_a_checkpoint_holding_a_clock_out_of_range_is_refused_as_corrupt() -> None:
    shard = ready()
    push(shard, "a", 0, 0, {"w": np.ones((4, 3), np.float32)})
    state = shard.snapshot()
    state.workers[0].clock = 2**63 - 1
    tensors, metadata = encode(state)
    with pytest.raises(CorruptCheckpointError, match=r"clock of worker 'a' is 9223372036854775807"):
        decode(tensors, metadata)


def test_a_declared_chunk_shape_that_differs_from_the_part_is_refused_before_allocating() -> None:
    shard = ready()
    chunk = codec.part_chunks("w", np.ones((4, 3), np.float32))
    forged = [c for c in chunk]
    forged[0].shape[:] = [1 << 40, 3]
    with pytest.raises(InvalidTensorError, match="does not match the part's shape"):
        assemble(forged, shard.push_layout())
