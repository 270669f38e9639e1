"""Unit tests for observability without sockets: shard metrics from events and state, JSON logs, the status table."""

from __future__ import annotations

import io
import json
import logging
import os
import resource
import sys

import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import cluster_info, codec
from ps_common.logs import configure_logging
from ps_common.shard_map import ParamSpec
from ps_server.config import ServerConfig
from ps_server import metrics as shard_metrics
from ps_server.metrics import ShardMetrics
from ps_server.shard import Shard
from ps_server.operations import Push
from tests.helpers.domain import decode, initialize, pull_values
from ps_tools import ctl

WEIGHT = np.arange(12, dtype=np.float32).reshape(4, 3)   # 48 bytes
BIAS = np.zeros(3, dtype=np.float64)                     # 24 bytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_shard(now=None, **settings) -> tuple[Shard, ShardMetrics]:
    shard = Shard(ServerConfig(**settings), **({"now": now} if now else {}))
    params = {"w": WEIGHT, "b": BIAS}
    specs = [ParamSpec(n, a.dtype.name, a.shape) for n, a in params.items()]
    chunks = [c for n, a in params.items() for c in codec.part_chunks(n, a)]
    initialize(shard, specs, chunks)
    return shard, ShardMetrics(shard, process=False)


def push(shard: Shard, worker: str, clock: int, read_step: int, scale: float = 1.0):
    grads = {"w": np.full_like(WEIGHT, scale), "b": np.full_like(BIAS, scale)}
    decoded = decode((c for n, g in grads.items() for c in codec.part_chunks(n, g)), shard.push_layout())
    return shard.push(Push(worker, clock, read_step, decoded))


def value(m: ShardMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, {"shard": m.label, **labels})


# ---------------------------------------------------------------------- metrics


def test_every_push_outcome_series_is_exported_at_zero_before_any_push():
    _, m = make_shard()
    assert value(m, "ps_pushes_total", outcome="accepted", reason="none") == 0
    assert value(m, "ps_pushes_total", outcome="dropped", reason="stale") == 0
    assert value(m, "ps_pushes_total", outcome="dropped", reason="already_contributed") == 0


def test_an_accepted_push_counts_once_and_adds_its_gradient_bytes():
    shard, m = make_shard(mode="async")
    shard.register("w0")
    push(shard, "w0", 0, 0)
    assert value(m, "ps_pushes_total", outcome="accepted", reason="none") == 1
    assert value(m, "ps_received_bytes_total") == WEIGHT.nbytes + BIAS.nbytes


def test_a_stale_sync_push_counts_as_dropped_with_reason_stale():
    shard, m = make_shard(mode="sync", replicas_to_aggregate=1, total_replicas=2)
    shard.register("w0")
    shard.register("w1")
    assert push(shard, "w0", 0, 0).accepted            # completes step 0: t = 1
    assert not push(shard, "w1", 0, 0).accepted        # read at step 0 < t: stale
    assert value(m, "ps_pushes_total", outcome="accepted", reason="none") == 1
    assert value(m, "ps_pushes_total", outcome="dropped", reason="stale") == 1
    assert value(m, "ps_pushes_total", outcome="dropped", reason="already_contributed") == 0


def test_a_retried_push_counts_as_a_duplicate_and_not_as_another_push():
    shard, m = make_shard(mode="async")
    shard.register("w0")
    push(shard, "w0", 0, 0)
    assert push(shard, "w0", 0, 0).duplicate
    assert value(m, "ps_duplicate_pushes_total") == 1
    assert value(m, "ps_pushes_total", outcome="accepted", reason="none") == 1
    assert value(m, "ps_received_bytes_total") == WEIGHT.nbytes + BIAS.nbytes


