"""Push-then-pull throughput of one float32 tensor (1, 16, 100 MB): onnx-ps against PyTorch RPC.

One shard process (`python -P -m ps_server`, async, SGD with lr 1e-9) and one client
(`PSClient`, in this process) alternate a push of a gradient and a pull of the tensor, so
every push is really applied and every pull must encode a new version (no cache serves
an unchanged one). Beside it, the same in PyTorch RPC at its best (`ps_bench.torch_rpc`): a
PS process holding the tensor and a client process driven over stdin, in each variant and
transport of `--torch-variants` (default: two-call/tcp, fused/tcp, fused/shm): ``two-call``
is an ``rpc_sync`` push that adds -lr x the gradient in place, then an ``rpc_sync`` pull that
returns it; ``fused`` is one rpc doing both (our PushPull's shape); ``tcp`` restricts
TensorPipe to its TCP transport (as between hosts), ``shm`` leaves it its defaults (shared
memory on one host). Each timed repeat is `--rounds` push+pull pairs after one untimed pair,
the systems in a rotated order each repeat.

GB/s = (bytes pushed + bytes pulled) / seconds = 2 x size x rounds / seconds. Prints one
JSON line per system and size, ``{"system", "metric": "pushpull_gbps", "size_mb", "value",
"unit", "runs"}`` (the median over repeats; a PyTorch RPC line says its "variant" and
"transport"), and per path of ours a ratio line ``{"system": "onnx-ps/torch-rpc", "metric":
"pushpull_ratio", "data_path", "against", "scope", ...}``: the median of the repeats' ratios,
ours over the fastest PyTorch RPC variant of the path's scope (above 1: we are faster). The
one-host path (push-pull, the defaults on one host) meets every variant; the wire paths
(channel, grpc, streams) only those over TCP, as ps_bench.peers rules for train_bench.
Without torch here it runs our side only and says so on stderr.

`--data-path` picks how our bytes travel, several comma-separated side by side (each with a
shard of its own, each repeat running them and torch in a rotated order; one line per path,
told apart by its "data_path" field): push-pull (the training loop's defaults on one host: shared
memory, the call's header over the data channel), channel (PushPull through the data channel, shared memory off: the bytes cross a TCP
connection as between hosts), grpc (PushPull with gRPC bytes only; past 256 KiB that is Push
then Pull streams), streams (Push then Pull). `--data-path channel,grpc` is our wire path next to
gRPC's "across the wire" on one host. `--raw-tcp` adds a reference with no framework at all: a
child process that receives the pushed bytes into a buffer and sends the tensor back over a
plain TCP socket (sendmsg and recv_into on numpy buffers), system "raw-tcp".

`--netns` (root, iproute2) measures across a network instead of loopback: `ps_bench.netns` builds two
hosts on a switch, each link shaped to `--netns-rate` both ways (10 Gbit/s by default); the servers (our
shard, the PyTorch RPC store, the raw echo) run on host 0 and the benchmark itself -- our client, the
PyTorch RPC client -- is started again on host 1 (`--inside`, given by the first process: the server
host's namespace, address and card, the client's card). Only the wire paths (channel, grpc, streams) and
TCP transports run there; every line says ``"network": "netns veth tbf RATE"`` (``"loopback"`` without).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ps_bench import harness, netns, peers
from ps_common import data_channel as dc
from ps_bench.harness import TORCH, Proc, log
from worker_client.client import PSClient

COLS = 256
LR = 1e-9
#: Ours, by how the bytes travel (module docstring).
DATA_PATHS = ("push-pull", "channel", "grpc", "streams")
#: The scope of each path (ps_bench.peers): which PyTorch RPC transports it is compared with.
SCOPES = {"push-pull": "one-host", "channel": "wire", "grpc": "wire", "streams": "wire"}
#: The reference without a framework (a plain TCP echo of the bytes), and its child's ready line.
RAW, RAW_READY = "raw-tcp", "RAW_READY "
#: --netns: the longest the benchmark may run on its client host, seconds.
NETNS_RUN_TIMEOUT = 4 * 3600.0


@dataclass(frozen=True)
class Sites:
    """Where the benchmark's processes run: all on 127.0.0.1, or (`server_ns` set, under --netns) the servers in
    that namespace at `server_address`, the clients here; the cards TensorPipe is told to use on each side."""

    server_ns: str | None = None
    server_address: str = "127.0.0.1"
    server_device: str = "lo"
    client_device: str = "lo"
    network: str = "loopback"

    def server_child(self, module: str, args: Sequence[object]) -> tuple[str, list[str]]:
        """(module, args) of a `harness.Proc` running `module ARGS` on the server side."""
        if self.server_ns is None:
            return module, [str(a) for a in args]
        started = netns.trampoline(self.server_ns, module, args)
        return started[0], started[1:]

    def tensorpipe_env(self, side: str) -> dict[str, str]:
        device = self.server_device if side == "server" else self.client_device
        return {"TP_SOCKET_IFNAME": device, "GLOO_SOCKET_IFNAME": device}

    def start_shard(self, flags: Sequence[str]) -> harness.Child:
        return harness.start_shard(flags, namespace=self.server_ns, host=self.server_address)

    def to_json(self) -> str:
        return json.dumps({"server_ns": self.server_ns, "server_address": self.server_address,
                           "server_device": self.server_device, "client_device": self.client_device,
                           "network": self.network})

    @classmethod
    def from_json(cls, text: str) -> "Sites":
        return cls(**json.loads(text))


def inside_argv(argv: Sequence[str], net: netns.Network, *, server: int = 0, client: int = 1) -> list[str]:
    """The command that runs this benchmark again on host `client` of `net`, its servers on host `server`:
    `argv` without --netns and --netns-rate, and --inside saying where the servers are."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--netns":
            continue
        if arg == "--netns-rate":
            skip = True
            continue
        if arg.startswith("--netns-rate="):
            continue
        kept.append(arg)
    there, here = net.host(server), net.host(client)
    sites = Sites(there.namespace, there.address, there.device, here.device, f"netns veth tbf {net.rate}")
    return net.exec_argv(client, "ps_bench.pushpull_bench", [*kept, "--inside", sites.to_json()])


