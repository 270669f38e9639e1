"""The `ps-ctl` command: `ps-ctl status ADDRESS[,ADDRESS...]` prints the cluster's shards and workers;
`ps-ctl export --model USER.onnx --out PATH --servers ADDRS | --checkpoint-dir DIR` writes the trained
model (ps_tools/export.py; docs/serving.md).

It asks every address for GetClusterInfo concurrently, each call bounded by --timeout,
and prints one table of shards and one of workers (or the same as JSON with --json).
An unreachable address is reported on stderr by name and makes the exit status 1; the
shards that answered are still printed.

It takes the workers' TLS and token settings, so it can ask a secured job: --tls-ca
(turns TLS on), --tls-cert/--tls-key (mutual TLS), --tls-server-name (when the address is
not a name the certificate holds), and a token: --admin-token-file, --auth-token-file or
--reader-token-file (else $PS_ADMIN_TOKEN, else $PS_AUTH_TOKEN, else $PS_READER_TOKEN).
GetClusterInfo and ReadState need only the reader role, which every token gives.
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
from ps_proto.v1 import replication_pb2 as rpb
from ps_proto.v1 import replication_pb2_grpc as rpb_grpc
from ps_common.cluster_info import owned_parts_and_bytes
from ps_common.errors import ExportError, JobConfigError
from ps_common.tf_config import split_address
from ps_common.tls import (ADMIN_TOKEN_ENV, AUTH_TOKEN_ENV, READER_TOKEN_ENV, Metadata, bearer_metadata,
                           channel_credentials, token_from)
from ps_tools.health import open_channel

#: Seconds to wait for each shard's answer unless --timeout says otherwise.
DEFAULT_TIMEOUT = 5.0
#: Most GetClusterInfo calls in flight at once.
MAX_PARALLEL_CALLS = 32


@dataclass(frozen=True)
class Connection:
    """How to reach the shards: TLS files (none: plaintext), the certificate's name, and the call metadata."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    server_name: str | None = None
    metadata: Metadata = ()

    def channel(self, address: str) -> grpc.Channel:
        return open_channel(address, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
                            server_name=self.server_name)


@dataclass(frozen=True)
class ShardReply:
    """What one address answered: its ClusterInfo, or the error that stood in the way."""

    address: str
    info: pb.ClusterInfo | None = None
    error: str | None = None
    replica: rpb.ReplicaStatus | None = None   # a replicated shard's replica (docs/replication.md)


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
    replicas = _replicas(replies)
    for reply in replies:
        info = reply.info
        if info is None or (reply.replica is not None and reply.replica.role != "PRIMARY"):
            continue   # a replicated shard is shown once, by its primary (its replicas: REPLICAS)
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
    return {"shards": shards, "workers": [workers[k] for k in sorted(workers)], "errors": errors,
            **({"replicas": replicas} if replicas else {})}


def _replicas(replies: Sequence[ShardReply]) -> list[dict[str, Any]]:
    """Each replica of a replicated shard: role, epoch, pid, address, and its lag behind its shard's primary in
    operations and steps (0 for the primary; null when no primary answered)."""
    found = [r.replica for r in replies if r.replica is not None]
    primaries = {s.shard: s for s in found if s.role == "PRIMARY"}
    out = []
    for s in sorted(found, key=lambda s: (s.shard, s.replica)):
        primary = primaries.get(s.shard)
        out.append({"shard": s.shard, "replica": s.replica, "role": s.role, "epoch": s.epoch, "pid": s.pid,
                    "address": s.address, "seq": s.seq, "step": s.step, "failovers": s.failovers,
                    "in_sync": s.role == "PRIMARY" or (primary is not None and f"s{s.shard}r{s.replica}" in primary.isr),
                    "lag_ops": None if primary is None or s.role == "WITNESS" else max(0, primary.seq - s.seq),
                    "lag_steps": None if primary is None or s.role == "WITNESS" else max(0, primary.step - s.step)})
    return out


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
    if summary.get("replicas"):
        lines += ["", "REPLICAS"]
        lines += _table(["shard", "replica", "role", "epoch", "pid", "address", "in_sync", "lag_ops", "lag_steps",
                         "failovers"],
                        [["-" if r["shard"] < 0 else r["shard"], r["replica"], r["role"].lower(), r["epoch"], r["pid"],
                          r["address"], "yes" if r["in_sync"] else "no", _or_dash(r["lag_ops"]),
                          _or_dash(r["lag_steps"]), r["failovers"]] for r in summary["replicas"]])
    return "\n".join(lines)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


