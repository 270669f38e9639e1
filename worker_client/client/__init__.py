"""The client library: `PSClient` pushes and pulls dicts of named arrays; the shards stay hidden.

| module | what it holds |
| --- | --- |
| `ps_client.py` | `PSClient` (routing by the shard map, push, pull, PushPull, rows, membership, shared memory, read_state), `PushReport` and `ShardState` |
| `retry.py` | the one retry loop (UNAVAILABLE, OVERLOADED) with `RetryPolicy`, and the typed errors of failed rpcs |
| `buffers.py` | the arrays pulls receive large tensors into, reused once the caller drops them |
| `from_job.py` | the client a worker process opens from its job configuration (credentials, data paths, the channel's TLS) |
| `rows.py` | sparse rows: routing ids to shards, row gradients on the wire, dynamic tables' declarations |
"""

from ps_common.errors import ServerError
from worker_client.client.ps_client import (GRPC_PUSH_PULL_MAX_BYTES, SEGMENT_RETRY_SECONDS, PSClient,
                                            PushReport, ShardState)
from worker_client.client.retry import RetryPolicy, call_with_retries, probe, reason_of, server_error

__all__ = ["GRPC_PUSH_PULL_MAX_BYTES", "SEGMENT_RETRY_SECONDS", "PSClient", "PushReport", "RetryPolicy", "ServerError",
           "ShardState", "call_with_retries", "probe", "reason_of", "server_error"]
