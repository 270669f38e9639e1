"""The `ps-serve` command: serves one ONNX model over the Open Inference Protocol until SIGTERM or Ctrl-C.

    ps-serve --model PATH [--name NAME] [--host 127.0.0.1] [--port 0] [--threads 1]
             [--tls-cert PEM --tls-key PEM] [--auth-token-file FILE] [--insecure] [--grpc-port N]
             [--follow ADDRESS[,ADDRESS...] [--follow-interval S] [--follow-token-file FILE] ...]

Once it listens it prints one line on stdout, ``PS_SERVE_READY {json}`` (``http``:
HOST:PORT, ``url``, ``model``, ``version``, ``step``, ``tls``, ``token``, and ``grpc`` when
served), which `ps_common.process.ChildProcess(..., ready_prefix="PS_SERVE_READY")` reads.
A bad argument -- a missing model file, a model onnxruntime cannot load, a port in use, TLS
files that cannot be read, a job to follow that cannot be read or does not match the model --
ends it with one line naming the thing, and exit status 2. With --follow the served weights
follow a running job's shards (ps_serve/follow.py). docs/serving.md describes the endpoints,
security, metrics and following.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from prometheus_client import disable_created_metrics

from ps_common.errors import JobConfigError
from ps_common.logs import configure_logging
from ps_common.tf_config import split_address
from ps_common.tls import AUTH_TOKEN_ENV, READER_TOKEN_ENV, client_security, token_from
from ps_serve.follow import Follower, FollowError
from ps_serve.metrics import FollowCollector
from ps_serve.model import ModelState, ServedModel
from ps_serve.security import load_token
from ps_serve.server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_WORKERS, InferenceServer, ServeConfig

log = logging.getLogger("ps_serve")

#: The line a started ps-serve prints on stdout, for launchers and tests that bind port 0.
READY_PREFIX = "PS_SERVE_READY "
#: The longest wait for worker threads still running a model when the server has stopped, in seconds.
EXIT_WAIT_SECONDS = 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-serve", description="Serve an ONNX model over the Open Inference Protocol (KServe v2): HTTP/REST, "
                                     "and gRPC with --grpc-port. See docs/serving.md.")
    p.add_argument("--model", required=True, metavar="PATH", help="the ONNX file to serve")
    p.add_argument("--name", help="the model's name in the protocol's paths (default: the file's stem)")
    p.add_argument("--step", type=int, help="the training step the model holds, reported with every answer and as "
                                            "the ps_serve_step metric (default: not reported)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; a non-loopback "
                                                       "address needs TLS or --insecure)")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free port, printed on the READY "
                                                       "line)")
    p.add_argument("--grpc-port", type=int, help="also serve the protocol's gRPC service on this port (0: a free one)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per inference (default 1)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                   help=f"inferences run at once (default {DEFAULT_WORKERS})")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (needs --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help="require 'Authorization: Bearer <token>' with the token in FILE on every endpoint but the "
                        "health checks (default: $PS_AUTH_TOKEN when set, else no token)")
    p.add_argument("--insecure", action="store_true", help="allow plaintext on a non-loopback --host")
    f = p.add_argument_group("following a running job (docs/serving.md)")
    f.add_argument("--follow", metavar="ADDRESS[,ADDRESS...]",
                   help="keep the weights fresh from the job whose shards are here (in shard order): only what "
                        "changed is read, each new step swapped in whole")
    f.add_argument("--follow-interval", type=float, default=0.25, metavar="SECONDS",
                   help="at least this long between two swaps (default 0.25)")
    f.add_argument("--follow-token-file", metavar="FILE",
                   help=f"the token to present to the shards; the reader token suffices (default ${READER_TOKEN_ENV}, "
                        f"else ${AUTH_TOKEN_ENV})")
    f.add_argument("--follow-tls-ca", metavar="PEM", help="the shards serve TLS: trust this CA bundle")
    f.add_argument("--follow-tls-cert", metavar="PEM", help="client certificate for the shards' mutual TLS")
    f.add_argument("--follow-tls-key", metavar="PEM", help="the private key of --follow-tls-cert")
    f.add_argument("--follow-tls-server-name", metavar="NAME", help="the name the shards' certificate holds")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    disable_created_metrics()   # this process's own registry: no *_created series beside every counter
    try:
        configure_logging(args.log_level, args.log_json)
    except ValueError as exc:
        print(f"ps-serve: --log-level: {exc}", file=sys.stderr)
        return 2
    try:
        server = _server(args)
        follower = _follower(args, server)
    except ValueError as exc:   # FollowError and ModelLoadError are ValueErrors
        print(f"ps-serve: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(server))
    except OSError as exc:   # a port in use: before the READY line, nothing is served
        print(f"ps-serve: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        if follower is not None:
            follower.stop()
        _wait_for_workers()


def _server(args: argparse.Namespace) -> InferenceServer:
    """The server from the arguments; ValueError naming the one that cannot be used (ModelLoadError is one)."""
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step must be 0 or more, got {args.step}")
    name = args.name if args.name is not None else Path(args.model).stem
    if args.step is None:
        args.step = exported_step(args.model)
    config = ServeConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, workers=args.workers,
                         max_request_bytes=args.max_request_bytes, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         token=load_token(args.auth_token_file), insecure=args.insecure)
    state = ModelState.load(args.model, threads=args.threads, step=args.step)
    return InferenceServer(ServedModel(name, state), config)


def exported_step(path: str) -> int | None:
    """The step an exported model holds (its onnx_ps.step metadata), None for any other model or file."""
    import onnx

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 -- the model's own load reports an unreadable file, by name
        return None
    value = next((p.value for p in model.metadata_props if p.key == "onnx_ps.step"), None)
    return int(value) if value is not None and value.isdigit() else None


def _follower(args: argparse.Namespace, server: InferenceServer) -> Follower | None:
    """With --follow: the follower, started (the job read whole and its step served); FollowError when it cannot."""
    if args.follow is None:
        return None
    from worker_client.engine.load import read_model

    addresses = [a.strip() for a in args.follow.split(",") if a.strip()]
    if not addresses:
        raise FollowError("--follow names no shard address")
    for address in addresses:   # a bad one was retried for 30 s; a port past 65535 reached another port
        for replica in address.split("|"):
            try:
                split_address(replica)
            except JobConfigError as exc:
                raise FollowError(f"--follow: {exc}") from None
    if (args.follow_tls_cert is None) != (args.follow_tls_key is None):
        raise FollowError("--follow-tls-cert and --follow-tls-key go together: give both or neither")
    token = token_from(args.follow_token_file) if args.follow_token_file else (
        token_from(env_var=READER_TOKEN_ENV) or token_from(env_var=AUTH_TOKEN_ENV))
    credentials, metadata = client_security(args.follow_tls_ca, args.follow_tls_cert, args.follow_tls_key, token)
    follower = Follower(server.served, read_model(args.model), addresses, channel_credentials=credentials,
                        call_metadata=metadata, server_name=args.follow_tls_server_name,
                        interval=args.follow_interval, threads=args.threads)
    follower.start()
    server.metrics.registry.register(FollowCollector(server.served.name, follower))
    log.info("following the job at %s: serving step %s", ",".join(addresses), server.served.current().step)
    return follower


async def _serve(server: InferenceServer) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    ready = await server.start()
    print(READY_PREFIX + json.dumps(ready), flush=True)
    await stop.wait()
    await server.stop()
    log.info("stopped")
    return 0


def _wait_for_workers() -> None:
    """Ends the process promptly even when a model run is still going: its thread cannot be interrupted."""
    busy = [t for t in threading.enumerate() if t.name.startswith("ps-serve") and t.is_alive()]
    for thread in busy:
        thread.join(EXIT_WAIT_SECONDS / max(1, len(busy)))
    if any(t.is_alive() for t in busy):
        log.warning("a model run is still going after the server stopped; exiting without waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