# ---------------------------------------------------------------------- rpc

#: What to check, by status, when a shard refuses the call.
HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "the shard wants a token: --reader-token-file, --auth-token-file or "
                                     "--admin-token-file (or $PS_READER_TOKEN / $PS_AUTH_TOKEN / $PS_ADMIN_TOKEN)",
    grpc.StatusCode.PERMISSION_DENIED: "the token or certificate lacks the role: use the reader, worker or admin "
                                       "token",
}


def fetch(address: str, timeout: float, connection: Connection | None = None) -> ShardReply:
    """GetClusterInfo from one address, waiting at most timeout s; errors are returned, not raised."""
    connection = connection or Connection()
    try:
        with connection.channel(address) as channel:
            info = pb_grpc.ParameterServerStub(channel).GetClusterInfo(pb.ClusterInfoRequest(), timeout=timeout,
                                                                       metadata=connection.metadata)
            try:   # a replicated shard's replica says its role (an unreplicated shard has no such service)
                replica = rpb_grpc.ReplicationStub(channel).Status(rpb.ReplicaStatusRequest(), timeout=timeout,
                                                                   metadata=connection.metadata)
            except grpc.RpcError:
                replica = None
        return ShardReply(address, info=info, replica=replica)
    except grpc.RpcError as exc:
        what = "unreachable" if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "failed"
        hint = HINTS.get(exc.code())
        if hint is None and exc.code() == grpc.StatusCode.UNAVAILABLE and connection.tls_ca is None:
            hint = "if the shard serves TLS, give --tls-ca (and --tls-cert/--tls-key under mutual TLS)"
        return ShardReply(address, error=f"{what}: {exc.code().name}: {exc.details()}" + (f" ({hint})" if hint else ""))


def collect(addresses: Sequence[str], timeout: float, connection: Connection | None = None) -> list[ShardReply]:
    """fetch() on every address concurrently; replies in the order given. Blocks at most about timeout s."""
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL_CALLS, len(addresses)))) as pool:
        return list(pool.map(lambda a: fetch(a, timeout, connection), addresses))


# ---------------------------------------------------------------------- command line

