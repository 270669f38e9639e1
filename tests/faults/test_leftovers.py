"""Processes killed with SIGKILL leave nothing behind, and the job's fast path comes back after a shard restart.

A job whose shards and workers are each killed three times (and restarted: shards from their
checkpoints) must not leave shared memory (RAM until reboot) or scratch folders (disk) of the
dead processes once their successors run, and its workers must negotiate shared memory with
each restarted shard again, so the step rate after the restarts is the rate before them.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from ps_common import scratch, shared_memory
from tests.faults.conftest import Job

KILLS = 3


def step_rate(job: Job, seconds: float) -> float:
    """Worker 0's pushes per second over the next `seconds` (from its progress events)."""
    def latest() -> tuple[float, int]:
        event = job.chief.wait_for(lambda e: e["event"] == "progress", timeout=30, what="a progress event")
        found = [e for e in job.chief.events if e["event"] == "progress"][-1] if job.chief.events else event
        return found["time"], found["iteration"]

    t0, i0 = latest()
    time.sleep(seconds)
    t1, i1 = latest()
    assert t1 > t0, "worker 0 made no progress"
    return (i1 - i0) / (t1 - t0)


def reopened(job: Job) -> int:
    """How many times worker 0 opened shared memory with shard 1 (its log)."""
    return len(re.findall(r"shard 1: bytes through shared memory", job.chief.log_tail(2_000_000)))


def scratch_of_dead_processes(tmpdir: Path) -> list[str]:
    root = tmpdir / f"onnx-ps-{os.getuid()}"
    found = []
    for entry in (root.iterdir() if root.is_dir() else []):
        match = re.match(r"^[a-z-]+?-(\d+)-(\d+)-", entry.name)
        if match is None or scratch.is_gone(int(match[1]), int(match[2])):
            found.append(entry.name)
    return found


@pytest.mark.timeout(240)
@pytest.mark.skipif(not shared_memory.available(), reason="needs Linux memfd and SCM_RIGHTS")
def test_killed_shards_and_workers_leave_nothing_and_the_step_rate_comes_back(start_job, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    shm_before = set(os.listdir("/dev/shm"))
    # a bundled model (each worker writes it into its scratch folder); its small shards through shared memory
    job = start_job(mode="async", shards=2, workers=2, steps=10**6, checkpoint_every=25,
                    worker_flags=["--model", "mlp", "--shared-memory-min-bytes", "0"], env={"TMPDIR": str(tmpdir)})
    job.chief.wait_for_step(100, timeout=90)
    before = step_rate(job, 3.0)
    for kill in range(KILLS):
        job.cluster.kill(1)
        time.sleep(0.5)
        job.cluster.restart(1)
        job.workers[1].kill()
        restarted = time.time()
        job.restart_worker(1, "--model", "mlp")
        # worker 0 (never restarted) opens shared memory with the new shard 1 before it is killed again
        deadline = time.monotonic() + 60
        while reopened(job) < 2 + kill:
            assert time.monotonic() < deadline, f"no new segment after restart {kill + 1}: {job.chief.log_tail(3000)}"
            time.sleep(0.1)
        job.workers[1].wait_for(lambda e: e["event"] == "progress" and e["time"] > restarted, timeout=60,
                                what="progress of the restarted worker 1")
    assert len(scratch_of_dead_processes(tmpdir)) == 0, os.listdir(tmpdir / f"onnx-ps-{os.getuid()}")
    time.sleep(1.0)
    after = step_rate(job, 3.0)
    assert set(os.listdir("/dev/shm")) == shm_before    # nothing named in /dev/shm, ever
    assert reopened(job) == 1 + KILLS, job.chief.log_tail(5000)
    print(f"worker 0: {before:.1f} pushes/s before the kills, {after:.1f} after {KILLS} shard restarts")
    assert after >= 0.6 * before, (before, after)
