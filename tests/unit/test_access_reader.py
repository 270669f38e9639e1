"""The read-only reader role without sockets: the policy's decisions, the certificate path, settings and flags."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import grpc
import pytest

from ps_common import jobconfig
from ps_common.access import (
    READ_METHODS,
    READER_OU,
    AccessPolicy,
    AuthInterceptor,
    Role,
    certificate_role,
)
from ps_common.tls import READER_TOKEN_ENV
from ps_server.cli import server_config
from ps_server.config import ServerConfig
from ps_server.security import check_bind, describe, interceptors

WORKER, ADMIN, READER = "worker-token-0123456789", "admin-token-0123456789", "reader-token-0123456789"
PS = "/ps.v1.ParameterServer/"
READS = tuple(PS + name for name in ("GetClusterInfo", "Pull", "PullRows", "ReadState"))
WRITES = tuple(PS + name for name in ("Push", "PushPull", "Barrier", "RegisterWorker", "Heartbeat",
                                      "DeregisterWorker", "InitParameters", "OpenSharedMemory"))
STAGE = "/ps.v1.StageExchange/Send"
ADMIN_RPCS = ("/ps.v1.Admin/Checkpoint", "/ps.v1.Admin/Shutdown", "/ps.v1.Admin/ResetParameters")
HEALTH = "/grpc.health.v1.Health/Check"
MTLS = dict(tls_cert="server.crt", tls_key="server.key", tls_client_ca="ca.crt")


def bearer(token: str) -> str:
    return f"Bearer {token}"


def subject(text: str) -> dict[str, list[bytes]]:
    """An auth context as gRPC gives it for a verified client certificate with this subject."""
    return {"x509_subject": [text.encode()], "x509_common_name": [b"someone"]}


# ---------------------------------------------------------------------- roles and the read-only rpcs


def test_the_roles_are_ordered_none_reader_worker_admin():
    assert [r.name for r in sorted(Role)] == ["NONE", "READER", "WORKER", "ADMIN"]
    assert Role.NONE < Role.READER < Role.WORKER < Role.ADMIN


def test_the_read_only_rpcs_are_named_in_one_constant():
    assert READ_METHODS == frozenset(READS)
    assert "/ps.v1.ParameterServer/ReadState" in READ_METHODS


@pytest.mark.parametrize("policy", [AccessPolicy(WORKER, ADMIN, reader_token=READER),
                                    AccessPolicy(WORKER, reader_token=READER),
                                    AccessPolicy(mutual_tls=True),
                                    AccessPolicy(WORKER, ADMIN, mutual_tls=True, reader_token=READER)])
def test_reads_need_the_reader_role_and_everything_else_the_worker_role_once_a_scheme_is_on(policy):
    assert {policy.needed(m) for m in READS} == {Role.READER}
    assert {policy.needed(m) for m in (*WRITES, STAGE)} == {Role.WORKER}
    assert policy.needed(HEALTH) == Role.NONE


def test_without_a_worker_token_or_mutual_tls_the_parameter_server_stays_open():
    for policy in (AccessPolicy(), AccessPolicy(admin_token=ADMIN)):
        assert all(policy.decide(m, None).allowed for m in (*READS, *WRITES))
    assert AccessPolicy().open and not AccessPolicy(admin_token=ADMIN).open


def test_the_reader_token_may_call_the_read_only_rpcs():
    policy = AccessPolicy(WORKER, ADMIN, reader_token=READER)
    for method in READS:
        assert policy.decide(method, bearer(READER)).allowed, method


@pytest.mark.parametrize("method", [*WRITES, STAGE, *ADMIN_RPCS])
def test_the_reader_token_is_refused_every_other_rpc_with_permission_denied(method):
    verdict = AccessPolicy(WORKER, ADMIN, reader_token=READER).decide(method, bearer(READER))
    assert (verdict.allowed, verdict.code, verdict.check_certificate) == (
        False, grpc.StatusCode.PERMISSION_DENIED, False), method
    assert method in verdict.message and "the caller has the reader role" in verdict.message


def test_a_refused_push_names_the_rpc_the_role_needed_the_role_held_and_how_to_get_it():
    message = AccessPolicy(WORKER, ADMIN, reader_token=READER).decide(PS + "Push", bearer(READER)).message
    assert message == ("/ps.v1.ParameterServer/Push needs the worker role, the caller has the reader role: send "
                       "metadata 'authorization: Bearer <token>' with the worker token or the admin token")


def test_a_read_without_any_token_is_unauthenticated_and_says_the_reader_token_would_do():
    verdict = AccessPolicy(WORKER, ADMIN, reader_token=READER).decide(PS + "Pull", None)
    assert verdict.code == grpc.StatusCode.UNAUTHENTICATED
    assert "needs the reader role" in verdict.message and "the reader token or the worker token" in verdict.message


def test_the_worker_and_admin_tokens_still_call_what_they_did():
    policy = AccessPolicy(WORKER, ADMIN, reader_token=READER)
    assert all(policy.decide(m, bearer(WORKER)).allowed for m in (*READS, *WRITES, STAGE))
    assert not any(policy.decide(m, bearer(WORKER)).allowed for m in ADMIN_RPCS)
    assert all(policy.decide(m, bearer(ADMIN)).allowed for m in (*READS, *WRITES, STAGE, *ADMIN_RPCS))


def test_a_wrong_token_is_unauthenticated_on_reads_too():
    policy = AccessPolicy(WORKER, reader_token=READER)
    for method in (*READS, PS + "Push"):
        verdict = policy.decide(method, bearer(READER + "x"))
        assert (verdict.allowed, verdict.code) == (False, grpc.StatusCode.UNAUTHENTICATED), method


def test_tokens_give_their_roles():
    policy = AccessPolicy(WORKER, ADMIN, reader_token=READER)
    assert [policy.token_role(t) for t in (READER, WORKER, ADMIN, "other")] == [
        Role.READER, Role.WORKER, Role.ADMIN, None]


def test_the_token_decides_without_a_certificate_check_when_it_is_enough():
    policy = AccessPolicy(WORKER, ADMIN, mutual_tls=True, reader_token=READER)
    assert policy.decide(PS + "Pull", bearer(READER)).allowed   # the hot path stays unwrapped
    assert policy.decide(PS + "Push", bearer(WORKER)).allowed
    # a reader token is not enough for Push: the certificate may still be a worker's
    verdict = policy.decide(PS + "Push", bearer(READER))
    assert verdict.check_certificate and verdict.token_role == Role.READER


# ---------------------------------------------------------------------- certificates


def test_a_certificate_with_ou_ps_reader_is_a_reader():
    assert READER_OU == "ps-reader"
    assert certificate_role(subject("CN=serve,OU=ps-reader,O=onnx-ps dev")) == Role.READER
    assert certificate_role(subject("CN=ps-reader,OU=ps-worker,O=onnx-ps dev")) == Role.WORKER   # CN is no role
    assert certificate_role(subject("CN=ops,OU=ps-reader,OU=ps-admin")) == Role.ADMIN
    assert certificate_role(subject(r"CN=a\,OU=ps-reader,O=x")) == Role.WORKER   # an escaped comma is no OU


def test_under_mutual_tls_without_tokens_every_call_but_health_is_checked_against_its_certificate():
    policy = AccessPolicy(mutual_tls=True)
    assert not policy.open
    for method in (*READS, *WRITES, *ADMIN_RPCS):
        verdict = policy.decide(method, None)
        assert not verdict.allowed and verdict.check_certificate, method
    assert policy.decide(HEALTH, None).allowed


class FakeContext:
    """The servicer context the interceptor's certificate check sees."""

    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self.auth = auth
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        self.trailing = ()

    def auth_context(self):
        return self.auth

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata

    def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")   # grpc's abort raises too


