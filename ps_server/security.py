"""Who may reach a shard and call what, from its ServerConfig: the bind check, TLS credentials, interceptors.

The rules themselves (roles, the access policy, the role-checking interceptor, server
credentials from PEM files) live in ps_common.access, shared with the pipeline's stage
servers; this module applies them to a shard's settings. docs/security.md has the table.
"""

from __future__ import annotations

import logging

import grpc

from ps_common import access
from ps_common.access import (  # noqa: F401 - re-exported: the shard's security names, as before
    ADMIN_OU,
    ADMIN_SERVICE,
    ALLOW,
    OPEN_SERVICES,
    READ_METHODS,
    READER_OU,
    AccessPolicy,
    AuthInterceptor,
    Role,
    Verdict,
    certificate_role,
    is_loopback,
    subject_attributes,
)
from ps_server.config import ServerConfig

log = logging.getLogger(__name__)

#: Tokens shorter than this are allowed but logged as weak.
WEAK_TOKEN_CHARS = 16


def tls_enabled(config: ServerConfig) -> bool:
    return config.tls_cert is not None


def check_bind(config: ServerConfig) -> None:
    """Refuses plaintext on a non-loopback host unless `config.insecure`; logs the shard's security setup.

    Raises ValueError naming the host and the settings that would allow it.
    """
    where = f"{config.host}:{config.port}"
    if not tls_enabled(config) and not is_loopback(config.host):
        if not config.insecure:
            raise ValueError(
                f"refusing to serve plaintext gRPC on {where}, a non-loopback address: set tls_cert and tls_key "
                "(--tls-cert, --tls-key) to serve TLS, or pass --insecure (insecure = true) to accept plaintext "
                "on this address")
        log.warning("shard %d serves PLAINTEXT gRPC on %s, a non-loopback address (insecure mode): anyone who can "
                    "reach it can read the traffic%s", config.shard_index, where,
                    "" if config.auth_token or config.admin_token else " and call every rpc")
    for name in ("auth_token", "admin_token", "reader_token"):
        token = getattr(config, name)
        if token is not None and len(token) < WEAK_TOKEN_CHARS:
            log.warning("shard %d: %s has only %d characters; use %d or more random ones (openssl rand -hex 32)",
                        config.shard_index, name, len(token), WEAK_TOKEN_CHARS)
    log.info("shard %d security: %s", config.shard_index, describe(config))


def describe(config: ServerConfig) -> str:
    """One line: transport and what each service needs (never the secrets)."""
    if config.tls_client_ca:
        transport = "mutual TLS"
    elif tls_enabled(config):
        transport = "TLS"
    else:
        transport = "plaintext" + (" (insecure)" if config.insecure else "")
    policy = AccessPolicy.from_config(config)

    def needs(method: str) -> str:
        role = policy.needed(method)
        return "no credential" if role == Role.NONE else f"the {role.name.lower()} role"

    writes, reads = needs("/ps.v1.ParameterServer/Push"), needs(min(READ_METHODS))
    read_only = ", ".join(sorted(m.rpartition("/")[2] for m in READ_METHODS))
    server = f"ps.v1.ParameterServer needs {writes}"
    if reads != writes:
        server += f" (its read-only rpcs {read_only} need {reads})"
    return (f"{transport}; {server}, ps.v1.Admin needs {needs('/ps.v1.Admin/Shutdown')}; "
            "health checks and reflection need none")


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's PEM files (mutual TLS when tls_client_ca is set); None for plaintext.

    Raises ValueError naming the setting and the file when one cannot be read.
    """
    if not tls_enabled(config):
        return None
    return access.server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)


def interceptors(config: ServerConfig) -> list[grpc.ServerInterceptor]:
    """The security interceptors the config needs: none when nothing is checked."""
    return access.policy_interceptors(AccessPolicy.from_config(config))


def peer_credentials(config: ServerConfig) -> grpc.ChannelCredentials | None:
    """How a replica dials the job's other processes (docs/replication.md): TLS when it serves TLS, trusting
    tls_client_ca (the job's CA) and presenting its own certificate under mutual TLS; plaintext otherwise."""
    if not tls_enabled(config):
        return None
    from ps_common.tls import channel_credentials

    if config.tls_client_ca is None:
        raise ValueError("a replicated shard serving TLS needs tls_client_ca (the job's CA) to verify its peers")
    return channel_credentials(config.tls_client_ca, config.tls_cert, config.tls_key)


def peer_metadata(config: ServerConfig) -> tuple[tuple[str, str], ...]:
    """The worker token, sent to the job's other processes (ps.v1.Replication needs the worker role)."""
    from ps_common.tls import bearer_metadata

    return tuple(bearer_metadata(config.auth_token))

