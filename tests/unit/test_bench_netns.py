"""The benchmarks' network namespaces, as commands: names, shaping, teardown, and what a cleanup may remove.

Nothing here creates a namespace (that needs root and is the benchmark's business,
`python -m ps_bench.train_bench --netns`); these check the commands and the rules that keep
the benchmark to its own namespaces and links.
"""

from __future__ import annotations

import sys

import pytest

from ps_bench import netns, pushpull_bench
from ps_bench.netns import MAX_HOSTS, Host, Network, Placement


def test_names_carry_the_pid_and_fit_the_kernel_limits() -> None:
    net = Network(4194304, hosts=MAX_HOSTS)   # the largest PID Linux gives, the most hosts
    last = net.host(MAX_HOSTS - 1)
    assert net.switch_ns == "onnxps-bench-4194304-x"
    assert last == Host(MAX_HOSTS - 1, f"onnxps-bench-4194304-h{MAX_HOSTS - 1}", f"psb4194304h{MAX_HOSTS - 1}",
                        f"10.77.0.{MAX_HOSTS}")
    for name in (last.device, net.port(MAX_HOSTS - 1), net.bridge):
        assert len(name) <= 15, name   # IFNAMSIZ - 1
    assert net.host(0).address == "10.77.0.1"
    with pytest.raises(IndexError, match="host 2 of a network of 2"):
        Network(1).host(2)
    for hosts in (0, MAX_HOSTS + 1):
        with pytest.raises(ValueError, match=f"a network of {hosts} hosts"):
            Network(1, hosts=hosts)


def test_setup_puts_each_host_on_the_switch_through_a_link_shaped_both_ways() -> None:
    net = Network(123, hosts=3, rate="1gbit")
    cmds = [" ".join(c) for c in net.setup_commands()]
    switch = "onnxps-bench-123-x"
    assert cmds[:4] == [f"ip netns add {switch}", f"ip -n {switch} link set lo up",
                        f"ip -n {switch} link add psb123br type bridge", f"ip -n {switch} link set psb123br up"]
    for i in range(3):
        ns, dev, port = f"onnxps-bench-123-h{i}", f"psb123h{i}", f"psb123x{i}"
        assert f"ip netns add {ns}" in cmds
        assert f"ip link add {dev} type veth peer name {port}" in cmds
        assert f"ip -n {ns} addr add 10.77.0.{i + 1}/24 dev {dev}" in cmds
        assert f"ip -n {switch} link set {port} master psb123br" in cmds
        assert f"ip -n {switch} link set {port} up" in cmds
        assert f"ip -n {ns} link set lo up" in cmds and f"ip -n {ns} link set {dev} up" in cmds
        shaper = "root tbf rate 1gbit burst 1mb latency 10ms"
        assert f"ip netns exec {ns} tc qdisc replace dev {dev} {shaper}" in cmds          # what the host sends
        assert f"ip netns exec {switch} tc qdisc replace dev {port} {shaper}" in cmds    # what it receives
        # each end moves into its namespace before it is addressed or enslaved there
        addressed = cmds.index(f"ip -n {ns} addr add 10.77.0.{i + 1}/24 dev {dev}")
        assert cmds.index(f"ip link set {dev} netns {ns}") < addressed
        enslaved = cmds.index(f"ip -n {switch} link set {port} master psb123br")
        assert cmds.index(f"ip link set {port} netns {switch}") < enslaved


def test_teardown_removes_every_namespace_and_links_left_outside() -> None:
    assert [" ".join(c) for c in Network(7).teardown_commands()] == [
        "ip netns del onnxps-bench-7-x", "ip netns del onnxps-bench-7-h0", "ip netns del onnxps-bench-7-h1",
        "ip link del psb7h0", "ip link del psb7h1"]
    assert Network(7, hosts=3).namespaces() == ["onnxps-bench-7-x", "onnxps-bench-7-h0", "onnxps-bench-7-h1",
                                                "onnxps-bench-7-h2"]


def test_a_host_each_placement_gives_every_process_its_own_host() -> None:
    place = Placement("host-each", shards=2, workers=3)
    assert place.hosts == 5
    assert [place.shard(i) for i in range(2)] == [0, 1]
    assert [place.worker(i) for i in range(3)] == [2, 3, 4]
    assert [place.ddp_rank(r) for r in range(3)] == [2, 3, 4]   # all-reduce's ranks are the workers


def test_a_two_hosts_placement_keeps_shards_and_workers_apart() -> None:
    place = Placement("two-hosts", shards=2, workers=3)
    assert place.hosts == 2
    assert {place.shard(i) for i in range(2)} == {0} and {place.worker(i) for i in range(3)} == {1}
    assert [place.ddp_rank(r) for r in range(3)] == [0, 1, 1]   # its bytes cross the one link
    with pytest.raises(ValueError, match="netns layout 'ring': one of host-each, two-hosts"):
        Placement("ring", 1, 1)


