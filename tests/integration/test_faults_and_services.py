"""A killed shard makes the client retry and then fail naming it; every shard serves health and reflection."""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from worker_client.client import PSClient, RetryPolicy, ServerError

MODEL = {"w": np.zeros((128, 32), np.float32), "b": np.zeros(32, np.float32)}
FLAGS = ["--partition-min-bytes", "4096"]


def test_a_killed_shard_makes_the_client_retry_unavailable_then_raise_naming_the_shard(start_cluster, caplog) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    retry = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.1)
    with PSClient(cluster.addresses, worker_id="w", rpc_timeout=10, wait_timeout=10, retry=retry) as worker:
        worker.wait_ready(30)
        worker.initialize(MODEL)
        worker.register(heartbeat=False)
        worker.pull()
        dead = cluster.addresses[1]
        assert cluster.kill(1) is not None           # SIGKILL, by pid: no goodbye
        assert not cluster.shards[1].alive()

        caplog.set_level(logging.WARNING, logger="worker_client.client")
        started = time.monotonic()
        with pytest.raises(ServerError) as failure:
            worker.pull()
        assert time.monotonic() - started < 10       # bounded: a few short backoffs, not a hang
        error = failure.value
        assert error.code == grpc.StatusCode.UNAVAILABLE
        assert error.address == dead
        assert "shard 1" in str(error) and dead in str(error) and "after 3 attempts" in str(error)
        retries = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(retries) == 2 and all("shard 1" in m for m in retries), retries

        with pytest.raises(ServerError, match=r"Push on shard 1 .* after 3 attempts: UNAVAILABLE"):
            worker.push({"w": np.ones((128, 32), np.float32)})
        # the surviving shard still answers
        assert worker.cluster_info(0).initialized


@pytest.mark.parametrize("service", ["", "ps.v1.ParameterServer"])
def test_every_shard_reports_serving_on_the_standard_health_service(start_cluster, service: str) -> None:
    cluster = start_cluster(2, mode="async")
    for address in cluster.addresses:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_parameter_server_and_health_services_and_describes_them(start_cluster) -> None:
    cluster = start_cluster(1, mode="async")
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="ps.v1.ParameterServer")]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"ps.v1.ParameterServer", "grpc.health.v1.Health"} <= names
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    services = {(f.package, s.name): [m.name for m in s.method] for f in files for s in f.service}
    assert set(services[("ps.v1", "ParameterServer")]) == {
        "InitParameters", "Push", "Pull", "Barrier", "RegisterWorker", "Heartbeat", "DeregisterWorker", "GetClusterInfo",
        "PushPull", "OpenSharedMemory", "PullRows", "ReadState", "OpenDataChannel"}