def test_a_pull_counts_once_and_adds_the_parameter_bytes_it_served():
    shard, m = make_shard()
    pull_values(shard, ["w"], min_step=0, worker_id="", clock=0, timeout=1.0)
    pull_values(shard, [], min_step=0, worker_id="", clock=0, timeout=1.0)
    assert value(m, "ps_pulls_total") == 2
    assert value(m, "ps_sent_bytes_total") == WEIGHT.nbytes + (WEIGHT.nbytes + BIAS.nbytes)


def test_staleness_histogram_records_how_many_steps_behind_each_push_arrived():
    shard, m = make_shard(mode="async")
    shard.register("w0")
    for clock in range(3):                # all read at step 0, arriving at steps 0, 1 and 2
        push(shard, "w0", clock, 0)
    assert value(m, "ps_push_staleness_steps_count") == 3
    assert value(m, "ps_push_staleness_steps_sum") == 0 + 1 + 2
    assert value(m, "ps_push_staleness_steps_bucket", le="0.0") == 1
    assert value(m, "ps_push_staleness_steps_bucket", le="1.0") == 2


def test_step_clock_and_live_worker_gauges_are_read_from_the_shard_at_scrape_time():
    clock = FakeClock()
    shard, m = make_shard(now=clock, mode="async", lease_seconds=10)
    shard.register("w0")
    shard.register("w1")
    push(shard, "w0", 0, 0)
    push(shard, "w0", 1, 1)
    assert value(m, "ps_step") == 2
    assert value(m, "ps_worker_clock", worker="w0") == 2
    assert value(m, "ps_worker_clock", worker="w1") == 0
    assert value(m, "ps_workers_live") == 2
    clock.now += 6
    shard.heartbeat("w0")
    clock.now += 6                        # w1's lease ran out, w0's did not
    assert value(m, "ps_workers_live") == 1
    assert value(m, "ps_workers_registered") == 2
    assert value(m, "ps_parts") == 2
    assert value(m, "ps_parameter_bytes") == WEIGHT.nbytes + BIAS.nbytes
    assert value(m, "ps_initialized") == 1


def test_effective_replicas_follow_live_workers_in_sync_mode_and_are_absent_otherwise():
    shard, m = make_shard(mode="sync", replicas_to_aggregate=3, total_replicas=3)
    shard.register("w0")
    shard.register("w1")
    assert value(m, "ps_effective_replicas") == 2
    _, m_async = make_shard(mode="async")
    assert value(m_async, "ps_effective_replicas") is None


def test_two_shards_in_one_process_count_into_separate_registries():
    a, ma = make_shard(mode="async")
    b, mb = make_shard(mode="async")
    a.register("w0")
    push(a, "w0", 0, 0)
    assert value(ma, "ps_pushes_total", outcome="accepted", reason="none") == 1
    assert value(mb, "ps_pushes_total", outcome="accepted", reason="none") == 0
    assert ma.registry is not mb.registry


def test_closed_metrics_stop_listening_to_the_shard():
    shard, m = make_shard(mode="async")
    m.close()
    shard.register("w0")
    push(shard, "w0", 0, 0)
    assert value(m, "ps_pushes_total", outcome="accepted", reason="none") == 0
    assert m.on_event not in shard.events._listeners


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="resident memory is read from Linux's /proc")
def test_the_shard_exports_its_process_resident_and_peak_memory_with_its_shard_label():
    m = ShardMetrics(Shard(ServerConfig(shard_index=3, num_shards=4)), process=False)
    resident = value(m, "ps_process_resident_memory_bytes")
    peak = value(m, "ps_process_peak_resident_memory_bytes")
    assert resident is not None and peak is not None, "no memory figures with shard=3"
    assert 1 << 20 < resident <= peak   # a Python process holds more than 1 MiB
    # the same figure getrusage gives (ru_maxrss, KiB on Linux), read around it as it may grow
    assert peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 1.1


def test_process_memory_reads_vmrss_and_vmhwm_in_bytes_from_the_proc_status_file(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  999999 kB\nVmHWM:\t    4096 kB\nVmRSS:\t    2048 kB\n"
                      "Threads:\t4\n", encoding="ascii")
    assert shard_metrics.process_memory(str(status)) == (2048 * 1024, 4096 * 1024)


