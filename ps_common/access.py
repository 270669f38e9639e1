"""Who may call what on a ps.v1 gRPC server: roles, the access policy, the role-checking interceptor, TLS
server credentials.

Shared by every server of the product: a parameter-server shard (ps_server.security builds
these from its ServerConfig) and a pipeline stage worker's StageExchange server
(worker_client.pipeline.exchange), so the two apply the same rules to the same tokens and
certificates. The roles (docs/security.md has the whole table):

- A call's role comes from its token when it presents one (metadata ``authorization:
  Bearer <token>``): the admin token gives ``admin``, the worker token ``worker``, the
  reader token ``reader``, any other token is refused UNAUTHENTICATED. A server with no
  tokens ignores tokens.
- A call without a token, under mutual TLS, takes its role from the client certificate
  the handshake verified: ``admin`` when its subject holds ``OU=ps-admin``, ``reader`` when
  it holds ``OU=ps-reader``, ``worker`` otherwise. Without mutual TLS it has no role.
- The read-only rpcs of ``ps.v1.ParameterServer`` (READ_METHODS: GetClusterInfo, Pull,
  PullRows, ReadState) need ``reader`` (or higher) when a worker token is set or mutual TLS
  is on. Every other rpc of the ps.v1 services but Admin (``ps.v1.ParameterServer``,
  ``ps.v1.StageExchange``) needs ``worker`` (or ``admin``) then. ``ps.v1.Admin`` needs
  ``admin`` when an admin token is set or mutual TLS is on, else ``worker`` when a worker
  token is set. Health checks and reflection need nothing, so probes and grpcurl work
  without credentials.
- A call without the role its rpc needs gets UNAUTHENTICATED when it has no role at all,
  PERMISSION_DENIED when it has one (the worker token calling Admin, a reader calling Push).

The interceptor decides from the metadata alone when it can, so an allowed call runs its
handler unwrapped; only the client-certificate case checks the peer inside the call. A
refused call's request is not parsed.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from ps_common.errors import REASON_KEY, PermissionDeniedError, UnauthenticatedError
from ps_common.tls import AUTH_METADATA_KEY, parse_bearer, read_pem

log = logging.getLogger(__name__)

#: The services every caller may reach: health checks (probes) and reflection (grpcurl, ps-ctl).
OPEN_SERVICES: frozenset[str] = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
#: The operator service; see the role table above.
ADMIN_SERVICE = "ps.v1.Admin"
#: The rpcs that only read a shard's state: the reader role may call them (and nothing else but the
#: open services). Full method names, as gRPC gives them to interceptors.
READ_METHODS: frozenset[str] = frozenset({
    "/ps.v1.ParameterServer/GetClusterInfo",
    "/ps.v1.ParameterServer/Pull",
    "/ps.v1.ParameterServer/PullRows",
    "/ps.v1.ParameterServer/ReadState",
})
#: Under mutual TLS, a client certificate whose subject has this organizational unit is an admin.
ADMIN_OU = "ps-admin"
#: Under mutual TLS, a client certificate whose subject has this organizational unit (and not ADMIN_OU)
#: is a reader: it may call READ_METHODS only.
READER_OU = "ps-reader"
#: The metadata key naming the calling worker, sent with every PSClient call. It proves nothing (the
#: token or certificate does): a shard uses it to give a registered worker's calls slots of their own
#: (ps_server/admission.py), so anonymous callers cannot take them.
WORKER_ID_KEY = "ps-worker-id-bin"   # binary metadata: any UTF-8 id travels as it is


class Role(enum.IntEnum):
    """What a caller may do; a higher role may do everything a lower one may."""

    NONE = 0
    READER = 1   # the read-only rpcs (READ_METHODS)
    WORKER = 2
    ADMIN = 3


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 (brackets allowed); False for names and all-interfaces hosts."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------- TLS


def server_credentials(tls_cert: str | None, tls_key: str | None,
                       tls_client_ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (mutual TLS when tls_client_ca is set); None for plaintext (no tls_cert).

    Raises ValueError naming the setting and the file when one cannot be read, or when the
    key is not the certificate's (gRPC itself would only say "Failed to bind").
    """
    if tls_cert is None:
        return None
    if tls_key is None:
        raise ValueError(f"tls_cert {tls_cert!r} needs tls_key, its private key")
    key = read_pem(tls_key, "tls_key")
    cert = read_pem(tls_cert, "tls_cert")
    client_ca = read_pem(tls_client_ca, "tls_client_ca") if tls_client_ca else None
    _check_pair(tls_cert, tls_key, tls_client_ca)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _check_pair(tls_cert: str, tls_key: str, tls_client_ca: str | None) -> None:
    """ValueError unless the key matches the certificate and the client CA bundle parses (gRPC would only say
    "Failed to bind")."""

    def no_password() -> bytes:
        raise ValueError(f"tls_key {tls_key!r} is encrypted; give the server an unencrypted key "
                         "(readable by its user only)")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls_cert, tls_key, password=no_password)
    except ssl.SSLError as exc:
        raise ValueError(f"tls_key {tls_key!r} is not the private key of tls_cert {tls_cert!r}, "
                         f"or one of them is damaged: {exc}") from exc
    if tls_client_ca:
        try:
            context.load_verify_locations(cafile=tls_client_ca)
        except ssl.SSLError as exc:
            raise ValueError(f"tls_client_ca {tls_client_ca!r} holds no usable CA certificate: {exc}") from exc

