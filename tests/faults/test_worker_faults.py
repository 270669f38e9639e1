"""Workers that die (SIGKILL), stall (SIGSTOP longer than the lease), stop (SIGTERM) or come back, mid-job, in every mode."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.faults.conftest import LEASE, longest_stall, metric

#: The accuracy that shows a job trained after losing a worker (well above chance, below every run seen).
TRAINED = 0.85

#: What a stall may add to the lease before the job moves on: the reaper's tick (<= 1 s), a
#: pull's recheck, and a loaded 2-core machine.
SLACK = 3.0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_a_worker_killed_mid_job_leaves_the_others_to_finish_without_waiting_past_its_lease(start_job, mode):
    job = start_job(mode=mode, shards=2, workers=3, steps=500)
    job.chief.wait_for_step(100, timeout=90)
    killed_at = time.time()
    assert job.workers[2].kill() == -signal.SIGKILL
    results = job.finish(skip=[2])
    assert [r["steps"] >= 500 for r in results] == [True, True]
    # The run trains (chance is 0.1); how well depends a little on how the surviving workers'
    # pushes interleave: 12 runs each gave 0.969-0.983 async, 0.961-0.981 ssp (see LR).
    assert results[0]["test_accuracy"] >= TRAINED, results[0]
    if mode in ("sync", "ssp"):
        # The dead worker holds a step (sync: N = 3 of 3) or the clock minimum (ssp) for one lease, not longer.
        stall = longest_stall(job.chief, killed_at)
        assert LEASE - 1.5 <= stall <= LEASE + SLACK, f"worker 0 stood still {stall:.1f} s after the kill (lease {LEASE} s)"
    if mode == "sync":
        for shard in job.cluster.shards:
            assert metric(shard, "ps_replicas_capped_total") >= 1
            assert "replicas_to_aggregate=3 capped at 2" in shard.log_tail(500_000)


@pytest.mark.timeout(150)
def test_a_killed_worker_restarted_with_its_id_rejoins_at_the_current_step_and_the_job_completes(start_job):
    job = start_job(mode="sync", shards=2, workers=3, steps=500)
    job.chief.wait_for_step(100, timeout=90)
    job.workers[2].kill()
    killed_at = time.time()
    # Past the dead worker's lease. Not "a step past the kill's": the chief's events can reach the test after it
    # has run 50 steps more (the MLP runs ~400 a second), so a later step may already have been reported when the
    # kill lands, and the worker came back inside its lease, uncapped (one CI run). Without the dead worker a sync
    # step waits for its lease to run out (LEASE s), so progress a second after the kill comes after the cap.
    reached = job.chief.wait_for(lambda e: e["event"] == "progress" and e["time"] >= killed_at + 1.0, timeout=60,
                                 what="progress past the dead worker's lease")["step"]
    back = job.restart_worker(2)
    start = back.wait_for(lambda e: e["event"] == "start", timeout=60, what="the start event")
    assert start["resumed"] and start["step"] >= reached, start          # no start barrier, the current step
    results = job.finish()
    assert [r["steps"] >= 500 for r in results] == [True, True, True]
    assert results[2]["iterations"] > 0 and results[2]["resumed"]
    for shard in job.cluster.shards:
        log = shard.log_tail(500_000)
        # Capped while worker 2 was dead, and back to N = 3 once it rejoined. At 2, or at 1: on a loaded machine
        # worker 1's lease can lapse for a moment too, and a cap at 1 lifted straight to N = 3 by the rejoin logs
        # no "capped at 2" (a shard's log lacked that line once in four CI runs on a 2-core machine).
        capped = re.search(r"replicas_to_aggregate=3 capped at [12] ", log)
        assert capped and "wait for replicas_to_aggregate=3 gradients again" in log, \
            f"shard log {shard.log_path}: no cap while worker 2 was dead, or none lifted on its return:\n{log[-20_000:]}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_worker_paused_past_its_lease_does_not_hold_the_job_and_goes_on_when_resumed(start_job, mode):
    job = start_job(mode=mode, shards=2, workers=3, steps=500)
    job.chief.wait_for_step(100, timeout=90)
    paused_at = time.time()
    job.workers[2].pause()                                   # SIGSTOP: a network stall, as far as the shards see
    time.sleep(LEASE + 3)
    resumed_at = time.time()
    job.workers[2].resume()                                  # SIGCONT
    stall = longest_stall(job.chief, paused_at, resumed_at)
    assert stall <= LEASE + SLACK, f"worker 0 stood still {stall:.1f} s while worker 2 was paused (lease {LEASE} s)"
    results = job.finish()
    assert [r["steps"] >= 500 for r in results] == [True, True, True]
    if mode == "sync":
        assert results[2]["stale_drops"] >= 1, "its first push after the pause was read at a step long gone"


@pytest.mark.timeout(150)
def test_a_worker_stopped_with_sigterm_leaves_the_job_at_once_and_the_others_do_not_wait_for_its_lease(start_job):
    job = start_job(mode="sync", shards=2, workers=3, steps=500)
    job.chief.wait_for_step(100, timeout=90)
    stopped_at = time.time()
    job.workers[2].process.send_signal(signal.SIGTERM)
    assert job.workers[2].finish(10) == 128 + signal.SIGTERM
    assert job.workers[2].result["stopped"] is True
    results = job.finish(skip=[2])
    assert [r["steps"] >= 500 for r in results] == [True, True]
    stall = longest_stall(job.chief, stopped_at)
    assert stall < LEASE - 1, f"worker 0 stood still {stall:.1f} s: it waited for the lease of a worker that left"
    for shard in job.cluster.shards:
        assert f"worker 'worker2' left shard {shard.shard_index}" in shard.log_tail(500_000)
