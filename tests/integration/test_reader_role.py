"""The read-only reader role against a real shard: a reader token, and OU=ps-reader client certificates.

Shards run in this process on 127.0.0.1 port 0: one with a worker, an admin and a reader
token (plaintext on loopback), one with mutual TLS and no tokens. Certificates come from
``ps-certs --reader`` in a temporary directory (no openssl command).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_common.access import READER_OU, Role, certificate_role
from ps_common.tls import bearer_metadata, client_security, read_token
from ps_server.config import ServerConfig
from ps_server.server import ShardServer, create_server
from ps_tools import certs
from worker_client.client import PSClient, RetryPolicy

PARAMS = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, dtype=np.float32)}
GRADS = {n: np.full_like(a, 0.5) for n, a in PARAMS.items()}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    assert certs.main(["-o", str(directory), "--reader"]) == 0
    return directory


@pytest.fixture(autouse=True)
def no_token_variables(monkeypatch) -> None:
    for name in ("PS_AUTH_TOKEN", "PS_ADMIN_TOKEN", "PS_READER_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def client(server: ShardServer, *, ca=None, cert=None, key=None, token=None) -> PSClient:
    """A PSClient that does not retry (a refusal fails at once)."""
    creds, metadata = client_security(ca, cert, key, token)
    return PSClient([server.address], channel_credentials=creds, call_metadata=metadata, rpc_timeout=10,
                    retry=RetryPolicy(attempts=1), shared_memory=False)


def stub(server: ShardServer, *, ca=None, cert=None, key=None) -> pb_grpc.ParameterServerStub:
    creds, _ = client_security(ca, cert, key)
    channel = grpc.insecure_channel(server.address) if creds is None else grpc.secure_channel(server.address, creds)
    return pb_grpc.ParameterServerStub(channel)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def initialized(server: ShardServer, **security) -> ShardServer:
    worker = client(server, **security)
    try:
        worker.initialize(PARAMS)
    finally:
        worker.close()
    return server


@pytest.fixture(scope="module")
def tokens(made: Path) -> Iterator[ShardServer]:
    """A loopback shard with a worker, an admin and a reader token, initialized with PARAMS."""
    server, _ = create_server(ServerConfig(
        auth_token=read_token(made / "worker.token"), admin_token=read_token(made / "admin.token"),
        reader_token=read_token(made / "reader.token"), optimizer_params={"lr": 0.1}))
    yield initialized(server, token=read_token(made / "worker.token"))
    server.stop(grace=0.5)


@pytest.fixture(scope="module")
def mutual(made: Path) -> Iterator[ShardServer]:
    """A mutual-TLS shard without tokens: the client certificate gives the role. Initialized with PARAMS."""
    server, _ = create_server(ServerConfig(
        tls_cert=str(made / "server.crt"), tls_key=str(made / "server.key"), tls_client_ca=str(made / "ca.crt"),
        optimizer_params={"lr": 0.1}))
    yield initialized(server, **mtls(made, "worker"))
    server.stop(grace=0.5)


def mtls(made: Path, role: str) -> dict[str, str]:
    return dict(ca=str(made / "ca.crt"), cert=str(made / f"{role}.crt"), key=str(made / f"{role}.key"))


def refusals(rpcs: pb_grpc.ParameterServerStub, metadata=()) -> dict[str, grpc.RpcError]:
    """The errors of the rpcs a reader may not call: Push, RegisterWorker, Barrier."""
    return {
        "Push": rpc_error(lambda: rpcs.Push(iter([pb.PushRequest()]), metadata=metadata, timeout=10)),
        "RegisterWorker": rpc_error(lambda: rpcs.RegisterWorker(pb.RegisterWorkerRequest(worker_id="r"),
                                                                metadata=metadata, timeout=10)),
        "Barrier": rpc_error(lambda: rpcs.Barrier(pb.BarrierRequest(name="b", participant_id="r", participants=1),
                                                  metadata=metadata, timeout=10)),
    }


def test_ps_certs_reader_writes_a_reader_certificate_key_and_token(made: Path) -> None:
    assert sorted(p.name for p in made.iterdir()) == sorted((*certs.FILES, *certs.READER_FILES))
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((made / "reader.crt").read_bytes())
    assert certificate_role({"x509_subject": [cert.subject.rfc4514_string().encode()]}) == Role.READER
    assert READER_OU in cert.subject.rfc4514_string()
    assert len({read_token(made / f"{role}.token") for role in ("worker", "admin", "reader")}) == 3


# ---------------------------------------------------------------------- the reader token


def test_the_reader_token_may_get_cluster_info_and_pull(made, tokens) -> None:
    reader = client(tokens, token=read_token(made / "reader.token"))
    try:
        assert reader.cluster_info().initialized
        reader.fetch_shard_map()
        pulled = reader.pull()
    finally:
        reader.close()
    assert sorted(pulled) == sorted(PARAMS)
    assert all(pulled[n].shape == a.shape for n, a in PARAMS.items())


def test_the_reader_token_is_refused_push_register_barrier_and_admin(made, tokens) -> None:
    metadata = bearer_metadata(read_token(made / "reader.token"))
    errors = refusals(stub(tokens), metadata)
    errors["Checkpoint"] = rpc_error(lambda: pb_grpc.AdminStub(grpc.insecure_channel(tokens.address)).Checkpoint(
        pb.CheckpointRequest(), metadata=metadata, timeout=10))
    for rpc, error in errors.items():
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc, error.details())
        assert f"/{rpc} needs the " in error.details() and "the caller has the reader role" in error.details(), rpc
    assert "needs the worker role" in errors["Push"].details() and "the worker token" in errors["Push"].details()
    assert "needs the admin role" in errors["Checkpoint"].details()


def test_the_worker_token_still_registers_pushes_and_pulls(made, tokens) -> None:
    worker = client(tokens, token=read_token(made / "worker.token"))
    try:
        worker.fetch_shard_map()
        worker.register(heartbeat=False)
        before = worker.pull()
        assert worker.push(GRADS).accepted
        after = worker.pull()
    finally:
        worker.close()
    for name in PARAMS:
        np.testing.assert_allclose(after[name], before[name] - 0.1 * GRADS[name])


def test_a_wrong_reader_token_is_unauthenticated(made, tokens) -> None:
    metadata = bearer_metadata(read_token(made / "reader.token") + "0")
    error = rpc_error(lambda: stub(tokens).GetClusterInfo(pb.ClusterInfoRequest(), metadata=metadata, timeout=10))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid token" in error.details()
    error = rpc_error(lambda: list(stub(tokens).Pull(pb.PullRequest(), metadata=(), timeout=10)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "the reader token" in error.details()


# ---------------------------------------------------------------------- OU=ps-reader certificates


def test_a_reader_certificate_may_pull_under_mutual_tls(made, mutual) -> None:
    reader = client(mutual, **mtls(made, "reader"))
    try:
        reader.fetch_shard_map()
        pulled = reader.pull()
    finally:
        reader.close()
    assert sorted(pulled) == sorted(PARAMS)


def test_a_reader_certificate_is_refused_push_register_and_barrier(made, mutual) -> None:
    for rpc, error in refusals(stub(mutual, **mtls(made, "reader"))).items():
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc, error.details())
        assert error.details() == (f"/ps.v1.ParameterServer/{rpc} needs the worker role, the caller has the reader "
                                   f"role: connect with a client certificate without OU={READER_OU}")


@pytest.mark.parametrize("role", ["worker", "admin"])
def test_an_ordinary_or_admin_certificate_still_pushes(made, mutual, role) -> None:
    worker = client(mutual, **mtls(made, role))
    try:
        worker.fetch_shard_map()
        worker.register(heartbeat=False)
        step = worker.cluster_info().step
        assert worker.push(GRADS).accepted
        assert worker.cluster_info().step == step + 1
    finally:
        worker.close()