# ---------------------------------------------------------------------- roles


def subject_attributes(subject: str, attribute: str) -> list[str]:
    """The values of one attribute (e.g. ``OU``) in an RFC 4514 subject such as ``CN=a,OU=b\\,c,O=d``."""
    values, current, escaped = [], [], False
    rdns: list[str] = []
    for ch in subject:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",+":
            rdns.append("".join(current))
            current = []
        else:
            current.append(ch)
    rdns.append("".join(current))
    for rdn in rdns:
        key, sep, value = rdn.partition("=")
        if sep and key.strip().upper() == attribute.upper():
            values.append(value.strip())
    return values


def certificate_role(auth_context: dict[str, Sequence[bytes]]) -> Role:
    """The role of a verified client certificate: ADMIN for OU=ps-admin, else READER for OU=ps-reader, else
    WORKER; NONE without one."""
    subjects = auth_context.get("x509_subject") or []
    if not subjects and not auth_context.get("x509_common_name") and not auth_context.get("x509_pem_cert"):
        return Role.NONE
    units = [ou for subject in subjects for ou in subject_attributes(subject.decode("utf-8", "replace"), "OU")]
    if ADMIN_OU in units:
        return Role.ADMIN
    if READER_OU in units:
        return Role.READER
    return Role.WORKER


@dataclass(frozen=True)
class Verdict:
    """What to do with a call: allow it, check its client certificate, or refuse it with a status."""

    allowed: bool
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    check_certificate: bool = False
    token_role: Role = Role.NONE


ALLOW = Verdict(True)


@dataclass(frozen=True)
class AccessPolicy:
    """The role each rpc needs and the role each credential gives (pure: unit-testable without sockets)."""

    # The tokens are secrets: kept out of repr(), as in ServerConfig.
    worker_token: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    mutual_tls: bool = False
    #: Gives the reader role; only meaningful beside a worker token or mutual TLS (ServerConfig checks).
    reader_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config) -> "AccessPolicy":
        """The policy of any settings object with ``auth_token``, ``admin_token``, ``tls_client_ca`` (and
        optionally ``reader_token``)."""
        return cls(config.auth_token, config.admin_token, config.tls_client_ca is not None,
                   getattr(config, "reader_token", None))

    @property
    def open(self) -> bool:
        """True when nothing is ever checked (no worker or admin token, no mutual TLS): no interceptor is needed.

        A reader token alone protects nothing (ServerConfig refuses it): reads are open when writes are.
        """
        return self.worker_token is None and self.admin_token is None and not self.mutual_tls

    @property
    def _has_tokens(self) -> bool:
        return self.worker_token is not None or self.admin_token is not None or self.reader_token is not None

    def needed(self, method: str) -> Role:
        """The role a full method name (``/package.Service/Method``) needs."""
        name = method.lstrip("/")
        service = name.partition("/")[0]
        if service in OPEN_SERVICES:
            return Role.NONE
        if service == ADMIN_SERVICE:
            if self.admin_token is not None or self.mutual_tls:
                return Role.ADMIN
            return Role.WORKER if self.worker_token is not None else Role.NONE
        if self.worker_token is None and not self.mutual_tls:
            return Role.NONE
        return Role.READER if "/" + name in READ_METHODS else Role.WORKER

    def token_role(self, token: str) -> Role | None:
        """The role a presented token gives; None when it is none of the tokens (compared in constant time)."""
        given = token.encode()
        found = None
        # Every configured token is compared (no early exit), the highest role first.
        for role, expected in ((Role.ADMIN, self.admin_token), (Role.WORKER, self.worker_token),
                               (Role.READER, self.reader_token)):
            if expected is not None and hmac.compare_digest(given, expected.encode()) and found is None:
                found = role
        return found

    def decide(self, method: str, authorization: str | None) -> Verdict:
        """The verdict for a call from its method and its ``authorization`` metadata (None: absent)."""
        needed = self.needed(method)
        if needed == Role.NONE:
            return ALLOW
        role = Role.NONE
        if authorization is not None and self._has_tokens:
            token = parse_bearer(authorization)
            if token is None:
                return Verdict(False, grpc.StatusCode.UNAUTHENTICATED,
                               f"{method}: the {AUTH_METADATA_KEY!r} metadata must be 'Bearer <token>'")
            found = self.token_role(token)
            if found is None:
                return Verdict(False, grpc.StatusCode.UNAUTHENTICATED, f"{method}: invalid token")
            role = found
        if role >= needed:
            return ALLOW
        if self.mutual_tls:
            return Verdict(False, check_certificate=True, token_role=role)
        return self.refuse(method, needed, role)

    def refuse(self, method: str, needed: Role, role: Role) -> Verdict:
        """The refusal of a call holding `role` for an rpc that needs `needed`."""
        how = self.how_to_get(needed)
        needs = f"{method} needs the {needed.name.lower()} role"
        if role == Role.NONE:
            return Verdict(False, grpc.StatusCode.UNAUTHENTICATED, f"{needs}: {how}")
        return Verdict(False, grpc.StatusCode.PERMISSION_DENIED,
                       f"{needs}, the caller has the {role.name.lower()} role: {how}")

    def how_to_get(self, role: Role) -> str:
        """What a caller must present to hold `role`, for refusal messages."""
        if role == Role.ADMIN:
            tokens = ["the admin token"] if self.admin_token is not None else []
            certificate = f"a client certificate with OU={ADMIN_OU}" if self.mutual_tls else ""
        elif role == Role.WORKER:
            tokens = [f"the {name} token" for name, t in (("worker", self.worker_token), ("admin", self.admin_token))
                      if t is not None]
            certificate = f"a client certificate without OU={READER_OU}" if self.mutual_tls else ""
        else:
            tokens = [f"the {name} token" for name, t in (("reader", self.reader_token), ("worker", self.worker_token),
                                                         ("admin", self.admin_token)) if t is not None]
            certificate = "a client certificate" if self.mutual_tls else ""
        ways = []
        if tokens:
            ways.append(f"send metadata '{AUTH_METADATA_KEY}: Bearer <token>' with {' or '.join(tokens)}")
        if certificate:
            ways.append(f"connect with {certificate}")
        return ", or ".join(ways)


