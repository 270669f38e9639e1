"""Contract: InitParameters, Push and Pull on an initialized shard; every malformed request is refused and changes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import numpy as np

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec
from tests.contract.wire import Target, Workers, expect_status, new_id

# ------------------------------------------------------------------ InitParameters


def test_init_again_with_the_same_parameter_list_is_idempotent_and_ignores_the_new_values(ready: Target) -> None:
    before = [ready.snapshot(i) for i in range(ready.num_shards)]
    other = {name: np.asarray(value) + 7 for name, value in ready.model.items()}
    for shard in range(ready.num_shards):
        response = ready.init(shard, ready.init_messages(shard, other))
        assert response.already_initialized
        assert response.step == before[shard][0]
        assert response.num_parts == len(ready.parts_on(shard))
    assert [ready.snapshot(i) for i in range(ready.num_shards)] == before


def test_init_with_a_different_parameter_list_is_failed_precondition_naming_the_tensor(ready: Target) -> None:
    before = [ready.snapshot(i) for i in range(ready.num_shards)]
    reshaped = dict(ready.model, **{"contract.w": np.zeros((16, 5), np.float32)})
    extra = dict(ready.model, **{"contract.extra": np.zeros(3, np.float32)})
    for shard in range(ready.num_shards):
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, lambda: ready.init(shard, ready.init_messages(shard, reshaped)),
                      "'contract.w'", "[16, 4]", "[16, 5]")
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, lambda: ready.init(shard, ready.init_messages(shard, extra)),
                      "'contract.extra'")
    assert [ready.snapshot(i) for i in range(ready.num_shards)] == before


def test_init_without_a_header_is_invalid(ready: Target) -> None:
    for shard in range(ready.num_shards):
        messages = ready.init_messages(shard)
        messages[0].ClearField("header")
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: ready.init(shard, messages), "header")
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: ready.init(shard, []), "header")


# ------------------------------------------------------------------ Pull


def test_pull_streams_this_shards_parts_with_the_step_in_the_first_message(ready: Target) -> None:
    for shard in range(ready.num_shards):
        messages = list(ready.pull_stream(shard))
        assert messages, "a pull answers at least one message"
        assert messages[0].step == ready.info(shard).step
        assembler = codec.PartAssembler()
        for message in messages:
            for chunk in message.chunks:
                assembler.add(chunk)
        parts = assembler.finish()
        expected = {(p.name, p.row_start): p for p in ready.parts_on(shard)}
        assert sorted(parts) == sorted(expected)
        for key, value in parts.items():
            part = expected[key]
            assert value.dtype == np.dtype(part.dtype) and value.shape == tuple(part.shape)


def test_pull_of_named_tensors_returns_only_their_parts_on_this_shard(ready: Target) -> None:
    shard_map = ready.shard_map()
    for shard in range(ready.num_shards):
        for name in ready.model:
            pulled = ready.pull(shard, [name])
            assert sorted(pulled.parts) == sorted((p.name, p.row_start) for p in shard_map.parts_on(shard) if p.name == name)


def test_pull_of_an_unknown_tensor_is_not_found_naming_it(ready: Target) -> None:
    for shard in range(ready.num_shards):
        expect_status(grpc.StatusCode.NOT_FOUND, lambda: ready.pull(shard, ["contract.w", "contract.nope"]),
                      "'contract.nope'")


def test_pull_for_a_step_that_does_not_come_ends_with_deadline_exceeded_saying_what_it_awaited(ready: Target) -> None:
    for shard in range(ready.num_shards):
        step = ready.info(shard).step
        started = time.monotonic()
        message = expect_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                                lambda: ready.pull(shard, min_step=step + 1000, wait_timeout_ms=300),
                                f"step >= {step + 1000}", "0.3 s")
        waited = time.monotonic() - started
        assert 0.25 <= waited < 10, (waited, message)


def test_pull_for_the_current_step_is_answered_at_once(ready: Target) -> None:
    for shard in range(ready.num_shards):
        step = ready.info(shard).step
        assert ready.pull(shard, min_step=step, wait_timeout_ms=100).step == step


def test_pull_with_a_negative_min_step_or_wait_is_invalid(ready: Target) -> None:
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: ready.pull(0, min_step=-1), "min_step", "-1")
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: ready.pull(0, wait_timeout_ms=-5), "wait_timeout_ms", "-5")


# ------------------------------------------------------------------ Push: malformed requests change nothing


def _push_cases(target: Target, shard: int):
    """(label, code, needles, build(worker_id, clock, read_step) -> messages) for one shard's bad pushes."""
    parts = target.parts_on(shard)
    part = parts[0]
    grads = target.grads(1.0)

    def good_chunks() -> list[pb.TensorChunk]:
        return list(target.chunks_for(shard, grads))

    def mutated(mutate: Callable[[pb.TensorChunk], None]):
        def build(worker: str, clock: int, read_step: int) -> list[pb.PushRequest]:
            chunks = good_chunks()
            for chunk in chunks:
                if (chunk.name, chunk.row_start) == (part.name, part.row_start):
                    mutate(chunk)
                    break
            # the bad chunk travels last, after the good ones, in a message of its own
            bad = [c for c in chunks if (c.name, c.row_start) == (part.name, part.row_start)]
            good = [c for c in chunks if (c.name, c.row_start) != (part.name, part.row_start)]
            return target.push_messages(worker, clock, read_step, good + bad, per_message=max(1, len(good)))
        return build

    def other_dtype(chunk: pb.TensorChunk) -> None:
        chunk.dtype = pb.DTYPE_FLOAT64 if chunk.dtype != pb.DTYPE_FLOAT64 else pb.DTYPE_FLOAT32
        chunk.data = chunk.data + chunk.data

    def other_shape(chunk: pb.TensorChunk) -> None:
        chunk.shape[:] = [*chunk.shape, 1] if chunk.shape else [1]

    def short_bytes(chunk: pb.TensorChunk) -> None:
        chunk.data = chunk.data[:-4]

    nbytes = part.nbytes

    def extra_chunk(make: Callable[[], pb.TensorChunk]):
        def build(worker: str, clock: int, read_step: int) -> list[pb.PushRequest]:
            return target.push_messages(worker, clock, read_step, [*good_chunks(), make()])
        return build

    def overlap() -> pb.TensorChunk:
        return next(c for c in good_chunks() if (c.name, c.row_start) == (part.name, part.row_start))

    def unknown() -> pb.TensorChunk:
        return next(codec.part_chunks("contract.nope", np.ones(3, np.float32)))

    def no_header(worker: str, clock: int, read_step: int) -> list[pb.PushRequest]:
        messages = target.push_messages(worker, clock, read_step, good_chunks())
        messages[0].ClearField("header")
        return messages

    cases = [
        ("wrong dtype", grpc.StatusCode.INVALID_ARGUMENT, [repr(part.name), "dtype"], mutated(other_dtype)),
        ("wrong shape", grpc.StatusCode.INVALID_ARGUMENT, [repr(part.name), "shape", str(list(part.shape))],
         mutated(other_shape)),
        ("short bytes", grpc.StatusCode.INVALID_ARGUMENT, [repr(part.name), str(nbytes - 4), str(nbytes)],
         mutated(short_bytes)),
        ("overlapping chunks", grpc.StatusCode.INVALID_ARGUMENT, [repr(part.name)], extra_chunk(overlap)),
        ("unknown tensor", grpc.StatusCode.NOT_FOUND, ["'contract.nope'"], extra_chunk(unknown)),
        ("missing header", grpc.StatusCode.INVALID_ARGUMENT, ["header"], no_header),
    ]
    if part.row_end - part.row_start > 1 and part.shape:
        def unknown_rows() -> pb.TensorChunk:
            return next(codec.part_chunks(part.name, grads[part.name][part.row_start + 1:part.row_end],
                                          row_start=part.row_start + 1))
        cases.append(("a row range that is no part", grpc.StatusCode.NOT_FOUND,
                      [repr(part.name), str(part.row_start + 1)], extra_chunk(unknown_rows)))
    foreign = [p for i in range(target.num_shards) if i != shard for p in target.parts_on(i)]
    if foreign:
        other = foreign[0]

        def foreign_part() -> pb.TensorChunk:
            array = grads[other.name]
            piece = array if other.whole else array[other.row_start:other.row_end]
            return next(codec.part_chunks(other.name, piece, row_start=other.row_start))
        cases.append(("another shard's part", grpc.StatusCode.INVALID_ARGUMENT, [repr(other.name)],
                      extra_chunk(foreign_part)))
    return cases


