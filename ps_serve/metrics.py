"""Prometheus metrics of one ps-serve process, on its own registry, served at ``GET /metrics``.

Metric names (all prefixed ``ps_serve_``, all with the ``model`` label):

  requests_total{protocol,endpoint,code}    finished requests: protocol http|grpc, endpoint the route's name
                                            (infer, model_metadata, server_live, ...; "unmatched" for a path
                                            that is no route), code the HTTP status or the gRPC status name
  request_duration_seconds{protocol,endpoint}  histogram of a request's time in the server (reading the body,
                                            decoding, the model run, encoding)
  inference_duration_seconds                histogram of the model runs alone (onnxruntime), successful ones
  step                                      the training step the served model holds; absent while unknown
                                            (read at scrape time, so it follows every swap)

With --follow (ps_serve/follow.py), also:

  follow_swaps_total                        new steps swapped in from the job
  follow_failures_total                     reads of the job's shards that failed (the last good step stays served)
  follow_shard_step{shard}                  each shard's step in the served state
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the HTTP endpoint
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ps_serve.model import ServedModel

#: Latency buckets in seconds: a small model answers in well under a millisecond, a large one in seconds.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The counters and histograms of one served model, and the scrape of its step."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.registry = CollectorRegistry(auto_describe=True)
        model = served.name
        self._requests = Counter("ps_serve_requests_total", "Finished requests by protocol, endpoint and status",
                                 ["model", "protocol", "endpoint", "code"], registry=self.registry)
        self._request_seconds = Histogram("ps_serve_request_duration_seconds",
                                          "Time from a request's arrival to its answer",
                                          ["model", "protocol", "endpoint"], buckets=BUCKETS, registry=self.registry)
        self._inference = Histogram("ps_serve_inference_duration_seconds", "Model runs (onnxruntime) alone",
                                    ["model"], buckets=BUCKETS, registry=self.registry).labels(model)
        self.registry.register(_StepCollector(served))
        self._model = model

    def request(self, protocol: str, endpoint: str, code: int | str, seconds: float) -> None:
        self._requests.labels(self._model, protocol, endpoint, str(code)).inc()
        self._request_seconds.labels(self._model, protocol, endpoint).observe(seconds)

    def inference(self, seconds: float) -> None:
        self._inference.observe(seconds)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class FollowCollector(Collector):
    """The follower's counters, read at scrape time (`follower`: a ps_serve.follow.Follower)."""

    def __init__(self, model: str, follower) -> None:
        self.model = model
        self.follower = follower

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        swaps = CounterMetricFamily("ps_serve_follow_swaps", "New steps of the followed job swapped in",
                                    labels=["model"])
        swaps.add_metric([self.model], float(self.follower.swaps))
        yield swaps
        failures = CounterMetricFamily("ps_serve_follow_failures", "Failed reads of the followed job's shards",
                                       labels=["model"])
        failures.add_metric([self.model], float(self.follower.failures))
        yield failures
        steps = GaugeMetricFamily("ps_serve_follow_shard_step", "Each shard's step in the served state",
                                  labels=["model", "shard"])
        for shard, step in enumerate(self.follower.served_steps):
            steps.add_metric([self.model, str(shard)], float(step))
        yield steps


class _StepCollector(Collector):
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("ps_serve_step", "Training step of the served model (absent while unknown)",
                                  labels=["model"])
        step = self.served.current().step
        if step is not None:
            gauge.add_metric([self.served.name], float(step))
        yield gauge
