"""Integration tests of the secured wire: TLS, mutual TLS, tokens and roles, the bind rule and request limits.

Real servers on 127.0.0.1 port 0 (in-process, and ``python -m ps_server`` processes for the
command line), with certificates made by deploy/tls/make-dev-certs.sh in temporary
directories: CA "a" for the job, CA "b" as a stranger.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_common.codec import MAX_MESSAGE_BYTES
from ps_common.process import child_env, python_module_argv
from ps_common.tls import bearer_metadata, client_security
from ps_server.config import ServerConfig
from ps_server.server import ShardServer, create_server
from worker_client.client import PSClient, RetryPolicy, ServerError
from ps_common.errors import UnauthenticatedError

REPO_ROOT = Path(__file__).resolve().parents[2]
MAKE_CERTS = REPO_ROOT / "deploy" / "tls" / "make-dev-certs.sh"
PARAMS = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, dtype=np.float32)}
GRADS = {n: np.full_like(a, 0.5) for n, a in PARAMS.items()}
LR = 0.1

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


class Certs:
    """The files make-dev-certs.sh wrote to one directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def __getattr__(self, name: str) -> str:   # certs.ca_crt -> DIR/ca.crt, certs.worker_token -> DIR/worker.token
        return str(self.dir / name.replace("_", "."))

    def token(self, role: str) -> str:
        return (self.dir / f"{role}.token").read_text().strip()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[Certs, Certs]:
    """Two independent development CAs with their certificates and tokens: (a, b)."""
    made = []
    for name in ("a", "b"):
        directory = tmp_path_factory.mktemp(f"ca-{name}")
        subprocess.run(["bash", str(MAKE_CERTS), "-o", str(directory), "-f"], check=True, capture_output=True,
                       timeout=60)
        made.append(Certs(directory))
    return made[0], made[1]


@pytest.fixture
def start() -> Iterator[Callable[..., ShardServer]]:
    """start(**ServerConfig settings) -> a started in-process shard on 127.0.0.1:0; all stopped at teardown."""
    servers: list[ShardServer] = []

    def run(**settings) -> ShardServer:
        settings.setdefault("optimizer_params", {"lr": LR})
        server, _ = create_server(ServerConfig(**settings))
        servers.append(server)
        return server

    yield run
    for server in servers:
        server.stop(grace=0.5)


def tls_settings(c: Certs, *, mutual: bool = False, tokens: bool = False, **extra) -> dict:
    settings = dict(tls_cert=c.server_crt, tls_key=c.server_key, **extra)
    if mutual:
        settings["tls_client_ca"] = c.ca_crt
    if tokens:
        settings.update(auth_token=c.token("worker"), admin_token=c.token("admin"))
    return settings


def client(server: ShardServer, *, ca=None, cert=None, key=None, token=None) -> PSClient:
    """A PSClient that does not retry UNAVAILABLE (a refused handshake fails at once)."""
    creds, metadata = client_security(ca, cert, key, token)
    return PSClient([server.address], channel_credentials=creds, call_metadata=metadata, rpc_timeout=10,
                    retry=RetryPolicy(attempts=1))


def channel(server: ShardServer, *, ca=None, cert=None, key=None, **options) -> grpc.Channel:
    creds, _ = client_security(ca, cert, key)
    opts = list(options.items())
    if creds is None:
        return grpc.insecure_channel(server.address, options=opts)
    return grpc.secure_channel(server.address, creds, options=opts)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def admin_call(stub: pb_grpc.AdminStub, rpc: str, metadata=()) -> object:
    request = {"Checkpoint": pb.CheckpointRequest(), "ResetParameters": pb.ResetParametersRequest(),
               "Shutdown": pb.ShutdownRequest(reason="test")}[rpc]
    return getattr(stub, rpc)(request, metadata=metadata, timeout=10)


def expected_after_one_push() -> dict[str, np.ndarray]:
    return {n: a - LR * GRADS[n] for n, a in PARAMS.items()}


# ---------------------------------------------------------------------- TLS and mutual TLS


def test_a_job_initializes_registers_pushes_and_pulls_over_tls(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True))
    worker = client(server, ca=a.ca_crt, token=a.token("worker"))
    try:
        assert worker.initialize(PARAMS) is False
        worker.register(heartbeat=False)
        assert worker.push(GRADS).accepted
        pulled = worker.pull()
    finally:
        worker.close()
    for name, value in expected_after_one_push().items():
        np.testing.assert_allclose(pulled[name], value)
    assert server.shard.step == 1


