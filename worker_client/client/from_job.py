"""The PSClient a worker process (ps-worker, a pipeline stage) opens from its job configuration."""

from __future__ import annotations

import threading

from ps_common import data_channel
from ps_common.jobconfig import JobConfig
from ps_common.tls import AUTH_TOKEN_ENV, client_security, token_from
from worker_client.client.ps_client import PSClient
from worker_client.client.retry import RetryPolicy

__all__ = ["client_for_job"]


def client_for_job(job: JobConfig, *, worker_id: str, stop: threading.Event | None = None) -> PSClient:
    """A client of the job's shards with the worker's settings: its gRPC credentials and token, and for the
    data channel the same TLS files (a shard serving TLS serves its channel with TLS too: without them the
    bytes would fall back to gRPC), the data paths and the wire dtype."""
    w = job.worker
    credentials, metadata = client_security(w.tls_ca, w.tls_cert, w.tls_key,
                                            token_from(job.job.auth_token_file, env_var=AUTH_TOKEN_ENV))
    channel_tls = data_channel.client_tls_context(w.tls_ca, w.tls_cert, w.tls_key) if w.tls_ca else None
    return PSClient(w.servers, worker_id=worker_id, rpc_timeout=w.rpc_timeout, wait_timeout=job.job.wait_timeout,
                    retry=RetryPolicy(window=w.reconnect_timeout), channel_credentials=credentials,
                    call_metadata=metadata, stop=stop, shared_memory=w.shared_memory,
                    shared_memory_min_bytes=w.shared_memory_min_bytes, wire_dtype=job.job.wire_dtype,
                    data_channel_tls=channel_tls)
