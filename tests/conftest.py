"""Shared fixtures: real shard processes on port 0 (reaped by pid), and the contract suite's --ps-address."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from tests.helpers.processes import ShardCluster


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, in the root conftest: pytest only takes options from the conftests it loads at start.
    parser.addoption(
        "--ps-address", default=None, metavar="HOST:PORT[,HOST:PORT...]",
        help="run tests/contract against these running shards (in shard order) instead of fresh ones",
    )


StartCluster = Callable[..., ShardCluster]


@pytest.fixture
def start_cluster() -> Iterator[StartCluster]:
    """``start_cluster(num_shards, mode=..., flags=[...], shard_flags={i: [...]})`` -> a started ShardCluster.

    Every cluster started through it is stopped (SIGTERM, then SIGKILL, by pid) at teardown.
    """
    clusters: list[ShardCluster] = []

    def start(num_shards: int = 1, *, mode: str = "async", flags: Sequence[str] = (),
              shard_flags: Mapping[int, Sequence[str]] | None = None, **kwargs) -> ShardCluster:
        cluster = ShardCluster(num_shards, mode=mode, flags=flags, shard_flags=shard_flags, **kwargs)
        clusters.append(cluster)
        return cluster.start()

    yield start
    errors = []
    for cluster in reversed(clusters):
        try:
            cluster.stop()
        except RuntimeError as exc:
            errors.append(str(exc))
    assert not errors, errors
