"""A network that is not loopback, for the benchmarks: hosts of their own in network namespaces, on one switch.

`network(hosts=N)` creates, for the life of a ``with`` block, N "host" namespaces
(``onnxps-bench-<pid>-h0`` .. ``-h<N-1>``) and a "switch" namespace (``onnxps-bench-<pid>-x``)
holding a bridge. Host i has one network card: a veth end ``psb<pid>h<i>`` at 10.77.0.<i+1>/24,
whose peer ``psb<pid>x<i>`` is a port of the bridge. Both ends' root qdiscs are token buckets
(``tc qdisc replace dev DEV root tbf rate RATE burst BURST latency LATENCY``, 10 Gbit/s by
default): the host end shapes what the host sends, the switch end what it receives, so each host
has a full-duplex link of that rate to a switch that is not itself a bottleneck -- a rack of
machines with one NIC each. Every byte between two hosts crosses both hosts' links through the
kernel's TCP stack and the shapers (there is no propagation delay: netem is not available
everywhere, tbf is).

Which process runs on which host is the benchmark's choice (`Placement`): by default each shard
and each worker on a host of its own, as a cluster runs them, so a worker's link carries its own
pushes and pulls and a shard's link its own share of every worker's; or ``two-hosts``, every
shard on host 0 and every worker on host 1, the layout of the first measurements, where one link
carries all workers' bytes.

A process is started in a namespace through this module's trampoline,
``python -P -m ps_bench.netns exec NAMESPACE MODULE ARGS...``, which replaces itself with
``ip netns exec NAMESPACE python -P -m MODULE ARGS...``: the same PID all along, so the
benchmarks' children are still stopped by PID, and `harness.Proc` is used unchanged.

Needs root (CAP_NET_ADMIN), iproute2's ``ip`` and ``tc``, and the kernel's bridge; `unavailable()`
says why not. The namespaces are always deleted: at the end of the block (deleting a namespace
deletes the veth ends inside it, and with them their peers), and at the start of every
`network()`, any of ours left behind by a process that no longer runs (killed before its cleanup
ran). Nothing here touches a namespace or link it did not name.

Servers bound to a host's 10.77.0.x address listen off loopback in plaintext: they need
``--insecure`` (acceptable for a benchmark on a private switch; never for a job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

#: Every namespace of ours starts with this, then the creating process's PID.
NS_PREFIX = "onnxps-bench-"
#: Every veth end of ours starts with this, then the PID (interface names are at most 15 bytes).
DEV_PREFIX = "psb"
#: Host i's address is SUBNET.(i + 1).
SUBNET = "10.77.0"
PREFIX_LENGTH = 24
#: At most this many hosts (the /24 keeps .255 for broadcast; .0 is the net).
MAX_HOSTS = 250
#: The shaper's defaults: a 10 Gbit/s link.
RATE, BURST, LATENCY = "10gbit", "1mb", "10ms"
#: Longest wait for one ip/tc command, seconds.
COMMAND_TIMEOUT = 30.0
#: Placements of the benchmark's processes on the hosts (`Placement`): a host each (the default), or two.
LAYOUTS = ("host-each", "two-hosts")

# Ours: -h<i> hosts and -x the switch; -s / -w the two namespaces of earlier versions, still cleaned up.
_NS_PATTERN = re.compile(rf"^{re.escape(NS_PREFIX)}(\d+)-(?:[sw]|x|h\d+)$")
_DEV_PATTERN = re.compile(rf"^{re.escape(DEV_PREFIX)}(\d+)(?:[sw]|[hx]\d+)$")


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its network card (the veth end inside it) and that card's address."""

    index: int
    namespace: str
    device: str
    address: str


