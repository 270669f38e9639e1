"""Contract: sparse rows (PullRows, PushHeader.row_gradients) in every mode, with the bad-input rules."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec
from tests.contract.wire import RPC_TIMEOUT, Target, Workers, expect_status

TABLE = "contract.emb"
#: The contract clusters' SGD learning rate (conftest COMMON_FLAGS).
LR = 0.1


def owned_ids(target: Target, shard: int) -> np.ndarray:
    """Two ids of the table's rows this shard owns (its first and last)."""
    parts = [p for p in target.parts_on(shard) if p.name == TABLE]
    return np.array([parts[0].row_start, parts[-1].row_end - 1], np.int64)


def table_shards(target: Target) -> list[int]:
    return [s for s in range(target.num_shards) if any(p.name == TABLE for p in target.parts_on(s))]


def pull_rows(target: Target, shard: int, ids, **kwargs) -> pb.PullRowsResponse:
    request = pb.PullRowsRequest(tables=[pb.RowIds(name=TABLE, ids=list(ids))], **kwargs)
    return target.stubs[shard].PullRows(request, timeout=RPC_TIMEOUT)


def rows_of(response: pb.PullRowsResponse) -> np.ndarray:
    (table,) = response.tables
    return codec.rows_from_wire(table.name, table.dtype, table.data, table.shape[0], table.shape[1:])


def row_gradient(ids, values: np.ndarray, name: str = TABLE) -> pb.RowGradient:
    dtype, data = codec.rows_to_wire(values)
    return pb.RowGradient(name=name, ids=list(ids), dtype=dtype, data=data)


def push_rows(target: Target, shard: int, worker_id: str, clock: int, read_step: int, rows: list[pb.RowGradient],
              *, dense: bool = False) -> pb.PushResponse:
    """A push of row gradients; with dense, also all-ones chunks of the shard's other parts (sync needs them)."""
    chunks = target.chunks_for(shard, target.grads(1.0), skip=[TABLE]) if dense else []
    messages = target.push_messages(worker_id, clock, read_step, chunks)
    messages[0].header.row_gradients.extend(rows)
    return target.push_raw(shard, messages)


def new_worker_on_the_table(target: Target, workers: Workers) -> tuple[str, int, np.ndarray, np.ndarray, int, int]:
    """(a new worker, the first shard holding the table, two ids it owns, their rows now, the worker's clock
    there, the shard's step)."""
    worker = workers.new()
    shard = table_shards(target)[0]
    ids = owned_ids(target, shard)
    return (worker, shard, ids, rows_of(pull_rows(target, shard, ids)), workers.start_clocks[worker][shard],
            target.info(shard).step)


def dense_names(target: Target) -> list[str]:
    """The model's tensors other than the table (the ones a sparse step's PushPull pulls)."""
    return sorted(n for n in target.shard_map().specs if n != TABLE)


def test_pull_rows_returns_the_rows_in_request_order_and_refuses_ids_of_another_shard(ready: Target) -> None:
    shards = table_shards(ready)
    assert len(shards) == 2, "the contract table must be split over both shards"
    for shard in shards:
        ids = owned_ids(ready, shard)[::-1]
        full = ready.pull(shard, [TABLE])
        want = np.concatenate([v for (_, start), v in sorted(full.parts.items())])
        start = min(s for (_, s) in full.parts)
        got = rows_of(pull_rows(ready, shard, [*ids, ids[0]]))
        np.testing.assert_array_equal(got, want[[*(ids - start), ids[0] - start]])
    other = owned_ids(ready, shards[1])[0]
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: pull_rows(ready, shards[0], [other]),
                  f"row {other} of tensor {TABLE!r} belongs to shard {shards[1]}")
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: pull_rows(ready, shards[0], [96]), "row id 96")
    expect_status(grpc.StatusCode.NOT_FOUND, lambda: ready.stubs[0].PullRows(
        pb.PullRowsRequest(tables=[pb.RowIds(name="nope", ids=[0])]), timeout=RPC_TIMEOUT), "'nope'")


