"""Who may reach ps-serve and call what: the bind rule, TLS, and the bearer token -- the shards' rules, for HTTP.

As a shard (docs/security.md):

- TLS with ``--tls-cert`` and ``--tls-key`` (PEM, both or neither); the files are checked
  at start, and a missing file, a file that is not PEM, or a key that is not the
  certificate's ends the start with a line naming the setting and the path.
- Plaintext only on a loopback host, unless ``--insecure`` says so.
- A token (``--auth-token-file``, else ``$PS_AUTH_TOKEN``, the workers' token variable) is
  then needed on every endpoint but the two health checks (``/v2/health/live`` and
  ``/v2/health/ready``, and gRPC's ServerLive and ServerReady), so probes need no
  credential: header ``Authorization: Bearer <token>`` (scheme in any case), compared in
  constant time. A request without it, or with another token, gets 401.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl

from ps_common.access import is_loopback
from ps_common.tls import AUTH_SCHEME, AUTH_TOKEN_ENV, parse_bearer, read_pem, token_from

log = logging.getLogger(__name__)

#: Tokens shorter than this are allowed but logged as weak (the shards' rule).
WEAK_TOKEN_CHARS = 16
#: The header a refused request's answer carries (RFC 6750).
CHALLENGE = f'{AUTH_SCHEME} realm="ps-serve"'


def check_bind(host: str, *, tls: bool, insecure: bool) -> None:
    """ValueError for plaintext on a non-loopback host without `insecure`; a warning with it."""
    if tls or is_loopback(host):
        return
    if not insecure:
        raise ValueError(f"refusing to serve plaintext HTTP on {host}, a non-loopback address: pass --tls-cert and "
                         "--tls-key to serve TLS, or --insecure to accept plaintext on this address")
    log.warning("ps-serve serves PLAINTEXT on %s, a non-loopback address (--insecure): anyone who can reach it can "
                "read the traffic", host)


def server_ssl_context(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ssl.SSLContext:
    """A TLS server context from PEM files; ValueError naming the setting and the file when one is unusable."""
    read_pem(cert, "--tls-cert")
    read_pem(key, "--tls-key")

    def no_password() -> bytes:
        raise ValueError(f"--tls-key {os.fspath(key)!r} is encrypted; give ps-serve an unencrypted key "
                         "(readable by its user only)")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(os.fspath(cert), os.fspath(key), password=no_password)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-key {os.fspath(key)!r} is not the private key of --tls-cert {os.fspath(cert)!r}, "
                         f"or one of them is damaged: {exc}") from exc
    return context


def load_token(path: str | os.PathLike[str] | None) -> str | None:
    """The token from the file, else from $PS_AUTH_TOKEN, else None; ValueError naming an unusable file."""
    token = token_from(path, env_var=AUTH_TOKEN_ENV)
    if token is not None and len(token) < WEAK_TOKEN_CHARS:
        log.warning("the token has only %d characters; use %d or more random ones (openssl rand -hex 32)",
                    len(token), WEAK_TOKEN_CHARS)
    return token


class TokenCheck:
    """Whether a request's ``Authorization`` value holds the token (always true when there is none)."""

    def __init__(self, token: str | None) -> None:
        self._token = None if token is None else token.encode()

    @property
    def required(self) -> bool:
        return self._token is not None

    def allows(self, authorization: str | None) -> bool:
        if self._token is None:
            return True
        if not authorization:
            return False
        presented = parse_bearer(authorization)
        return presented is not None and hmac.compare_digest(presented.encode(), self._token)

    def refusal(self, authorization: str | None) -> str:
        """Why a request was refused, without the secret."""
        if not authorization:
            return "this server needs a token: send the header 'Authorization: Bearer <token>'"
        if parse_bearer(authorization) is None:
            return "the Authorization header must be 'Bearer <token>'"
        return "invalid token"
