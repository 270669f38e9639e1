"""`ps-health`, the image's HEALTHCHECK command: exit 0 for a SERVING shard, 1 otherwise, 2 for bad options."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ps_tools import health
from tests.helpers.processes import REPO_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ps_tools.health", *args], capture_output=True, text=True,
                          timeout=30, cwd=REPO_ROOT, env=env)


def test_probe_exits_0_for_a_serving_shard(start_cluster) -> None:
    cluster = start_cluster(1)
    address = cluster.addresses[0]
    result = probe(address)
    assert result.returncode == health.EXIT_SERVING, result.stderr
    assert "SERVING" in result.stdout
    serving, seen = health.check(address, service="ps.v1.ParameterServer")
    assert serving, seen


def test_probe_exits_1_when_nothing_listens() -> None:
    result = probe(f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == health.EXIT_NOT_SERVING
    assert "DEADLINE_EXCEEDED" in result.stderr or "UNAVAILABLE" in result.stderr


def test_probe_reports_an_unknown_service_as_not_serving(start_cluster) -> None:
    cluster = start_cluster(1)
    serving, seen = health.check(cluster.addresses[0], service="no.such.Service")
    assert not serving and "NOT_FOUND" in seen


def test_probe_takes_its_address_from_the_environment(start_cluster) -> None:
    import os

    cluster = start_cluster(1)
    result = probe("--quiet", env={**os.environ, health.ADDRESS_ENV: cluster.addresses[0]})
    assert result.returncode == 0 and result.stdout == ""


def test_probe_exits_2_naming_an_unreadable_tls_file(tmp_path) -> None:
    missing = tmp_path / "ca.crt"
    result = probe(f"127.0.0.1:{free_port()}", "--tls-ca", str(missing))
    assert result.returncode == health.EXIT_USAGE
    assert str(missing) in result.stderr


def test_check_refuses_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="Invalid timeout: 0"):
        health.check("127.0.0.1:1", timeout=0)