BAD = {
    "an id past the table": lambda ids: row_gradient([96], np.ones((1, 16), np.float32)),
    "an id of another shard": None,   # built in the test
    "NaN": lambda ids: row_gradient(ids[:1], np.full((1, 16), np.nan, np.float32)),
    "a byte count off by one row": lambda ids: row_gradient(ids[:1], np.ones((2, 16), np.float32)),
    "a float64 row of a float32 table": lambda ids: row_gradient(ids[:1], np.ones((1, 16), np.float64)),
    "a scalar tensor": lambda ids: row_gradient([0], np.ones((1,), np.float64), name="contract.scale"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_row_gradient_is_invalid_argument_and_changes_nothing(ready: Target, workers: Workers, what) -> None:
    shards = table_shards(ready)
    worker = workers.new()
    shard = shards[0]
    ids = owned_ids(ready, shard)
    rows = BAD[what](ids) if BAD[what] else row_gradient(owned_ids(ready, shards[1])[:1], np.ones((1, 16), np.float32))
    before = ready.snapshot(shard, [worker])
    expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                  lambda: push_rows(ready, shard, worker, workers.start_clocks[worker][shard], ready.info(shard).step,
                                    [rows], dense=True))
    assert ready.snapshot(shard, [worker]) == before


def test_async_rows_apply_on_arrival_summing_repeated_ids_and_a_retry_is_a_duplicate(async_ready: Target,
                                                                                    workers: Workers) -> None:
    worker, shard, (a, b), before, clock, step = new_worker_on_the_table(async_ready, workers)
    grad = row_gradient([a, a], np.ones((2, 16), np.float32))
    first = push_rows(async_ready, shard, worker, clock, step, [grad])
    assert first.outcome == pb.PUSH_ACCEPTED and first.step == step + 1
    again = push_rows(async_ready, shard, worker, clock, step, [grad])
    assert again.duplicate and again.step == step + 1
    after = rows_of(pull_rows(async_ready, shard, [a, b]))
    np.testing.assert_allclose(after[0], before[0] - LR * 2, rtol=1e-6)   # id a twice: summed, applied once
    np.testing.assert_array_equal(after[1], before[1])


def test_ssp_rows_apply_on_arrival(ssp_ready: Target, workers: Workers) -> None:
    worker = workers.new()
    shard = table_shards(ssp_ready)[1]
    a, _ = owned_ids(ssp_ready, shard)
    before = rows_of(pull_rows(ssp_ready, shard, [a]))
    response = push_rows(ssp_ready, shard, worker, workers.start_clocks[worker][shard], ssp_ready.info(shard).step,
                         [row_gradient([a], np.full((1, 16), 2.0, np.float32))])
    assert response.outcome == pb.PUSH_ACCEPTED
    np.testing.assert_allclose(rows_of(pull_rows(ssp_ready, shard, [a]))[0], before[0] - LR * 2.0, rtol=1e-6)


def test_sync_rows_are_summed_over_the_steps_contributors_and_divided_by_n(sync_ready: Target,
                                                                          workers: Workers) -> None:
    n = sync_ready.info(0).replicas_to_aggregate
    ids = [workers.new() for _ in range(n)]
    shard = table_shards(sync_ready)[0]
    a, b = owned_ids(sync_ready, shard)
    t = sync_ready.info(shard).step
    before = rows_of(pull_rows(sync_ready, shard, [a, b]))
    for k, worker in enumerate(ids):
        # every worker touches row a (gradient k + 1); only the first touches row b
        touched = [a, b] if k == 0 else [a]
        grad = np.full((len(touched), 16), float(k + 1), np.float32)
        response = push_rows(sync_ready, shard, worker, workers.start_clocks[worker][shard], t,
                             [row_gradient(touched, grad)], dense=True)
        assert response.outcome == pb.PUSH_ACCEPTED
    after = pull_rows(sync_ready, shard, [a, b], min_step=t + 1, wait_timeout_ms=5000)
    assert after.step == t + 1
    total_a = sum(range(1, n + 1))
    np.testing.assert_allclose(rows_of(after)[0], before[0] - LR * total_a / n, rtol=1e-5)
    np.testing.assert_allclose(rows_of(after)[1], before[1] - LR * 1.0 / n, rtol=1e-5)


def test_a_push_pull_carries_row_gradients_as_push_does_and_pulls_only_the_named_tensors(async_ready: Target,
                                                                                         workers: Workers) -> None:
    """The fast path of a sparse step: the rows ride in PushPull's header, the pull reads the dense tensors."""
    worker, shard, (a, b), before, clock, step = new_worker_on_the_table(async_ready, workers)
    # a shard may hold none of the dense tensors: then none come back, as a Pull of a name the shard holds no
    # part of returns nothing
    request = pb.PushPullRequest(header=pb.PushHeader(worker_id=worker, clock=clock, read_step=step,
                                                      row_gradients=[row_gradient([a, a], np.ones((2, 16),
                                                                                                 np.float32))]),
                                 pull=pb.PullAfterPush(names=dense_names(async_ready), wait_timeout_ms=1000))
    first = async_ready.stubs[shard].PushPull(request, timeout=RPC_TIMEOUT)
    assert first.push.outcome == pb.PUSH_ACCEPTED and first.ready and first.step == step + 1
    held = {p.name for p in async_ready.parts_on(shard) if p.name != TABLE}
    assert {c.name for c in first.chunks} == held                   # the named tensors this shard holds, no table
    again = async_ready.stubs[shard].PushPull(request, timeout=RPC_TIMEOUT)
    assert again.push.duplicate and again.step == step + 1          # acknowledged, not applied twice
    after = rows_of(pull_rows(async_ready, shard, [a, b]))
    np.testing.assert_allclose(after[0], before[0] - LR * 2, rtol=1e-6)
    np.testing.assert_array_equal(after[1], before[1])
    # a bad row gradient in a PushPull is refused whole, as in a Push
    bad = pb.PushPullRequest(header=pb.PushHeader(worker_id=worker, clock=clock + 1, read_step=step + 1,
                                                  row_gradients=[row_gradient([a], np.ones((1, 3), np.float32))]),
                             pull=pb.PullAfterPush(names=request.pull.names, wait_timeout_ms=1000))
    snapshot = async_ready.snapshot(shard, [worker])
    expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                  lambda: async_ready.stubs[shard].PushPull(bad, timeout=RPC_TIMEOUT), TABLE)
    assert async_ready.snapshot(shard, [worker]) == snapshot