def test_without_a_proc_status_file_process_memory_gives_only_the_peak_from_getrusage(tmp_path):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    resident, peak = shard_metrics.process_memory(str(tmp_path / "no-such-status"))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes on macOS, KiB elsewhere
    assert resident is None
    assert before * scale <= peak <= after * scale


# ---------------------------------------------------------------------- logs


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_logs_are_one_object_a_line_with_ts_level_logger_msg_and_extra_fields(restore_root_logger):
    out = io.StringIO()
    configure_logging("INFO", json=True, stream=out, fields={"shard": 3})
    logging.getLogger("ps_server.test").info("pushed %d bytes", 48, extra={"worker": "w0", "step": 7})
    logging.getLogger("ps_server.test").debug("below the level")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["level"] == "INFO"
    assert entry["logger"] == "ps_server.test"
    assert entry["msg"] == "pushed 48 bytes"
    assert entry["worker"] == "w0" and entry["step"] == 7 and entry["shard"] == 3
    assert entry["ts"].endswith("Z") and "T" in entry["ts"]


def test_json_logs_carry_the_traceback_of_a_logged_exception(restore_root_logger):
    out = io.StringIO()
    configure_logging("WARNING", json=True, stream=out)
    try:
        raise KeyError("w9")
    except KeyError:
        logging.getLogger("x").exception("lookup failed")
    entry = json.loads(out.getvalue())
    assert entry["level"] == "ERROR" and entry["msg"] == "lookup failed"
    assert "KeyError: 'w9'" in entry["exc"]


def test_text_logs_are_plain_lines_and_reconfiguring_replaces_the_handler(restore_root_logger):
    first, second = io.StringIO(), io.StringIO()
    configure_logging("INFO", json=False, stream=first)
    configure_logging("INFO", json=False, stream=second)
    logging.getLogger("ps_server.x").warning("shard %d slow", 2)
    assert first.getvalue() == ""
    assert second.getvalue().rstrip().endswith("WARNING ps_server.x: shard 2 slow")
    assert len(second.getvalue().splitlines()) == 1


def test_an_unknown_log_level_is_rejected_naming_it(restore_root_logger):
    with pytest.raises(ValueError, match="'LOUD'"):
        configure_logging("LOUD")


# ---------------------------------------------------------------------- status table