@dataclass(frozen=True)
class Network:
    """The names, addresses and shaping of `hosts` namespaces on one switch (`tag`: the creating process's PID)."""

    tag: int
    hosts: int = 2
    rate: str = RATE
    burst: str = BURST
    latency: str = LATENCY

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"a network of {self.hosts} hosts: between 1 and {MAX_HOSTS}")

    @property
    def switch_ns(self) -> str:
        return f"{NS_PREFIX}{self.tag}-x"

    @property
    def bridge(self) -> str:
        """The bridge, inside the switch's namespace."""
        return f"{DEV_PREFIX}{self.tag}br"

    def host(self, index: int) -> Host:
        if not 0 <= index < self.hosts:
            raise IndexError(f"host {index} of a network of {self.hosts} (0 .. {self.hosts - 1})")
        return Host(index, f"{NS_PREFIX}{self.tag}-h{index}", f"{DEV_PREFIX}{self.tag}h{index}",
                    f"{SUBNET}.{index + 1}")

    def port(self, index: int) -> str:
        """The switch's end of host `index`'s link (a port of the bridge)."""
        return f"{DEV_PREFIX}{self.tag}x{index}"

    def describe(self) -> str:
        first, last = self.host(0), self.host(self.hosts - 1)
        return (f"{self.hosts} host namespaces ({first.namespace} .. {last.namespace}, {first.address} .. "
                f"{last.address}) on the bridge of {self.switch_ns}, each host's veth link shaped by tbf rate "
                f"{self.rate} burst {self.burst} latency {self.latency} both ways")

    def _shape(self, namespace: str, device: str) -> list[str]:
        return ["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate",
                self.rate, "burst", self.burst, "latency", self.latency]

    def setup_commands(self) -> list[list[str]]:
        """The ip and tc commands that build the switch and the hosts, in order."""
        switch = self.switch_ns
        cmds = [["ip", "netns", "add", switch], ["ip", "-n", switch, "link", "set", "lo", "up"],
                ["ip", "-n", switch, "link", "add", self.bridge, "type", "bridge"],
                ["ip", "-n", switch, "link", "set", self.bridge, "up"]]
        for index in range(self.hosts):
            host, port = self.host(index), self.port(index)
            cmds += [["ip", "netns", "add", host.namespace],
                     ["ip", "link", "add", host.device, "type", "veth", "peer", "name", port],
                     ["ip", "link", "set", host.device, "netns", host.namespace],
                     ["ip", "link", "set", port, "netns", switch],
                     ["ip", "-n", switch, "link", "set", port, "master", self.bridge],
                     ["ip", "-n", switch, "link", "set", port, "up"],
                     ["ip", "-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", host.device],
                     ["ip", "-n", host.namespace, "link", "set", "lo", "up"],
                     ["ip", "-n", host.namespace, "link", "set", host.device, "up"],
                     self._shape(host.namespace, host.device),   # what the host sends
                     self._shape(switch, port)]                  # what it receives
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """The commands that remove everything `setup_commands` may have made (each may fail: nothing there)."""
        cmds = [["ip", "netns", "del", self.switch_ns]]
        cmds += [["ip", "netns", "del", self.host(i).namespace] for i in range(self.hosts)]
        # a link whose ends never left this namespace (a setup that failed half-way)
        return cmds + [["ip", "link", "del", self.host(i).device] for i in range(self.hosts)]

    def namespaces(self) -> list[str]:
        return [self.switch_ns, *(self.host(i).namespace for i in range(self.hosts))]

    def traffic_command(self, index: int) -> list[str]:
        """``ip -s -j link show`` of host `index`'s card (its byte counters, as JSON)."""
        host = self.host(index)
        return ["ip", "-n", host.namespace, "-s", "-j", "link", "show", "dev", host.device]

    def bytes_sent(self) -> int:
        """Bytes the hosts' cards have sent so far: every byte between two hosts once (0 where unreadable)."""
        total = 0
        for index in range(self.hosts):
            done = _run(self.traffic_command(index), check=False)
            total += parse_tx_bytes(done.stdout) if done.returncode == 0 else 0
        return total

    def exec_argv(self, index: int, module: str, args: Sequence[object]) -> list[str]:
        """``python -P -m ps_bench.netns exec NS MODULE ARGS``: `module` run on host `index`."""
        return [sys.executable, "-P", "-m", *trampoline(self.host(index).namespace, module, args)]


def trampoline(namespace: str, module: str, args: Sequence[object]) -> list[str]:
    """``ps_bench.netns exec NAMESPACE MODULE ARGS``: what `python -P -m` (or `harness.Proc`, given the first
    word as its module and the rest as its arguments) runs to start `module` in `namespace`."""
    return [__name__, "exec", namespace, module, *[str(a) for a in args]]


