"""Fault tests: whole jobs of real processes (ps-server shards, ps-worker workers) hit by kills, pauses and bad files.

`start_job(...)` starts the shards (tests.helpers.processes.ShardCluster, port 0) and the
workers (WorkerProcess, `python -m worker_client --events`) of one job on the bundled
MLP and the digits data, and stops every process it started, by pid, at teardown. Every
wait is bounded; every test carries a pytest-timeout mark well below the suite's 300 s.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ps_models.builders import write_model
from tests.helpers.processes import ShardCluster, ShardProcess, WorkerProcess

#: The lease of every fault-test shard, in seconds: short, so a dead worker is noticed soon,
#: yet well above the heartbeat period (a third of it) on a loaded 2-core machine.
LEASE = 3.0
#: Longest wait of one pull (sync step, SSP hold) and of worker 0's wait at the end.
WAIT_TIMEOUT = 60.0
#: How long a worker retries an unavailable (restarting) shard before it fails.
RECONNECT_TIMEOUT = 30.0
#: Longest run of one job from start to the last worker's exit, in seconds.
JOB_TIMEOUT = 150.0
#: The shards' learning rate (SGD, momentum 0.9). Not the demo's 0.05: with 3 workers pushing
#: stale gradients (async, ssp) that sits at the edge of stability -- the loss stayed near
#: chance for a varying part of the run and spiked now and then (50 async runs with a killed
#: worker ended at 0.869-0.975, and one CI run at 0.51). At 0.02 the loss falls steadily:
#: 12 runs each ended at 0.969-0.983 async, 0.961-0.981 ssp.
LR = 0.02


@pytest.fixture(scope="session")
def mlp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("mlp", tmp_path_factory.mktemp("model") / "mlp.onnx", seed=0)


class Job:
    """The processes of one training job; see the module docstring."""

    def __init__(self, tmp_path: Path, model: Path, *, mode: str, shards: int, workers: int, steps: int,
                 replicas: int | None = None, staleness: int = 2, checkpoint_every: int = 0,
                 shard_flags: Sequence[str] = (), worker_flags: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.model = model
        self.mode = mode
        self.num_workers = workers
        self.steps = steps
        self.worker_flags = [str(f) for f in worker_flags]
        self.env = env   # extra environment of every process (e.g. TMPDIR)
        flags = ["--optimizer", "momentum", "--lr", str(LR), "--lease-seconds", str(LEASE),
                 "--wait-timeout", str(WAIT_TIMEOUT), "--workers", str(workers), "--metrics-port", "0",
                 "--log-level", "INFO", *shard_flags]
        if mode == "sync":
            flags += ["--replicas-to-aggregate", str(replicas or workers)]
        elif mode == "ssp":
            flags += ["--staleness", str(staleness)]
        per_shard = {}
        if checkpoint_every:
            flags += ["--checkpoint-every-steps", str(checkpoint_every)]
            per_shard = {i: ["--checkpoint-dir", str(self.checkpoint_dir(i))] for i in range(shards)}
        self.cluster = ShardCluster(shards, mode=mode, flags=flags, shard_flags=per_shard, env=env)
        self.workers: list[WorkerProcess] = []
        self.retired: list[WorkerProcess] = []   # killed or replaced workers, stopped at teardown too

    def checkpoint_dir(self, shard: int) -> Path:
        return self.tmp_path / f"checkpoints-shard{shard}"

    def start(self, *, workers: bool = True) -> "Job":
        """Starts the shards, and the workers unless `workers` is False (the test starts them itself)."""
        self.cluster.start()
        if workers:
            self.workers = [self.start_worker(i) for i in range(self.num_workers)]
        return self

    def start_worker(self, index: int, *extra: str) -> WorkerProcess:
        """Starts ps-worker `index` (worker id "worker<index>"): one onnxruntime thread, progress every 0.1 s."""
        args = ["--servers", self.cluster.address_option, "--worker-index", str(index),
                "--workers", str(self.num_workers), "--model", str(self.model), "--data", "digits",
                "--batch-size", "32", "--steps", str(self.steps), "--eval-every", "0", "--progress-every", "0.1",
                "--intra-op-threads", "1", "--wait-timeout", str(WAIT_TIMEOUT), "--start-timeout", "60",
                "--reconnect-timeout", str(RECONNECT_TIMEOUT), "--log-level", "INFO", *self.worker_flags, *extra]
        return WorkerProcess(args, name=f"worker{index}", env=self.env)

    def restart_worker(self, index: int, *extra: str) -> WorkerProcess:
        """Starts worker `index` again with the same id (the old process must be gone)."""
        assert not self.workers[index].alive()
        self.retired.append(self.workers[index])
        self.workers[index] = self.start_worker(index, *extra)
        return self.workers[index]

    @property
    def chief(self) -> WorkerProcess:
        return self.workers[0]

    def finish(self, timeout: float = JOB_TIMEOUT, *, skip: Sequence[int] = ()) -> list[dict[str, Any]]:
        """Waits for every worker not in `skip` to exit 0 with a result (all within timeout s); their results."""
        deadline = time.monotonic() + timeout
        results = []
        for i, worker in enumerate(self.workers):
            if i in skip:
                continue
            code = worker.finish(max(1.0, deadline - time.monotonic()))
            assert code == 0, f"{worker.name} exited {code}; log tail:\n{worker.log_tail()}"
            assert worker.result is not None, f"{worker.name} reported no result; log tail:\n{worker.log_tail()}"
            results.append(worker.result)
        return results

    def stop(self) -> None:
        for worker in [*self.workers, *self.retired]:
            worker.stop()
            if not worker.alive():
                worker.remove_log()
        self.cluster.stop()


@pytest.fixture
def start_job(tmp_path: Path, mlp_model: Path) -> Iterator[Any]:
    """``start_job(mode=..., shards=..., workers=..., steps=..., ...)`` -> a started Job, stopped at teardown."""
    jobs: list[Job] = []

    def start(*, start_workers: bool = True, **settings: Any) -> Job:
        job = Job(tmp_path / f"job{len(jobs)}", mlp_model, **settings)
        jobs.append(job)
        return job.start(workers=start_workers)

    yield start
    for job in reversed(jobs):
        job.stop()


def metric(shard: ShardProcess, name: str) -> float:
    """The value of an unlabelled-but-for-shard metric on a running shard's /metrics endpoint."""
    port = shard.ready["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^{re.escape(name)}\{{shard="{shard.shard_index}"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} not on shard {shard.shard_index}'s /metrics"
    return float(match.group(1))


def longest_stall(worker: WorkerProcess, since: float, until: float | None = None) -> float:
    """The longest time between two consecutive progress events of `worker` that spans a moment in [since, until].

    Times are unix seconds (the events' `time`); the last event before `since` counts, so a
    stall that began just before `since` is measured whole.
    """
    times = [e["time"] for e in worker.events if e["event"] == "progress"]
    before = [t for t in times if t < since]
    inside = [t for t in times if t >= since and (until is None or t <= until)]
    times = before[-1:] + inside
    assert len(inside) >= 1 and len(times) >= 2, f"{worker.name}: too few progress events around {since}"
    return max(b - a for a, b in zip(times, times[1:]))