def test_a_push_pull_reads_the_rows_asked_in_its_pull_at_the_step_of_its_values(async_ready: Target,
                                                                                workers: Workers) -> None:
    """PullAfterPush.rows: a sparse step's next rows come back with the values, after the push."""
    worker, shard, (a, b), before, clock, step = new_worker_on_the_table(async_ready, workers)
    request = pb.PushPullRequest(
        header=pb.PushHeader(worker_id=worker, clock=clock, read_step=step,
                             row_gradients=[row_gradient([a], np.ones((1, 16), np.float32))]),
        pull=pb.PullAfterPush(names=dense_names(async_ready), wait_timeout_ms=1000,
                              rows=[pb.RowIds(name=TABLE, ids=[b, a, b])]))
    response = async_ready.stubs[shard].PushPull(request, timeout=RPC_TIMEOUT)
    assert response.ready and response.step == step + 1 and [t.name for t in response.rows] == [TABLE]
    (table,) = response.rows
    got = codec.rows_from_wire(table.name, table.dtype, table.data, table.shape[0], table.shape[1:])
    np.testing.assert_allclose(got[1], before[0] - LR, rtol=1e-6)          # read after the push: a updated
    np.testing.assert_array_equal(got[[0, 2]], before[[1, 1]])              # in request order, repeats kept
    np.testing.assert_array_equal(got, rows_of(pull_rows(async_ready, shard, [b, a, b])))


@pytest.mark.parametrize("what", ["an id of another shard", "an unknown tensor", "a tensor named twice"])
def test_a_push_pull_asking_bad_rows_is_refused_before_its_push_and_changes_nothing(ready: Target,
                                                                                   workers: Workers, what) -> None:
    worker = workers.new()
    shards = table_shards(ready)
    shard = shards[0]
    mine, theirs = owned_ids(ready, shard), owned_ids(ready, shards[1])
    asked = {"an id of another shard": [pb.RowIds(name=TABLE, ids=[int(theirs[0])])],
             "an unknown tensor": [pb.RowIds(name="contract.no-such-table", ids=[0])],
             "a tensor named twice": [pb.RowIds(name=TABLE, ids=[int(mine[0])]),
                                      pb.RowIds(name=TABLE, ids=[int(mine[1])])]}[what]
    chunks = ready.chunks_for(shard, ready.grads(1.0), skip=[TABLE])
    request = pb.PushPullRequest(
        header=pb.PushHeader(worker_id=worker, clock=workers.start_clocks[worker][shard],
                             read_step=ready.info(shard).step,
                             row_gradients=[row_gradient(mine[:1], np.ones((1, 16), np.float32))]),
        chunks=list(chunks), pull=pb.PullAfterPush(names=["contract.scale"], wait_timeout_ms=1000, rows=asked))
    before = ready.snapshot(shard, [worker])
    code = grpc.StatusCode.NOT_FOUND if what == "an unknown tensor" else grpc.StatusCode.INVALID_ARGUMENT
    expect_status(code, lambda: ready.stubs[shard].PushPull(request, timeout=RPC_TIMEOUT), asked[0].name)
    assert ready.snapshot(shard, [worker]) == before


