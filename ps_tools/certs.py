"""The `ps-certs` command: a development CA, server and client certificates and two tokens for a secured job.

    ps-certs [-o DIR] [-s SAN]... [-d DAYS] [-f] [--reader]

It writes into DIR (default ./certs; existing files are refused unless -f):

=============================  ============================================================
``ca.crt``, ``ca.key``         the development CA: ``ca.crt`` goes to shards
                               (--tls-client-ca) and clients (--tls-ca); keep ``ca.key``
                               away from pods (it only signs more certificates)
``server.crt``, ``server.key`` the shards' certificate (--tls-cert, --tls-key), serverAuth,
                               naming localhost, 127.0.0.1, ::1 and every -s
``worker.crt``, ``worker.key`` a client certificate with OU=ps-worker: the worker role under
                               mutual TLS
``admin.crt``, ``admin.key``   a client certificate with OU=ps-admin: the admin role
``worker.token``,              random bearer tokens (--auth-token-file, --admin-token-file)
``admin.token``
=============================  ============================================================

With --reader it also writes ``reader.crt``, ``reader.key`` (a client certificate with
OU=ps-reader: the read-only reader role under mutual TLS) and ``reader.token``
(--reader-token-file), for ps-serve --follow and ps-ctl export.

Keys and tokens are written mode 0600, certificates 0644. EC P-256 keys without a
passphrase, one CA for everything: for development and tests; use your own PKI in
production. It is the installed counterpart of deploy/tls/make-dev-certs.sh (same files,
same names, same roles) and needs no openssl command: the `cryptography` package makes
them. Exit status: 0 written, 1 a file could not be written, 2 a bad option or a file that
exists without -f.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import os
import secrets
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The names every server certificate holds, besides the -s ones.
DEFAULT_SANS = ("DNS:localhost", "IP:127.0.0.1", "IP:::1")
#: Every file written, in order.
FILES = ("ca.crt", "ca.key", "server.crt", "server.key", "worker.crt", "worker.key", "admin.crt", "admin.key",
         "worker.token", "admin.token")
#: The files --reader adds: the read-only reader role's certificate (OU=ps-reader), key and token.
READER_FILES = ("reader.crt", "reader.key", "reader.token")
#: The organization of every subject.
ORGANIZATION = "onnx-ps dev"


class CertsError(Exception):
    """A bad option or an existing file: the message says which and what to do (exit status 2)."""


@dataclass(frozen=True)
class Issued:
    """A key and its certificate."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def parse_san(text: str) -> x509.GeneralName:
    """A subjectAltName in openssl's syntax, DNS:name or IP:address, as a GeneralName (CertsError if neither)."""
    kind, sep, value = text.partition(":")
    kind, value = kind.strip().upper(), value.strip()
    if sep and kind == "DNS" and value:
        return x509.DNSName(value)
    if sep and kind == "IP":
        try:
            return x509.IPAddress(ipaddress.ip_address(value))
        except ValueError:
            raise CertsError(f"invalid -s {text!r}: {value!r} is not an IP address") from None
    raise CertsError(f"invalid -s {text!r}: write DNS:NAME or IP:ADDRESS, e.g. -s DNS:ps-0.ps.default.svc "
                     f"-s 'DNS:*.ps.default.svc.cluster.local' -s IP:10.0.0.5")


def _name(ou: str | None, cn: str) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION)]
    if ou:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou))
    parts.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(parts)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_ca(days: int, now: _dt.datetime) -> Issued:
    """A self-signed CA that signs leaf certificates only (pathlen 0)."""
    key = _new_key()
    name = _name(None, "onnx-ps development CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(key, cert)


def make_leaf(ca: Issued, ou: str, usage: x509.ObjectIdentifier, days: int, now: _dt.datetime,
              sans: Sequence[x509.GeneralName] = ()) -> Issued:
    """A certificate signed by `ca` with OU=`ou` (the role under mutual TLS) and extended key usage `usage`."""
    key = _new_key()
    builder = (x509.CertificateBuilder().subject_name(_name(ou, ou)).issuer_name(ca.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=True,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_files(sans: Sequence[str] = (), days: int = 365, *, reader: bool = False) -> dict[str, bytes]:
    """Every file's bytes, by name (FILES, and READER_FILES when `reader`), for a server certificate naming
    DEFAULT_SANS and `sans`."""
    if days < 1:
        raise CertsError(f"invalid -d {days}: a whole number of days >= 1")
    names = [parse_san(s) for s in (*DEFAULT_SANS, *sans)]
    now = _dt.datetime.now(_dt.timezone.utc)
    ca = make_ca(days, now)
    server = make_leaf(ca, "ps-server", ExtendedKeyUsageOID.SERVER_AUTH, days, now, names)
    worker = make_leaf(ca, "ps-worker", ExtendedKeyUsageOID.CLIENT_AUTH, days, now)
    admin = make_leaf(ca, "ps-admin", ExtendedKeyUsageOID.CLIENT_AUTH, days, now)
    leaves = [("server", server), ("worker", worker), ("admin", admin)]
    if reader:
        leaves.append(("reader", make_leaf(ca, "ps-reader", ExtendedKeyUsageOID.CLIENT_AUTH, days, now)))
    files = {"ca.crt": _pem_cert(ca.cert), "ca.key": _pem_key(ca.key)}
    for role, issued in leaves:
        files[f"{role}.crt"] = _pem_cert(issued.cert)
        files[f"{role}.key"] = _pem_key(issued.key)
    for role in ("worker", "admin", "reader") if reader else ("worker", "admin"):
        files[f"{role}.token"] = (secrets.token_hex(32) + "\n").encode()
    return files


def write_files(directory: Path, files: dict[str, bytes], *, force: bool) -> None:
    """Writes every file into `directory` (created): each to a temporary name, then renamed into place.

    CertsError when a file exists and not `force`, before anything is written; OSError
    when the folder or a file cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if not force:
        existing = [name for name in files if (directory / name).exists()]
        if existing:
            raise CertsError(f"{directory / existing[0]} exists ({len(existing)} of the {len(files)} files do); "
                             f"pass -f to overwrite them, or -o another folder")
    for name, data in files.items():
        mode = 0o644 if name.endswith(".crt") else 0o600
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-certs",
        description="Make a development CA, a server certificate, worker and admin client certificates and two "
                    "bearer tokens for a TLS / mutual-TLS job (docs/security.md). For development and tests; use "
                    "your own PKI in production.",
        epilog="example: ps-certs -o certs -s DNS:onnx-ps-shard-0.onnx-ps-shard -s "
               "'DNS:*.onnx-ps-shard.default.svc.cluster.local'")
    p.add_argument("-o", "--out", default="certs", metavar="DIR", help="where to write the files (default: ./certs)")
    p.add_argument("-s", "--san", action="append", default=[], metavar="SAN",
                   help="another name of the server certificate, DNS:NAME or IP:ADDRESS, repeatable (always: "
                        + ", ".join(DEFAULT_SANS) + ")")
    p.add_argument("-d", "--days", type=int, default=365, help="validity of every certificate in days (default: 365)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite files that exist (default: refuse)")
    p.add_argument("--reader", action="store_true",
                   help="also write reader.crt, reader.key (OU=ps-reader) and reader.token: the read-only reader role")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        files = make_files(args.san, args.days, reader=args.reader)
        write_files(out, files, force=args.force)
    except CertsError as exc:
        print(f"ps-certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ps-certs: cannot write to {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    names = ", ".join((*DEFAULT_SANS, *args.san))
    print(f"ps-certs: wrote {' '.join(files)} to {out} (server names: {names}; valid {args.days} days)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
