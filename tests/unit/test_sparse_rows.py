"""Sparse rows in one shard's domain: lazy per-row optimizer updates, row pushes in every mode,
row pulls, the bad-input rules, at-most-once and checkpoints (docs/protocol.md, "Sparse rows")."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import InvalidRequestError, InvalidTensorError, UnknownTensorError
from ps_server.checkpoints.directory import CheckpointDirectory
from ps_server.optimizers import make_optimizer
from ps_server.operations import Push
from tests.helpers.domain import LR, init_shard, make_shard, push, values, pull_rows

ROWS, DIM = 8, 3
TABLE = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
MODEL = {"emb": TABLE, "b": np.zeros(2, np.float32), "ids": np.arange(4, dtype=np.int64)}
#: Two shards with a split threshold below the table's 96 bytes: the table's rows are cut between them.
TWO_SHARDS = dict(num_shards=2, partition_min_bytes=32)


def ids(*values_: int) -> np.ndarray:
    return np.array(values_, dtype=np.int64)


def ready(mode: str = "async", **overrides):
    shard = make_shard(mode, **overrides)
    init_shard(shard, MODEL)
    shard.register("a")
    shard.register("b")
    return shard


def rows_of(shard, name: str, wanted: np.ndarray) -> np.ndarray:
    return pull_rows(shard, [(name, wanted)], min_step=0, worker_id="", clock=0, timeout=1.0)[1][0][1]


def state_of(shard) -> tuple:
    return (shard.step, {k: v.tolist() for k, v in values(shard).items()},
            {w: r.clock for w, r in shard.membership.workers.items()})


# ------------------------------------------------------------------ the lazy optimizer


@pytest.mark.parametrize("name,params", [("sgd", {"lr": 0.1}), ("momentum", {"lr": 0.1}), ("adagrad", {"lr": 0.1}),
                                         ("adam", {"lr": 0.1})])
def test_a_row_update_equals_the_dense_update_of_that_row_alone_and_leaves_other_rows_and_slots(name, params):
    opt = make_optimizer(name, **params)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    state = opt.init_state(table)
    row_alone = {i: (table[i:i + 1].copy(), opt.init_state(table[i:i + 1])) for i in range(ROWS)}
    before = table.copy()
    # row 1 is touched 3 times, row 5 once (at the table's third update): per-row step counts
    for touched in ([1], [1], [1, 5]):
        rows = np.array(touched, np.int64)
        grad = rng.standard_normal((len(rows), DIM)).astype(np.float32)
        opt.apply_rows(table, rows, grad, state)
        for k, r in enumerate(touched):
            opt.apply(row_alone[r][0], grad[k:k + 1], row_alone[r][1])
    for r in (1, 5):
        np.testing.assert_allclose(table[r], row_alone[r][0][0], rtol=1e-6, atol=1e-7)
    untouched = [r for r in range(ROWS) if r not in (1, 5)]
    np.testing.assert_array_equal(table[untouched], before[untouched])
    assert state["row_step"].tolist() == [0, 3, 0, 0, 0, 1, 0, 0]
    for slot, array in state.items():
        if slot not in ("step", "row_step"):
            assert not array[untouched].any() or name == "adagrad"   # adagrad's slot starts at its initial value


# ------------------------------------------------------------------ pushes and pulls of rows


def test_an_async_row_push_updates_only_its_rows_summing_repeated_ids():
    shard = ready()
    grad = np.ones((3, DIM), np.float32)
    result = shard.push(Push("a", 0, 0, {}, [("emb", ids(2, 6, 2), grad)]))
    assert result.accepted and shard.step == 1
    after = rows_of(shard, "emb", ids(0, 2, 6))
    np.testing.assert_array_equal(after[0], TABLE[0])
    np.testing.assert_array_equal(after[1], TABLE[2] - LR * 2)    # id 2 twice: its gradients summed
    np.testing.assert_array_equal(after[2], TABLE[6] - LR)


def test_a_sync_step_averages_row_gradients_over_its_contributors_also_when_one_touched_no_row():
    shard = ready("sync", replicas_to_aggregate=2, total_replicas=2)
    bias = np.zeros(2, np.float32)
    g = np.full((1, DIM), 4.0, np.float32)
    shard.push(Push("a", 0, 0, {("b", 0): bias}, [("emb", ids(3), g)]))
    assert shard.step == 0                           # one of two gradients in
    shard.push(Push("b", 0, 0, {("b", 0): bias}, [("emb", ids(), np.zeros((0, DIM), np.float32))]))
    assert shard.step == 1
    np.testing.assert_array_equal(rows_of(shard, "emb", ids(3))[0], TABLE[3] - LR * 4.0 / 2)


def test_a_retried_row_push_is_answered_as_a_duplicate_and_applied_once():
    shard = ready()
    g = np.ones((1, DIM), np.float32)
    shard.push(Push("a", 0, 0, {}, [("emb", ids(4), g)]))
    again = shard.push(Push("a", 0, 0, {}, [("emb", ids(4), g)]))
    assert again.duplicate and shard.step == 1
    np.testing.assert_array_equal(rows_of(shard, "emb", ids(4))[0], TABLE[4] - LR)


def test_rows_are_pulled_from_the_shard_that_owns_them_and_other_ids_are_refused():
    shards = [make_shard(shard_index=i, **TWO_SHARDS) for i in range(2)]
    for s in shards:
        init_shard(s, MODEL)
    owned = [[p for p in s.store.shard_map.parts_of("emb") if p.shard == i] for i, s in enumerate(shards)]
    assert owned[0] and owned[1], "the table must be split over both shards"
    first = owned[1][0].row_start    # shard 1's first row
    np.testing.assert_array_equal(rows_of(shards[1], "emb", ids(first, first)), TABLE[[first, first]])
    with pytest.raises(InvalidTensorError, match=f"row 0 of tensor 'emb' belongs to shard 0, not shard 1"):
        rows_of(shards[1], "emb", ids(first, 0))


# ------------------------------------------------------------------ bad input changes nothing

BAD_ROWS = [
    ("an id past the table", [("emb", ids(ROWS), np.ones((1, DIM), np.float32))], InvalidTensorError, r"row id 8 .* \[0, 8\)"),
    ("a negative id", [("emb", ids(-1), np.ones((1, DIM), np.float32))], InvalidTensorError, "row id -1"),
    ("NaN", [("emb", ids(1), np.full((1, DIM), np.nan, np.float32))], InvalidTensorError, "NaN or inf"),
    ("a wrong row shape", [("emb", ids(1), np.ones((1, DIM + 1), np.float32))], InvalidTensorError, r"float32\[1, 4\]"),
    ("rows of an integer tensor", [("ids", ids(1), np.ones((1,), np.int64))], InvalidTensorError, "does not train"),
    ("an unknown tensor", [("nope", ids(1), np.ones((1, DIM), np.float32))], UnknownTensorError, "'nope'"),
    ("a tensor twice", [("emb", ids(1), np.ones((1, DIM), np.float32))] * 2, InvalidTensorError, "two row gradients"),
]


@pytest.mark.parametrize("what,rows,error,match", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_a_bad_row_gradient_is_refused_naming_it_and_changes_nothing(what, rows, error, match):
    shard = ready()
    before = state_of(shard)
    with pytest.raises(error, match=match):
        shard.push(Push("a", 0, 0, {}, rows))
    assert state_of(shard) == before


def test_a_tensor_with_both_a_dense_and_a_row_gradient_is_refused():
    shard = ready()
    with pytest.raises(InvalidTensorError, match="both a dense gradient and a row gradient"):
        shard.push(Push("a", 0, 0, {("emb", 0): np.ones((ROWS, DIM), np.float32)}, [("emb", ids(1), np.ones((1, DIM), np.float32))]))


def test_a_pull_of_rows_naming_a_table_twice_or_none_is_refused():
    shard = ready()
    with pytest.raises(InvalidRequestError, match="named twice"):
        pull_rows(shard, [("emb", ids(1)), ("emb", ids(2))], min_step=0, worker_id="", clock=0, timeout=1.0)
    with pytest.raises(InvalidRequestError, match="no tables"):
        pull_rows(shard, [], min_step=0, worker_id="", clock=0, timeout=1.0)


# ------------------------------------------------------------------ checkpoints


def test_per_row_adam_counts_and_a_sync_row_accumulator_survive_a_checkpoint(tmp_path):
    settings = dict(optimizer="adam", optimizer_params={"lr": 0.01}, replicas_to_aggregate=2, total_replicas=2)
    shard = ready("sync", **settings)
    bias = np.zeros(2, np.float32)
    g = np.ones((1, DIM), np.float32)
    shard.push(Push("a", 0, 0, {("b", 0): bias}, [("emb", ids(5), g)]))
    shard.push(Push("b", 0, 0, {("b", 0): bias}, [("emb", ids(5), g)]))   # step 1: row 5 updated once
    shard.push(Push("a", 1, 1, {("b", 0): bias}, [("emb", ids(2), g)]))   # step 2 half in: a row accumulator
    directory = CheckpointDirectory(tmp_path)
    fresh = make_shard("sync", **settings)
    fresh.restore(directory.read(directory.write(shard.snapshot())))
    assert fresh.store.parts[("emb", 0)].slots["row_step"].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    for s in (shard, fresh):
        s.push(Push("b", 1, 1, {("b", 0): bias}, [("emb", ids(2), g)]))
    assert fresh.step == shard.step == 2
    np.testing.assert_array_equal(rows_of(fresh, "emb", ids(2, 5)), rows_of(shard, "emb", ids(2, 5)))
    assert not np.array_equal(rows_of(fresh, "emb", ids(2))[0], TABLE[2])


def test_rows_of_more_bytes_than_one_answer_carries_are_refused_before_they_are_read():
    from ps_common.errors import ResourceExhaustedError
    from ps_server.shard import ROWS_ANSWER_BYTES

    shard = make_shard("async")
    wide = np.zeros((4, ROWS_ANSWER_BYTES // 4 // 2), np.float32)      # two rows are exactly one answer
    init_shard(shard, {"wide": wide})
    assert rows_of(shard, "wide", ids(0, 3)).shape == (2, wide.shape[1])
    with pytest.raises(ResourceExhaustedError, match=rf"3 rows of \['wide'\] are {3 * wide[0].nbytes} bytes.*"
                                                     rf"\({ROWS_ANSWER_BYTES} bytes\)"):
        rows_of(shard, "wide", ids(0, 1, 0))
