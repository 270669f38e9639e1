"""Targets of the contract suite: fresh shard processes (one cluster per mode), or the shards at --ps-address.

Without ``--ps-address`` the suite starts, on first use, a 2-shard cluster for each mode
(sync with N=2 of M=3, ssp with b=1, async with max_staleness=2) as separate processes,
and runs the mode-independent rules against each and every mode's rules against its own.
With ``--ps-address HOST:PORT[,HOST:PORT...]`` (shard order) it reads the mode from
GetClusterInfo and runs the rules of that mode; the other modes' tests skip, saying so.
The suite needs the server to itself while it runs (it counts steps and clocks).

Tests marked ``before_init`` need a server that has not been initialized yet; they run
first, and skip with the reason when the server was initialized before the suite started.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.wire import Target, Workers
from tests.helpers.processes import ShardCluster

MODES = ("sync", "ssp", "async")
NUM_SHARDS = 2
COMMON_FLAGS = ["--partition-min-bytes", "4096", "--lease-seconds", "60", "--wait-timeout", "30",
                "--optimizer", "sgd", "--lr", "0.1"]
MODE_FLAGS = {
    "sync": ["--replicas-to-aggregate", "2", "--total-replicas", "3"],
    "ssp": ["--staleness", "1"],
    "async": ["--max-staleness", "2"],
    "async-unbounded": [],   # only for the rule that needs max_staleness = 0 (not parametrized)
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "before_init: a contract test that needs a not-yet-initialized server")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs the before_init contract tests first (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("before_init") else 1)


def _external(config: pytest.Config) -> list[str] | None:
    option = config.getoption("--ps-address")
    if not option:
        return None
    return [a.strip() for a in option.split(",") if a.strip()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that take `target` run once per mode's fresh cluster, or once against --ps-address."""
    if "target" in metafunc.fixturenames:
        ids = ["external"] if _external(metafunc.config) else list(MODES)
        metafunc.parametrize("target", ids, indirect=True)


class _Targets:
    """The session's targets, started on first use and stopped at the end."""

    def __init__(self, external: list[str] | None) -> None:
        self.external = external
        self.clusters: dict[str, ShardCluster] = {}
        self.targets: dict[str, Target] = {}

    def get(self, label: str) -> Target:
        if label not in self.targets:
            if label == "external":
                assert self.external is not None
                target = Target("external", self.external)
            else:
                mode = label.split("-")[0]
                cluster = ShardCluster(NUM_SHARDS, mode=mode, flags=[*COMMON_FLAGS, *MODE_FLAGS[label]])
                self.clusters[label] = cluster.start()
                target = Target(label, cluster.addresses)
            target.wait_ready(30)
            self.targets[label] = target
        return self.targets[label]

    def for_mode(self, mode: str) -> Target:
        """The target that serves `mode`, or a skip saying which mode the external server runs."""
        if self.external is None:
            return self.get(mode)
        target = self.get("external")
        if target.mode != mode:
            pytest.skip(f"the server at {','.join(self.external)} runs mode {target.mode}, not {mode}")
        return target

    def close(self) -> None:
        for target in self.targets.values():
            target.close()
        for cluster in self.clusters.values():
            cluster.stop()


@pytest.fixture(scope="session")
def contract_targets(request: pytest.FixtureRequest) -> Iterator[_Targets]:
    targets = _Targets(_external(request.config))
    yield targets
    targets.close()


@pytest.fixture
def target(request: pytest.FixtureRequest, contract_targets: _Targets) -> Target:
    """The shards under test (parametrized: each mode's cluster, or the external server)."""
    return contract_targets.get(request.param)


@pytest.fixture
def sync_target(contract_targets: _Targets) -> Target:
    return contract_targets.for_mode("sync")


@pytest.fixture
def ssp_target(contract_targets: _Targets) -> Target:
    return contract_targets.for_mode("ssp")


@pytest.fixture
def async_target(contract_targets: _Targets) -> Target:
    return contract_targets.for_mode("async")


@pytest.fixture
def unbounded_async_ready(contract_targets: _Targets) -> Target:
    """An async cluster without max_staleness (fresh shards), or the external async server."""
    if contract_targets.external is None:
        return _ready(contract_targets.get("async-unbounded"))
    return _ready(contract_targets.for_mode("async"))


@pytest.fixture
def uninitialized(target: Target) -> Target:
    """The target, when it has not been initialized yet (else a skip saying why)."""
    if target.initialized_here or any(target.info(i).initialized for i in range(target.num_shards)):
        pytest.skip(f"the server at {target.addresses} is already initialized; the before-init rules need a fresh one")
    return target


def _ready(target: Target) -> Target:
    target.ensure_initialized()
    return target


@pytest.fixture
def ready(target: Target) -> Target:
    """The target, initialized with the contract model (a skip when another parameter list is in place)."""
    return _ready(target)


@pytest.fixture
def sync_ready(sync_target: Target) -> Target:
    return _ready(sync_target)


@pytest.fixture
def ssp_ready(ssp_target: Target) -> Target:
    return _ready(ssp_target)


@pytest.fixture
def async_ready(async_target: Target) -> Target:
    return _ready(async_target)


@pytest.fixture
def workers(request: pytest.FixtureRequest) -> Iterator[Workers]:
    """Registers fresh worker ids on the test's target (`ready`, `*_ready` or `target`); deregisters them after."""
    for name in ("ready", "sync_ready", "ssp_ready", "async_ready", "unbounded_async_ready", "target"):
        if name in request.fixturenames:
            target = request.getfixturevalue(name)
            break
    else:
        raise RuntimeError("the workers fixture needs a target fixture in the test")
    registry = Workers(target)
    yield registry
    registry.cleanup()
