"""The `ps-server` command: runs one shard process until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from types import FrameType

from ps_common import jobconfig
from ps_common.jobconfig import JobConfig, JobConfigError
from ps_common.logs import configure_logging
from ps_common.tls import ADMIN_TOKEN_ENV, AUTH_TOKEN_ENV, READER_TOKEN_ENV, token_from
from ps_server.config import ServerConfig
from ps_server.optimizers import make_optimizer
from ps_server.server import create_server

log = logging.getLogger("ps_server")

#: The line a started shard prints on stdout, for launchers and tests that bind port 0.
READY_PREFIX = "PS_SERVER_READY "

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-server", description="Run one parameter-server shard (ps.v1 over gRPC). Settings come from "
                                      "the defaults, then --config JOB.toml, then TF_CONFIG, then these flags; "
                                      "see docs/settings.md.")
    jobconfig.add_arguments(p, scope="server")
    return p


def server_config(job: JobConfig, *, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The shard's ServerConfig from the job's settings (ValueError naming a bad value).

    Tokens come from the token files when set, else from $PS_AUTH_TOKEN / $PS_ADMIN_TOKEN /
    $PS_READER_TOKEN in `env` (default os.environ), never from flags.
    """
    s = job.server
    params = job.optimizer_hyperparameters()
    make_optimizer(s.optimizer, **params)   # validates the optimizer's name and hyperparameters up front
    return ServerConfig(
        shard_index=s.shard_index, num_shards=job.job.shards, host=s.host, port=s.port, mode=job.job.mode,
        replicas_to_aggregate=job.job.replicas_to_aggregate or 1, total_replicas=job.job.workers or 1,
        staleness=job.job.staleness, max_staleness=job.job.max_staleness, optimizer=s.optimizer,
        optimizer_params=params, partition_min_bytes=s.partition_min_bytes, chunk_bytes=s.chunk_bytes,
        lease_seconds=s.lease_seconds, wait_timeout_seconds=job.job.wait_timeout, max_workers=s.rpc_threads,
        checkpoint_dir=s.checkpoint_dir, checkpoint_every_steps=s.checkpoint_every_steps,
        checkpoint_every_seconds=s.checkpoint_every_seconds, checkpoint_keep=s.checkpoint_keep,
        metrics_port=s.metrics_port, log_json=job.job.log_json, tls_cert=s.tls_cert, tls_key=s.tls_key,
        tls_client_ca=s.tls_client_ca, auth_token=token_from(job.job.auth_token_file, env_var=AUTH_TOKEN_ENV, environ=env),
        admin_token=token_from(s.admin_token_file, env_var=ADMIN_TOKEN_ENV, environ=env),
        reader_token=token_from(s.reader_token_file, env_var=READER_TOKEN_ENV, environ=env), insecure=s.insecure,
        max_receive_message_bytes=s.max_receive_message_bytes, max_concurrent_rpcs=s.max_concurrent_rpcs,
        data_plane_calls=s.data_plane_calls, stream_idle_seconds=s.stream_idle_seconds,
        max_shard_bytes=s.max_shard_bytes, max_name_bytes=s.max_name_bytes, max_id_bytes=s.max_id_bytes,
        max_tensors=s.max_tensors, max_registered_workers=s.max_registered_workers, max_barriers=s.max_barriers,
        max_clock_ahead=s.max_clock_ahead, worker_retention_seconds=s.worker_retention_seconds,
        barrier_retention_seconds=s.barrier_retention_seconds, data_channel=s.data_channel,
        data_channel_port=s.data_channel_port, replicas=tuple(s.replicas), replica_index=s.replica_index,
        voters=tuple(s.voters), witness=s.witness)


def main(argv: list[str] | None = None) -> int:
    parent = os.getppid()   # read first: --stop-with-parent watches for it to change
    args = build_parser().parse_args(argv)
    try:
        job = jobconfig.load_config(args, scope="server")
        config = server_config(job)
    except (JobConfigError, ValueError) as exc:
        print(f"ps-server: {exc}", file=sys.stderr)
        return 2
    configure_logging(job.job.log_level, job.job.log_json, fields={"shard": config.shard_index})
    try:
        server, port = create_server(config)
    except (ValueError, OSError) as exc:
        print(f"ps-server: {exc}", file=sys.stderr)
        return 2
    ready = {"address": server.address, "port": port, "shard_index": config.shard_index}
    if config.replicas:
        ready["replica_index"] = config.replica_index
    if server.data_channel is not None:
        ready["data_channel_port"] = server.data_channel.port
    if config.metrics_port is not None:
        try:
            ready["metrics_port"] = server.metrics.serve(config.metrics_port, config.host)
        except OSError as exc:
            print(f"ps-server: {exc}", file=sys.stderr)
            server.stop()
            return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(READY_PREFIX + json.dumps(ready), flush=True)
    while not stop.is_set():
        if not server.wait(timeout=0.5):   # False: the gRPC server ended (ps.v1.Admin Shutdown stopped it)
            log.info("shard %d was shut down", config.shard_index)
            return 0                       # the stopping thread finishes (final checkpoint) before exit
        if job.job.stop_with_parent and os.getppid() != parent:
            log.warning("parent process %d is gone, stopping", parent)
            break
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
