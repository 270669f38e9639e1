"""A backup that replays its primary's operations (Shard.replay) holds the primary's state exactly: values,
optimizer slots, the sync accumulator, steps and every worker's clock and remembered outcomes, in every mode, with
sparse rows and dynamic tables, and a live-worker count that differs on the backup."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import ReplayMismatchError
from ps_common.shard_map import ParamSpec
from ps_server.operations import Op, Push
from ps_server.shard import Shard
from tests.helpers.domain import FakeClock, decode, make_shard, own_chunks, specs_of

VALUES = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32)}


class Collect:
    """A replication log that keeps the operations (as the primary's log would send them)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def record(self, op: Op) -> int:
        self.ops.append(op)
        return len(self.ops)

    def wait(self, seq: int) -> None:
        assert 1 <= seq <= len(self.ops)


def pair(mode: str, **overrides) -> tuple[Shard, Shard, Collect, FakeClock, FakeClock]:
    settings = {"optimizer": "adam", "optimizer_params": {"lr": 0.1}, **overrides}
    primary_clock, backup_clock = FakeClock(), FakeClock()
    primary = make_shard(mode, now=primary_clock, **settings)
    backup = make_shard(mode, now=backup_clock, **settings)
    log = Collect()
    primary.replication = log
    backup.following = True
    return primary, backup, log, primary_clock, backup_clock


def init(shard: Shard, values=VALUES, dynamic=()) -> None:
    specs = specs_of(values) + list(dynamic)
    shard.initialize(specs, decode(own_chunks(shard, values, specs=specs), shard.init_layout(specs)))


def push(shard: Shard, worker: str, clock: int, read_step: int, scale: float, rows=()) -> None:
    grads = decode(own_chunks(shard, {n: np.full_like(v, scale) for n, v in VALUES.items()},
                              specs=specs_of(VALUES)), shard.push_layout())
    shard.push(Push(worker, clock, read_step, grads, list(rows)))


def same_state(a: Shard, b: Shard) -> None:
    x, y = a.snapshot(), b.snapshot()
    assert (x.step, x.dropped, x.applied_gradients) == (y.step, y.dropped, y.applied_gradients)
    assert [(p.name, p.row_start) for p in x.parts] == [(p.name, p.row_start) for p in y.parts]
    for p, q in zip(x.parts, y.parts):
        np.testing.assert_array_equal(p.value, q.value)
        assert sorted(p.slots) == sorted(q.slots)
        for k in p.slots:
            np.testing.assert_array_equal(p.slots[k], q.slots[k])
        assert (p.accumulator is None) == (q.accumulator is None)
        if p.accumulator is not None:
            np.testing.assert_array_equal(p.accumulator, q.accumulator)
    assert x.contributors == y.contributors
    assert [(w.worker_id, w.clock, [(o.clock, o.accepted, o.step, o.clock_after) for o in w.outcomes])
            for w in x.workers] == [(w.worker_id, w.clock, [(o.clock, o.accepted, o.step, o.clock_after)
                                                            for o in w.outcomes]) for w in y.workers]
    for d, e in zip(x.dynamic, y.dynamic):
        np.testing.assert_array_equal(d.ids, e.ids)
        np.testing.assert_array_equal(d.values, e.values)


def replay_all(backup: Shard, log: Collect, start: int = 0) -> None:
    for op in log.ops[start:]:
        backup.replay(op)


@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_a_backup_replaying_every_operation_holds_the_primarys_state(mode: str) -> None:
    extra = {"replicas_to_aggregate": 2, "total_replicas": 3} if mode == "sync" else {}
    primary, backup, log, clock, _ = pair(mode, **extra)
    init(primary)
    for w in ("w0", "w1", "w2"):
        primary.register(w)
    push(primary, "w0", 0, 0, 0.5)
    push(primary, "w1", 0, 0, 1.5)
    push(primary, "w2", 0, 0, -1.0)     # sync: a backup worker, late: dropped as stale
    push(primary, "w0", 0, 0, 9.0)      # a retry: answered, not replicated
    push(primary, "w0", 1, primary.step, 2.0)
    primary.deregister("w2")
    replay_all(backup, log)
    same_state(primary, backup)
    assert [op.kind for op in log.ops].count("push") == 4   # the retry was not an operation


def test_a_sync_step_completed_by_an_expired_lease_replays_with_the_primarys_live_count() -> None:
    primary, backup, log, clock, backup_clock = pair("sync", replicas_to_aggregate=2, total_replicas=2,
                                                     lease_seconds=10.0)
    init(primary)
    for w in ("w0", "w1"):
        primary.register(w)
    push(primary, "w0", 0, 0, 1.0)       # 1 of 2 in
    clock.advance(11)                      # w1's lease runs out on the primary only
    primary.heartbeat("w0")
    primary.tick()                         # N_eff = 1: the step completes
    assert primary.step == 1
    backup_clock.advance(0)                # the backup's clock sees both workers live
    replay_all(backup, log)
    same_state(primary, backup)
    assert [op.kind for op in log.ops][-1] == "membership"


def test_sparse_rows_and_dynamic_tables_replay_to_the_same_rows() -> None:
    from ps_common.dynamic_ids import DynamicTable

    primary, backup, log, _, _ = pair("async")
    table = ParamSpec("emb", "float32", (4,), dynamic=DynamicTable("normal:0.01", 0, 3))
    init(primary, dynamic=[table])
    primary.register("w0")
    ids = np.array([5, -7, 10**12], np.int64)
    grads = decode(own_chunks(primary, {n: np.ones_like(v) for n, v in VALUES.items()}, specs=specs_of(VALUES)),
                   primary.push_layout())
    primary.push(Push("w0", 0, 0, grads, [("emb", ids, np.ones((3, 4), np.float32))]))
    replay_all(backup, log)
    same_state(primary, backup)


def test_a_replay_to_another_outcome_is_refused() -> None:
    primary, backup, log, _, _ = pair("async")
    init(primary)
    primary.register("w0")
    push(primary, "w0", 0, 0, 1.0)
    replay_all(backup, log)
    op = log.ops[-1]
    wrong = Op("push", push=Push("w0", 1, 0, op.push.grads), live_count=op.live_count, result=(True, 99, 2))
    with pytest.raises(ReplayMismatchError, match="the primary"):
        backup.replay(wrong)


def test_a_backup_refuses_calls_through_its_role_check() -> None:
    from ps_common.errors import NotPrimaryError

    _, backup, _, _, _ = pair("async")

    def refuse() -> None:
        raise NotPrimaryError("shard 0: this replica is a backup; the primary is at 127.0.0.1:1")

    backup.role_check = refuse
    with pytest.raises(NotPrimaryError):
        backup.register("w0")
    with pytest.raises(NotPrimaryError):
        init(backup)
