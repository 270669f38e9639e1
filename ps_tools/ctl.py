"""The `ps-ctl` command: `ps-ctl status ADDRESS[,ADDRESS...]` prints the cluster's shards and workers.

It asks every address for GetClusterInfo concurrently, each call bounded by --timeout,
and prints one table of shards and one of workers (or the same as JSON with --json).
An unreachable address is reported on stderr by name and makes the exit status 1; the
shards that answered are still printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_common.cluster_info import owned_parts_and_bytes

#: Seconds to wait for each shard's answer unless --timeout says otherwise.
DEFAULT_TIMEOUT = 5.0
#: Most GetClusterInfo calls in flight at once.
MAX_PARALLEL_CALLS = 32


@dataclass(frozen=True)
class ShardReply:
    """What one address answered: its ClusterInfo, or the error that stood in the way."""

    address: str
    info: pb.ClusterInfo | None = None
    error: str | None = None


# ---------------------------------------------------------------------- pure helpers

def describe_mode(info: pb.ClusterInfo) -> str:
    """The mode with its settings as one word (awk-friendly), e.g. "sync(N=2,M=3)", "ssp(b=1)", "async"."""
    if info.mode == pb.MODE_SYNC:
        return f"sync(N={info.replicas_to_aggregate},M={info.total_replicas})"
    if info.mode == pb.MODE_SSP:
        return "ssp(b=inf)" if info.staleness < 0 else f"ssp(b={info.staleness})"
    if info.mode == pb.MODE_ASYNC:
        return f"async(max_staleness={info.max_staleness})" if info.max_staleness else "async"
    return pb.ConsistencyMode.Name(info.mode) if info.mode in pb.ConsistencyMode.values() else str(info.mode)


def summarize(replies: Sequence[ShardReply]) -> dict[str, Any]:
    """The cluster as plain data: shards (in the order given), workers (by id) and errors.

    A worker's clock is listed per shard index; it is live when every answering shard
    that knows it holds its lease, and its lease remaining is the smallest of those.
    """
    shards: list[dict[str, Any]] = []
    workers: dict[str, dict[str, Any]] = {}
    errors = [{"address": r.address, "error": r.error} for r in replies if r.info is None]
    for reply in replies:
        info = reply.info
        if info is None:
            continue
        parts, nbytes = owned_parts_and_bytes(info)
        shards.append({
            "index": info.shard_index, "num_shards": info.num_shards, "address": reply.address,
            "mode": describe_mode(info), "step": info.step, "initialized": info.initialized, "parts": parts,
            "bytes": nbytes, "dropped": info.dropped_stale, "optimizer": info.optimizer,
            "live_workers": sum(1 for w in info.workers if w.live),
            **({"effective_replicas": info.effective_replicas} if info.mode == pb.MODE_SYNC else {}),
        })
        for w in info.workers:
            entry = workers.setdefault(w.worker_id, {"id": w.worker_id, "clocks": {}, "live": True,
                                                     "lease_remaining_ms": None})
            entry["clocks"][str(info.shard_index)] = w.clock
            entry["live"] = entry["live"] and w.live
            left = entry["lease_remaining_ms"]
            entry["lease_remaining_ms"] = w.lease_remaining_ms if left is None else min(left, w.lease_remaining_ms)
    return {"shards": shards, "workers": [workers[k] for k in sorted(workers)], "errors": errors}


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes}B" if unit == "B" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def format_table(summary: dict[str, Any]) -> str:
    """The summary as two aligned text tables, SHARDS and WORKERS."""
    shards = summary["shards"]
    lines = ["SHARDS"]
    lines += _table(["index", "address", "mode", "step", "initialized", "parts", "bytes", "dropped", "live"],
                    [[s["index"], s["address"], s["mode"], s["step"], "yes" if s["initialized"] else "no", s["parts"],
                      _size(s["bytes"]), s["dropped"], s["live_workers"]] for s in shards])
    indexes = [str(s["index"]) for s in shards]
    lines += ["", "WORKERS"]
    if summary["workers"]:
        lines += _table(["worker", *(f"clock@{i}" for i in indexes), "live", "lease_left"],
                        [[w["id"], *(w["clocks"].get(i, "-") for i in indexes), "yes" if w["live"] else "no",
                          f"{(w['lease_remaining_ms'] or 0) / 1000:.1f}s"] for w in summary["workers"]])
    else:
        lines.append("(none registered)")
    return "\n".join(lines)


# ---------------------------------------------------------------------- rpc

def fetch(address: str, timeout: float) -> ShardReply:
    """GetClusterInfo from one address, waiting at most timeout s; errors are returned, not raised."""
    try:
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.ParameterServerStub(channel).GetClusterInfo(pb.ClusterInfoRequest(), timeout=timeout)
        return ShardReply(address, info=info)
    except grpc.RpcError as exc:
        what = "unreachable" if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "failed"
        return ShardReply(address, error=f"{what}: {exc.code().name}: {exc.details()}")


def collect(addresses: Sequence[str], timeout: float) -> list[ShardReply]:
    """fetch() on every address concurrently; replies in the order given. Blocks at most about timeout s."""
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL_CALLS, len(addresses)))) as pool:
        return list(pool.map(lambda a: fetch(a, timeout), addresses))


# ---------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-ctl", description="Inspect a running parameter-server job.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="print the shards and workers of a job")
    s.add_argument("addresses", metavar="ADDRESS[,ADDRESS...]",
                   help="shard addresses host:port, comma-separated (one or more arguments)", nargs="+")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds to wait for each shard (default {DEFAULT_TIMEOUT:g})")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when every address answered, 1 when one did not, 2 for bad arguments."""
    args = build_parser().parse_args(argv)
    addresses = [a.strip() for arg in args.addresses for a in arg.split(",") if a.strip()]
    if not addresses:
        print("ps-ctl: no addresses given", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print(f"ps-ctl: Invalid --timeout: {args.timeout} (must be > 0)", file=sys.stderr)
        return 2
    summary = summarize(collect(addresses, args.timeout))
    for error in summary["errors"]:
        print(f"ps-ctl: shard at {error['address']} {error['error']}", file=sys.stderr)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary), flush=True)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