def test_mutual_tls_accepts_a_client_certificate_signed_by_the_ca(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, mutual=True))
    worker = client(server, ca=a.ca_crt, cert=a.worker_crt, key=a.worker_key)
    try:
        worker.initialize(PARAMS)
        np.testing.assert_array_equal(worker.pull()["w"], PARAMS["w"])
    finally:
        worker.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, mutual=True))
    worker = client(server, ca=a.ca_crt)
    with pytest.raises(ServerError) as info:
        worker.cluster_info()
    worker.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert not server.shard.store.initialized


def test_mutual_tls_refuses_a_client_certificate_from_another_ca(certs, start):
    a, b = certs
    server = start(**tls_settings(a, mutual=True))
    worker = client(server, ca=a.ca_crt, cert=b.worker_crt, key=b.worker_key)
    with pytest.raises(ServerError) as info:
        worker.initialize(PARAMS)
    worker.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert not server.shard.store.initialized


def test_a_server_certificate_from_another_ca_is_refused_with_a_handshake_error(certs, start):
    a, b = certs
    server = start(**tls_settings(b))   # the shard's certificate is signed by CA b; the worker trusts CA a
    worker = client(server, ca=a.ca_crt)
    with pytest.raises(ServerError) as info:
        worker.cluster_info()
    worker.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    message = str(info.value)
    assert "handshake failed" in message.lower() and "CERTIFICATE_VERIFY_FAILED" in message


def test_a_plaintext_client_cannot_talk_to_a_tls_port(certs, start):
    a, _ = certs
    server = start(**tls_settings(a))
    error = rpc_error(lambda: pb_grpc.ParameterServerStub(channel(server)).GetClusterInfo(
        pb.ClusterInfoRequest(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------------- tokens and roles


def test_a_call_without_a_token_is_unauthenticated(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True))
    worker = client(server, ca=a.ca_crt)
    with pytest.raises(ServerError) as info:
        worker.initialize(PARAMS)
    worker.close()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(info.value, UnauthenticatedError)   # the refusal's reason maps back to the catalog class
    assert "authorization: Bearer <token>" in str(info.value)
    assert not server.shard.store.initialized


def test_a_call_with_a_wrong_token_is_unauthenticated(certs, start):
    a, b = certs
    server = start(**tls_settings(a, tokens=True))
    worker = client(server, ca=a.ca_crt, token=b.token("worker"))   # another job's token
    with pytest.raises(ServerError) as info:
        worker.cluster_info()
    worker.close()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "invalid token" in str(info.value)


@pytest.mark.parametrize("rpc", ["Checkpoint", "ResetParameters", "Shutdown"])
def test_the_worker_token_may_not_call_admin_rpcs(certs, start, tmp_path, rpc):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True, checkpoint_dir=str(tmp_path / "ckpt")))
    worker = client(server, ca=a.ca_crt, token=a.token("worker"))
    worker.initialize(PARAMS)
    worker.register(heartbeat=False)
    worker.push(GRADS)
    stub = pb_grpc.AdminStub(channel(server, ca=a.ca_crt))
    error = rpc_error(lambda: admin_call(stub, rpc, bearer_metadata(a.token("worker"))))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the admin role" in error.details()
    info = worker.cluster_info()   # nothing happened: still serving, same step, nothing written
    worker.close()
    assert (info.initialized, info.step) == (True, 1)
    assert not list((tmp_path / "ckpt").glob("ckpt-*"))


def test_the_admin_token_may_checkpoint_reset_and_shut_down(certs, start, tmp_path):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True, checkpoint_dir=str(tmp_path / "ckpt")))
    admin = client(server, ca=a.ca_crt, token=a.token("admin"))   # the admin token may do a worker's calls too
    admin.initialize(PARAMS)
    admin.register(heartbeat=False)
    admin.push(GRADS)
    admin.close()
    stub = pb_grpc.AdminStub(channel(server, ca=a.ca_crt))
    metadata = bearer_metadata(a.token("admin"))

    written = admin_call(stub, "Checkpoint", metadata)
    assert written.step == 1 and Path(written.path).is_file() and Path(written.path).parent == tmp_path / "ckpt"

    assert admin_call(stub, "ResetParameters", metadata).step == 1
    assert (server.shard.store.initialized, server.shard.step) == (False, 0)

    admin_call(stub, "Shutdown", metadata)
    assert server.wait(10) is False   # wait_for_termination: False when it terminated in time