def test_every_malformed_push_is_refused_with_its_status_and_values_and_changes_nothing(ready: Target,
                                                                                        workers: Workers) -> None:
    worker = workers.new()
    workers.new()   # a second live worker, so that in sync mode one push never completes a step
    for shard in ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        for label, code, needles, build in _push_cases(ready, shard):
            before = ready.snapshot(shard, [worker])
            step = before[0]
            expect_status(code, lambda: ready.push_raw(shard, build(worker, clock, step)), *needles)
            assert ready.snapshot(shard, [worker]) == before, f"{label}: the rejected push changed the shard"

        # the shard still takes a good push from the same worker at the same clock: nothing was recorded
        step = ready.info(shard).step
        good = ready.push(shard, worker, clock, step)
        assert good.outcome == pb.PUSH_ACCEPTED and not good.duplicate and good.clock == clock + 1


def test_a_push_from_an_unregistered_or_unnamed_worker_is_refused(ready: Target,
                                                                                       workers: Workers) -> None:
    worker = workers.new()
    ghost = new_id("contract-ghost")
    for shard in ready.shards_with_parts():
        before = ready.snapshot(shard, [worker])
        step = before[0]
        chunks = list(ready.chunks_for(shard, ready.grads(1.0)))
        expect_status(grpc.StatusCode.NOT_FOUND,
                      lambda: ready.push_raw(shard, ready.push_messages(ghost, 0, step, chunks)), repr(ghost))
        expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                      lambda: ready.push_raw(shard, ready.push_messages("", 0, step, chunks)), "worker_id")
        assert ready.snapshot(shard, [worker]) == before


