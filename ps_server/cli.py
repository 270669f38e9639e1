"""The `ps-server` command: runs one shard process until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading

from ps_server.config import MODES, ServerConfig
from ps_server.optimizers import OPTIMIZERS
from ps_server.server import create_server

log = logging.getLogger("ps_server")

#: The line a started shard prints on stdout, for launchers and tests that bind port 0.
READY_PREFIX = "PS_SERVER_READY "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-server", description="Run one parameter-server shard (ps.v1 over gRPC).")
    p.add_argument("--shard-index", type=int, default=0, help="this shard's index, 0-based (default 0)")
    p.add_argument("--num-shards", type=int, default=1, help="shards in the job (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default 0)")
    p.add_argument("--mode", choices=MODES, default="async", help="consistency mode (default async)")
    p.add_argument("--replicas-to-aggregate", type=int, default=1, help="sync: gradients per step, N (default 1)")
    p.add_argument("--total-replicas", type=int, default=None, help="sync: workers in the job, M >= N (default N)")
    p.add_argument("--staleness", type=float, default=0, help="ssp: staleness bound b; 'inf' for none (default 0)")
    p.add_argument("--max-staleness", type=int, default=0, help="async: drop gradients older than this many steps; 0 = never (default 0)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="server-side optimizer (default sgd)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="another optimizer hyperparameter, e.g. --opt momentum=0.9 --opt nesterov=true (repeatable)")
    p.add_argument("--partition-min-bytes", type=int, default=None, help="split tensors larger than this over shards")
    p.add_argument("--lease-seconds", type=float, default=10.0, help="worker lease (default 10)")
    p.add_argument("--wait-timeout", type=float, default=300.0, help="longest pull/barrier wait in seconds (default 300)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def parse_value(text: str):
    """A hyperparameter value from text: bool, int, float, or the string itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    params = {"lr": args.lr}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"Invalid --opt {item!r}: expected KEY=VALUE")
        params[key.strip()] = parse_value(value.strip())
    extra = {}
    if args.partition_min_bytes is not None:
        extra["partition_min_bytes"] = args.partition_min_bytes
    return ServerConfig(
        shard_index=args.shard_index, num_shards=args.num_shards, host=args.host, port=args.port, mode=args.mode,
        replicas_to_aggregate=args.replicas_to_aggregate,
        total_replicas=args.total_replicas if args.total_replicas is not None else args.replicas_to_aggregate,
        staleness=math.inf if args.staleness == math.inf else args.staleness, max_staleness=args.max_staleness,
        optimizer=args.optimizer, optimizer_params=params, lease_seconds=args.lease_seconds,
        wait_timeout_seconds=args.wait_timeout, **extra)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        server, port = create_server(config)
    except (ValueError, OSError) as exc:
        print(f"ps-server: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(READY_PREFIX + json.dumps({"address": server.address, "port": port, "shard_index": config.shard_index}), flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