def test_checkpoint_without_a_checkpoint_directory_is_a_failed_precondition(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True))
    error = rpc_error(lambda: admin_call(pb_grpc.AdminStub(channel(server, ca=a.ca_crt)), "Checkpoint",
                                         bearer_metadata(a.token("admin"))))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "checkpointing not available" in error.details()


def test_health_checks_and_reflection_need_no_token(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True))
    ch = channel(server, ca=a.ca_crt)
    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="ps.v1.ParameterServer"),
                                                  timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"ps.v1.ParameterServer", "ps.v1.Admin", "grpc.health.v1.Health"} <= services


def test_under_mutual_tls_the_client_certificate_gives_the_role_when_no_token_is_sent(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, mutual=True, tokens=True))
    as_worker = channel(server, ca=a.ca_crt, cert=a.worker_crt, key=a.worker_key)
    as_admin = channel(server, ca=a.ca_crt, cert=a.admin_crt, key=a.admin_key)
    info = pb_grpc.ParameterServerStub(as_worker).GetClusterInfo(pb.ClusterInfoRequest(), timeout=5)
    assert info.initialized is False   # a worker certificate may call the parameter server without a token
    error = rpc_error(lambda: admin_call(pb_grpc.AdminStub(as_worker), "ResetParameters"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "OU=ps-admin" in error.details()
    assert admin_call(pb_grpc.AdminStub(as_admin), "ResetParameters").step == 0
    # a token, when sent, is checked even under mutual TLS
    error = rpc_error(lambda: admin_call(pb_grpc.AdminStub(as_admin), "ResetParameters", bearer_metadata("wrong")))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_refused_calls_are_counted_in_the_rpc_metrics(certs, start):
    a, _ = certs
    server = start(**tls_settings(a, tokens=True))
    worker = client(server, ca=a.ca_crt)
    with pytest.raises(ServerError):
        worker.cluster_info()
    worker.close()
    value = server.metrics.registry.get_sample_value(
        "ps_rpcs_total", {"shard": "0", "rpc": "GetClusterInfo", "code": "UNAUTHENTICATED"})
    assert value == 1


def test_a_key_that_does_not_match_the_certificate_stops_the_start_naming_both(certs):
    a, b = certs
    with pytest.raises(ValueError) as info:
        create_server(ServerConfig(tls_cert=a.server_crt, tls_key=b.server_key))
    assert f"tls_key {b.server_key!r} is not the private key of tls_cert {a.server_crt!r}" in str(info.value)


def test_a_missing_certificate_file_stops_the_start_naming_the_setting(certs, tmp_path):
    a, _ = certs
    missing = str(tmp_path / "missing.crt")
    with pytest.raises(ValueError, match=f"cannot read tls_cert '{missing}'"):
        create_server(ServerConfig(tls_cert=missing, tls_key=a.server_key))


# ---------------------------------------------------------------------- the bind rule


def test_plaintext_on_a_non_loopback_host_is_refused_without_insecure():
    with pytest.raises(ValueError, match=r"refusing to serve plaintext gRPC on 0\.0\.0\.0:0.*--insecure"):
        create_server(ServerConfig(host="0.0.0.0"))


def test_insecure_mode_serves_plaintext_on_all_interfaces_with_a_warning(start, caplog):
    with caplog.at_level(logging.WARNING, logger="ps_server.security"):
        server = start(host="0.0.0.0", insecure=True)
    assert any("PLAINTEXT" in r.getMessage() for r in caplog.records)
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_tls_on_all_interfaces_needs_no_insecure_flag(certs, start):
    a, _ = certs
    server = start(**tls_settings(a), host="0.0.0.0")
    worker = PSClient([f"127.0.0.1:{server.port}"], channel_credentials=client_security(a.ca_crt)[0], rpc_timeout=10,
                      retry=RetryPolicy(attempts=1))
    assert worker.cluster_info().initialized is False
    worker.close()


# ---------------------------------------------------------------------- request limits


def test_a_request_above_the_size_limit_is_refused_with_resource_exhausted(start):
    server = start()
    big = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.ParameterServerStub(big)
    request = pb.RegisterWorkerRequest(worker_id="w" * (MAX_MESSAGE_BYTES + (1 << 20)))
    error = rpc_error(lambda: stub.RegisterWorker(request, timeout=10))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.shard.membership.workers == {}
    # the shard keeps serving
    assert stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=5).num_shards == 1


def test_the_receive_limit_is_a_setting(start):
    server = start(max_receive_message_bytes=2 * MAX_MESSAGE_BYTES, max_id_bytes=4 * MAX_MESSAGE_BYTES)
    big = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
    worker_id = "w" * (MAX_MESSAGE_BYTES + (1 << 20))
    pb_grpc.ParameterServerStub(big).RegisterWorker(pb.RegisterWorkerRequest(worker_id=worker_id), timeout=10)
    assert list(server.shard.membership.workers) == [worker_id]


def test_rpcs_beyond_max_concurrent_rpcs_are_refused_with_resource_exhausted(start):
    server = start(max_concurrent_rpcs=1)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(server.address))
    waiting = stub.Barrier.future(pb.BarrierRequest(name="b", participant_id="w0", participants=2, timeout_ms=2000),
                                  timeout=10)
    time.sleep(0.5)   # the barrier call now holds the one slot (it waits for a second participant)
    assert not waiting.done()
    error = rpc_error(lambda: stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rpc_error(waiting.result).code() == grpc.StatusCode.DEADLINE_EXCEEDED   # the barrier's own timeout
    time.sleep(0.2)   # gRPC frees the slot just after the answer went out
    assert stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=5).num_shards == 1


