"""The test helper that runs real shard processes: READY on port 0, clear start failures, stopping by pid."""

from __future__ import annotations

import pytest

from tests.helpers.processes import ShardCluster, ShardStartError, start_shard


def test_a_shard_that_fails_to_start_is_reported_with_its_log() -> None:
    with pytest.raises(ShardStartError, match="invalid choice: 'bogus'"):
        start_shard("--mode", "bogus", ready_timeout=30)


def test_a_cluster_starts_each_shard_on_its_own_free_port_and_stops_them_by_pid_with_sigterm() -> None:
    with ShardCluster(2, mode="ssp", flags=["--staleness", "1"]) as cluster:
        assert [s.shard_index for s in cluster.shards] == [0, 1]
        assert len(set(cluster.addresses)) == 2 and all(s.port > 0 for s in cluster.shards)
        assert cluster.address_option == ",".join(cluster.addresses)
        processes = [s.process for s in cluster.shards]
        assert all(p.poll() is None for p in processes)
    assert [p.returncode for p in processes] == [0, 0]   # SIGTERM: a clean exit, not a kill


def test_a_killed_shard_restarts_on_its_old_port() -> None:
    with ShardCluster(1) as cluster:
        port = cluster.shards[0].port
        assert cluster.kill(0) == -9
        restarted = cluster.restart(0)
        assert restarted.port == port and restarted.alive()
