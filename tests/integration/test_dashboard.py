"""The Grafana dashboard in deploy/grafana asks only for metrics a shard really exports.

A real shard (sync, with its metrics endpoint on port 0) takes an initialization, two
workers' pushes and pulls; every sample name it then serves is collected from
/metrics. Every query of every panel must name at least one ps_ metric, and every metric
it names must be among them, so a renamed or dropped metric breaks this test, not the
dashboard of the person watching a job.
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


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every sample name a sync shard serves on /metrics after two workers pushed and pulled."""
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
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


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