# ---------------------------------------------------------------------- the ps-server command


def run_server_command(*flags: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Runs ``python -P -m ps_server *flags`` to its end (at most timeout s), without TF_CONFIG."""
    return subprocess.run(python_module_argv("ps_server", *flags), cwd=REPO_ROOT, env=child_env(drop=["TF_CONFIG"]),
                          capture_output=True, text=True, timeout=timeout)


def test_the_server_command_refuses_plaintext_on_a_non_loopback_host():
    done = run_server_command("--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 2
    assert "refusing to serve plaintext gRPC on 0.0.0.0:0" in done.stderr and "--insecure" in done.stderr
    assert "PS_SERVER_READY" not in done.stdout


def test_a_shard_process_serves_mutual_tls_and_checks_tokens_from_its_flags(certs, start_cluster):
    a, _ = certs
    cluster = start_cluster(1, flags=["--tls-cert", a.server_crt, "--tls-key", a.server_key,
                                      "--tls-client-ca", a.ca_crt, "--auth-token-file", a.worker_token,
                                      "--admin-token-file", a.admin_token])
    address = cluster.addresses[0]

    def connect(token: str | None) -> PSClient:
        creds, metadata = client_security(a.ca_crt, a.worker_crt, a.worker_key, token)
        return PSClient([address], channel_credentials=creds, call_metadata=metadata, rpc_timeout=10,
                        retry=RetryPolicy(attempts=1))

    worker = connect(a.token("worker"))
    worker.initialize(PARAMS)
    worker.register(heartbeat=False)
    assert worker.push(GRADS).accepted
    np.testing.assert_allclose(worker.pull()["b"], -0.01 * GRADS["b"])   # the command's default lr is 0.01
    worker.close()
    stranger = connect("wrong")
    with pytest.raises(ServerError) as info:
        stranger.cluster_info()
    stranger.close()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_admin_shutdown_ends_a_shard_process_that_refuses_the_worker_token(certs, start_cluster, tmp_path):
    a, _ = certs
    cluster = start_cluster(1, flags=["--tls-cert", a.server_crt, "--tls-key", a.server_key,
                                      "--auth-token-file", a.worker_token, "--admin-token-file", a.admin_token,
                                      "--checkpoint-dir", str(tmp_path / "ckpt")])
    shard = cluster.shards[0]
    creds, _ = client_security(a.ca_crt)
    stub = pb_grpc.AdminStub(grpc.secure_channel(shard.address, creds))
    error = rpc_error(lambda: admin_call(stub, "Shutdown", bearer_metadata(a.token("worker"))))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and shard.alive()
    admin_call(stub, "Shutdown", bearer_metadata(a.token("admin")))
    deadline = time.monotonic() + 15
    while shard.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not shard.alive()
