"""The Grafana dashboard in deploy/grafana asks only for metrics a shard really exports, by shard.

A real shard (sync, with its metrics endpoint on port 0) takes an initialization, two
workers' pushes and pulls; every sample it then serves is collected from /metrics. Every
query of every panel must name at least one ps_ metric, and every metric it names must be
among them, so a renamed or dropped metric breaks this test, not the dashboard of the
person watching a job. Every panel follows the dashboard's shard variable, so every
metric a panel reads must carry the `shard` label on /metrics (the standard process_*
metrics do not: a panel of them shows "shard " for All and nothing for one shard), and a
latency panel lists only the rpcs called in its window (no NaN series).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ps_server.config import ServerConfig
from ps_server.server import create_server
from worker_client.client import PSClient

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "onnx-ps-shards.json"
#: A metric name in a PromQL expression: ours start with ps_, the process collector's with process_.
METRIC = re.compile(r"\b((?:ps|process)_[a-z0-9_]+)\b")
#: A metric name with its label matchers, if any.
SELECTOR = re.compile(r"\b((?:ps|process)_[a-z0-9_]+)\b(\{[^}]*\})?")
#: The matcher of the dashboard's shard variable.
SHARD_FILTER = 'shard=~"$shard"'
#: An aggregation in prefix form, with its `by`/`without` clause if any: ("sum", "by", "shard, rpc").
AGGREGATION = re.compile(r"\b(sum|min|max|avg|count|group|stddev|stdvar)\s*(?:(by|without)\s*\(([^)]*)\))?\s*\(")
#: The window of a rate() over a metric: rate(NAME{...}[WINDOW]).
RATE = r"rate\({name}\{{[^}}]*\}}\[(\w+)\]\)"
#: What the dashboard must show (issue 13): steps/s, push outcomes by reason, staleness, live workers, rpc latency.
REQUIRED = {"ps_step", "ps_pushes_total", "ps_push_staleness_steps_bucket", "ps_workers_live",
            "ps_rpc_duration_seconds_bucket"}


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel, and the template variables' queries."""
    found = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            found.append((f"variable {variable['name']}", query["query"]))
    return found


def panel_targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every target of every panel."""
    return [(panel["title"], target) for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.fixture(scope="module")
def samples() -> list[tuple[str, dict[str, str], float]]:
    """Every sample (name, labels, value) a sync shard serves on /metrics after two workers pushed and pulled."""
    server, _ = create_server(ServerConfig(mode="sync", replicas_to_aggregate=2, total_replicas=2))
    try:
        port = server.metrics.serve(0, "127.0.0.1")
        params = {"w": np.ones((16, 4), dtype=np.float32), "b": np.zeros(4, dtype=np.float32)}
        with PSClient([server.address], worker_id="w0") as w0, PSClient([server.address], worker_id="w1") as w1:
            w0.initialize(params)
            for client in (w0, w1):
                client.register(heartbeat=False)
            grads = {n: np.full_like(a, 0.1) for n, a in params.items()}
            w0.push(grads)
            w1.push(grads)
            w0.pull()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    finally:
        server.stop(grace=0.5)
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


@pytest.fixture(scope="module")
def exported(samples: list[tuple[str, dict[str, str], float]]) -> set[str]:
    """Every sample name the shard serves."""
    return {name for name, _, _ in samples}


def test_the_dashboard_is_a_grafana_dashboard_with_unique_panels_on_one_prometheus_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "shard"} <= names


def test_every_query_names_only_metrics_the_shards_really_export(exported: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    named: set[str] = set()
    for title, expr in queries(dashboard):
        metrics = set(METRIC.findall(expr))
        assert metrics, f"panel {title!r}: {expr!r} names no ps_ metric"
        unknown = metrics - exported
        assert not unknown, f"panel {title!r}: {expr!r} names {sorted(unknown)}, which no shard exports"
        named |= metrics
    assert REQUIRED <= named, f"the dashboard does not show {sorted(REQUIRED - named)}"
    assert not [n for n in exported if n.endswith("_created")]


def test_every_panel_follows_the_shard_variable_with_metrics_that_carry_the_shard_label(samples) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    unlabelled = {name for name, labels, _ in samples if "shard" not in labels}
    for title, target in panel_targets(dashboard):
        for name, matchers in SELECTOR.findall(target["expr"]):
            assert SHARD_FILTER in matchers, f"panel {title!r}: {name} in {target['expr']!r} is not filtered by shard"
            assert name not in unlabelled, (f"panel {title!r}: {name} has series without a shard label on /metrics: "
                                            f"filtered by shard it shows nothing, unfiltered a line named 'shard '")


def test_the_memory_panel_shows_each_shards_resident_and_peak_memory_by_shard(samples) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if "memory" in p["title"].lower()]
    assert len(panels) == 1, [p["title"] for p in dashboard["panels"]]
    names = set()
    for target in panels[0]["targets"]:
        expr = target["expr"]
        assert "{{shard}}" in target["legendFormat"], target
        for _, clause, labels in AGGREGATION.findall(expr):   # an aggregation must keep the shard label
            assert clause == "by" and "shard" in [x.strip() for x in labels.split(",")], expr
        names |= set(METRIC.findall(expr))
    assert names == {"ps_process_resident_memory_bytes", "ps_process_peak_resident_memory_bytes"}, names
    served = {name: (labels, value) for name, labels, value in samples if name in names}
    assert set(served) == names, f"the shard serves only {sorted(served)} of {sorted(names)}"
    (resident_labels, resident), (peak_labels, peak) = (served["ps_process_resident_memory_bytes"],
                                                        served["ps_process_peak_resident_memory_bytes"])
    assert resident_labels == peak_labels == {"shard": "0"}
    assert 1 << 20 < resident <= peak, (resident, peak)   # a Python process holds more than 1 MiB


def test_rpc_latency_panels_hide_the_rpcs_with_no_calls_in_the_window() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    latency = [(title, t["expr"]) for title, t in panel_targets(dashboard)
               if "histogram_quantile" in t["expr"] and "ps_rpc_duration_seconds_bucket" in t["expr"]]
    assert len(latency) >= 2, latency   # p99 and p50
    for title, expr in latency:
        window = re.search(RATE.format(name="ps_rpc_duration_seconds_bucket"), expr)
        assert window, expr
        # histogram_quantile(...) and on (rpc) (sum by (rpc) (rate(..._count{...}[W])) > 0): a series only
        # for an rpc called in the window W (without calls its quantile is NaN).
        calls = re.search(r"\)\s+and\s+on\s*\(\s*rpc\s*\)\s*\(?\s*sum\s+by\s*\(\s*rpc\s*\)\s*\("
                          + RATE.format(name="ps_rpc_duration_seconds_count") + r"\)\s*>\s*0\s*\)?\s*$", expr)
        assert calls, f"panel {title!r}: {expr!r} keeps rpcs with no calls in the window"
        assert calls.group(1) == window.group(1), f"panel {title!r}: the calls are counted over another window"