def table_rows(table: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The SHARDS and WORKERS sections of a status table as lists of dicts keyed by their column headers."""
    shards, workers = ([dict(zip(lines[1].split(), row.split())) for row in lines[2:]]
                       for lines in (section.splitlines() for section in table.split("\n\n")))
    return shards, workers


def _info(index: int, step: int, workers: list[tuple[str, int, bool, int]]) -> pb.ClusterInfo:
    info = pb.ClusterInfo(shard_index=index, num_shards=2, mode=pb.MODE_SYNC, replicas_to_aggregate=2,
                          total_replicas=3, step=step, initialized=True, dropped_stale=index + 4, effective_replicas=2)
    info.parameters.append(codec.spec_to_wire("emb", "float32", (10, 4)))
    info.parts.add(name="emb", row_start=0, row_end=6, shard=0)
    info.parts.add(name="emb", row_start=6, row_end=10, shard=1)
    for worker_id, clock, live, lease_ms in workers:
        info.workers.add(worker_id=worker_id, clock=clock, live=live, lease_remaining_ms=lease_ms)
    return info


def test_status_counts_only_the_parts_and_bytes_each_shard_holds():
    assert cluster_info.owned_parts_and_bytes(_info(0, 1, [])) == (1, 6 * 4 * 4)
    assert cluster_info.owned_parts_and_bytes(_info(1, 1, [])) == (1, 4 * 4 * 4)


def test_status_table_shows_each_shard_step_and_every_worker_clock_per_shard():
    replies = [ctl.ShardReply("h:1", _info(0, 12, [("w0", 12, True, 9000), ("w1", 11, True, 4000)])),
               ctl.ShardReply("h:2", _info(1, 13, [("w0", 13, True, 8000)]))]
    shards, workers = table_rows(ctl.format_table(ctl.summarize(replies)))
    assert [(s["index"], s["address"], s["step"], s["bytes"], s["dropped"]) for s in shards] == [
        ("0", "h:1", "12", "96B", "4"), ("1", "h:2", "13", "64B", "5")]
    assert workers == [{"worker": "w0", "clock@0": "12", "clock@1": "13", "live": "yes", "lease_left": "8.0s"},
                       {"worker": "w1", "clock@0": "11", "clock@1": "-", "live": "yes", "lease_left": "4.0s"}]


def test_a_worker_is_live_only_where_every_shard_that_knows_it_holds_its_lease():
    replies = [ctl.ShardReply("h:1", _info(0, 1, [("w0", 1, True, 5000)])),
               ctl.ShardReply("h:2", _info(1, 1, [("w0", 1, False, 0)])),
               ctl.ShardReply("h:3", error="unreachable: UNAVAILABLE: refused")]
    summary = ctl.summarize(replies)
    assert summary["workers"] == [{"id": "w0", "clocks": {"0": 1, "1": 1}, "live": False, "lease_remaining_ms": 0}]
    assert summary["errors"] == [{"address": "h:3", "error": "unreachable: UNAVAILABLE: refused"}]
    assert [s["mode"] for s in summary["shards"]] == ["sync(N=2,M=3)", "sync(N=2,M=3)"]


def test_a_sync_quorum_capped_below_n_counts_each_time_an_expired_lease_shrinks_it():
    now = FakeClock()
    shard, m = make_shard(now=now, mode="sync", replicas_to_aggregate=3, total_replicas=3, lease_seconds=10)
    for w in ("w0", "w1", "w2"):
        shard.register(w)
    for w in ("w0", "w1", "w2"):
        push(shard, w, 0, 0)
    assert value(m, "ps_replicas_capped_total") == 0
    now.now += 8
    push(shard, "w0", 1, 1)
    push(shard, "w1", 1, 1)                 # w0 and w1 renew their leases; w2 was last heard at +0 s
    now.now += 4
    shard.tick()                            # w2's lease ran out: 3 -> 2
    assert value(m, "ps_replicas_capped_total") == 1
    now.now += 8
    push(shard, "w0", 2, 2)                 # w0 renews; w1 was last heard at +8 s
    now.now += 4
    shard.tick()                            # w1's lease ran out: 2 -> 1
    assert value(m, "ps_replicas_capped_total") == 2
    shard.register("w1")                    # back to 2: not a shrink
    shard.tick()
    assert value(m, "ps_replicas_capped_total") == 2


def test_workers_that_leave_by_deregistering_cap_the_quorum_without_counting_it():
    """A normal finish: every worker deregisters; an alert on ps_replicas_capped_total must stay quiet."""
    shard, m = make_shard(mode="sync", replicas_to_aggregate=3, total_replicas=3)
    for w in ("w0", "w1", "w2"):
        shard.register(w)
    for w in ("w0", "w1", "w2"):
        push(shard, w, 0, 0)
    shard.deregister("w2")                  # 3 -> 2
    shard.deregister("w1")                  # 2 -> 1
    shard.tick()
    assert shard.view().policy.effective_replicas == 1
    assert value(m, "ps_replicas_capped_total") == 0


def test_the_exposition_holds_no_created_series():
    from prometheus_client import generate_latest

    shard, m = make_shard(mode="sync", replicas_to_aggregate=1, total_replicas=1)
    shard.register("w0")
    push(shard, "w0", 0, 0)
    m.observe_rpc("Push", "OK", 0.01)
    text = generate_latest(m.registry).decode()
    assert "ps_pushes_total{" in text and "ps_rpc_duration_seconds_bucket{" in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line][:5]
