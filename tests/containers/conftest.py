"""Fixtures of the container tests: the validators, the engine, the image built from this checkout.

The health-probe, lint and manifest tests also run under ``make test`` (the lint and
manifest ones where the validators of the test extras are installed). The tests that need
a container engine (test_image.py, test_jobs.py) are collected only under ``make
test-containers``, which sets PS_CONTAINER_TESTS=1. There, a machine with no engine and no
root to install one, or without a validator, skips with the reason printed, except under
CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.engine import SCRIPTS, Engine, EngineError, EngineUnavailable, Session, in_ci

#: Test modules that need a container engine; collected only with PS_CONTAINER_TESTS=1.
ENGINE_MODULES = ("test_image.py", "test_jobs.py")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name in ENGINE_MODULES and os.environ.get("PS_CONTAINER_TESTS") != "1":
        return True
    return None


def unavailable(reason: str) -> None:
    """Skips with `reason`; fails instead under CI in `make test-containers`, where nothing may be skipped.

    (Under a plain `make test` the container checks are not what was asked for, so a missing
    validator skips there even in CI; `make test-containers` is the CI step that runs them.)
    """
    if in_ci() and os.environ.get("PS_CONTAINER_TESTS") == "1":
        pytest.fail(f"{reason} (CI=true: a missing container tool is a failure here, not a skip)", pytrace=False)
    print(f"\nSKIPPED (container tests): {reason}", file=sys.stderr)
    pytest.skip(reason)


def find_tool(name: str) -> str:
    """The path of a validator installed with the test extras (this interpreter's bin first, then PATH)."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    unavailable(f"`{name}` is not installed (pip install '.[test]' installs it)")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def tool():
    """tool(name) -> the path of a validator command, or skip/fail when it is missing."""
    return find_tool


@pytest.fixture(scope="session")
def engine() -> Engine:
    """A working podman (installed and configured first when running as root)."""
    try:
        return Engine.setup()
    except EngineUnavailable as exc:
        unavailable(str(exc))
        raise AssertionError("unreachable") from exc


@pytest.fixture(scope="session")
def run_id() -> str:
    """A short id unique to this test run: names and labels of everything it creates."""
    return f"{os.getpid()}{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="session")
def image(engine: Engine, run_id: str) -> Iterator[str]:
    """The CPU image built from this checkout (cached layers reused), under a tag of this run, untagged at the end."""
    tag = f"localhost/onnx-ps:test-{run_id}"
    try:
        engine.command([str(SCRIPTS / "build-image.sh")], env={"PS_IMAGE": tag}, timeout=1500)
    except EngineError as exc:
        pytest.fail(f"building the image failed: {exc}", pytrace=False)
    yield tag
    engine.podman("rmi", tag, check=False)


@pytest.fixture
def containers(engine: Engine, run_id: str, request: pytest.FixtureRequest) -> Iterator[Session]:
    """A Session for one test: its containers, networks and volumes are removed (by id) afterwards."""
    role = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_"))[:24].strip("-")
    session = engine.session(f"{run_id}-{role}")
    yield session
    errors = session.close()
    assert not errors, errors
