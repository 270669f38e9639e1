"""Contract: GetClusterInfo, RegisterWorker, Heartbeat, DeregisterWorker, the health service and reflection."""

from __future__ import annotations

import threading

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec
from ps_common.shard_map import ParamSpec, build_shard_map
from tests.contract.wire import MODE_NAMES, RPC_TIMEOUT, Target, Workers, expect_status, new_id

RPCS = {"InitParameters", "Push", "Pull", "Barrier", "RegisterWorker", "Heartbeat", "DeregisterWorker", "GetClusterInfo",
        "PushPull", "OpenSharedMemory", "PullRows", "ReadState", "OpenDataChannel"}


def test_every_shard_reports_its_index_the_shard_count_and_one_shared_configuration(target: Target) -> None:
    infos = [target.info(i) for i in range(target.num_shards)]
    for shard, info in enumerate(infos):
        assert info.shard_index == shard, f"the address list is not in shard order: {target.addresses}"
        assert info.num_shards == target.num_shards
        assert info.mode in MODE_NAMES
        assert info.chunk_bytes > 0 and info.partition_min_bytes > 0 and info.optimizer
    shared = {(i.mode, i.replicas_to_aggregate, i.total_replicas, i.staleness, i.max_staleness, i.optimizer,
               i.partition_min_bytes) for i in infos}
    assert len(shared) == 1, shared


def test_cluster_info_states_the_settings_of_its_mode(target: Target) -> None:
    info = target.info(0)
    if info.mode == pb.MODE_SYNC:
        assert 1 <= info.replicas_to_aggregate <= info.total_replicas
        assert 1 <= info.effective_replicas <= info.replicas_to_aggregate
    elif info.mode == pb.MODE_SSP:
        assert info.staleness >= 0 or info.staleness == -1
    else:
        assert info.max_staleness >= 0


def test_every_shard_serves_the_same_shard_map_which_covers_each_tensor_once(ready: Target) -> None:
    infos = [ready.info(i) for i in range(ready.num_shards)]
    maps = [[(p.name, p.row_start, p.row_end, p.shard) for p in info.parts] for info in infos]
    assert all(m == maps[0] for m in maps)
    params = {p.name: (p.dtype, tuple(p.shape)) for p in infos[0].parameters}
    for name, array in ready.model.items():
        assert params[name] == (codec.dtype_to_wire(array.dtype), array.shape)
    for name, (_, shape) in params.items():
        rows = shape[0] if shape else 1
        ranges = sorted((p.row_start, p.row_end) for p in infos[0].parts if p.name == name)
        assert ranges[0][0] == 0 and ranges[-1][1] == rows, (name, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (name, ranges)
    # and it is the map every client computes from the parameter list
    specs = [ParamSpec(p.name, codec.dtype_name(p.dtype), tuple(p.shape)) for p in infos[0].parameters]
    expected = build_shard_map(specs, ready.num_shards, partition_min_bytes=infos[0].partition_min_bytes)
    assert maps[0] == [(p.name, p.row_start, p.row_end, p.shard) for p in expected.parts]


def test_register_worker_returns_a_clock_the_step_and_a_lease_and_shows_the_worker_live(target: Target,
                                                                                     workers: Workers) -> None:
    worker = workers.new()
    for shard in range(target.num_shards):
        info = target.info(shard)
        record = target.worker(info, worker)
        assert record is not None and record.live and record.lease_remaining_ms > 0
        assert record.clock == workers.start_clocks[worker][shard]
    [response, *_] = target.register(worker)         # renewing keeps the clock
    assert response.clock == workers.start_clocks[worker][0]
    assert response.lease_ms > 0 and response.step == target.info(0).step


def test_register_worker_with_an_empty_id_is_invalid(target: Target) -> None:
    for stub in target.stubs:
        expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                      lambda: stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=""), timeout=RPC_TIMEOUT))


def test_heartbeat_renews_a_registered_worker_and_an_unknown_one_is_not_found(target: Target, workers: Workers) -> None:
    worker = workers.new()
    ghost = new_id("contract-ghost")
    for shard, stub in enumerate(target.stubs):
        response = stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker), timeout=RPC_TIMEOUT)
        assert response.lease_ms > 0 and response.step == target.info(shard).step
        expect_status(grpc.StatusCode.NOT_FOUND,
                      lambda: stub.Heartbeat(pb.HeartbeatRequest(worker_id=ghost), timeout=RPC_TIMEOUT), repr(ghost))
        assert target.worker(target.info(shard), ghost) is None   # a refused heartbeat registers nobody


def test_heartbeat_with_an_empty_worker_id_is_invalid(target: Target) -> None:
    for stub in target.stubs:
        expect_status(grpc.StatusCode.INVALID_ARGUMENT,
                      lambda: stub.Heartbeat(pb.HeartbeatRequest(worker_id=""), timeout=RPC_TIMEOUT), "worker_id")


def test_deregister_worker_ends_the_lease_at_once_and_unknown_ids_are_ok(target: Target, workers: Workers) -> None:
    worker = workers.new()
    for shard, stub in enumerate(target.stubs):
        stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=worker), timeout=RPC_TIMEOUT)
        stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=new_id("contract-never")), timeout=RPC_TIMEOUT)
        record = target.worker(target.info(shard), worker)
        assert record is not None and not record.live and record.lease_remaining_ms == 0


def test_get_cluster_info_answers_while_a_pull_is_waiting(ready: Target) -> None:
    step = ready.info(0).step
    stream = ready.pull_stream(0, min_step=step + 1000, wait_timeout_ms=3000)
    waiting = threading.Thread(target=lambda: _drain(stream), daemon=True)
    waiting.start()
    try:
        info = ready.stubs[0].GetClusterInfo(pb.ClusterInfoRequest(), timeout=2)
        assert info.step == step
    finally:
        stream.cancel()
        waiting.join(10)


def _drain(stream) -> None:
    try:
        list(stream)
    except grpc.RpcError:
        pass


def test_every_shard_serves_the_standard_health_service_as_serving(target: Target) -> None:
    for channel in target.channels:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ps.v1.ParameterServer"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
            assert response.status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_lists_and_describes_the_parameter_server_with_every_rpc(target: Target) -> None:
    for channel in target.channels:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="ps.v1.ParameterServer")]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=RPC_TIMEOUT))
        names = {s.name for s in listed.list_services_response.service}
        assert {"ps.v1.ParameterServer", "grpc.health.v1.Health"} <= names
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in described.file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files if f.package == "ps.v1" for s in f.service if s.name == "ParameterServer"
                   for m in s.method}
        assert methods == RPCS
