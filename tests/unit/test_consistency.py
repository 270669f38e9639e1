"""The consistency modes (sync N of M, ssp with bound b, async with max_staleness) on a Shard, without sockets."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common.errors import InvalidTensorError, WaitTimeoutError
from ps_server.config import ServerConfig
from ps_common.modes import DropReason, Mode
from ps_server.consistency import ConsistencyPolicy, Decision
from ps_server.shard import Shard
from tests.helpers.domain import FakeClock, LR, clocks, cluster_info, init_shard, make_shard, pull_values, push, values

W0 = np.ones((4, 3), np.float32)
B0 = np.zeros(3, np.float32)


def grads(scale: float) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 3), scale, np.float32), "b": np.full(3, scale, np.float32)}


def sync_shard(n: int = 2, m: int = 3, workers=("a", "b", "c"), now: FakeClock | None = None):
    shard = make_shard("sync", replicas_to_aggregate=n, total_replicas=m, now=now)
    init_shard(shard, {"w": W0, "b": B0})
    for w in workers:
        shard.register(w)
    return shard


# ------------------------------------------------------------------ sync


def test_sync_accumulates_n_gradients_applies_their_mean_once_and_advances_the_step() -> None:
    shard = sync_shard()
    first = push(shard, "a", 0, 0, grads(1.0))
    assert (first.accepted, first.step, first.aggregated) == (True, 0, 1)
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0)  # nothing applied with 1 of 2

    second = push(shard, "b", 0, 0, grads(3.0))
    assert (second.accepted, second.step, second.aggregated) == (True, 1, 0)
    assert shard.step == 1
    after = values(shard)
    np.testing.assert_array_equal(after[("w", 0)], W0 - LR * 2.0)  # the mean of 1 and 3, applied once
    np.testing.assert_array_equal(after[("b", 0)], B0 - LR * 2.0)
    assert shard.applied_gradients == 2


def test_sync_drops_a_gradient_read_at_an_older_step_as_stale_with_the_reason_and_the_step() -> None:
    shard = sync_shard()
    push(shard, "a", 0, 0, grads(1.0))
    push(shard, "b", 0, 0, grads(1.0))
    before = values(shard)

    late = push(shard, "c", 0, 0, grads(100.0))  # the backup worker, read at step 0; the shard is at 1
    assert not late.accepted
    assert late.drop_reason == pb.DROP_STALE
    assert late.step == 1
    assert "step 0" in late.message and "step 1" in late.message
    assert late.clock == 1  # a dropped push still counts on the worker's clock
    assert shard.dropped == 1
    for key, value in values(shard).items():
        np.testing.assert_array_equal(value, before[key])


def test_sync_drops_a_second_gradient_from_a_worker_for_the_same_step_as_already_contributed() -> None:
    shard = sync_shard()
    push(shard, "a", 0, 0, grads(1.0))
    again = push(shard, "a", 1, 0, grads(50.0))
    assert (again.accepted, again.drop_reason, again.step) == (False, pb.DROP_ALREADY_CONTRIBUTED, 0)
    assert "'a'" in again.message and "step 0" in again.message

    push(shard, "b", 0, 0, grads(3.0))
    # the dropped gradient never entered the mean
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0 - LR * 2.0)


def test_sync_backup_workers_never_hold_a_step_back() -> None:
    shard = sync_shard(n=2, m=3)
    for step in range(3):
        push(shard, "a", step, step, grads(1.0))
        done = push(shard, "b", step, step, grads(1.0))
        assert done.step == step + 1  # "c" never pushed, and never needed to
    assert shard.step == 3


def test_sync_quorum_is_capped_by_the_live_workers_when_a_lease_expires() -> None:
    now = FakeClock()
    shard = sync_shard(n=2, m=2, workers=("a", "b"), now=now)   # both leases end at +10 s
    now.advance(8)
    push(shard, "a", 0, 0, grads(2.0))                            # renews a's lease to +18 s
    assert shard.step == 0 and cluster_info(shard).effective_replicas == 2

    now.advance(4)   # +12 s: b's lease has expired, a's has not
    shard.tick()
    info = cluster_info(shard)
    assert {w.worker_id: w.live for w in info.workers} == {"a": True, "b": False}
    assert info.effective_replicas == 1
    assert shard.step == 1  # the step closed with the one live contribution
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0 - LR * 2.0)


def test_sync_a_worker_that_deregisters_leaves_the_quorum_at_once() -> None:
    shard = sync_shard(n=2, m=2, workers=("a", "b"))
    push(shard, "a", 0, 0, grads(1.0))
    shard.deregister("b")
    assert shard.step == 1
    assert cluster_info(shard).effective_replicas == 1


def test_sync_refuses_a_push_that_lacks_one_of_the_shards_parts_and_records_nothing() -> None:
    shard = sync_shard()
    with pytest.raises(InvalidTensorError, match=r"'b' rows from 0"):
        push(shard, "a", 0, 0, {"w": grads(1.0)["w"]})
    assert clocks(shard)["a"] == 0
    # "a" did not become a contributor: its full push is accepted and counted once
    full = push(shard, "a", 0, 0, grads(1.0))
    assert full.accepted and full.aggregated == 1


def test_sync_pull_for_the_next_step_waits_until_the_step_completes() -> None:
    shard = sync_shard()
    push(shard, "a", 0, 0, grads(1.0))
    result: dict = {}

    def pull_next() -> None:
        result["pull"] = pull_values(shard, min_step=1, timeout=10.0)

    waiter = threading.Thread(target=pull_next)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "the pull for step 1 returned before the step completed"
    push(shard, "b", 0, 0, grads(1.0))
    waiter.join(10.0)
    assert not waiter.is_alive()
    step, pulled = result["pull"]
    assert step == 1
    np.testing.assert_array_equal(pulled["w"], W0 - LR)


def test_sync_pull_for_a_step_that_never_completes_times_out_naming_the_missing_gradients() -> None:
    shard = sync_shard()
    push(shard, "a", 0, 0, grads(1.0))
    with pytest.raises(WaitTimeoutError, match=r"step >= 1 .*1 of 2 gradients in for step 0"):
        pull_values(shard, [], min_step=1, worker_id="a", clock=1, timeout=0.2)


# ------------------------------------------------------------------ ssp


def ssp_shard(staleness: float, workers=("fast", "slow"), now: FakeClock | None = None):
    shard = make_shard("ssp", staleness=staleness, now=now)
    init_shard(shard, {"w": W0, "b": B0})
    for w in workers:
        shard.register(w)
    return shard


def test_ssp_applies_every_gradient_as_it_arrives() -> None:
    shard = ssp_shard(2)
    for clock in range(3):
        result = push(shard, "fast", clock, 0, grads(1.0))  # even an old read step is applied
        assert result.accepted and result.step == clock + 1
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0 - 3 * LR)


def test_ssp_holds_a_pull_while_a_live_worker_is_more_than_b_clocks_behind() -> None:
    shard = ssp_shard(1)
    push(shard, "fast", 0, 0, grads(1.0))
    assert shard.policy.pull_blocker(shard.policy_host, "fast", 1) is None       # 1 ahead of "slow": within b = 1
    push(shard, "fast", 1, 1, grads(1.0))
    blocker = shard.policy.pull_blocker(shard.policy_host, "fast", 2)            # 2 ahead: held
    assert blocker is not None and "slow at 0" in blocker and ">= 1" in blocker
    with pytest.raises(WaitTimeoutError, match="slow at 0"):
        pull_values(shard, [], min_step=0, worker_id="fast", clock=2, timeout=0.2)

    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("pull", pull_values(
        shard, worker_id="fast", clock=2, timeout=10.0)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    push(shard, "slow", 0, 0, grads(1.0))                           # slow reaches clock 1 = 2 - b
    waiter.join(10.0)
    assert not waiter.is_alive()
    assert result["pull"][0] == 3


def test_ssp_with_b_0_is_bulk_synchronous() -> None:
    shard = ssp_shard(0)
    push(shard, "fast", 0, 0, grads(1.0))
    assert shard.policy.pull_blocker(shard.policy_host, "fast", 1) is not None
    push(shard, "slow", 0, 0, grads(1.0))
    assert shard.policy.pull_blocker(shard.policy_host, "fast", 1) is None


def test_ssp_with_an_unbounded_b_never_holds_a_pull() -> None:
    shard = ssp_shard(math.inf)
    for clock in range(5):
        push(shard, "fast", clock, 0, grads(1.0))
    assert shard.policy.pull_blocker(shard.policy_host, "fast", 5) is None
    assert cluster_info(shard).staleness == -1


def test_ssp_leaves_a_worker_whose_lease_expired_out_of_the_clock_minimum() -> None:
    now = FakeClock()
    shard = ssp_shard(1, now=now)
    now.advance(8)
    push(shard, "fast", 0, 0, grads(1.0))
    push(shard, "fast", 1, 1, grads(1.0))
    assert shard.policy.pull_blocker(shard.policy_host, "fast", 2) is not None
    now.advance(4)   # slow's lease (10 s from registration) has expired; fast's was renewed by its pushes
    assert shard.policy.pull_blocker(shard.policy_host, "fast", 2) is None
    step, _ = pull_values(shard, worker_id="fast", clock=2, timeout=1.0)
    assert step == 2


def test_ssp_pull_without_a_worker_id_is_never_held() -> None:
    shard = ssp_shard(0)
    push(shard, "fast", 0, 0, grads(1.0))
    step, _ = pull_values(shard, timeout=1.0)
    assert step == 1


# ------------------------------------------------------------------ async


def async_shard(max_staleness: int = 0):
    shard = make_shard("async", max_staleness=max_staleness)
    init_shard(shard, {"w": W0, "b": B0})
    shard.register("a")
    shard.register("b")
    return shard


def test_async_applies_every_gradient_as_it_arrives() -> None:
    shard = async_shard()
    for clock in range(4):
        result = push(shard, "a", clock, 0, grads(1.0))
        assert result.accepted and result.step == clock + 1
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0 - 4 * LR)


def test_async_without_max_staleness_never_drops_an_old_gradient() -> None:
    shard = async_shard(0)
    for clock in range(10):
        push(shard, "a", clock, clock, grads(0.0))
    assert push(shard, "b", 0, 0, grads(1.0)).accepted  # 10 steps behind


def test_async_drops_a_gradient_that_lags_by_more_than_max_staleness_with_the_steps() -> None:
    shard = async_shard(max_staleness=2)
    for clock in range(2):
        push(shard, "a", clock, clock, grads(1.0))
    at_bound = push(shard, "b", 0, 0, grads(1.0))        # t - s = 2: within the bound
    assert at_bound.accepted and at_bound.step == 3
    before = values(shard)

    over = push(shard, "b", 1, 0, grads(1.0))            # t - s = 3 > 2
    assert (over.accepted, over.drop_reason, over.step) == (False, pb.DROP_STALE, 3)
    assert "read at step 0" in over.message and "step 3" in over.message and "max_staleness 2" in over.message
    assert shard.dropped == 1
    for key, value in values(shard).items():
        np.testing.assert_array_equal(value, before[key])


def test_sync_logs_and_reports_a_quorum_capped_by_an_expired_lease_once_per_change_not_per_push(caplog) -> None:
    now = FakeClock()
    shard = sync_shard(n=3, m=3, workers=("a", "b", "c"), now=now)
    events = []
    shard.events.subscribe(lambda event, **fields: events.append(fields) if event == "replicas_capped" else None)
    caplog.set_level("INFO", logger="ps_server.consistency")
    for w in ("a", "b", "c"):
        push(shard, w, 0, 0, grads(1.0))
    assert shard.step == 1 and events == []                   # training under way, nobody missing
    now.advance(8)
    push(shard, "a", 1, 1, grads(1.0))
    push(shard, "b", 1, 1, grads(1.0))                        # a and b renew; c was last heard at +0 s
    now.advance(4)
    shard.tick()                                              # c's lease (10 s) ran out: the step closes with 2
    assert shard.step == 2
    for step in range(2, 5):                                  # more pushes and ticks: no more reports
        push(shard, "a", step, step, grads(1.0))
        push(shard, "b", step, step, grads(1.0))
        shard.tick()
    assert shard.step == 5
    assert events == [{"effective": 2, "replicas": 3, "shrunk": True}]
    capped = [r for r in caplog.records if "capped" in r.getMessage()]
    assert len(capped) == 1 and capped[0].levelname == "WARNING"
    assert "replicas_to_aggregate=3 capped at 2 from step 1" in capped[0].getMessage()
    assert "expired leases: c; left: none" in capped[0].getMessage()

    shard.register("c")                                       # back: the quorum is N again, said once
    push(shard, "c", 1, 5, grads(1.0))
    assert events[-1] == {"effective": 3, "replicas": 3, "shrunk": False}
    assert "wait for replicas_to_aggregate=3 gradients again (3 live workers)" in caplog.records[-1].getMessage()


def test_sync_says_nothing_about_the_quorum_while_the_workers_are_still_registering(caplog) -> None:
    shard = sync_shard(n=3, m=3, workers=("a",))
    caplog.set_level("INFO", logger="ps_server.consistency")
    shard.tick()
    shard.register("b")
    shard.tick()
    assert not [r for r in caplog.records if "capped" in r.getMessage()]


class _DropEverything(ConsistencyPolicy):
    """A replacement policy: every push dropped as stale, pulls never held."""

    mode = Mode.ASYNC

    def on_push(self, host, worker_id, read_step, grads):
        return Decision.drop(DropReason.STALE, f"dropped by policy at step {host.step}")


def test_a_shard_runs_an_injected_policy_in_place_of_its_modes() -> None:
    shard = Shard(ServerConfig(mode="async", optimizer="sgd", optimizer_params={"lr": LR}),
                  policy=_DropEverything(), now=FakeClock())
    init_shard(shard, {"w": W0})
    shard.register("a")
    result = push(shard, "a", 0, 0, {"w": np.ones_like(W0)})
    assert (result.accepted, result.drop_reason, result.step) == (False, DropReason.STALE, 0)
    assert result.message == "dropped by policy at step 0"
    np.testing.assert_array_equal(values(shard)[("w", 0)], W0)


def test_a_policy_sees_only_the_narrow_host_view() -> None:
    shard = ssp_shard(1)
    host = shard.policy_host
    assert not hasattr(host, "store") and not hasattr(host, "membership") and not hasattr(host, "config")
    assert host.step == shard.step and host.parts() == set(shard.store.parts)


def test_the_domain_drop_reasons_are_exactly_those_of_the_wire_contract() -> None:
    wire = {pb.DropReason.Name(v): v for v in pb.DropReason.values()}
    domain = {("DROP_REASON_UNSPECIFIED" if r is DropReason.NONE else f"DROP_{r.name}"): r.value for r in DropReason}
    assert domain == wire
