"""A worker asked to stop (SIGTERM) while it waits exits within 3 s, whatever it waits for; a worker that
cannot reach a shard says which address and why within 10 s, and keeps saying it."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from tests.helpers.processes import ShardCluster, WorkerProcess
from worker_client.client import PSClient

#: The promise: a stopped process is gone this soon after SIGTERM (seconds).
EXIT_WITHIN = 3.0


def _free_port() -> int:
    """A port nothing listens on (bound, read, released: a connection to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(servers: str, model, *extra: str) -> WorkerProcess:
    return WorkerProcess(["--servers", servers, "--worker-index", "0", "--model", str(model), "--data", "digits",
                          "--batch-size", "32", "--steps", "50", "--eval-every", "0", "--intra-op-threads", "1",
                          "--log-level", "INFO", *extra], name="worker0")


def _sigterm_exit_seconds(worker: WorkerProcess) -> tuple[float, int]:
    started = time.monotonic()
    worker._signal(signal.SIGTERM)
    code = worker.finish(timeout=15)
    return time.monotonic() - started, code


@pytest.mark.timeout(90)
def test_a_worker_waiting_at_the_start_barrier_exits_within_3_s_of_sigterm(mlp_model) -> None:
    with ShardCluster(1, mode="sync", flags=["--workers", "2", "--replicas-to-aggregate", "2"]) as cluster:
        worker = _worker(cluster.address_option, mlp_model, "--workers", "2", "--start-timeout", "120")
        try:
            with PSClient(cluster.addresses, worker_id="observer", rpc_timeout=10) as observer:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                        w.worker_id == "worker0" for w in observer.cluster_info(0).workers):
                    time.sleep(0.2)
            time.sleep(1.5)   # registered, so now inside the start barrier's wait (one of two workers arrived)
            assert worker.alive(), worker.log_tail()
            seconds, code = _sigterm_exit_seconds(worker)
        finally:
            worker.stop()
    print(f"start barrier: exited {seconds:.2f} s after SIGTERM with {code}")
    assert seconds < EXIT_WITHIN and code == 143


@pytest.mark.timeout(90)
def test_a_worker_given_a_wrong_address_names_it_and_why_and_stops_on_sigterm(mlp_model) -> None:
    address = f"127.0.0.1:{_free_port()}"
    worker = _worker(address, mlp_model, "--start-timeout", "300")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "waiting for shard 0" not in worker.log_tail():
            time.sleep(0.2)
        log = worker.log_tail()
        assert f"waiting for shard 0 at {address}: connection refused" in log, log
        seconds, code = _sigterm_exit_seconds(worker)
    finally:
        worker.stop()
    print(f"wrong address: exited {seconds:.2f} s after SIGTERM with {code}")
    assert seconds < EXIT_WITHIN and code == 143