def continued(target: Target, shard: int, worker_id: str, clock: int, read_step: int, header_rows: list[pb.RowGradient],
              pieces: list[list[pb.RowGradient]]) -> pb.PushResponse:
    """A push whose row gradients go on past the header: `pieces` in the messages after it, one list each."""
    messages = target.push_messages(worker_id, clock, read_step, [])
    messages[0].header.row_gradients.extend(header_rows)
    messages += [pb.PushRequest(row_gradients=group) for group in pieces]
    return target.push_raw(shard, messages)


def test_row_gradients_continued_past_the_header_apply_as_one_push(async_ready: Target, workers: Workers) -> None:
    worker, shard, (a, b), before, clock, step = new_worker_on_the_table(async_ready, workers)
    assert async_ready.info(shard).row_gradients_continue
    response = continued(async_ready, shard, worker, clock, step, [row_gradient([a], np.ones((1, 16), np.float32))],
                         [[row_gradient([b, a], np.full((2, 16), 2.0, np.float32))],
                          [row_gradient([b], np.full((1, 16), 4.0, np.float32))]])
    assert response.outcome == pb.PUSH_ACCEPTED and response.step == step + 1   # one push: one step
    after = rows_of(pull_rows(async_ready, shard, [a, b]))
    np.testing.assert_allclose(after[0], before[0] - LR * 3.0, rtol=1e-6)   # 1 + 2: the pieces joined, summed
    np.testing.assert_allclose(after[1], before[1] - LR * 6.0, rtol=1e-6)   # 2 + 4


PIECES_BAD = {
    "a table the header has no row gradient for": (
        lambda ids: [[row_gradient(ids[:1], np.ones((1, 1), np.float32), name="contract.w")]],
        "continues no row gradient of the header"),
    "another dtype than the header's": (
        lambda ids: [[row_gradient(ids[:1], np.ones((1, 16), np.float16))]], "is float16, its header's is float32"),
    "an id of another shard's rows": (lambda ids: [[row_gradient([0 if ids[0] else 95], np.ones((1, 16), np.float32))]],
                                      "belongs to shard"),
}


@pytest.mark.parametrize("what", list(PIECES_BAD))
def test_a_bad_continued_row_gradient_is_invalid_argument_and_changes_nothing(async_ready: Target, workers: Workers,
                                                                            what: str) -> None:
    worker, shard, ids, _, clock, step = new_worker_on_the_table(async_ready, workers)
    pieces, needle = PIECES_BAD[what]
    before = async_ready.snapshot(shard, [worker])
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: continued(
        async_ready, shard, worker, clock, step, [row_gradient(ids[:1], np.ones((1, 16), np.float32))], pieces(ids)),
        needle)
    assert async_ready.snapshot(shard, [worker]) == before


def test_continued_row_gradients_past_the_bound_are_resource_exhausted_and_change_nothing(async_ready: Target,
                                                                                        workers: Workers) -> None:
    # at most max(8 MiB, the shard's parameter bytes) of rows per push: three messages of 3 MiB pass it
    worker, shard, (a, _), _, clock, step = new_worker_on_the_table(async_ready, workers)
    count = (3 << 20) // (16 * 4)
    piece = row_gradient(np.full(count, a), np.zeros((count, 16), np.float32))
    before = async_ready.snapshot(shard, [worker])
    expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: continued(
        async_ready, shard, worker, clock, step, [row_gradient([a], np.ones((1, 16), np.float32))],
        [[piece], [piece], [piece]]), "row gradients continued past the header take more than 8388608 bytes")
    assert async_ready.snapshot(shard, [worker]) == before
