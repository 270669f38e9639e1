"""A network that is not loopback, for the benchmarks: two network namespaces joined by a shaped veth pair.

`network()` creates, for the life of a ``with`` block, a "server" namespace and a "worker"
namespace (names ``onnxps-bench-<pid>-s`` / ``-w``), joined by a veth pair (``psb<pid>s`` in
the server namespace at 10.77.0.1/24, ``psb<pid>w`` in the worker namespace at 10.77.0.2/24),
each end's root qdisc a token bucket (``tc qdisc replace dev DEV root tbf rate RATE burst
BURST latency LATENCY``, 10 Gbit/s by default). Shards (and the PyTorch peers' servers) run
in the server namespace, workers in the worker namespace, so every byte between them
crosses the veth pair through the kernel's TCP stack and the shaper, as it would between
two hosts (there is no propagation delay: netem is not available everywhere, tbf is).

A process is started in a namespace through this module's trampoline,
``python -P -m ps_bench.netns exec NAMESPACE MODULE ARGS...``, which replaces itself with
``ip netns exec NAMESPACE python -P -m MODULE ARGS...``: the same PID all along, so the
benchmarks' children are still stopped by PID, and `harness.Proc` is used unchanged.

Needs root (CAP_NET_ADMIN) and iproute2's ``ip`` and ``tc``; `unavailable()` says why not.
The namespaces are always deleted: at the end of the block (deleting a namespace deletes the
veth end inside it, and with it its peer), and at the start of every `network()`, any of ours
left behind by a process that no longer runs (killed before its cleanup ran). Nothing here
touches a namespace or link it did not name.

Shards bound to 10.77.0.1 listen off loopback in plaintext: they need ``--insecure``
(acceptable for a benchmark on a private veth pair; never for a job).
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
SERVER_ADDRESS = "10.77.0.1"
WORKER_ADDRESS = "10.77.0.2"
PREFIX_LENGTH = 24
#: The shaper's defaults: a 10 Gbit/s link.
RATE, BURST, LATENCY = "10gbit", "1mb", "10ms"
#: Longest wait for one ip/tc command, seconds.
COMMAND_TIMEOUT = 30.0

_NS_PATTERN = re.compile(rf"^{re.escape(NS_PREFIX)}(\d+)-[sw]$")
_DEV_PATTERN = re.compile(rf"^{re.escape(DEV_PREFIX)}(\d+)[sw]$")


@dataclass(frozen=True)
class Network:
    """The names, addresses and shaping of one pair of namespaces (`tag`: the creating process's PID)."""

    tag: int
    rate: str = RATE
    burst: str = BURST
    latency: str = LATENCY

    @property
    def server_ns(self) -> str:
        return f"{NS_PREFIX}{self.tag}-s"

    @property
    def worker_ns(self) -> str:
        return f"{NS_PREFIX}{self.tag}-w"

    @property
    def server_dev(self) -> str:
        return f"{DEV_PREFIX}{self.tag}s"

    @property
    def worker_dev(self) -> str:
        return f"{DEV_PREFIX}{self.tag}w"

    server_address = SERVER_ADDRESS
    worker_address = WORKER_ADDRESS

    def namespace(self, side: str) -> str:
        """The namespace of `side` ("server" or "worker")."""
        return {"server": self.server_ns, "worker": self.worker_ns}[side]

    def device(self, side: str) -> str:
        """The veth end inside `side`'s namespace (what TP_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name there)."""
        return {"server": self.server_dev, "worker": self.worker_dev}[side]

    def address(self, side: str) -> str:
        return {"server": self.server_address, "worker": self.worker_address}[side]

    def describe(self) -> str:
        return (f"veth {self.server_dev} ({self.server_ns}, {self.server_address}) <-> {self.worker_dev} "
                f"({self.worker_ns}, {self.worker_address}), tbf rate {self.rate} burst {self.burst} "
                f"latency {self.latency} on both ends")

    def setup_commands(self) -> list[list[str]]:
        """The ip and tc commands that build the pair, in order."""
        cmds = [["ip", "netns", "add", self.server_ns], ["ip", "netns", "add", self.worker_ns],
                ["ip", "link", "add", self.server_dev, "type", "veth", "peer", "name", self.worker_dev]]
        for ns, dev, address in ((self.server_ns, self.server_dev, self.server_address),
                                 (self.worker_ns, self.worker_dev, self.worker_address)):
            cmds += [["ip", "link", "set", dev, "netns", ns],
                     ["ip", "-n", ns, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", dev],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "-n", ns, "link", "set", dev, "up"],
                     ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                      self.rate, "burst", self.burst, "latency", self.latency]]
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """The commands that remove everything `setup_commands` may have made (each may fail: nothing there)."""
        return [["ip", "netns", "del", self.server_ns], ["ip", "netns", "del", self.worker_ns],
                ["ip", "link", "del", self.server_dev]]   # only if it never left this namespace

    def traffic_command(self, side: str) -> list[str]:
        """``ip -s -j link show`` of `side`'s veth end (its byte counters, as JSON)."""
        return ["ip", "-n", self.namespace(side), "-s", "-j", "link", "show", "dev", self.device(side)]

    def bytes_sent(self) -> int:
        """Bytes both veth ends have sent so far: what crossed the pair, both ways (0 if unreadable)."""
        total = 0
        for side in ("server", "worker"):
            done = _run(self.traffic_command(side), check=False)
            total += parse_tx_bytes(done.stdout) if done.returncode == 0 else 0
        return total

    def exec_argv(self, side: str, module: str, args: Sequence[object]) -> list[str]:
        """``python -P -m ps_bench.netns exec NS MODULE ARGS``: `module` run inside `side`'s namespace."""
        return [sys.executable, "-P", "-m", __name__, "exec", self.namespace(side), module, *[str(a) for a in args]]


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
def network(*, rate: str = RATE, burst: str = BURST, latency: str = LATENCY,
            log: Callable[[str], None] | None = None) -> Iterator[Network]:
    """Two namespaces joined by a shaped veth pair for the block; always deleted after it."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"--netns: {why}")
    cleanup_stale(log)
    net = Network(os.getpid(), rate=rate, burst=burst, latency=latency)
    try:
        for cmd in net.setup_commands():
            _run(cmd)
        if log is not None:
            log(f"netns: {net.describe()}")
        yield net
    finally:
        for cmd in net.teardown_commands():
            _run(cmd, check=False)
        left = set(parse_netns_list(_run(["ip", "netns", "list"], check=False).stdout)) & {net.server_ns,
                                                                                             net.worker_ns}
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
