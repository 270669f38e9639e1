"""The benchmarks' namespace network, built for real: hosts on one switch reach each other, the bytes are counted,
each host's link is shaped, and nothing is left behind.

Needs root and iproute2 (and the kernel's bridge); skips with the reason where `ps_bench.netns.unavailable()`
gives one. Each transfer is bounded in bytes and time.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ps_bench import netns

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(netns.unavailable() is not None, reason=f"{netns.unavailable()}")]

#: A listener that takes one connection, reads it to the end, and prints the byte count.
SINK = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
s.settimeout(30)
c, _ = s.accept()
c.settimeout(30)
n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""
#: Connects to argv[1]:argv[2] and sends argv[3] bytes; prints the seconds it took.
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
data = bytes(int(sys.argv[3]))
t = time.perf_counter()
c.sendall(data)
c.shutdown(socket.SHUT_WR)
c.recv(1)
print(time.perf_counter() - t, flush=True)
"""


def send(net: netns.Network, source: int, sink: int, size: int) -> tuple[int, float]:
    """(bytes the sink host received, seconds the send took) for `size` bytes from host `source` to host `sink`."""
    there = net.host(sink)
    listener = subprocess.Popen(["ip", "netns", "exec", there.namespace, sys.executable, "-c", SINK, there.address],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        sent = subprocess.run(["ip", "netns", "exec", net.host(source).namespace, sys.executable, "-c", SOURCE,
                               there.address, str(port), str(size)], capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        received = int(listener.stdout.readline())
        return received, float(sent.stdout)
    finally:
        listener.kill()
        listener.wait(timeout=10)


def test_hosts_on_the_switch_reach_each_other_through_shaped_links_and_are_deleted_after() -> None:
    size = 4 << 20
    with netns.network(hosts=3, rate="200mbit") as net:
        names = net.namespaces()
        assert set(names) <= set(netns.parse_netns_list(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                                        text=True, timeout=30).stdout))
        before = net.bytes_sent()
        received, seconds = send(net, 2, 0, size)
        assert received == size
        # a link of 200 Mbit/s takes 4 MiB in about 0.17 s: well above what the veth pair alone needs
        assert seconds > 0.1, f"{size} bytes took {seconds:.3f} s through a 200 Mbit/s link: not shaped"
        received, _ = send(net, 0, 1, size)   # another pair of hosts, the other way through the switch
        assert received == size
        assert net.bytes_sent() - before >= 2 * size   # every byte counted once, by the host that sent it
    time.sleep(0.1)
    left = set(netns.parse_netns_list(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                     timeout=30).stdout)) & set(names)
    assert not left, f"namespaces left after the block: {sorted(left)}"