def test_a_push_read_at_a_step_the_shard_has_not_reached_is_dropped_as_step_ahead(ready: Target,
                                                                                  workers: Workers) -> None:
    worker = workers.new()
    for shard in ready.shards_with_parts():
        step = ready.info(shard).step
        clock = workers.start_clocks[worker][shard]
        response = ready.push(shard, worker, clock, step + 5)
        assert (response.outcome, response.drop_reason, response.step) == (pb.PUSH_DROPPED, pb.DROP_STEP_AHEAD, step)
        assert f"read at step {step + 5}" in response.message and response.clock == clock + 1
        assert ready.info(shard).step == step


def test_a_retried_push_is_acknowledged_as_a_duplicate_with_its_first_outcome_and_not_applied_again(
        ready: Target, workers: Workers) -> None:
    worker = workers.new()
    workers.new()   # sync: a second live worker keeps the step open after one push
    for shard in ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        step = ready.info(shard).step
        first = ready.push(shard, worker, clock, step)
        assert not first.duplicate and first.clock == clock + 1
        after_first = ready.snapshot(shard, [worker])
        retry = ready.push(shard, worker, clock, step)
        assert retry.duplicate
        assert (retry.outcome, retry.drop_reason, retry.clock, retry.step) == \
            (first.outcome, first.drop_reason, first.clock, first.step)
        assert ready.snapshot(shard, [worker]) == after_first


def test_a_push_records_the_workers_clock_plus_one(ready: Target, workers: Workers) -> None:
    worker = workers.new()
    for shard in ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        response = ready.push(shard, worker, clock, ready.info(shard).step)
        assert response.clock == clock + 1
        assert ready.worker(ready.info(shard), worker).clock == clock + 1


def test_a_part_sent_as_many_small_chunks_in_any_order_lands_where_it_belongs(ready: Target, workers: Workers) -> None:
    info = ready.info(0)
    ids = [workers.new()]
    while info.mode == pb.MODE_SYNC and len(ids) < ready.info(0).effective_replicas:
        ids.append(workers.new())   # sync: enough workers to complete a step
    quorum = len(ids)
    rng = np.random.default_rng(1)
    grads = {n: (rng.random(np.shape(a)) + 0.5).astype(np.asarray(a).dtype) for n, a in ready.model.items()}
    for shard in ready.shards_with_parts():
        before = ready.pull(shard)
        step = ready.info(shard).step
        chunks = list(ready.chunks_for(shard, grads, chunk_bytes=64))[::-1]
        first = ready.push_raw(shard, ready.push_messages(ids[0], workers.start_clocks[ids[0]][shard], step, chunks,
                                                          per_message=1))
        assert first.outcome == pb.PUSH_ACCEPTED
        for other in ids[1:quorum]:
            assert ready.push(shard, other, workers.start_clocks[other][shard], step, grads).outcome == pb.PUSH_ACCEPTED
        after = ready.pull(shard)
        assert after.step == step + 1
        if info.optimizer != "sgd":
            continue
        for key, old in before.parts.items():   # plain SGD: the change is -lr * g, element by element
            name, row_start = key
            g = grads[name]
            g = g if g.ndim == 0 or old.shape == g.shape else g[row_start:row_start + old.shape[0]]
            ratio = (old.astype(np.float64) - after.parts[key]) / g
            np.testing.assert_allclose(ratio, float(np.median(ratio)), rtol=1e-3, err_msg=f"{key}")
            assert float(np.median(ratio)) > 0
