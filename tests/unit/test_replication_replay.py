"""A backup that replays its primary's operations (Shard.replay) holds the primary's state exactly: values,
optimizer slots, the sync accumulator, steps and every worker's clock and remembered outcomes, in every mode, with
sparse rows and dynamic tables, and a live-worker count that differs on the backup."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from ps_common.errors import NotPrimaryError, ReplayMismatchError
from ps_common.shard_map import ParamSpec
from ps_server.operations import Op, Push, Read
from ps_server.shard import Shard
from tests.helpers.domain import FakeClock, decode, make_shard, own_chunks, specs_of

VALUES = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32)}


class Collect:
    """A replication log that keeps the operations (as the primary's log would send them)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    @property
    def seq(self) -> int:
        return len(self.ops)

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


class CutOff(Collect):
    """A primary's log whose backup confirms every operation until `cut()`, and none after (the primary dies before
    they reach it); `kill()` is the primary's end: a wait for an operation never confirmed fails as the replica's
    lost lease would (NotPrimaryError: the worker retries on the backup). `waiting`: the operations waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.confirmed = 0
        self.waiting: list[int] = []
        self._cut = self._dead = False
        self._changed = threading.Condition()

    def record(self, op: Op) -> int:
        with self._changed:
            seq = super().record(op)
            if not self._cut:
                self.confirmed = seq
            self._changed.notify_all()
            return seq

    def wait(self, seq: int) -> None:
        with self._changed:
            self.waiting.append(seq)
            self._changed.notify_all()
            self._changed.wait_for(lambda: self.confirmed >= seq or self._dead, timeout=10)
            if self.confirmed < seq:
                raise NotPrimaryError(f"operation {seq} never reached the backup (it holds {self.confirmed})")

    def cut(self) -> None:
        with self._changed:
            self._cut = True

    def kill(self) -> None:
        with self._changed:
            self._dead = True
            self._changed.notify_all()

    def until(self, done: Callable[[], bool]) -> None:
        """Until done() (looked at on every change here, and every 10 ms: a call may end without one)."""
        deadline = time.monotonic() + 10
        with self._changed:
            while not done():
                assert time.monotonic() < deadline, "the shard did not get there within 10 s"
                self._changed.wait(0.01)


class Call(threading.Thread):
    """One call to a shard on a thread of its own (a worker's rpc): its answer, or the error it raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn, self.answer, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.answer = self.fn()
        except Exception as exc:  # noqa: BLE001 -- kept for the test to look at
            self.error = exc


def push_pull(shard: Shard, worker: str, clock: int, read_step: int, scale: float, *, read: bool = True) -> Call:
    """A sync worker's step in a thread: its push, and the read of the step it belongs to (PushPull); a plain push
    when not `read`."""
    grads = decode(own_chunks(shard, {n: np.full_like(v, scale) for n, v in VALUES.items()},
                              specs=specs_of(VALUES)), shard.push_layout())
    if not read:
        return Call(lambda: shard.push(Push(worker, clock, read_step, grads)))
    return Call(lambda: shard.push_pull(Push(worker, clock, read_step, grads), Read(wait_for_step=True, timeout=10)))


def test_a_primary_answers_no_read_of_a_step_its_backup_may_not_hold() -> None:
    """The stall of a failover in sync (tests/faults/test_replicated_shards.py): w2's push completes step 0 on the
    primary, which dies before the push reaches its backup. w0 and w1, whose PushPulls were waiting for step 1, were
    answered with step 1's values all the same (read uncommitted), and pushed their next gradients read at step 1:
    the promoted backup, at step 0 until w2's retry, dropped them on this shard as STEP_AHEAD while the job's other
    shard took them, so w0 and w1 had given the other shard one step more than this one, and every worker waited
    for a step that needed another's gradient (2 of 3 in, until wait_timeout). A read is answered only once the
    backups hold the step it shows: here never, so w0 and w1 retry on the backup like w2, and all three meet there."""
    primary, backup, _, _, _ = pair("sync", replicas_to_aggregate=3, total_replicas=3)
    log = primary.replication = CutOff()
    init(primary)
    for w in ("w0", "w1", "w2"):
        primary.register(w)
    first = [push_pull(primary, w, 0, 0, 1.0) for w in ("w0", "w1")]
    log.until(lambda: primary.policy.aggregated() == 2)       # both pushes in, and held by the backup
    log.cut()
    last = push_pull(primary, "w2", 0, 0, 1.0)                 # completes step 0 on the primary alone
    log.until(lambda: primary.step == 1)
    completing = len(log.ops)
    # w0 and w1 woke for step 1; answered only once the backup holds it (never: they wait for w2's operation)
    log.until(lambda: all(not c.is_alive() for c in first) or log.waiting.count(completing) >= 2)
    log.kill()
    for call in [*first, last]:
        call.join(10)
    replay_all(backup, _confirmed(log))
    assert (backup.step, backup.policy.aggregated()) == (0, 2)
    told = [c.answer.values.step for c in first if c.answer is not None and c.answer.values is not None]
    assert not told, f"a worker was told of step {max(told)}, which the backup (at step 0) never held"
    assert all(isinstance(c.error, NotPrimaryError) for c in [*first, last])
    # the backup takes over and every worker sends its step again: w0's and w1's are duplicates, w2's completes it
    backup.following = False
    backup.replication = Collect()
    retried = [push_pull(backup, w, 0, 0, 1.0) for w in ("w0", "w1", "w2")]
    for call in retried:
        call.join(10)
    assert [(c.answer.push.accepted, c.answer.push.duplicate, c.answer.values.step) for c in retried] == [
        (True, True, 1), (True, True, 1), (True, False, 1)]
    assert backup.applied_gradients == 3


def test_a_retry_answered_as_a_duplicate_waits_until_the_backup_holds_the_first_push() -> None:
    """A push retried on the primary while its first try still waits for the backup (the worker's call ran past its
    deadline) is a duplicate: acknowledged at once, it was a push the backup may never get -- lost if the primary
    dies then, and in sync a gradient the new primary waits for while its worker waits for the next step."""
    primary, _, _, _, _ = pair("sync", replicas_to_aggregate=2, total_replicas=2)
    log = primary.replication = CutOff()
    init(primary)
    for w in ("w0", "w1"):
        primary.register(w)
    log.cut()
    first = push_pull(primary, "w0", 0, 0, 1.0, read=False)
    log.until(lambda: primary.policy.aggregated() == 1)
    retry = push_pull(primary, "w0", 0, 0, 1.0, read=False)
    log.until(lambda: not retry.is_alive() or len(log.waiting) >= 2)
    log.kill()
    for call in (first, retry):
        call.join(10)
    assert retry.answer is None and isinstance(retry.error, NotPrimaryError), retry.answer


def test_a_primary_that_steps_down_before_its_answer_does_not_acknowledge_the_push() -> None:
    """Deposed (a newer epoch seen, its lease lost) between recording a push and answering it, a replica no longer has
    a log to wait on: the push is not acknowledged there (NOT_PRIMARY: the worker sends it again to the new primary),
    since its backups may never get it."""
    primary, _, _, _, _ = pair("async")
    init(primary)
    primary.register("w0")

    def refuse() -> None:
        raise NotPrimaryError("shard 0: this replica stepped down")

    class SteppedDown(Collect):
        def record(self, op: Op) -> int:
            seq = super().record(op)
            primary.replication, primary.role_check = None, refuse   # what Replica.step_down does
            return seq

    primary.replication = SteppedDown()
    with pytest.raises(NotPrimaryError):
        push(primary, "w0", 0, 0, 1.0)


def _confirmed(log: CutOff) -> Collect:
    """The operations the backup got: those confirmed before the primary died."""
    got = Collect()
    got.ops = log.ops[:log.confirmed]
    return got
