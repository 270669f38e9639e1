"""The client's side of a secured wire: TLS channel credentials, bearer-token metadata, token files.

``client_security(ca_path, cert_path, key_path, token)`` gives what ``PSClient`` takes as
``channel_credentials`` and ``call_metadata``: TLS is on when any of the three paths is
given (``cert_path`` and ``key_path`` together add a client certificate, for mutual TLS),
and a token becomes the ``authorization: Bearer <token>`` metadata of every call. The
server's side lives in ``ps_common.access`` (applied to a shard's settings by
``ps_server.security``); docs/security.md describes both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import grpc

#: The metadata key that carries the token (gRPC metadata keys are lower case).
AUTH_METADATA_KEY = "authorization"
#: The scheme before the token in the metadata value: ``Bearer <token>``.
AUTH_SCHEME = "Bearer"
#: Environment variables a command reads a token from when no token file is given.
AUTH_TOKEN_ENV = "PS_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "PS_ADMIN_TOKEN"
READER_TOKEN_ENV = "PS_READER_TOKEN"

Metadata = tuple[tuple[str, str], ...]


def bearer_metadata(token: str | None) -> Metadata:
    """The call metadata that presents `token` (empty when token is None)."""
    if token is None:
        return ()
    return ((AUTH_METADATA_KEY, f"{AUTH_SCHEME} {token}"),)


def parse_bearer(value: str) -> str | None:
    """The token in an ``authorization`` value ``Bearer <token>`` (scheme in any case), else None."""
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != AUTH_SCHEME.lower() or not token:
        return None
    return token


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding whitespace and the final newline dropped).

    Raises ValueError naming the file when it cannot be read or holds no token.
    """
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read token file {os.fspath(path)!r}: {exc}") from exc
    if not token:
        raise ValueError(f"token file {os.fspath(path)!r} is empty")
    if any(not 0x21 <= ord(ch) <= 0x7E for ch in token):
        raise ValueError(f"token file {os.fspath(path)!r}: a token must be printable ASCII without spaces")
    return token


def token_from(path: str | os.PathLike[str] | None = None, *, env_var: str = AUTH_TOKEN_ENV,
               environ: Mapping[str, str] | None = None) -> str | None:
    """A token from a file when `path` is given, else from the environment variable `env_var`, else None.

    Tokens are read from files or the environment, never from flags, so they do not show
    in process listings.
    """
    if path is not None:
        return read_token(path)
    value = (os.environ if environ is None else environ).get(env_var, "").strip()
    return value or None


def read_pem(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of a PEM file; ValueError naming `what` (the setting) and the path when unusable."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {os.fspath(path)!r}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {os.fspath(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def channel_credentials(ca_path: str | os.PathLike[str] | None = None, cert_path: str | os.PathLike[str] | None = None,
                        key_path: str | os.PathLike[str] | None = None) -> grpc.ChannelCredentials:
    """TLS credentials: trust `ca_path` (None: the system's roots), and present cert/key when both are given."""
    if (cert_path is None) != (key_path is None):
        raise ValueError(f"a client certificate needs both cert_path and key_path (got cert_path={cert_path!r}, "
                         f"key_path={key_path!r})")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca_path is None else read_pem(ca_path, "CA certificate (tls_ca)"),
        private_key=None if key_path is None else read_pem(key_path, "client key (tls_key)"),
        certificate_chain=None if cert_path is None else read_pem(cert_path, "client certificate (tls_cert)"))


def client_security(ca_path: str | os.PathLike[str] | None = None, cert_path: str | os.PathLike[str] | None = None,
                    key_path: str | os.PathLike[str] | None = None,
                    token: str | None = None) -> tuple[grpc.ChannelCredentials | None, Metadata]:
    """(channel credentials, call metadata) for PSClient: TLS when any path is given, plaintext (None) otherwise.

    For example: ``creds, metadata = client_security("certs/ca.crt", token=read_token("certs/worker.token"))``,
    then ``PSClient(addresses, channel_credentials=creds, call_metadata=metadata)``.
    """
    creds = None
    if ca_path is not None or cert_path is not None or key_path is not None:
        creds = channel_credentials(ca_path, cert_path, key_path)
    return creds, bearer_metadata(token)
