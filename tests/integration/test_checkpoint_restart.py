"""Real shard processes with a checkpoint directory: SIGKILL, restart on the same port, resume; SIGTERM writes a final checkpoint.

The shards are `python -m ps_server` processes (tests.helpers.processes): started on
port 0, stopped by their pid at teardown. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_server.checkpoints import CheckpointDirectory
from tests.helpers.processes import READY_TIMEOUT, ShardStartError
from worker_client.client import PSClient, RetryPolicy

RNG = np.random.default_rng(3)
MODEL = {
    "emb": RNG.standard_normal((64, 32)).astype(np.float32),    # 8 KiB: split over the two shards
    "w": RNG.standard_normal((32, 4)).astype(np.float32),
    "b": np.zeros(4, np.float32),
}
FLAGS = ["--partition-min-bytes", "1024", "--lease-seconds", "5", "--wait-timeout", "20"]
MOMENTUM = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]


def grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in MODEL.items()}


def checkpoint_dirs(tmp_path: Path, num_shards: int) -> dict[int, list[str]]:
    """One checkpoint directory per shard, as --checkpoint-dir flags for shard_flags."""
    return {i: ["--checkpoint-dir", str(tmp_path / f"shard{i}")] for i in range(num_shards)}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def rows_on(shard_map, shard: int, arrays: dict[str, np.ndarray]) -> dict[tuple[str, int], np.ndarray]:
    return {(p.name, p.row_start): np.asarray(arrays[p.name])[p.row_start:p.row_end] if not p.whole
            else np.asarray(arrays[p.name]) for p in shard_map.parts_on(shard)}


def test_a_shard_killed_with_sigkill_resumes_from_its_last_checkpoint_and_the_client_reconnects_on_its_own(
        start_cluster, tmp_path):
    cluster = start_cluster(2, flags=[*FLAGS, *MOMENTUM, "--checkpoint-every-steps", "3"],
                            shard_flags=checkpoint_dirs(tmp_path, 2))
    retry = RetryPolicy(attempts=60, initial_backoff=0.05, max_backoff=0.5)     # up to ~30 s of reconnecting
    client = PSClient(cluster.addresses, worker_id="w0", retry=retry, rpc_timeout=20, wait_timeout=20)
    try:
        client.wait_ready(10)
        client.initialize(MODEL)
        client.register(heartbeat=True)
        assert any(not p.whole for p in client.shard_map.parts_of("emb")), "emb should be split over both shards"
        history = {}                                   # step -> the values pulled at that step (both shards in lockstep)
        for i in range(10):
            history[client.steps[1]] = client.pull()
            assert client.steps[0] == client.steps[1] == i
            assert client.push(grads(i)).accepted
        history[10] = client.pull()
        directory = CheckpointDirectory(tmp_path / "shard1")
        # A checkpoint every 3 steps: the newest one ends at step 8, 9 or 10.
        wait_for(lambda: directory.checkpoints() and directory.checkpoints()[0][0] >= 8, 10, "a checkpoint at step >= 8")

        address = cluster.shards[1].address
        cluster.kill(1)
        step, path = directory.checkpoints()[0]
        saved = directory.read(path)
        assert saved.step == step and {w.worker_id: w.clock for w in saved.workers} == {"w0": step}

        # Restart on the same port while the client is already retrying its pull.
        restarter = threading.Thread(target=lambda: (time.sleep(0.5), cluster.restart(1)), daemon=True)
        restarter.start()
        values = client.pull()
        restarter.join(READY_TIMEOUT)
        assert not restarter.is_alive() and cluster.shards[1].alive() and cluster.shards[1].address == address
        assert client.steps == [10, step]
        for key, value in rows_on(client.shard_map, 1, values).items():
            np.testing.assert_array_equal(value, rows_on(client.shard_map, 1, history[step])[key])
        for key, value in rows_on(client.shard_map, 0, values).items():
            np.testing.assert_array_equal(value, rows_on(client.shard_map, 0, history[10])[key])

        # A retry of a push the checkpoint already holds: acknowledged as a duplicate, not applied (on both shards).
        retried = client.push(grads(step - 1), clock=step - 1, read_steps=[10, step])
        assert [r.duplicate for r in retried.responses] == [True, True]
        assert retried.steps == [10, step]
        again = client.pull()
        for name in MODEL:
            np.testing.assert_array_equal(again[name], values[name])

        # Training goes on: the next push (clock 10) is applied once on each shard.
        assert client.clock == 10
        report = client.push(grads(100))
        assert report.accepted and not any(r.duplicate for r in report.responses)
        assert report.steps == [11, step + 1] and [r.clock for r in report.responses] == [11, 11]
        info = client.cluster_info(1)
        assert info.step == step + 1 and [(w.worker_id, w.clock, w.live) for w in info.workers] == [("w0", 11, True)]
    finally:
        client.close()


def test_a_shard_stopped_with_sigterm_writes_a_final_checkpoint_and_resumes_from_it_exactly(start_cluster, tmp_path):
    # No interval: the only checkpoint is the one written on stop.
    cluster = start_cluster(1, flags=[*FLAGS, "--optimizer", "adam", "--lr", "0.01"],
                            shard_flags=checkpoint_dirs(tmp_path, 1))
    client = PSClient(cluster.addresses, worker_id="w1", retry=RetryPolicy(attempts=20, initial_backoff=0.05),
                      rpc_timeout=20, wait_timeout=20)
    try:
        client.wait_ready(10)
        client.initialize(MODEL)
        client.register(heartbeat=False)
        for i in range(4):
            client.pull()
            assert client.push(grads(i)).accepted
        before = client.pull()
        assert cluster.shards[0].stop() == 0                       # SIGTERM: a clean exit after the final checkpoint
        assert [s for s, _ in CheckpointDirectory(tmp_path / "shard0").checkpoints()] == [4]
        cluster.restart(0)
        after = client.pull()
        assert client.steps == [4]
        for name in MODEL:
            np.testing.assert_array_equal(after[name], before[name])
        retried = client.push(grads(3), clock=3, read_steps=[3])
        assert retried.responses[0].duplicate and retried.responses[0].outcome == pb.PUSH_ACCEPTED
        assert client.push(grads(4)).steps == [5]
    finally:
        client.close()


def test_a_shard_refuses_to_start_from_a_checkpoint_of_another_mode(start_cluster, tmp_path):
    cluster = start_cluster(1, flags=FLAGS, shard_flags=checkpoint_dirs(tmp_path, 1))
    client = PSClient(cluster.addresses, worker_id="w2", retry=RetryPolicy(attempts=3, initial_backoff=0.05))
    try:
        client.initialize(MODEL)
    finally:
        client.close()
    assert cluster.shards[0].stop() == 0
    with pytest.raises(ShardStartError, match="mode='async'.*mode='sync'"):
        start_cluster(1, mode="sync", flags=FLAGS, shard_flags=checkpoint_dirs(tmp_path, 1))


def test_a_client_sees_which_shard_lost_the_steps_and_pushes_it_had_seen_after_a_restart_from_an_older_checkpoint(
        start_cluster, tmp_path):
    cluster = start_cluster(2, flags=[*FLAGS, "--checkpoint-every-steps", "4"], shard_flags=checkpoint_dirs(tmp_path, 2))
    client = PSClient(cluster.addresses, worker_id="w3", retry=RetryPolicy(attempts=3, window=20), rpc_timeout=20,
                      wait_timeout=20)
    try:
        client.wait_ready(10)
        client.initialize(MODEL)
        client.register(heartbeat=False)
        directory = CheckpointDirectory(tmp_path / "shard1")
        for i in range(6):
            client.pull()
            assert client.push(grads(i)).accepted
        wait_for(lambda: [s for s, _ in directory.checkpoints()] == [4], 10, "the checkpoint at step 4")
        client.pull()
        assert client.steps == [6, 6] and client.lost_progress() == {}
        cluster.kill(1)
        cluster.restart(1)                                # back at step 4, with w3 at clock 4
        assert client.lost_progress() == {1: "its step went down to 4 from 6"}
        client.pull()                                     # what the shard holds now: step 4 there
        assert client.steps == [6, 4]
        assert client.lost_progress() == {1: "its clock for 'w3' went down to 4 from 6"}
        assert client.push(grads(6)).accepted             # clock 6, read at [6, 4]: taken by both
        assert client.lost_progress() == {}
    finally:
        client.close()
