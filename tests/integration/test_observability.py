"""Integration tests for observability: /metrics of in-process shards on port 0, JSON logs, `ps-ctl status`."""

from __future__ import annotations

import io
import json
import logging
import socket
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_common.logs import configure_logging
from ps_server import metrics
from ps_tools import ctl
from ps_server.config import ServerConfig
from ps_server.server import ShardServer, create_server
from worker_client.client import PSClient

PARAMS = {"w": np.ones((64, 8), dtype=np.float32), "b": np.zeros(8, dtype=np.float32)}
PARAM_BYTES = sum(a.nbytes for a in PARAMS.values())
GRADS = {n: np.full_like(a, 0.5) for n, a in PARAMS.items()}


def start(**settings) -> tuple[ShardServer, int]:
    """A started shard server and its metrics port, both bound on port 0."""
    server, _ = create_server(ServerConfig(**settings))
    return server, server.metrics.serve(0, "127.0.0.1")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:port/metrics, keyed by (name, sorted labels without `shard`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "shard"))
            samples[(s.name, labels)] = s.value
    return samples


def table_rows(table: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The SHARDS and WORKERS sections of a status table as lists of dicts keyed by their column headers."""
    shards, workers = ([dict(zip(lines[1].split(), row.split())) for row in lines[2:]]
                       for lines in (section.splitlines() for section in table.split("\n\n")))
    return shards, workers


def sample(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def sync_shard():
    """One sync shard (N=1 of M=2) with its metrics endpoint; stopped after the test."""
    server, port = start(mode="sync", replicas_to_aggregate=1, total_replicas=2)
    yield server, port
    server.stop(grace=0.5)


def test_scraped_counters_move_by_exactly_the_pushes_pulls_drops_and_retries_made(sync_shard):
    server, port = sync_shard
    with PSClient([server.address], worker_id="w0") as w0, PSClient([server.address], worker_id="w1") as w1:
        w0.initialize(PARAMS)
        w0.register(heartbeat=False)
        w1.register(heartbeat=False)
        w1.fetch_shard_map()
        before = scrape(port)
        w0.pull()                                          # step 0
        assert w0.push(GRADS).accepted                     # completes step 0: t = 1
        assert w0.push(GRADS, clock=0, read_steps=[0]).responses[0].duplicate   # a retry
        assert not w1.push(GRADS, read_steps=[0]).accepted  # read at step 0 < 1: stale
        after = scrape(port)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("ps_pushes_total", outcome="accepted", reason="none") == 1
    assert delta("ps_pushes_total", outcome="dropped", reason="stale") == 1
    assert delta("ps_pushes_total", outcome="dropped", reason="already_contributed") == 0
    assert delta("ps_duplicate_pushes_total") == 1
    assert delta("ps_pulls_total") == 1
    assert delta("ps_sent_bytes_total") == PARAM_BYTES
    assert delta("ps_received_bytes_total") == 2 * PARAM_BYTES      # the duplicate is not counted
    assert delta("ps_rpc_duration_seconds_count", rpc="Push") == 3
    assert delta("ps_rpcs_total", rpc="Push", code="OK") == 3
    assert delta("ps_rpc_duration_seconds_count", rpc="Pull") == 1
    assert delta("ps_push_staleness_steps_sum") == 1                # the stale push arrived one step late
    assert sample(after, "ps_step") == 1
    assert sample(after, "ps_worker_clock", worker="w0") == 1
    assert sample(after, "ps_worker_clock", worker="w1") == 1
    assert sample(after, "ps_workers_live") == 2
    assert sample(after, "ps_effective_replicas") == 1


def test_a_failed_rpc_is_counted_under_its_status_code(sync_shard):
    server, port = sync_shard
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(pb.PullRequest(names=["missing"]), timeout=5))   # before init
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            stub.Heartbeat(pb.HeartbeatRequest(worker_id="nobody"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    samples = scrape(port)
    assert sample(samples, "ps_rpcs_total", rpc="Pull", code="FAILED_PRECONDITION") == 1
    assert sample(samples, "ps_rpcs_total", rpc="Heartbeat", code="NOT_FOUND") == 1
    assert sample(samples, "ps_rpcs_total", rpc="Pull", code="OK") == 0


def test_each_shard_in_one_process_serves_only_its_own_metrics():
    a, port_a = start(shard_index=0, num_shards=2)
    b, port_b = start(shard_index=1, num_shards=2)
    try:
        assert port_a != port_b
        with PSClient([a.address, b.address], worker_id="w0") as client:
            client.initialize(PARAMS)
            client.register(heartbeat=False)
            client.pull()
            client.push(GRADS)
        for port, index in ((port_a, "0"), (port_b, "1")):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                families = list(text_string_to_metric_families(response.read().decode()))
            shards = {s.labels["shard"] for f in families for s in f.samples if "shard" in s.labels}
            assert shards == {index}
        received = [sample(scrape(p), "ps_received_bytes_total") for p in (port_a, port_b)]
        assert sum(received) == PARAM_BYTES and all(r > 0 for r in received)
    finally:
        a.stop(grace=0.5)
        b.stop(grace=0.5)


def test_the_metrics_endpoint_stops_with_its_server():
    server, port = start()
    assert sample(scrape(port), "ps_initialized") == 0
    server.stop(grace=0.5)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_shard_writes_json_log_lines_with_its_fields():
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    out = io.StringIO()
    try:
        configure_logging("INFO", json=True, stream=out, fields={"shard": 0})
        server, _ = create_server(ServerConfig())
        with PSClient([server.address], worker_id="w-json") as client:
            client.register(heartbeat=False)
        server.stop(grace=0.5)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    entries = [json.loads(line) for line in out.getvalue().splitlines()]
    assert entries and all({"ts", "level", "logger", "msg", "shard"} <= e.keys() for e in entries)
    assert any(e["logger"] == "ps_server.server" and server.address in e["msg"] for e in entries)
    assert any("'w-json' registered" in e["msg"] for e in entries)


# ---------------------------------------------------------------------- ps-ctl status


@pytest.fixture
def two_shards():
    servers = [create_server(ServerConfig(shard_index=i, num_shards=2, mode="async"))[0] for i in range(2)]
    yield servers
    for s in servers:
        s.stop(grace=0.5)


def test_status_prints_each_shard_step_and_the_registered_workers(two_shards, capsys):
    addresses = [s.address for s in two_shards]
    with PSClient(addresses, worker_id="trainer-a") as a, PSClient(addresses, worker_id="trainer-b") as b:
        a.initialize(PARAMS)
        a.register(heartbeat=False)
        b.register(heartbeat=False)
        a.pull()
        for _ in range(3):
            a.push(GRADS)
        b.pull()
        b.push(GRADS)
        assert ctl.main(["status", ",".join(addresses)]) == 0
    shards, workers = table_rows(capsys.readouterr().out)
    assert [(s["index"], s["address"], s["step"], s["initialized"]) for s in shards] == [
        ("0", addresses[0], "4", "yes"), ("1", addresses[1], "4", "yes")]   # 3 + 1 pushes applied on each
    assert [(w["worker"], w["clock@0"], w["clock@1"], w["live"]) for w in workers] == [
        ("trainer-a", "3", "3", "yes"), ("trainer-b", "1", "1", "yes")]


def test_status_json_holds_the_same_cluster(two_shards, capsys):
    addresses = [s.address for s in two_shards]
    assert ctl.main(["status", *addresses, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [s["address"] for s in summary["shards"]] == addresses
    assert [s["step"] for s in summary["shards"]] == [0, 0]
    assert summary["workers"] == [] and summary["errors"] == []


def test_status_names_an_unreachable_address_and_still_prints_the_others(two_shards, capsys):
    with socket.socket() as probe:         # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    assert ctl.main(["status", f"{two_shards[0].address},{dead}", "--timeout", "2"]) == 1
    captured = capsys.readouterr()
    assert f"shard at {dead} unreachable" in captured.err
    assert two_shards[0].address in captured.out