def run_intercepted(policy: AccessPolicy, method: str, auth: dict[str, list[bytes]],
                    authorization: str | None = None) -> FakeContext:
    """Runs a unary call of `method` through the interceptor with a client certificate of `auth`."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: "answered")
    metadata = () if authorization is None else (("authorization", authorization),)
    details = SimpleNamespace(method=method, invocation_metadata=metadata)
    wrapped = AuthInterceptor(policy).intercept_service(lambda _: handler, details)
    context = FakeContext(auth)
    try:
        assert wrapped.unary_unary(b"", context) == "answered"
    except RuntimeError:
        assert context.aborted is not None
    return context


def test_a_reader_certificate_may_pull_and_is_refused_push_by_the_interceptor(caplog):
    policy = AccessPolicy(mutual_tls=True)
    reader = subject("CN=serve,OU=ps-reader,O=onnx-ps dev")
    assert run_intercepted(policy, PS + "Pull", reader).aborted is None
    with caplog.at_level(logging.WARNING, logger="ps_common.access"):
        context = run_intercepted(policy, PS + "Push", reader)
    code, message = context.aborted
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert message == ("/ps.v1.ParameterServer/Push needs the worker role, the caller has the reader role: "
                       f"connect with a client certificate without OU={READER_OU}")
    assert any("refused /ps.v1.ParameterServer/Push" in r.getMessage() for r in caplog.records)


def test_an_ordinary_certificate_still_pushes_and_a_worker_token_lifts_a_reader_certificate():
    policy = AccessPolicy(WORKER, mutual_tls=True, reader_token=READER)
    assert run_intercepted(policy, PS + "Push", subject("CN=w,OU=ps-worker,O=onnx-ps dev")).aborted is None
    reader = subject("CN=serve,OU=ps-reader,O=onnx-ps dev")
    assert run_intercepted(policy, PS + "Push", reader, bearer(WORKER)).aborted is None
    assert run_intercepted(policy, PS + "Push", reader, bearer(READER)).aborted[0] == grpc.StatusCode.PERMISSION_DENIED


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize("settings, message", [
    ({"reader_token": READER}, "Invalid reader_token: it needs auth_token"),
    ({"reader_token": READER, "admin_token": ADMIN}, "Invalid reader_token: it needs auth_token"),
    ({"reader_token": WORKER, "auth_token": WORKER}, "Invalid reader_token: it equals auth_token"),
    ({"reader_token": ADMIN, "auth_token": WORKER, "admin_token": ADMIN}, "Invalid reader_token: it equals admin_token"),
    ({"reader_token": "has space", "auth_token": WORKER}, "Invalid reader_token (9 characters)"),
])
def test_bad_reader_token_settings_are_refused_naming_the_settings(settings, message):
    with pytest.raises(ValueError) as info:
        ServerConfig(**settings)
    assert message in str(info.value)
    for name in ("auth_token", "admin_token", "reader_token"):   # a secret never shows in the message
        if name in settings and settings[name] != "has space":
            assert settings[name] not in str(info.value)


def test_a_reader_token_without_credentials_for_writes_explains_why_it_is_refused():
    with pytest.raises(ValueError) as info:
        ServerConfig(reader_token=READER)
    text = str(info.value)
    assert "tls_client_ca" in text and "grant nothing an anonymous caller lacks" in text


def test_a_reader_token_beside_a_worker_token_or_mutual_tls_is_accepted_and_kept_out_of_repr():
    assert ServerConfig(reader_token=READER, auth_token=WORKER).reader_token == READER
    config = ServerConfig(reader_token=READER, **MTLS)
    assert READER not in repr(config)
    assert len(interceptors(config)) == 1
    assert AccessPolicy.from_config(config) == AccessPolicy(None, None, True, READER)


def test_a_short_reader_token_is_logged_as_weak(caplog):
    with caplog.at_level(logging.WARNING, logger="ps_server.security"):
        check_bind(ServerConfig(auth_token=WORKER, reader_token="short"))
    assert any("reader_token has only 5 characters" in r.getMessage() for r in caplog.records)


def test_the_security_summary_says_what_the_read_only_rpcs_need():
    text = describe(ServerConfig(auth_token=WORKER, admin_token=ADMIN, reader_token=READER))
    assert ("ps.v1.ParameterServer needs the worker role (its read-only rpcs GetClusterInfo, Pull, PullRows, "
            "ReadState need the reader role)") in text
    assert READER not in text
    assert "read-only" not in describe(ServerConfig())   # all open: one phrase says it


def load_server(argv: list[str], env: dict[str, str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    jobconfig.add_arguments(parser, scope="server")
    return server_config(jobconfig.load_config(parser.parse_args(argv), scope="server", env=env), env=env)


def test_the_server_reads_the_reader_token_from_its_file_else_from_the_environment(tmp_path):
    (tmp_path / "reader.token").write_text(READER + "\n")
    (tmp_path / "worker.token").write_text(WORKER + "\n")
    base = ["--auth-token-file", str(tmp_path / "worker.token")]
    config = load_server([*base, "--reader-token-file", str(tmp_path / "reader.token")],
                         {READER_TOKEN_ENV: "from-the-environment-0123"})
    assert config.reader_token == READER
    assert READER_TOKEN_ENV == "PS_READER_TOKEN"
    assert load_server(base, {READER_TOKEN_ENV: "from-the-environment-0123"}).reader_token == "from-the-environment-0123"
    assert load_server(base, {}).reader_token is None