def test_a_cleanup_removes_only_ours_of_processes_that_are_gone() -> None:
    listing = "onnxps-bench-11-x (id: 0)\nonnxps-bench-11-h0 (id: 1)\nonnxps-bench-11-h12\nonnxps-bench-22-h0\n" \
              "someone-else\nonnxps-bench-33-y\nonnxps-bench-abc-x\nonnxps-bench-44-s\nonnxps-bench-44-w\n"
    links = ("1: lo: <LOOPBACK,UP> mtu 65536 qdisc noqueue\n"
             "5: psb11h0@if6: <BROADCAST,MULTICAST> mtu 1500 qdisc noop\n"
             "6: psb11x0@psb11h0: <BROADCAST,MULTICAST> mtu 1500 qdisc noop\n"
             "7: psb22h1@psb22x1: <BROADCAST> mtu 1500\n"
             "8: psb44s: <BROADCAST> mtu 1500\n"
             "9: psbx1s: <BROADCAST> mtu 1500\n"
             "10: eth0: <BROADCAST,UP> mtu 1500\n")
    namespaces, devices = netns.parse_netns_list(listing), netns.parse_link_names(links)
    assert namespaces[:3] == ["onnxps-bench-11-x", "onnxps-bench-11-h0", "onnxps-bench-11-h12"]
    assert devices == ["lo", "psb11h0", "psb11x0", "psb22h1", "psb44s", "psbx1s", "eth0"]
    alive = {22}
    # what an earlier version named (-s, -w, psb<pid>s) is ours too; names that only look alike are not
    assert netns.stale(namespaces, devices, lambda pid: pid in alive) == (
        ["onnxps-bench-11-x", "onnxps-bench-11-h0", "onnxps-bench-11-h12", "onnxps-bench-44-s", "onnxps-bench-44-w"],
        ["psb11h0", "psb11x0", "psb44s"])


def test_the_trampoline_runs_a_module_in_a_namespace_under_the_same_interpreter() -> None:
    argv = Network(5).exec_argv(1, "ps_bench.train_worker", ["--index", 1])
    assert argv == [sys.executable, "-P", "-m", "ps_bench.netns", "exec", "onnxps-bench-5-h1",
                    "ps_bench.train_worker", "--index", "1"]


def test_the_trampoline_enters_only_a_namespace_of_ours() -> None:
    with pytest.raises(SystemExit, match="not a namespace of this module"):
        netns.main(["exec", "some-other-namespace", "ps_server"])
    assert netns.main(["what"]) == 2


def test_the_bytes_a_veth_end_sent_are_read_from_ip_s_j() -> None:
    assert Network(9).traffic_command(1) == ["ip", "-n", "onnxps-bench-9-h1", "-s", "-j", "link", "show", "dev",
                                             "psb9h1"]
    shown = '[{"ifname": "psb9h1", "stats64": {"rx": {"bytes": 5}, "tx": {"bytes": 1234567, "packets": 10}}}]'
    assert netns.parse_tx_bytes(shown) == 1234567
    assert netns.parse_tx_bytes("") == 0 and netns.parse_tx_bytes('[{"ifname": "x"}]') == 0


def test_the_push_pull_benchmark_runs_itself_again_on_the_client_host_told_where_the_servers_are() -> None:
    net = Network(77, rate="5gbit")
    argv = pushpull_bench.inside_argv(["--netns", "--sizes-mb", "1", "--netns-rate", "5gbit", "--data-path",
                                       "channel", "--netns-rate=2gbit"], net)
    assert argv[:6] == [sys.executable, "-P", "-m", "ps_bench.netns", "exec", "onnxps-bench-77-h1"]
    assert argv[6:11] == ["ps_bench.pushpull_bench", "--sizes-mb", "1", "--data-path", "channel"]
    assert argv[11] == "--inside" and len(argv) == 13
    sites = pushpull_bench.Sites.from_json(argv[12])
    assert sites == pushpull_bench.Sites("onnxps-bench-77-h0", "10.77.0.1", "psb77h0", "psb77h1",
                                         "netns veth tbf 5gbit")
    # the servers start on host 0 through the trampoline; TensorPipe is told each side's card
    assert sites.server_child("ps_bench.torch_rpc", ["store", "--port", 5]) == (
        "ps_bench.netns", ["exec", "onnxps-bench-77-h0", "ps_bench.torch_rpc", "store", "--port", "5"])
    assert sites.tensorpipe_env("server") == {"TP_SOCKET_IFNAME": "psb77h0", "GLOO_SOCKET_IFNAME": "psb77h0"}
    assert sites.tensorpipe_env("client")["TP_SOCKET_IFNAME"] == "psb77h1"
    here = pushpull_bench.Sites()   # loopback: everything here
    assert here.server_child("ps_bench.pushpull_bench", ["--raw-tcp-child"]) == (
        "ps_bench.pushpull_bench", ["--raw-tcp-child"])
    assert here.network == "loopback" and here.server_address == "127.0.0.1"
