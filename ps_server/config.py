"""The shard's settings: one typed object, validated up front (flags, TOML and TF_CONFIG feed it)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ps_common.codec import CHUNK_BYTES, MAX_MESSAGE_BYTES
from ps_common.modes import MODES
from ps_common.shard_map import DEFAULT_PARTITION_MIN_BYTES


#: Limits on what a request may declare, checked before anything is allocated or applied
#: (docs/settings.md; docs/protocol.md, "Limits"). Each is a setting; these are the defaults.
DEFAULT_MAX_NAME_BYTES = 1024            # a tensor name, UTF-8 bytes
DEFAULT_MAX_ID_BYTES = 256               # a worker id, barrier name or participant id
DEFAULT_MAX_TENSORS = 100_000            # tensors in one parameter list
DEFAULT_MAX_REGISTERED_WORKERS = 4096    # worker records a shard holds (live, left or expired)
DEFAULT_MAX_BARRIERS = 1024              # barrier names a shard holds at once
DEFAULT_MAX_CLOCK_AHEAD = 1_000_000      # how far a push's clock may run ahead of the shard's record
DEFAULT_WORKER_RETENTION_SECONDS = 3600.0   # a worker gone (left or expired) this long is forgotten
DEFAULT_BARRIER_RETENTION_SECONDS = 600.0   # an idle barrier (nobody waiting) this long is forgotten
DEFAULT_STREAM_IDLE_SECONDS = 30.0       # a client stream silent this long is cut
#: Clocks, steps and counts a shard accepts or holds stay below this (the wire carries int64;
#: the margin keeps every "+ 1" representable). Larger values are refused, in requests and
#: in checkpoints alike.
MAX_COUNTER = 2**62


def _port_of(address: str) -> int:
    """The port of HOST:PORT (-1 when it has none)."""
    host, _, port = address.rpartition(":")
    return int(port) if host and port.isdigit() else -1


@dataclass
class ServerConfig:
    """Everything one shard process needs to know. See docs/settings.md for each field."""

    shard_index: int = 0
    num_shards: int = 1
    host: str = "127.0.0.1"
    port: int = 0                       # 0: pick a free port
    mode: str = "async"                 # sync | ssp | async
    replicas_to_aggregate: int = 1      # sync: N
    total_replicas: int = 1             # sync: M >= N
    staleness: float = 0                # ssp: b (math.inf for unbounded)
    max_staleness: int = 0              # async: drop when t - read_step > this; 0 = never drop
    optimizer: str = "sgd"
    optimizer_params: dict[str, Any] = field(default_factory=lambda: {"lr": 0.01})
    partition_min_bytes: int = DEFAULT_PARTITION_MIN_BYTES
    chunk_bytes: int = CHUNK_BYTES
    lease_seconds: float = 10.0         # a worker not heard from for this long is not live
    wait_timeout_seconds: float = 300.0  # default and largest wait of a pull or barrier
    max_workers: int = 512              # data-plane threads (made as needed): bounds data-plane calls held at once
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0     # 0: not by step count
    checkpoint_every_seconds: float = 0  # 0: not by time
    checkpoint_keep: int = 3            # newest checkpoints kept in checkpoint_dir
    metrics_port: int | None = None     # None: no metrics endpoint; 0: pick a free port
    log_json: bool = False
    # Security (docs/security.md): TLS, mutual TLS, bearer tokens and request limits.
    tls_cert: str | None = None         # PEM certificate chain of the server; with tls_key: TLS on the port
    tls_key: str | None = None          # PEM private key of tls_cert
    tls_client_ca: str | None = None    # PEM CA bundle that client certificates must chain to: mutual TLS
    # The tokens are secrets: kept out of repr(), so a logged config never shows them.
    auth_token: str | None = field(default=None, repr=False)   # worker token: ps.v1.ParameterServer needs it
    admin_token: str | None = field(default=None, repr=False)  # admin token: ps.v1.Admin needs it
    reader_token: str | None = field(default=None, repr=False)  # reader token: the read-only rpcs only
    insecure: bool = False              # allow plaintext on a non-loopback host (logged as a warning)
    max_receive_message_bytes: int = MAX_MESSAGE_BYTES  # larger requests get RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int | None = None  # more at once get RESOURCE_EXHAUSTED; None: 4 x max_workers + control
    # Load and input limits (docs/protocol.md, "Limits").
    data_plane_calls: int | None = None  # anonymous data-plane calls at once; None: min(64, max_workers / 4)
    stream_idle_seconds: float = DEFAULT_STREAM_IDLE_SECONDS
    max_shard_bytes: int | None = None   # parameter bytes this shard may hold; None: the machine's memory
    max_name_bytes: int = DEFAULT_MAX_NAME_BYTES
    max_id_bytes: int = DEFAULT_MAX_ID_BYTES
    max_tensors: int = DEFAULT_MAX_TENSORS
    max_registered_workers: int = DEFAULT_MAX_REGISTERED_WORKERS
    max_barriers: int = DEFAULT_MAX_BARRIERS
    max_clock_ahead: int = DEFAULT_MAX_CLOCK_AHEAD
    worker_retention_seconds: float = DEFAULT_WORKER_RETENTION_SECONDS
    barrier_retention_seconds: float = DEFAULT_BARRIER_RETENTION_SECONDS
    # The data channel (docs/protocol.md, "The data channel between hosts"): PushPull's bytes on a TCP port.
    data_channel: bool = True           # False: gRPC bytes only for workers on other hosts
    data_channel_port: int = 0          # on `host`; 0: pick a free port (OpenDataChannel tells workers which)
    # Replication (docs/replication.md): this shard's replica addresses (empty: not replicated), this process's
    # index among them, every voter's address (default: the replicas), or a witness that only votes.
    replicas: tuple[str, ...] = ()
    replica_index: int = 0
    voters: tuple[str, ...] = ()
    witness: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting and its value."""
        if self.num_shards < 1:
            raise ValueError(f"Invalid num_shards: {self.num_shards} (must be >= 1)")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"Invalid shard_index: {self.shard_index} (must be in [0, {self.num_shards}))")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"Invalid port: {self.port}")
        if not 0 <= self.data_channel_port <= 65535:
            raise ValueError(f"Invalid data_channel_port: {self.data_channel_port}")
        if self.replicas and not 0 <= self.replica_index < len(self.replicas):
            raise ValueError(f"Invalid replica_index: {self.replica_index} (must be in [0, {len(self.replicas)}) for "
                             f"the {len(self.replicas)} --replicas)")
        if self.replicas and self.voters and self.replicas[self.replica_index] not in self.voters:
            raise ValueError(f"Invalid voters: this replica's address {self.replicas[self.replica_index]} is not "
                             f"among them ({', '.join(self.voters)})")
        if self.witness and not self.voters:
            raise ValueError("Invalid witness: a witness needs --voters (every voter's address, its own included)")
        if self.replicas and self.port not in (0, _port_of(self.replicas[self.replica_index])):
            raise ValueError(f"Invalid port: {self.port}, but this replica's address in --replicas is "
                             f"{self.replicas[self.replica_index]}")
        if self.mode not in MODES:
            raise ValueError(f"Invalid mode: {self.mode!r} (choose one of {', '.join(MODES)})")
        if self.replicas_to_aggregate < 1:
            raise ValueError(f"Invalid replicas_to_aggregate: {self.replicas_to_aggregate} (must be >= 1)")
        if self.total_replicas < self.replicas_to_aggregate:
            raise ValueError(
                f"Invalid total_replicas: {self.total_replicas} (must be >= replicas_to_aggregate={self.replicas_to_aggregate})")
        if not (self.staleness >= 0):
            raise ValueError(f"Invalid staleness: {self.staleness} (must be >= 0, or inf)")
        if self.staleness != math.inf and self.staleness != int(self.staleness):
            raise ValueError(f"Invalid staleness: {self.staleness} (must be a whole number or inf)")
        if self.max_staleness < 0:
            raise ValueError(f"Invalid max_staleness: {self.max_staleness} (must be >= 0)")
        if self.partition_min_bytes < 1:
            raise ValueError(f"Invalid partition_min_bytes: {self.partition_min_bytes}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"Invalid chunk_bytes: {self.chunk_bytes} (must be >= 1024)")
        if self.lease_seconds <= 0:
            raise ValueError(f"Invalid lease_seconds: {self.lease_seconds}")
        if self.wait_timeout_seconds <= 0:
            raise ValueError(f"Invalid wait_timeout_seconds: {self.wait_timeout_seconds}")
        if self.max_workers < 4:
            raise ValueError(f"Invalid max_workers: {self.max_workers} (must be >= 4)")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_seconds < 0:
            raise ValueError(
                f"Invalid checkpoint interval: every {self.checkpoint_every_steps} steps / {self.checkpoint_every_seconds} s")
        if self.checkpoint_keep < 1:
            raise ValueError(f"Invalid checkpoint_keep: {self.checkpoint_keep} (must be >= 1)")
        if self.checkpoint_dir is not None and not str(self.checkpoint_dir).strip():
            raise ValueError(f"Invalid checkpoint_dir: {self.checkpoint_dir!r} (a directory path, or None for no checkpoints)")
        self._validate_security()
        self._validate_limits()

    @property
    def data_plane_limit(self) -> int:
        """Data-plane calls of callers that are not registered workers at once: data_plane_calls, or a quarter
        of the data-plane threads (at most 64), so such calls never hold the threads registered workers need."""
        return self.data_plane_calls or max(1, min(64, self.max_workers // 4))

    @property
    def concurrent_rpcs_limit(self) -> int:
        """Rpcs gRPC takes at once before RESOURCE_EXHAUSTED: max_concurrent_rpcs, or room for every data-plane
        thread four times over and the control rpcs."""
        return self.max_concurrent_rpcs or self.max_workers * 4 + 64

    @property
    def shard_bytes_limit(self) -> int:
        """The most parameter bytes this shard takes: max_shard_bytes, or the machine's physical memory."""
        if self.max_shard_bytes:
            return self.max_shard_bytes
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):   # no sysconf (not POSIX): a fixed bound
            return 1 << 40

    def _validate_limits(self) -> None:
        if self.data_plane_calls is not None and not 1 <= self.data_plane_calls < self.max_workers:
            raise ValueError(f"Invalid data_plane_calls: {self.data_plane_calls} (must be in [1, max_workers="
                             f"{self.max_workers}): the other threads answer health checks and cluster info)")
        if not self.stream_idle_seconds > 0:
            raise ValueError(f"Invalid stream_idle_seconds: {self.stream_idle_seconds} (must be > 0)")
        if self.max_shard_bytes is not None and self.max_shard_bytes < 0:
            raise ValueError(f"Invalid max_shard_bytes: {self.max_shard_bytes} (must be >= 0; 0 or None: memory size)")
        for name in ("max_name_bytes", "max_id_bytes", "max_tensors", "max_registered_workers", "max_barriers",
                     "max_clock_ahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"Invalid {name}: {getattr(self, name)} (must be >= 1)")
        for name in ("worker_retention_seconds", "barrier_retention_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)} (must be > 0 seconds)")

    def _validate_security(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ValueError(f"Invalid {name}: {value!r} (a PEM file path, or None)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"Invalid TLS settings: tls_cert={self.tls_cert!r} and tls_key={self.tls_key!r} "
                             "must be set together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(f"Invalid tls_client_ca: {self.tls_client_ca!r} needs tls_cert and tls_key "
                             "(mutual TLS is TLS plus client certificates)")
        for name in ("auth_token", "admin_token", "reader_token"):
            token = getattr(self, name)
            # The value is a secret: messages give its length, never the value.
            if token is not None and (not isinstance(token, str) or not token
                                      or any(not 0x21 <= ord(ch) <= 0x7E for ch in token)):
                what = f"{len(token)} characters" if isinstance(token, str) else f"of type {type(token).__name__}"
                raise ValueError(f"Invalid {name} ({what}): a token must be a non-empty string of printable "
                                 "ASCII without spaces")
        if self.auth_token is not None and self.auth_token == self.admin_token:
            raise ValueError("Invalid admin_token: it equals auth_token, so every worker would be an admin")
        if self.reader_token is not None:
            for name, role in (("auth_token", "a worker"), ("admin_token", "an admin")):
                if self.reader_token == getattr(self, name):
                    raise ValueError(f"Invalid reader_token: it equals {name}, so every reader would be {role} "
                                     "(give readers a token of their own)")
            if self.auth_token is None and self.tls_client_ca is None:
                raise ValueError(
                    "Invalid reader_token: it needs auth_token (the worker token: --auth-token-file, "
                    "$PS_AUTH_TOKEN) or mutual TLS (tls_client_ca, --tls-client-ca); without either, "
                    "ps.v1.ParameterServer is open to every caller, so the reader token would grant nothing an "
                    "anonymous caller lacks and would restrict no one")
        if not MAX_MESSAGE_BYTES <= self.max_receive_message_bytes <= 2**31 - 1:
            raise ValueError(f"Invalid max_receive_message_bytes: {self.max_receive_message_bytes} "
                             f"(must be >= {MAX_MESSAGE_BYTES}, the largest message the protocol sends, "
                             f"and < 2**31)")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError(f"Invalid max_concurrent_rpcs: {self.max_concurrent_rpcs} (must be >= 1, or None)")