def _add_security(p: argparse.ArgumentParser) -> None:
    tls = p.add_argument_group("a secured job (docs/security.md): the workers' settings")
    tls.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA bundle (the shards' issuer)")
    tls.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (with --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", help="the private key of the client certificate")
    tls.add_argument("--tls-server-name", metavar="NAME",
                     help="the name the shards' certificate holds, when an ADDRESS is another (e.g. an IP)")
    tls.add_argument("--auth-token-file", metavar="FILE",
                     help=f"file holding the worker token (default ${AUTH_TOKEN_ENV})")
    tls.add_argument("--admin-token-file", metavar="FILE",
                     help=f"file holding the admin token, sent instead of the worker token (default "
                          f"${ADMIN_TOKEN_ENV})")
    tls.add_argument("--reader-token-file", metavar="FILE",
                     help=f"file holding the read-only reader token (default ${READER_TOKEN_ENV})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-ctl", description="Inspect a running parameter-server job; export its "
                                                           "trained model.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="print the shards and workers of a job")
    s.add_argument("addresses", metavar="ADDRESS[,ADDRESS...]",
                   help="shard addresses host:port, comma-separated (one or more arguments); a replicated shard's "
                        "replicas joined by '|'", nargs="+")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds to wait for each shard (default {DEFAULT_TIMEOUT:g})")
    _add_security(s)
    e = sub.add_parser("export", help="write the trained model: the given ONNX model with the job's values",
                       description="Writes the model the job trained: MODEL with every trained initializer and "
                                   "running statistic replaced, from the live shards (--servers, at one step) or "
                                   "from their checkpoint folders (--checkpoint-dir, no shard running). Prints one "
                                   "JSON line; exit 2 with one line on stderr when it cannot.")
    e.add_argument("--model", required=True, metavar="USER.onnx", help="the model the job was given")
    e.add_argument("--out", required=True, metavar="PATH", help="where to write the trained model (.onnx)")
    source = e.add_mutually_exclusive_group(required=True)
    source.add_argument("--servers", metavar="ADDRESS[,ADDRESS...]",
                        help="the job's shard addresses, in shard order (the reader role suffices)")
    source.add_argument("--checkpoint-dir", metavar="DIR", action="append",
                        help="a shard's checkpoint folder, once per shard (or the one folder holding "
                             "shard0, shard1, ... as ps-launch --checkpoint-dir writes them)")
    e.add_argument("--step", type=int, metavar="N",
                   help="export this step (default: the newest one every shard holds)")
    e.add_argument("--external-data", action="store_true",
                   help="keep the tensors in a data file beside the model (default: only above 1 GiB)")
    e.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to reach the shards and read them at one step (default 60)")
    _add_security(e)
    return p


def connection_from(args: argparse.Namespace) -> Connection:
    """The Connection the flags (and the token variables) describe; ValueError naming an unreadable file."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError(f"a client certificate needs both --tls-cert and --tls-key (got --tls-cert "
                         f"{args.tls_cert!r}, --tls-key {args.tls_key!r})")
    if args.admin_token_file is not None:
        token = token_from(args.admin_token_file)
    elif args.auth_token_file is not None:
        token = token_from(args.auth_token_file)
    elif args.reader_token_file is not None:
        token = token_from(args.reader_token_file)
    else:
        token = (token_from(env_var=ADMIN_TOKEN_ENV) or token_from(env_var=AUTH_TOKEN_ENV)
                 or token_from(env_var=READER_TOKEN_ENV))
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"cannot read {flag} {path!r}: {exc.strerror or exc}") from None
    return Connection(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name, bearer_metadata(token))


def export_main(args: argparse.Namespace) -> int:
    """ps-ctl export: 0 and one JSON line when the model is written; 2 and one line on stderr when it cannot be."""
    from ps_tools import export

    try:
        connection = connection_from(args)
        if args.timeout <= 0:
            raise ExportError(f"Invalid --timeout: {args.timeout} (must be > 0)")
        if args.servers is not None:
            addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
            if not addresses:
                raise ExportError("--servers names no address")
            for address in addresses:
                try:
                    split_address(address.split("|")[0])
                except JobConfigError as exc:
                    raise ExportError(f"--servers: {exc}") from None
            credentials = (channel_credentials(connection.tls_ca, connection.tls_cert, connection.tls_key)
                           if connection.tls_ca or connection.tls_cert else None)
            state = export.read_servers(addresses, channel_credentials=credentials,
                                        call_metadata=connection.metadata, server_name=connection.server_name,
                                        step=args.step, timeout=args.timeout)
        else:
            state = export.read_checkpoints(args.checkpoint_dir, step=args.step)
        path = export.export(args.model, state, args.out, external_data=True if args.external_data else None)
    except (ExportError, ValueError) as exc:
        print(f"ps-ctl export: {exc}", file=sys.stderr)
        return 2
    files = [path, *path.parent.glob(f"{path.name}.*.data")]
    print(json.dumps({"exported": str(path), "model": args.model, "step": state.step, "shard_steps": state.steps,
                      "mode": state.mode, "source": state.source, "bytes": sum(f.stat().st_size for f in files),
                      "dynamic_tables": {n: len(ids) for n, (ids, _) in state.dynamic.items()}}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when every address answered, 1 when one did not, 2 for bad arguments."""
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return export_main(args)
    # a replicated shard's replicas are joined by '|' (as workers take them): each is asked
    addresses = [a.strip() for arg in args.addresses for group in arg.split(",") for a in group.split("|")
                 if a.strip()]
    if not addresses:
        print("ps-ctl: no addresses given", file=sys.stderr)
        return 2
    try:   # gRPC would wrap a port past 65535 round to another (99999 reached 34463)
        for address in addresses:
            split_address(address)
    except JobConfigError as exc:
        print(f"ps-ctl: {exc}", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print(f"ps-ctl: Invalid --timeout: {args.timeout} (must be > 0)", file=sys.stderr)
        return 2
    try:
        connection = connection_from(args)
    except ValueError as exc:
        print(f"ps-ctl: {exc}", file=sys.stderr)
        return 2
    try:
        replies = collect(addresses, args.timeout, connection)
    except ValueError as exc:   # a TLS file that is not PEM (ps_common.tls.read_pem)
        print(f"ps-ctl: {exc}", file=sys.stderr)
        return 2
    summary = summarize(replies)
    for error in summary["errors"]:
        print(f"ps-ctl: shard at {error['address']} {error['error']}", file=sys.stderr)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary), flush=True)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