@dataclass(frozen=True)
class Placement:
    """Which host runs each process of a job of `shards` shards and `workers` workers, by `layout` (LAYOUTS):
    ``host-each``: shard i on host i, worker j on host shards + j, DDP's rank r on worker r's host;
    ``two-hosts``: the shards (and DDP's rank 0) on host 0, the workers (and DDP's other ranks) on host 1."""

    layout: str
    shards: int
    workers: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"netns layout {self.layout!r}: one of {', '.join(LAYOUTS)}")

    @property
    def hosts(self) -> int:
        return self.shards + self.workers if self.layout == "host-each" else 2

    def shard(self, index: int) -> int:
        return index if self.layout == "host-each" else 0

    def worker(self, index: int) -> int:
        return self.shards + index if self.layout == "host-each" else 1

    def ddp_rank(self, rank: int) -> int:
        """All-reduce has no servers: its ranks are the workers (in two-hosts, rank 0 beside the shards, so that
        its bytes cross the one link)."""
        if self.layout == "host-each":
            return self.worker(rank)
        return 0 if rank == 0 else 1


def stale(namespaces: Sequence[str], devices: Sequence[str], alive: Callable[[int], bool]
          ) -> tuple[list[str], list[str]]:
    """(namespaces, devices) of ours whose creating process no longer runs: what a cleanup removes."""
    def dead(pattern: re.Pattern[str], name: str) -> bool:
        found = pattern.match(name)
        return found is not None and not alive(int(found.group(1)))

    return ([n for n in namespaces if dead(_NS_PATTERN, n)], [d for d in devices if dead(_DEV_PATTERN, d)])


def parse_netns_list(text: str) -> list[str]:
    """The names in ``ip netns list``'s output (``NAME`` or ``NAME (id: N)`` a line)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def parse_link_names(text: str) -> list[str]:
    """The interface names in ``ip -o link show``'s output (``N: NAME[@PEER]: <...> ...`` a line)."""
    names = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2 and parts[1].strip():
            names.append(parts[1].strip().split("@")[0])
    return names


def parse_tx_bytes(text: str) -> int:
    """The bytes sent in ``ip -s -j link show DEV``'s output (0 when it says none)."""
    try:
        return sum(int(link["stats64"]["tx"]["bytes"]) for link in json.loads(text))
    except (ValueError, KeyError, TypeError):
        return 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable() -> str | None:
    """Why `network()` cannot run here (None: it can)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not found on PATH"
    return None


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def cleanup_stale(log: Callable[[str], None] | None = None) -> list[str]:
    """Deletes our namespaces and veth ends whose creating process is gone; their names."""
    namespaces = parse_netns_list(_run(["ip", "netns", "list"], check=False).stdout)
    devices = parse_link_names(_run(["ip", "-o", "link", "show"], check=False).stdout)
    dead_ns, dead_devs = stale(namespaces, devices, pid_alive)
    for ns in dead_ns:
        _run(["ip", "netns", "del", ns], check=False)
    for dev in dead_devs:
        _run(["ip", "link", "del", dev], check=False)
    removed = dead_ns + dead_devs
    if removed and log is not None:
        log(f"netns: removed what an earlier run left: {', '.join(removed)}")
    return removed


@contextmanager
def network(*, hosts: int = 2, rate: str = RATE, burst: str = BURST, latency: str = LATENCY,
            log: Callable[[str], None] | None = None) -> Iterator[Network]:
    """`hosts` namespaces on one switch, each link shaped, for the block; always deleted after it."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"--netns: {why}")
    cleanup_stale(log)
    net = Network(os.getpid(), hosts=hosts, rate=rate, burst=burst, latency=latency)
    try:
        for cmd in net.setup_commands():
            _run(cmd)
        if log is not None:
            log(f"netns: {net.describe()}")
        yield net
    finally:
        for cmd in net.teardown_commands():
            _run(cmd, check=False)
        left = set(parse_netns_list(_run(["ip", "netns", "list"], check=False).stdout)) & set(net.namespaces())
        if left and log is not None:
            log(f"netns: could not delete {', '.join(sorted(left))}: delete them with `ip netns del NAME`")


def exec_in(namespace: str, module: str, args: Sequence[str]) -> None:
    """Replaces this process with ``ip netns exec NAMESPACE python -P -m MODULE ARGS`` (the same PID)."""
    if not _NS_PATTERN.match(namespace):
        raise SystemExit(f"ps_bench.netns exec: {namespace!r} is not a namespace of this module")
    os.execvp("ip", ["ip", "netns", "exec", namespace, sys.executable, "-P", "-m", module, *args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 3 and argv[0] == "exec":
        exec_in(argv[1], argv[2], argv[3:])
    if argv[:1] == ["cleanup"]:
        removed = cleanup_stale(lambda text: print(text, file=sys.stderr))
        print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
        return 0
    print("usage: python -m ps_bench.netns exec NAMESPACE MODULE [ARGS...] | cleanup", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