def shape_for(size_mb: float) -> tuple[int, int]:
    """A (rows, 256) float32 shape of about size_mb megabytes (10^6 bytes)."""
    return max(1, int(size_mb * 1e6) // (4 * COLS)), COLS


class Ours:
    """One shard and one client of ours, kept for every size and repeat.

    `data_path` "push-pull" is what the training loop uses (PSClient.push_pull: one round trip,
    through shared memory when the shard shares the host, the call's header over the data channel:
    PSClient's defaults); "channel" is PSClient.push_pull through
    the data channel (no shared memory); "grpc" is PSClient.push_pull with neither (gRPC bytes, or
    Push and Pull past 256 KiB); "streams" is Push then Pull over gRPC.
    """

    def __init__(self, data_path: str = "push-pull", sites: Sites = Sites()) -> None:
        self.data_path, self.sites = data_path, sites
        self.shard = sites.start_shard(["--mode", "async", "--optimizer", "sgd", "--lr", str(LR)])
        self.client: PSClient | None = None
        self.shape: tuple[int, int] | None = None

    def timed(self, shape: tuple[int, int], rounds: int) -> float:
        if self.shape != shape:
            # A tensor of another size: a fresh job on the same shard (initialization is once per shard).
            if self.client is not None:
                self.client.close()
                self.restart()
            self.client = PSClient([self.shard.ready["address"]], worker_id="pushpull-bench",
                                   shared_memory=self.data_path == "push-pull",
                                   data_channel=self.data_path in ("push-pull", "channel"))
            self.client.wait_ready(timeout=30)
            tensor = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            self.client.initialize({"t": tensor})
            self.client.register(heartbeat=True)
            self.grad = np.full(shape, 1e-3, dtype=np.float32)
            self.shape = shape
        client = self.client
        assert client is not None
        client.pull()
        step = self._streams if self.data_path == "streams" else self._round
        step(client)   # one untimed round (and the shared-memory segment or the data channel opened)
        start = time.perf_counter()
        for _ in range(rounds):
            pulled = step(client)
        seconds = time.perf_counter() - start
        assert pulled["t"].shape == shape
        if self.data_path == "channel" and not client._links:
            raise RuntimeError("the data channel path ran without a data channel (see the client's warning)")
        return seconds

    def _round(self, client: PSClient) -> dict:
        _, pulled = client.push_pull({"t": self.grad})
        return pulled if pulled is not None else client.pull()   # too large for one message without shm

    def _streams(self, client: PSClient) -> dict:
        client.push({"t": self.grad})
        return client.pull()

    def restart(self) -> None:
        harness.stop_all([self.shard])
        self.shard = self.sites.start_shard(["--mode", "async", "--optimizer", "sgd", "--lr", str(LR)])

    def close(self) -> None:
        if self.client is not None:
            self.client.deregister()
            self.client.close()
        harness.stop_all([self.shard])


class RawTcp:
    """The floor: a child process (`raw_tcp_child`) that takes the pushed bytes into a buffer and answers as many
    bytes of its own over one TCP connection (sendmsg, recv_into on numpy buffers), as a framework-free push and
    pull would."""

    def __init__(self, sites: Sites = Sites()) -> None:
        echo = sites.server_child("ps_bench.pushpull_bench",
                                  ["--raw-tcp-child", "--raw-tcp-host", sites.server_address])
        self.proc = Proc(f"{RAW} echo", *echo)
        port = int(self.proc.wait_for(RAW_READY, 60)["port"])
        self.sock = socket.create_connection((sites.server_address, port), timeout=120)
        dc.no_delay(self.sock)

    def timed(self, shape: tuple[int, int], rounds: int) -> float:
        grad = np.full(shape, 1e-3, dtype=np.float32)
        back = np.empty(shape, dtype=np.float32)
        prefix = grad.nbytes.to_bytes(8, "little")

        def one() -> None:
            dc.send_views(self.sock, [prefix, dc.as_bytes(grad)])
            dc.recv_views(self.sock, [dc.as_bytes(back)])

        one()
        start = time.perf_counter()
        for _ in range(rounds):
            one()
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.close()
        harness.stop_all([self.proc])


def raw_tcp_child(host: str = "127.0.0.1") -> int:
    """The echo side of RawTcp: one connection on `host`, port 0 (said on stdout as RAW_READY {"port": N})."""
    with socket.create_server((host, 0)) as listener:
        listener.settimeout(60)
        print(RAW_READY + json.dumps({"port": listener.getsockname()[1]}), flush=True)
        conn, _ = listener.accept()
    dc.no_delay(conn)
    buffer = answer = np.empty(0, np.uint8)
    with conn:
        while True:
            prefix = dc.recv_exactly(conn, 8, at_boundary=True)
            if prefix is None:
                return 0
            n = int.from_bytes(prefix, "little")
            if n != buffer.nbytes:
                buffer, answer = np.empty(n, np.uint8), np.ones(n, np.uint8)
            dc.recv_views(conn, [dc.as_bytes(buffer)])
            dc.send_views(conn, [dc.as_bytes(answer)])


class Theirs:
    """The PyTorch RPC store and its client (child processes), in one variant over one transport, started for each
    timed run and stopped after it: TensorPipe's shared-memory transport polls (about half a core per idle
    process here), so a peer left running between its runs would slow every other system measured meanwhile."""

    def __init__(self, system: peers.System, sites: Sites = Sites()) -> None:
        self.system, self.sites = system, sites
        self.procs: list[Proc] = []

    def _start(self) -> None:
        port = harness.free_port()
        common = ["--port", port, "--host", self.sites.server_address, "--transport", self.system.transport]
        self.procs = [Proc(f"{self.system.label} store",
                           *self.sites.server_child("ps_bench.torch_rpc", ["store", *common, "--lr", LR]),
                           env=self.sites.tensorpipe_env("server"))]
        self.procs.append(Proc(f"{self.system.label} client", "ps_bench.torch_rpc",
                               ["store-client", *common, "--variant", self.system.variant],
                               env=self.sites.tensorpipe_env("client"), stdin=True))
        self.procs[1].wait_for("TORCH_PP ", 120)

    def timed(self, shape: tuple[int, int], rounds: int, timeout: float) -> float:
        try:
            self._start()
            self.procs[1].send(f"run {shape[0]} {shape[1]} {rounds}")
            return float(self.procs[1].wait_for("TORCH_PP ", timeout)["seconds"])
        finally:
            self.close()

    def close(self) -> None:
        if not self.procs:
            return
        if len(self.procs) > 1:   # the client was started: ask it for a clean rpc shutdown
            try:
                self.procs[1].send("quit")
            except OSError:
                pass
        deadline = time.monotonic() + 15
        for proc in reversed(self.procs):   # a clean rpc shutdown first, then by PID
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        harness.stop_all(self.procs)
        self.procs = []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.pushpull_bench", description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,16,100", help="tensor sizes in MB (default 1,16,100)")
    p.add_argument("--rounds", type=int, default=0,
                   help="push+pull pairs per timed repeat (default: about 400 MB moved per repeat, 3 to 50)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per system and size; medians (default 5)")
    p.add_argument("--no-torch", action="store_true", help="our side only, even when torch is importable")
    p.add_argument("--data-path", default="push-pull", metavar="PATH[,PATH...]",
                   help="ours, one or more of: push-pull (the training loop's PushPull, shared memory on one "
                        "host; default), channel (PushPull through the data channel, no shared memory), grpc "
                        "(PushPull over gRPC bytes; Push and Pull past 256 KiB), streams (Push then Pull)")
    p.add_argument("--raw-tcp", action="store_true", help="also measure a plain TCP echo of the bytes (system "
                                                          "raw-tcp): the floor without any framework")
    p.add_argument("--torch-variants", default=",".join(peers.TORCH_VARIANTS), metavar="VARIANT/TRANSPORT[,...]",
                   help=f"PyTorch RPC's variants and transports, of {', '.join(peers.ALL_TORCH_VARIANTS)} or 'all' "
                        f"(default {','.join(peers.TORCH_VARIANTS)})")
    p.add_argument("--netns", action="store_true",
                   help="across a network: the servers on one host, the clients on another, network namespaces on "
                        "a switch with each link shaped (root); the wire paths and TCP transports only")
    p.add_argument("--netns-rate", default=netns.RATE, help=f"each link's tbf rate, both ways (default {netns.RATE})")
    p.add_argument("--raw-tcp-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw-tcp-host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--inside", default=None, help=argparse.SUPPRESS)   # Sites as JSON: run on the client host
    args = p.parse_args(argv)
    if args.raw_tcp_child:
        return raw_tcp_child(args.raw_tcp_host)
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    paths = args.data_path.split(",")
    if args.repeats < 1 or args.rounds < 0 or any(s <= 0 for s in sizes):
        p.error("--repeats >= 1, --rounds >= 0, sizes > 0")
    if not paths or any(path not in DATA_PATHS for path in paths) or len(set(paths)) != len(paths):
        p.error(f"--data-path: one or more of {', '.join(DATA_PATHS)}, each once")
    try:
        variants = peers.parse_list(args.torch_variants, peers.ALL_TORCH_VARIANTS, "--torch-variants")
    except ValueError as exc:
        p.error(str(exc))
    if args.netns or args.inside:
        if any(SCOPES[path] == "one-host" for path in paths):
            p.error("--netns runs the wire paths only (shared memory does not cross hosts): --data-path "
                    "channel, grpc or streams")
        variants = [v for v in variants if not v.endswith("/shm")]
    if args.netns and not args.inside:   # (on the client host already: never a network inside the network)
        why = netns.unavailable()
        if why is not None:
            p.error(f"--netns: {why}")
        own = list(sys.argv[1:] if argv is None else argv)
        with netns.network(hosts=2, rate=args.netns_rate, log=log) as net:
            try:
                return subprocess.run(inside_argv(own, net), timeout=NETNS_RUN_TIMEOUT, stdin=subprocess.DEVNULL,
                                      env=harness.child_env()).returncode
            except subprocess.TimeoutExpired:
                log(f"pushpull_bench: the run on {net.host(1).namespace} took more than {NETNS_RUN_TIMEOUT:.0f} s: "
                    "stopped")
                return 1
    sites = Sites.from_json(args.inside) if args.inside else Sites()
    with_torch = not args.no_torch and harness.torch_available()
    if not with_torch:
        log("pushpull_bench: " + ("--no-torch: " if args.no_torch else "torch is not importable in this environment "
            f"({sys.executable}): ") + "running onnx-ps only (docs/benchmarks.md: the torch environment)")
    log(f"pushpull_bench: machine {json.dumps(harness.machine())}")
    ours: dict[str, Ours] = {}
    theirs: dict[str, Theirs] = {}
    raw: RawTcp | None = None
    try:
        for path in paths:
            ours[path] = Ours(path, sites)
        for pair in (variants if with_torch else []):
            variant, transport = pair.split("/")
            system = peers.System(TORCH, variant=variant, transport=transport)
            theirs[system.label] = Theirs(system, sites)
        raw = RawTcp(sites) if args.raw_tcp else None
        for size in sizes:
            shape = shape_for(size)
            nbytes = shape[0] * shape[1] * 4
            rounds = args.rounds or min(50, max(3, round(200e6 / nbytes)))
            moved = 2 * nbytes * rounds
            timeout = 120 + moved / 10e6   # at least 10 MB/s, or something is wrong
            systems: dict[str, object] = {path: (lambda o=o: moved / o.timed(shape, rounds) / 1e9)
                                          for path, o in ours.items()}
            for label, peer in theirs.items():
                systems[label] = lambda peer=peer: moved / peer.timed(shape, rounds, timeout) / 1e9
            if raw is not None:
                systems[RAW] = lambda: moved / raw.timed(shape, rounds) / 1e9
            runs: dict[str, list[float]] = {name: [] for name in systems}
            stolen: dict[str, list[float | None]] = {name: [] for name in systems}   # harness.steal_share
            for repeat in range(args.repeats):
                order = list(systems)
                shift = repeat % len(order)   # each system goes first in turn: none always meets a warmer machine
                for name in order[shift:] + order[:shift]:
                    ticks = harness.cpu_ticks()
                    runs[name].append(systems[name]())
                    stolen[name].append(harness.steal_share(ticks, harness.cpu_ticks()))
                log(f"pushpull_bench: {size:g} MB, repeat {repeat + 1}/{args.repeats}: "
                    + ", ".join(f"{'onnx-ps ' + n if n in ours else n} {v[-1]:.3f} GB/s"
                                + harness.stolen_note(stolen[n][-1]) for n, v in runs.items()))
            extra = dict(size_mb=size, unit="GB/s", rounds=rounds, repeats=args.repeats, shape=list(shape),
                         network=sites.network)
            for path in ours:
                emit_median(harness.SYSTEM, runs[path], stolen[path], data_path=path, **extra)
            for label, peer in theirs.items():
                emit_median(TORCH, runs[label], stolen[label], **extra, **peer.system.fields())
            if raw is not None:
                emit_median(RAW, runs[RAW], stolen[RAW], **extra)
            ratio_fields = {k: v for k, v in extra.items() if k not in ("size_mb", "unit")}
            for path in ours:
                best = peers.best_peer({peer.system: runs[label] for label, peer in theirs.items()}, SCOPES[path])
                against = [(TORCH, best.label, runs[best.label])] if best is not None else []
                for other, label, their_runs in against + ([(RAW, RAW, runs[RAW])] if raw is not None else []):
                    ratios = peers.paired_ratios(runs[path], their_runs)
                    scoped = {"against": label, "scope": SCOPES[path]} if other == TORCH else {}
                    harness.emit(f"{harness.SYSTEM}/{other}", "pushpull_ratio", size, harness.median(ratios), "x",
                                 **ratio_fields, data_path=path, **scoped, runs=[round(r, 3) for r in ratios])
    finally:
        for closing in (raw, *theirs.values(), *ours.values()):
            if closing is not None:
                closing.close()
    log(f"pushpull_bench: loadavg at the end {harness.machine()['loadavg']}")
    return 0


def emit_median(system: str, values: list[float], stolen: Sequence[float | None] = (), *, size_mb: float, unit: str,
                **extra: object) -> None:
    """One JSON line: the median of a system's runs (harness.emit_medians' line), with the share of the CPU the
    hypervisor took during each run (`stolen`, harness.steal_share) where it was measured."""
    harness.emit(system, "pushpull_gbps", size_mb, harness.median(values), unit, **extra,
                 **harness.steal_fields(stolen), runs=[round(v, 4) for v in values])


if __name__ == "__main__":
    sys.exit(main())