# ---------------------------------------------------------------------- the interceptor


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


def _same_kind(handler: grpc.RpcMethodHandler, behavior: Callable, *, parse: bool = True) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary/stream in and out) as `handler` running `behavior`.

    parse=False passes the request bytes through unparsed (for refusals).
    """
    io = dict(request_deserializer=handler.request_deserializer if parse else None,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **io)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **io)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **io)
    return grpc.unary_unary_rpc_method_handler(behavior, **io)


#: The catalog's error for each refusal status, whose reason the refusal carries (docs/protocol.md).
_REFUSALS = {grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
             grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError}


def _abort(context: grpc.ServicerContext, verdict: Verdict) -> None:
    """Ends a refused call with its status, its message, and the catalog reason in the trailing metadata."""
    context.set_trailing_metadata(((REASON_KEY, _REFUSALS[verdict.code].reason),))
    context.abort(verdict.code, verdict.message)


def _behavior(handler: grpc.RpcMethodHandler) -> Callable:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call's role against its rpc (AccessPolicy); refusals are aborted before the handler runs."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        verdict = self.policy.decide(method, _authorization(handler_call_details.invocation_metadata))
        if verdict.allowed:
            return handler
        if verdict.check_certificate:
            return _same_kind(handler, self._certificate_checked(method, verdict.token_role, _behavior(handler)))
        return _same_kind(handler, self._refusal(method, verdict), parse=False)

    @staticmethod
    def _refusal(method: str, verdict: Verdict) -> Callable:
        def refuse(request, context):
            log.warning("refused %s from %s: %s: %s", method, context.peer(), verdict.code.name, verdict.message)
            _abort(context, verdict)

        return refuse

    def _certificate_checked(self, method: str, token_role: Role, behavior: Callable) -> Callable:
        needed = self.policy.needed(method)

        def checked(request, context):
            role = max(token_role, certificate_role(context.auth_context()))
            if role < needed:
                verdict = self.policy.refuse(method, needed, role)
                log.warning("refused %s from %s: %s: %s", method, context.peer(), verdict.code.name, verdict.message)
                _abort(context, verdict)
            return behavior(request, context)

        return checked


def policy_interceptors(policy: AccessPolicy) -> list[grpc.ServerInterceptor]:
    """The interceptors a policy needs: none when nothing is checked."""
    return [] if policy.open else [AuthInterceptor(policy)]
