"""ps-certs makes a development CA and certificates that a secured shard and its clients use; ps-ctl talks to it.

The shard runs in this process on 127.0.0.1 port 0 with TLS, mutual TLS, a worker token
and an admin token, all from ps-certs' files (no openssl command, no script). ps-ctl
takes the workers' TLS and token settings (issue 10) and asks it for its status.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ps_common.tls import client_security, read_token
from ps_server.config import ServerConfig
from ps_server.server import ShardServer, create_server
from ps_tools import certs, ctl
from worker_client.client import PSClient


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    assert certs.main(["-o", str(directory), "-s", "DNS:ps-0.example", "-d", "30"]) == 0
    return directory


def test_ps_certs_writes_every_file_keys_and_tokens_private(made: Path) -> None:
    assert sorted(p.name for p in made.iterdir()) == sorted(certs.FILES)
    for name in certs.FILES:
        mode = stat.S_IMODE((made / name).stat().st_mode)
        assert mode == (0o644 if name.endswith(".crt") else 0o600), (name, oct(mode))
    from cryptography import x509

    server = x509.load_pem_x509_certificate((made / "server.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ps-0.example" in names.get_values_for_type(x509.DNSName)
    assert len(read_token(made / "worker.token")) == 64 and read_token(made / "worker.token") != read_token(
        made / "admin.token")


def test_ps_certs_refuses_to_overwrite_without_f_and_a_bad_name(made: Path, capsys) -> None:
    assert certs.main(["-o", str(made)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ps-certs: {made / 'ca.crt'} exists (10 of the 10 files do); pass -f"), err
    assert certs.main(["-o", str(made / "other"), "-s", "ps-0.example"]) == 2
    assert "write DNS:NAME or IP:ADDRESS" in capsys.readouterr().err
    assert not (made / "other" / "ca.crt").exists()


def start_secured(made: Path, *, mutual: bool) -> ShardServer:
    return create_server(ServerConfig(
        host="127.0.0.1", port=0, tls_cert=str(made / "server.crt"), tls_key=str(made / "server.key"),
        tls_client_ca=str(made / "ca.crt") if mutual else None, auth_token=read_token(made / "worker.token"),
        admin_token=read_token(made / "admin.token"), optimizer_params={"lr": 0.1}))[0]


@pytest.fixture(scope="module")
def mutual(made: Path) -> Iterator[ShardServer]:
    """A shard requiring mutual TLS (a client certificate gives the role) and tokens, from ps-certs' files."""
    server = start_secured(made, mutual=True)
    yield server
    server.stop(grace=0.5)


@pytest.fixture(scope="module")
def tokens(made: Path) -> Iterator[ShardServer]:
    """A TLS shard requiring a token on every call (no client certificate)."""
    server = start_secured(made, mutual=False)
    yield server
    server.stop(grace=0.5)


@pytest.fixture(autouse=True)
def no_token_variables(monkeypatch) -> None:
    monkeypatch.delenv("PS_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("PS_ADMIN_TOKEN", raising=False)


def test_a_worker_trains_against_a_secured_shard_with_ps_certs_files(made: Path, mutual: ShardServer) -> None:
    creds, metadata = client_security(str(made / "ca.crt"), str(made / "worker.crt"), str(made / "worker.key"),
                                      read_token(made / "worker.token"))
    params = {"w": np.ones((4, 3), dtype=np.float32)}
    with PSClient([mutual.address], worker_id="w0", channel_credentials=creds, call_metadata=metadata) as client:
        client.initialize(params)
        client.register(heartbeat=False)
        assert client.push({"w": np.full((4, 3), 1.0, dtype=np.float32)}).accepted
        np.testing.assert_allclose(client.pull()["w"], 0.9)


def ctl_status(capsys, *flags: str) -> tuple[int, str, str]:
    status = ctl.main(["status", *flags])
    out = capsys.readouterr()
    return status, out.out, out.err


def answered(status: int, out: str, err: str, address: str) -> bool:
    summary = json.loads(out)
    return status == 0 and [s["address"] for s in summary["shards"]] == [address] and summary["errors"] == []


@pytest.mark.parametrize("role", ["worker", "admin"])
def test_ps_ctl_asks_a_mutual_tls_cluster_with_a_client_certificate_and_a_token(made, mutual, capsys, role) -> None:
    flag = "--auth-token-file" if role == "worker" else "--admin-token-file"
    result = ctl_status(capsys, mutual.address, "--json", "--tls-ca", str(made / "ca.crt"),
                        "--tls-cert", str(made / f"{role}.crt"), "--tls-key", str(made / f"{role}.key"),
                        flag, str(made / f"{role}.token"))
    assert answered(*result, mutual.address), result[2]


def test_ps_ctl_asks_a_tls_and_token_cluster_with_either_token(made, tokens, capsys, monkeypatch) -> None:
    ca = ["--tls-ca", str(made / "ca.crt"), "--json"]
    for flag, file in (("--auth-token-file", "worker.token"), ("--admin-token-file", "admin.token")):
        result = ctl_status(capsys, tokens.address, *ca, flag, str(made / file))
        assert answered(*result, tokens.address), (flag, result[2])
    status, _, err = ctl_status(capsys, tokens.address, *ca, "--timeout", "3")     # no token
    assert status == 1
    assert f"ps-ctl: shard at {tokens.address} failed: UNAUTHENTICATED" in err
    assert "--auth-token-file or --admin-token-file" in err
    monkeypatch.setenv("PS_AUTH_TOKEN", read_token(made / "worker.token"))       # the token from the environment
    assert answered(*ctl_status(capsys, tokens.address, *ca), tokens.address)


def test_ps_ctl_in_plaintext_to_a_tls_shard_says_it_needs_tls_ca(tokens, capsys) -> None:
    status, _, err = ctl_status(capsys, tokens.address, "--timeout", "2")
    assert status == 1 and "unreachable: UNAVAILABLE" in err and "if the shard serves TLS, give --tls-ca" in err


def test_ps_ctl_names_a_tls_file_it_cannot_read_and_exits_2(made, capsys) -> None:
    status, _, err = ctl_status(capsys, "127.0.0.1:1", "--tls-ca", str(made / "missing.crt"))
    assert status == 2 and "ps-ctl: cannot read --tls-ca" in err and "missing.crt" in err
    status, _, err = ctl_status(capsys, "127.0.0.1:1", "--tls-ca", str(made / "ca.crt"), "--tls-cert",
                                str(made / "worker.crt"))
    assert status == 2 and "needs both --tls-cert and --tls-key" in err
