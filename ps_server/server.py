"""The composition root of one shard process: builds the Shard, its metrics, checkpoints and services,
and starts the gRPC server (ps.v1.ParameterServer, ps.v1.Admin, grpc.health.v1.Health, reflection) and
the data channel's listener (ps_server/data_channel.py), unless it is turned off.

This is the one module that wires things together; nothing imports it but the CLI and tests.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps_common import data_channel as dc
from ps_common.codec import MAX_MESSAGE_BYTES
from ps_common.errors import NotPrimaryError
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import replication_pb2 as rpb
from ps_server import security, service
from ps_server.admin import AdminServicer
from ps_server.admission import CONTROL_THREADS, Admission, DataPlanePool, StreamWatchdog
from ps_server.checkpoints import Checkpointer
from ps_server.config import ServerConfig
from ps_server.consistency import ConsistencyPolicy
from ps_server.data_channel import DataChannelServer
from ps_server.metrics import ShardMetrics
from ps_server.replication.quorum import Voter
from ps_server.replication.replica import Peers, Replica, ReplicaConfig
from ps_server.replication.service import ReplicationServicer
from ps_server.service import ParameterServerServicer
from ps_server.shared_memory import Segments
from ps_server.shard import Shard

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name
REPLICATION_SERVICE_NAME = rpb.DESCRIPTOR.services_by_name["Replication"].full_name


class ShardServer:
    """A running shard: the gRPC server, the Shard behind it, and its lease-reaper thread."""

    def __init__(self, config: ServerConfig, *, policy: ConsistencyPolicy | None = None) -> None:
        self.config = config
        security.check_bind(config)   # plaintext on a non-loopback host only when config.insecure
        credentials = security.server_credentials(config)   # None: plaintext
        self.shard = Shard(config, policy=policy)
        self.metrics = ShardMetrics(self.shard)   # its own registry; metrics.serve() starts the endpoint
        # Restored before the port is bound: no rpc ever sees the state from before the restore.
        self.checkpointer = Checkpointer(self.shard, config) if config.checkpoint_dir else None
        if self.checkpointer is not None:
            self.checkpointer.restore()
        # Two pools (ps_server/admission.py): the data plane's, as large as rpc_threads (threads made as
        # needed), and the control rpcs', which no stalled or waiting data-plane call can take.
        self._data_pool = futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                     thread_name_prefix=f"shard{config.shard_index}-data")
        data_plane = frozenset(f"/{SERVICE_NAME}/{rpc}" for rpc in service.DATA_PLANE_RPCS)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=CONTROL_THREADS, thread_name_prefix=f"shard{config.shard_index}"),
            options=[
                ("grpc.max_receive_message_length", config.max_receive_message_bytes),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # a replicated shard's clients ping every 0.5 s while a call is in flight, to find a frozen
                # primary (worker_client/client/ps_client.py, KEEPALIVE_MS): such pings are not abuse here
                *([("grpc.http2.min_ping_interval_without_data_ms", 100), ("grpc.http2.max_ping_strikes", 0)]
                  if config.replicas else []),
            ],
            maximum_concurrent_rpcs=config.concurrent_rpcs_limit,
            interceptors=[DataPlanePool(self._data_pool, data_plane), self.metrics.interceptor,
                          *security.interceptors(config)],
        )
        self.watchdog = StreamWatchdog(config.stream_idle_seconds)
        admission = Admission(config.data_plane_limit, shard_index=config.shard_index, is_live=self.shard.holds_lease)
        self.segments = Segments(limit=config.max_registered_workers, shard_index=config.shard_index)
        servicer = ParameterServerServicer(self.shard, admission=admission, watchdog=self.watchdog,
                                           segments=self.segments)
        service.add_to_server(servicer, self.server)
        service.add_to_server(AdminServicer(self.shard, self.checkpointer, self.stop), self.server, "Admin")
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.replica: Replica | None = None
        replicated = bool(config.replicas) or config.witness
        reflection.enable_server_reflection(
            (SERVICE_NAME, ADMIN_SERVICE_NAME, *([REPLICATION_SERVICE_NAME] if replicated else []),
             health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        if replicated:   # docs/replication.md: a voter in every replica process, and this shard's replica
            own = config.replicas[config.replica_index] if config.replicas else f"{config.host}:{config.port}"
            self.voter = Voter()
            peers = Peers(security.peer_credentials(config), security.peer_metadata(config))
            if config.replicas:
                self.replica = Replica(self.shard, ReplicaConfig(
                    shard=config.shard_index, replica=config.replica_index, replicas=tuple(config.replicas),
                    voters=tuple(config.voters or config.replicas), address=own), self.voter, peers)
                self.metrics.watch_replica(self.replica.status)
            else:
                self.shard.role_check = self._witness_refuses
            # through the product's boundary (bytes that do not parse: INVALID_ARGUMENT), not the generated adder
            service.add_to_server(ReplicationServicer(self.voter, self.replica, own), self.server, "Replication", rpb)
        bind_port = config.port
        if config.replicas and not bind_port:
            bind_port = int(config.replicas[config.replica_index].rpartition(":")[2])
        address = f"{config.host}:{bind_port}"
        try:
            self.port = (self.server.add_insecure_port(address) if credentials is None
                         else self.server.add_secure_port(address, credentials))
        except RuntimeError:   # grpc's "Failed to bind": the port is taken, or the host is not this machine's
            self.port = 0
        if self.port == 0:
            raise OSError(f"shard {config.shard_index}: cannot bind {address}: the port is in use or the host is "
                          f"not an address of this machine; choose another --port (0 picks a free one) or --host, "
                          f"or stop the process that holds the port")
        self.address = f"{config.host}:{self.port}"
        #: the data channel's listener (PushPull's bytes from other hosts); None when turned off
        self.data_channel: DataChannelServer | None = None
        if config.data_channel:
            try:
                self.data_channel = DataChannelServer(
                    config.host, config.data_channel_port, servicer.push_pull_on_channel,
                    shard_index=config.shard_index, limit=config.max_registered_workers,
                    idle_seconds=config.stream_idle_seconds,
                    tls=dc.server_tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
                    if security.tls_enabled(config) else None, observe=self.metrics.observe_rpc)
            except BaseException:
                self.server.stop(0)
                raise
            servicer.channel = self.data_channel
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)

    def start(self) -> "ShardServer":
        self.server.start()
        if self.data_channel is not None:
            self.data_channel.start()
        self._reaper.start()
        self.watchdog.start()
        if self.replica is not None:
            self.replica.start()
        if self.checkpointer is not None:
            self.checkpointer.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("shard %d/%d serving on %s, mode %s, optimizer %s%s", self.config.shard_index, self.config.num_shards,
                 self.address, self.shard.policy.describe(), self.shard.optimizer.name,
                 f", data channel on port {self.data_channel.port}" if self.data_channel is not None else "")
        return self

    def _witness_refuses(self) -> None:
        raise NotPrimaryError(f"{self.address} is a witness: it votes only and holds no shard")

    def _reap(self) -> None:
        period = min(1.0, self.config.lease_seconds / 4)
        while not self._stop.wait(period):
            self.shard.tick()

    def stop(self, grace: float = 2.0) -> None:
        """Stops serving: health NOT_SERVING, waiters woken with UNAVAILABLE, then the server."""
        self.health.enter_graceful_shutdown()
        self._stop.set()
        if self.replica is not None:
            self.replica.stop()
        self.shard.stop()
        if self.data_channel is not None:
            self.data_channel.close()   # calls in flight end; their workers go on over gRPC
        self.watchdog.stop()
        if self.checkpointer is not None:
            self.checkpointer.stop()   # the final checkpoint: no push is taken after shard.stop()
        self.server.stop(grace).wait(grace + 1)
        self._data_pool.shutdown(wait=False, cancel_futures=True)
        self.segments.close_all()
        self.metrics.close()

    def wait(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


def create_server(config: ServerConfig) -> tuple[ShardServer, int]:
    """A started shard server and the port it bound (config.port 0 picks a free one)."""
    server = ShardServer(config).start()
    return server, server.port
