"""The benchmarks' network namespaces, as commands: names, shaping, teardown, and what a cleanup may remove.

Nothing here creates a namespace (that needs root and is the benchmark's business,
`python -m ps_bench.train_bench --netns`); these check the commands and the rules that keep
the benchmark to its own namespaces and links.
"""

from __future__ import annotations

import sys

import pytest

from ps_bench import netns
from ps_bench.netns import Network


def test_names_carry_the_pid_and_fit_the_kernel_limits() -> None:
    net = Network(4194304)   # the largest PID Linux gives
    assert net.server_ns == "onnxps-bench-4194304-s" and net.worker_ns == "onnxps-bench-4194304-w"
    assert len(net.server_dev) <= 15 and len(net.worker_dev) <= 15   # IFNAMSIZ - 1
    assert (net.namespace("server"), net.device("worker"), net.address("server")) == (
        net.server_ns, net.worker_dev, "10.77.0.1")


def test_setup_builds_a_shaped_veth_pair_between_two_namespaces() -> None:
    net = Network(123, rate="1gbit")
    cmds = [" ".join(c) for c in net.setup_commands()]
    assert cmds[:3] == ["ip netns add onnxps-bench-123-s", "ip netns add onnxps-bench-123-w",
                        "ip link add psb123s type veth peer name psb123w"]
    for ns, dev, address in (("onnxps-bench-123-s", "psb123s", "10.77.0.1"), ("onnxps-bench-123-w", "psb123w",
                                                                              "10.77.0.2")):
        assert f"ip link set {dev} netns {ns}" in cmds
        assert f"ip -n {ns} addr add {address}/24 dev {dev}" in cmds
        assert f"ip -n {ns} link set lo up" in cmds and f"ip -n {ns} link set {dev} up" in cmds
        assert f"ip netns exec {ns} tc qdisc replace dev {dev} root tbf rate 1gbit burst 1mb latency 10ms" in cmds
    # the device moves into its namespace before it is addressed there
    assert cmds.index("ip link set psb123s netns onnxps-bench-123-s") < cmds.index(
        "ip -n onnxps-bench-123-s addr add 10.77.0.1/24 dev psb123s")


def test_teardown_removes_both_namespaces_and_a_link_left_outside() -> None:
    assert [" ".join(c) for c in Network(7).teardown_commands()] == [
        "ip netns del onnxps-bench-7-s", "ip netns del onnxps-bench-7-w", "ip link del psb7s"]


def test_a_cleanup_removes_only_ours_of_processes_that_are_gone() -> None:
    listing = "onnxps-bench-11-s (id: 0)\nonnxps-bench-11-w (id: 1)\nonnxps-bench-22-s\nsomeone-else\n" \
              "onnxps-bench-33-x\nonnxps-bench-abc-s\n"
    links = ("1: lo: <LOOPBACK,UP> mtu 65536 qdisc noqueue\n"
             "5: psb11s@if6: <BROADCAST,MULTICAST> mtu 1500 qdisc noop\n"
             "7: psb22w@psb22s: <BROADCAST> mtu 1500\n"
             "9: psbx1s: <BROADCAST> mtu 1500\n"
             "10: eth0: <BROADCAST,UP> mtu 1500\n")
    namespaces, devices = netns.parse_netns_list(listing), netns.parse_link_names(links)
    assert namespaces[:3] == ["onnxps-bench-11-s", "onnxps-bench-11-w", "onnxps-bench-22-s"]
    assert devices == ["lo", "psb11s", "psb22w", "psbx1s", "eth0"]
    alive = {22}
    assert netns.stale(namespaces, devices, lambda pid: pid in alive) == (
        ["onnxps-bench-11-s", "onnxps-bench-11-w"], ["psb11s"])


def test_the_trampoline_runs_a_module_in_a_namespace_under_the_same_interpreter() -> None:
    argv = Network(5).exec_argv("worker", "ps_bench.train_worker", ["--index", 1])
    assert argv == [sys.executable, "-P", "-m", "ps_bench.netns", "exec", "onnxps-bench-5-w",
                    "ps_bench.train_worker", "--index", "1"]


def test_the_trampoline_enters_only_a_namespace_of_ours() -> None:
    with pytest.raises(SystemExit, match="not a namespace of this module"):
        netns.main(["exec", "some-other-namespace", "ps_server"])
    assert netns.main(["what"]) == 2


def test_the_bytes_a_veth_end_sent_are_read_from_ip_s_j() -> None:
    assert Network(9).traffic_command("worker") == ["ip", "-n", "onnxps-bench-9-w", "-s", "-j", "link", "show", "dev",
                                                    "psb9w"]
    shown = '[{"ifname": "psb9w", "stats64": {"rx": {"bytes": 5}, "tx": {"bytes": 1234567, "packets": 10}}}]'
    assert netns.parse_tx_bytes(shown) == 1234567
    assert netns.parse_tx_bytes("") == 0 and netns.parse_tx_bytes('[{"ifname": "x"}]') == 0
