"""The `ps-health` command: asks a shard's grpc.health.v1 service whether it is SERVING (exit 0) or not (exit 1)."""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.errors import JobConfigError
from ps_common.tf_config import split_address
from ps_common.tls import channel_credentials

#: Where the probe looks when no address is given: $PS_HEALTH_ADDRESS, else the image's default shard port.
DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "PS_HEALTH_ADDRESS"
#: Environment defaults of the TLS options, so an image's HEALTHCHECK can follow a TLS shard without new flags.
TLS_ENV = {"tls_ca": "PS_HEALTH_TLS_CA", "tls_cert": "PS_HEALTH_TLS_CERT", "tls_key": "PS_HEALTH_TLS_KEY",
           "tls_server_name": "PS_HEALTH_TLS_SERVER_NAME"}

#: Seconds to wait for the answer unless --timeout says otherwise.
DEFAULT_TIMEOUT = 3.0

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1   # what Docker's HEALTHCHECK reads as unhealthy
EXIT_USAGE = 2


def open_channel(address: str, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, server_name: str | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one when any TLS file is given (a client certificate for mutual TLS).

    Raises ValueError naming the file when one cannot be read.
    """
    if not (tls_ca or tls_cert or tls_key):
        return grpc.insecure_channel(address)
    credentials = channel_credentials(tls_ca, tls_cert, tls_key)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(address: str, *, service: str = "", timeout: float = DEFAULT_TIMEOUT, tls_ca: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None,
          server_name: str | None = None) -> tuple[bool, str]:
    """One Health.Check call: (serving, what was seen).

    Blocks for at most `timeout` seconds; an rpc error is an answer (not serving), a bad
    setting or unreadable file raises ValueError.
    """
    if timeout <= 0:
        raise ValueError(f"Invalid timeout: {timeout} (must be > 0)")
    with open_channel(address, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, server_name=server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                                  wait_for_ready=True)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            name = code.name if code is not None else "ERROR"
            return False, f"{address} service {service!r}: {name} {details or ''}".rstrip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, f"{address} service {service!r}: {status}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-health",
        description="Exit 0 when the shard at ADDRESS reports SERVING through grpc.health.v1, else 1 "
                    "(for container HEALTHCHECKs and exec probes).")
    p.add_argument("address", nargs="?", default=None,
                   help=f"HOST:PORT of the shard (default ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})")
    p.add_argument("--service", default="", help="health service name; '' is the whole server (default '')")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--tls-ca", metavar="PEM",
                   help=f"CA bundle to verify a TLS shard with; turns TLS on (default ${TLS_ENV['tls_ca']})")
    p.add_argument("--tls-cert", metavar="PEM",
                   help=f"client certificate, for a shard that requires mutual TLS (default ${TLS_ENV['tls_cert']})")
    p.add_argument("--tls-key", metavar="PEM",
                   help=f"the client certificate's private key (default ${TLS_ENV['tls_key']})")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the shard's certificate holds, when ADDRESS is another, e.g. 127.0.0.1 "
                        f"(default ${TLS_ENV['tls_server_name']})")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    address = args.address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS
    try:   # gRPC would wrap a port past 65535 round to another, and report that one SERVING
        split_address(address)
    except JobConfigError as exc:
        print(f"ps-health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for name, env in TLS_ENV.items():
        if getattr(args, name) is None:
            setattr(args, name, os.environ.get(env) or None)
    try:
        serving, seen = check(address, service=args.service, timeout=args.timeout, tls_ca=args.tls_ca,
                              tls_cert=args.tls_cert, tls_key=args.tls_key, server_name=args.tls_server_name)
    except ValueError as exc:
        print(f"ps-health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.quiet:
        print(seen, file=sys.stdout if serving else sys.stderr)
    return EXIT_SERVING if serving else EXIT_NOT_SERVING


if __name__ == "__main__":
    sys.exit(main())
