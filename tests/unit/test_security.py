"""Security without sockets: config checks, roles and tokens, the bind rule, client helpers, Shard.reset."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np
import pytest

from ps_common.codec import MAX_MESSAGE_BYTES
from ps_common.errors import NotInitializedError, ShuttingDownError
from ps_common.tls import (
    bearer_metadata,
    client_security,
    parse_bearer,
    read_pem,
    read_token,
    token_from,
)
from ps_server.config import ServerConfig
from ps_server.security import (
    AccessPolicy,
    Role,
    certificate_role,
    check_bind,
    describe,
    interceptors,
    is_loopback,
    subject_attributes,
)
from tests.helpers.domain import cluster_info, init_shard, make_shard, pull_values, push

WORKER, ADMIN = "worker-token-0123456789", "admin-token-0123456789"
PUSH = "/ps.v1.ParameterServer/Push"
ADMIN_RPCS = ("/ps.v1.Admin/Checkpoint", "/ps.v1.Admin/Shutdown", "/ps.v1.Admin/ResetParameters")
HEALTH = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def bearer(token: str) -> str:
    return f"Bearer {token}"


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize("settings, message", [
    ({"tls_cert": "server.crt"}, "tls_cert='server.crt' and tls_key=None must be set together"),
    ({"tls_key": "server.key"}, "tls_cert=None and tls_key='server.key' must be set together"),
    ({"tls_client_ca": "ca.crt"}, "Invalid tls_client_ca: 'ca.crt' needs tls_cert and tls_key"),
    ({"tls_cert": " ", "tls_key": "k"}, "Invalid tls_cert: ' '"),
    ({"auth_token": ""}, "Invalid auth_token (0 characters)"),
    ({"admin_token": "has space"}, "Invalid admin_token (9 characters)"),
    ({"auth_token": WORKER, "admin_token": WORKER}, "it equals auth_token"),
    ({"max_receive_message_bytes": MAX_MESSAGE_BYTES - 1},
     f"Invalid max_receive_message_bytes: {MAX_MESSAGE_BYTES - 1}"),
    ({"max_concurrent_rpcs": 0}, "Invalid max_concurrent_rpcs: 0"),
])
def test_bad_security_settings_are_refused_with_a_message_naming_the_setting_and_value(settings, message):
    with pytest.raises(ValueError) as info:
        ServerConfig(**settings)
    assert message in str(info.value)


def test_a_bad_token_is_refused_without_echoing_it():
    with pytest.raises(ValueError) as info:
        ServerConfig(auth_token="sec ret")
    assert "sec ret" not in str(info.value)


def test_tokens_never_show_in_the_config_repr():
    text = repr(ServerConfig(auth_token=WORKER, admin_token=ADMIN))
    assert WORKER not in text and ADMIN not in text


def test_the_default_limits_are_the_protocol_message_size_and_no_explicit_rpc_cap():
    config = ServerConfig()
    assert config.max_receive_message_bytes == MAX_MESSAGE_BYTES
    assert config.max_concurrent_rpcs is None


# ---------------------------------------------------------------------- the bind rule


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("[::]", False), ("", False), ("10.0.0.5", False), ("ps-0.ps.default.svc", False),
])
def test_only_loopback_hosts_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_plaintext_on_a_non_loopback_host_is_refused_unless_insecure_is_asked_for():
    with pytest.raises(ValueError, match=r"refusing to serve plaintext gRPC on 0\.0\.0\.0:7000.*--insecure"):
        check_bind(ServerConfig(host="0.0.0.0", port=7000))


def test_insecure_mode_on_a_non_loopback_host_logs_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="ps_server.security"):
        check_bind(ServerConfig(host="0.0.0.0", insecure=True))
    assert any(r.levelno == logging.WARNING and "PLAINTEXT" in r.getMessage() for r in caplog.records)


def test_plaintext_on_loopback_and_tls_anywhere_need_no_insecure_flag(caplog):
    with caplog.at_level(logging.WARNING, logger="ps_server.security"):
        check_bind(ServerConfig(host="127.0.0.1"))
        check_bind(ServerConfig(host="0.0.0.0", tls_cert="server.crt", tls_key="server.key"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_short_token_is_logged_as_weak(caplog):
    with caplog.at_level(logging.WARNING, logger="ps_server.security"):
        check_bind(ServerConfig(auth_token="short"))
    assert any("auth_token has only 5 characters" in r.getMessage() for r in caplog.records)


def test_the_security_summary_names_the_transport_and_roles_but_no_secret():
    text = describe(ServerConfig(tls_cert="c", tls_key="k", tls_client_ca="ca", auth_token=WORKER, admin_token=ADMIN))
    assert text.startswith("mutual TLS;")
    assert "ps.v1.ParameterServer needs the worker role" in text and "ps.v1.Admin needs the admin role" in text
    assert WORKER not in text and ADMIN not in text


def test_no_interceptor_is_installed_when_nothing_is_checked():
    assert interceptors(ServerConfig()) == []
    assert len(interceptors(ServerConfig(auth_token=WORKER))) == 1


# ---------------------------------------------------------------------- roles


def test_a_call_without_a_token_is_unauthenticated_when_a_worker_token_is_set():
    verdict = AccessPolicy(WORKER, ADMIN).decide(PUSH, None)
    assert not verdict.allowed and verdict.code == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <token>" in verdict.message


def test_a_wrong_token_is_unauthenticated_on_every_protected_rpc():
    policy = AccessPolicy(WORKER, ADMIN)
    for method in (PUSH, *ADMIN_RPCS):
        verdict = policy.decide(method, bearer("not-the-token"))
        assert (verdict.allowed, verdict.code) == (False, grpc.StatusCode.UNAUTHENTICATED), method


def test_an_authorization_value_that_is_not_bearer_is_unauthenticated():
    verdict = AccessPolicy(WORKER).decide(PUSH, f"Basic {WORKER}")
    assert verdict.code == grpc.StatusCode.UNAUTHENTICATED and "'Bearer <token>'" in verdict.message


def test_the_worker_token_may_call_the_parameter_server_but_not_admin():
    policy = AccessPolicy(WORKER, ADMIN)
    assert policy.decide(PUSH, bearer(WORKER)).allowed
    for method in ADMIN_RPCS:
        verdict = policy.decide(method, bearer(WORKER))
        assert (verdict.allowed, verdict.code) == (False, grpc.StatusCode.PERMISSION_DENIED), method
        assert "the admin token" in verdict.message


def test_the_admin_token_may_call_everything():
    policy = AccessPolicy(WORKER, ADMIN)
    assert all(policy.decide(m, bearer(ADMIN)).allowed for m in (PUSH, *ADMIN_RPCS))


def test_the_bearer_scheme_is_case_insensitive():
    assert AccessPolicy(WORKER).decide(PUSH, f"bearer {WORKER}").allowed


def test_health_and_reflection_need_no_token():
    policy = AccessPolicy(WORKER, ADMIN, mutual_tls=True)
    assert policy.decide(HEALTH, None).allowed
    assert policy.decide(REFLECTION, None).allowed
    assert policy.decide(HEALTH, bearer("wrong")).allowed   # a probe's stray header is not checked


def test_a_server_without_tokens_or_mtls_lets_every_call_through():
    policy = AccessPolicy()
    assert policy.open
    assert all(policy.decide(m, None).allowed for m in (PUSH, *ADMIN_RPCS))
    assert policy.decide(PUSH, bearer("anything")).allowed   # tokens are ignored when none is configured


def test_an_admin_token_alone_protects_admin_only():
    policy = AccessPolicy(admin_token=ADMIN)
    assert policy.decide(PUSH, None).allowed
    assert policy.decide(ADMIN_RPCS[0], None).code == grpc.StatusCode.UNAUTHENTICATED
    assert policy.decide(ADMIN_RPCS[0], bearer(ADMIN)).allowed


def test_a_worker_token_alone_lets_workers_call_admin():
    policy = AccessPolicy(worker_token=WORKER)
    assert policy.decide(ADMIN_RPCS[0], bearer(WORKER)).allowed
    assert policy.decide(ADMIN_RPCS[0], None).code == grpc.StatusCode.UNAUTHENTICATED


def test_under_mutual_tls_a_call_without_enough_token_role_is_decided_by_its_certificate():
    policy = AccessPolicy(WORKER, ADMIN, mutual_tls=True)
    for method, header in ((PUSH, None), (ADMIN_RPCS[0], None), (ADMIN_RPCS[0], bearer(WORKER))):
        verdict = policy.decide(method, header)
        assert not verdict.allowed and verdict.check_certificate, (method, header)
    assert policy.decide(ADMIN_RPCS[0], bearer(WORKER)).token_role == Role.WORKER
    assert policy.decide(ADMIN_RPCS[0], bearer("wrong")).code == grpc.StatusCode.UNAUTHENTICATED


def test_mutual_tls_restricts_admin_to_the_admin_role_even_without_tokens():
    policy = AccessPolicy(mutual_tls=True)
    assert policy.needed(ADMIN_RPCS[0]) == Role.ADMIN
    # Every verified certificate is at least a reader (OU=ps-reader), so writes need the worker role.
    assert policy.needed(PUSH) == Role.WORKER


def test_a_client_certificate_with_ou_ps_admin_is_an_admin_and_any_other_a_worker():
    admin = {"x509_subject": [b"CN=ops,OU=ps-admin,O=onnx-ps dev"], "x509_common_name": [b"ops"]}
    worker = {"x509_subject": [b"CN=ps-admin,OU=ps-worker,O=onnx-ps dev"], "x509_common_name": [b"ps-admin"]}
    assert certificate_role(admin) == Role.ADMIN
    assert certificate_role(worker) == Role.WORKER   # the CN is a name, not a role
    assert certificate_role({"transport_security_type": [b"ssl"]}) == Role.NONE


def test_subject_parsing_honours_escaped_commas_and_multi_valued_rdns():
    assert subject_attributes(r"CN=a\,OU=ps-admin,O=x", "OU") == []
    assert subject_attributes("CN=a+OU=ps-admin,O=x", "ou") == ["ps-admin"]
    assert subject_attributes("OU=one,OU=two", "OU") == ["one", "two"]


# ---------------------------------------------------------------------- client helpers


def test_a_token_travels_as_bearer_authorization_metadata():
    assert bearer_metadata("t0k") == (("authorization", "Bearer t0k"),)
    assert bearer_metadata(None) == ()
    assert parse_bearer("Bearer  t0k ") == "t0k"
    assert parse_bearer("Bearer") is None and parse_bearer("Token t0k") is None


def test_a_token_file_is_read_without_its_newline_and_an_empty_one_is_refused(tmp_path):
    good, empty = tmp_path / "worker.token", tmp_path / "empty.token"
    good.write_text("abc123\n")
    empty.write_text("\n")
    assert read_token(good) == "abc123"
    with pytest.raises(ValueError, match="empty.token' is empty"):
        read_token(empty)
    with pytest.raises(ValueError, match="cannot read token file .*missing.token"):
        read_token(tmp_path / "missing.token")


def test_a_token_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "t"
    path.write_text("from-file")
    env = {"PS_AUTH_TOKEN": "from-env"}
    assert token_from(path, environ=env) == "from-file"
    assert token_from(None, environ=env) == "from-env"
    assert token_from(None, environ={}) is None


def test_client_security_without_paths_is_plaintext_with_the_token_metadata():
    creds, metadata = client_security(token="t0k")
    assert creds is None and metadata == (("authorization", "Bearer t0k"),)


def test_client_security_with_a_ca_gives_tls_credentials(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    creds, metadata = client_security(ca)
    assert isinstance(creds, grpc.ChannelCredentials) and metadata == ()


def test_a_client_certificate_without_its_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs both cert_path and key_path"):
        client_security(cert_path=tmp_path / "worker.crt")


def test_a_file_that_is_not_pem_is_refused_naming_the_setting(tmp_path):
    path = tmp_path / "server.crt"
    path.write_bytes(b"\x30\x82 DER bytes")
    with pytest.raises(ValueError, match=r"tls_cert .*server.crt' is not a PEM file"):
        read_pem(path, "tls_cert")
    with pytest.raises(ValueError, match=r"cannot read tls_key .*nope.key"):
        read_pem(tmp_path / "nope.key", "tls_key")


# ---------------------------------------------------------------------- Admin.ResetParameters in the domain


MODEL = {"w": np.arange(6, dtype=np.float32)}
GRADS = {"w": np.ones(6, dtype=np.float32)}


def test_reset_drops_parameters_step_and_workers_and_returns_the_step_before():
    shard = make_shard()
    init_shard(shard, MODEL)
    shard.register("w0")
    push(shard, "w0", 0, 0, GRADS)
    assert shard.step == 1
    assert shard.reset() == 1
    assert (shard.step, shard.store.initialized, shard.membership.workers) == (0, False, {})
    with pytest.raises(NotInitializedError):
        push(shard, "w0", 1, 0, GRADS)
    # a different parameter list is accepted after the reset
    init_shard(shard, {"v": np.zeros(2, np.float32)})
    assert [p.name for p in cluster_info(shard).parameters] == ["v"]


def test_reset_clears_the_sync_step_in_progress():
    shard = make_shard("sync", replicas_to_aggregate=2, total_replicas=2)
    init_shard(shard, MODEL)
    for w in ("w0", "w1"):
        shard.register(w)
    push(shard, "w0", 0, 0, GRADS)
    assert shard.policy.contributors == ["w0"]
    shard.reset()
    assert shard.policy.contributors == [] and shard.policy.accumulator == {}


def test_a_pull_waiting_during_a_reset_fails_as_unavailable():
    shard = make_shard()
    init_shard(shard, MODEL)
    errors: list[BaseException] = []

    def pull():
        try:
            pull_values(shard, ["w"], min_step=5, worker_id="", clock=0, timeout=10)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=pull)
    thread.start()
    time.sleep(0.2)   # the pull is waiting for step 5
    shard.reset()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ShuttingDownError)
    assert "were reset" in str(errors[0])
