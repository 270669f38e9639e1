"""Shared fixtures: real shard processes on port 0 (reaped by pid), the contract suite's --ps-address, and a
session-end sweep that stops, by pid, every process the test session started and left running."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from ps_common.process import running_children, stop_all
from tests.helpers.processes import REAP_GRACE, ShardCluster, reap_descendants


class LeftoverProcessWarning(pytest.PytestWarning):
    """A process the test session started was still running at its end and had to be stopped."""


@pytest.fixture(scope="session", autouse=True)
def reap_leftover_processes() -> Iterator[None]:
    """At the end of the session: stops every descendant of this pytest process, by PID, and warns about each.

    Descendants are found in /proc (children, grandchildren, ...); where there is no /proc,
    the children started through ps_common.process are. SIGTERM, then SIGKILL after
    REAP_GRACE s. Runs after every other fixture's teardown, so what it finds is a leak.
    """
    yield
    stopped = reap_descendants(os.getpid(), grace=REAP_GRACE)
    leftovers = running_children()   # none after the sweep where /proc exists
    stop_all(leftovers, grace=REAP_GRACE)
    stopped += [f"pid {c.pid} ({' '.join(c.argv)}): exit status {c.returncode}" for c in leftovers]
    if stopped:
        warnings.warn(LeftoverProcessWarning(f"{len(stopped)} process(es) the tests left running were stopped:\n  "
                                             + "\n  ".join(stopped)), stacklevel=1)


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
