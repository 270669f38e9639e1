"""The declarations of every job setting: section, key, type, default, flags, commands, TF_CONFIG mapping, help.

Each setting is a dataclass field whose metadata holds its flags, the commands (scopes)
that take it, its TF_CONFIG mapping, its checks and its help; `ps_common.jobconfig` derives
the flags, the job-file checks, the launcher's child command lines and docs/settings.md
from these declarations, so a setting is added in one place: here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ps_common.codec import CHUNK_BYTES, MAX_MESSAGE_BYTES
from ps_common.modes import MODES
from ps_common.shard_map import DEFAULT_PARTITION_MIN_BYTES

#: The commands that read settings; each setting says which of them take it.
SCOPES: tuple[str, ...] = ("server", "worker", "launch")
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Global steps a worker trains for when neither `steps` nor `epochs` is set.
DEFAULT_STEPS = 300

_ALL = frozenset(SCOPES)
_SERVER = frozenset({"server", "launch"})
_WORKER = frozenset({"worker", "launch"})
_LAUNCH = frozenset({"launch"})


def _setting(default: Any, *flags: str, help: str, scopes: frozenset[str] = _ALL, toml: bool = True,
             tf_config: str = "", choices: Sequence[str] | None = None, minimum: float | None = None,
             positive: bool = False, metavar: str | None = None, default_doc: str | None = None) -> Any:
    """A dataclass field carrying a setting's flags, scopes, TF_CONFIG mapping and checks."""
    meta = {"flags": flags, "help": help, "scopes": scopes, "toml": toml, "tf_config": tf_config,
            "choices": tuple(choices) if choices else None, "minimum": minimum, "positive": positive,
            "metavar": metavar, "default_doc": default_doc}
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSettings:
    """[job]: what every process of the job must agree on."""

    mode: str = _setting("async", "--mode", choices=MODES,
                         help="consistency mode: sync (N of M replicas per step), ssp (bounded staleness) "
                              "or async; a worker follows the shards' mode, and refuses to run when it was "
                              "given a different one")
    workers: int | None = _setting(None, "--workers", "--num-workers", "--total-replicas", minimum=1,
                                   tf_config="len(cluster.chief) + len(cluster.worker)",
                                   default_doc="replicas_to_aggregate, else 1",
                                   help="workers in the job (M); sync mode's total_replicas")
    shards: int = _setting(1, "--shards", "--num-shards", minimum=1, tf_config="len(cluster.ps)",
                           default_doc="1, or the number of `servers`",
                           help="parameter-server shards (processes) in the job")
    shard_replicas: int = _setting(1, "--shard-replicas", scopes=_LAUNCH, minimum=1,
                                   help="processes per shard: a primary and shard_replicas - 1 backups that take "
                                        "over within seconds when it dies (docs/replication.md)")
    stages: int = _setting(1, "--stages", minimum=1,
                           help="pipeline stages: the model's graph cut into this many consecutive stages, each "
                                "run by its own worker process against its own `shards` shards; `workers` is then "
                                "the number of replicas of the whole pipeline (workers x stages processes; "
                                "docs/pipeline.md)")
    micro_batches: int = _setting(0, "--micro-batches", scopes=_WORKER, minimum=0, default_doc="auto",
                                  help="pipeline: micro-batches per step (GPipe: every forward, then every "
                                       "backward, gradients summed); 0: the largest of 4, 2, 1 that divides "
                                       "the batch size")
    cuts: list[str] = _setting([], "--cuts", scopes=_WORKER, metavar="NAME,...",
                               help="pipeline: where to cut the model, stages - 1 tensor or node names in graph "
                                    "order (the cut follows the node that makes the tensor); default: chosen to "
                                    "balance parameters and compute")
    replicas_to_aggregate: int | None = _setting(None, "--replicas-to-aggregate", minimum=1, default_doc="workers",
                                                 help="sync: gradients averaged into each step (N <= M); the "
                                                      "other M - N workers are backups whose late gradients "
                                                      "are dropped")
    staleness: float = _setting(0.0, "--staleness", minimum=0,
                                help="ssp: staleness bound b in clocks (a whole number, or inf for unbounded); "
                                     "0 is bulk synchronous")
    max_staleness: int = _setting(0, "--max-staleness", minimum=0,
                                  help="async: drop a gradient read more than this many steps ago; 0 never drops")
    seed: int = _setting(0, "--seed", scopes=_WORKER, minimum=0,
                         help="seed of the data order (per epoch) and of synthetic datasets")
    wire_dtype: str = _setting("float32", "--wire-dtype", scopes=_WORKER, choices=("float32", "float16", "bfloat16"),
                               help="dtype float32 gradients and parameters cross gRPC in: float16 or bfloat16 "
                                    "halve the bytes; the shards keep float32 master weights and optimizer "
                                    "state (shared memory carries float32)")
    wait_timeout: float = _setting(300.0, "--wait-timeout", positive=True, metavar="SECONDS",
                                   help="longest wait of a pull (sync step, SSP hold) or barrier, in seconds: "
                                        "the shard's cap, the worker's pull timeout, and how long worker 0 "
                                        "waits at the end for the others to finish")
    log_level: str = _setting("INFO", "--log-level", choices=LOG_LEVELS,
                              default_doc="INFO (ps-launch: WARNING, INFO with --verbose)",
                              help="logging level of every process (logs go to stderr)")
    log_json: bool = _setting(False, "--log-json",
                              help="log one JSON object a line (ts, level, logger, msg, and the record's fields "
                                   "such as shard, worker, step) instead of text; ps-launch: every line on "
                                   "stderr, its children's too (with a process field), is JSON")
    auth_token_file: str | None = _setting(None, "--auth-token-file", metavar="FILE",
                                           default_doc="$PS_AUTH_TOKEN, else none",
                                           help="file holding the worker token: shards require it on every "
                                                "ps.v1.ParameterServer call, workers present it")
    stop_with_parent: bool = _setting(False, "--stop-with-parent", scopes=frozenset({"server", "worker"}),
                                      toml=False, help="exit when the parent process exits (ps-launch sets it "
                                                       "on its children)")


@dataclass
class ServerSettings:
    """[server]: one shard process (`ps-server`)."""

    shard_index: int = _setting(0, "--shard-index", scopes=frozenset({"server"}), toml=False, minimum=0,
                                tf_config="task.index (task.type ps)", help="this shard's index, 0-based")
    host: str = _setting("127.0.0.1", "--host", scopes=frozenset({"server"}),
                         tf_config="0.0.0.0, or the host of cluster.ps[task.index] when it is a loopback host",
                         help="address to bind")
    port: int = _setting(0, "--port", scopes=frozenset({"server"}), minimum=0,
                         tf_config="the port of cluster.ps[task.index]",
                         help="port to bind; 0 picks a free one (the READY line on stdout says which)")
    optimizer: str = _setting("sgd", "--optimizer",
                              help="server-side optimizer: sgd, momentum (sgd with momentum 0.9), adam, adamw, "
                                   "adagrad or rmsprop (torch.optim semantics)", scopes=_SERVER)
    lr: float = _setting(0.01, "--lr", scopes=_SERVER, minimum=0, help="learning rate")
    momentum: float | None = _setting(None, "--momentum", scopes=_SERVER, minimum=0,
                                      default_doc="the optimizer's", help="sgd/momentum/rmsprop: momentum")
    nesterov: bool | None = _setting(None, "--nesterov", scopes=_SERVER, default_doc="the optimizer's",
                                     help="sgd/momentum: Nesterov momentum")
    weight_decay: float | None = _setting(None, "--weight-decay", scopes=_SERVER, minimum=0,
                                          default_doc="the optimizer's", help="L2 (adamw: decoupled) weight decay")
    beta1: float | None = _setting(None, "--beta1", scopes=_SERVER, minimum=0, default_doc="the optimizer's",
                                   help="adam/adamw: first-moment decay")
    beta2: float | None = _setting(None, "--beta2", scopes=_SERVER, minimum=0, default_doc="the optimizer's",
                                   help="adam/adamw: second-moment decay")
    eps: float | None = _setting(None, "--eps", scopes=_SERVER, minimum=0, default_doc="the optimizer's",
                                 help="adam/adamw/adagrad/rmsprop: epsilon")
    optimizer_params: dict[str, Any] = _setting({}, "--opt", scopes=_SERVER, metavar="KEY=VALUE",
                                                help="any other optimizer hyperparameter (TOML: a "
                                                     "[server.optimizer_params] table; flag: repeatable), "
                                                     "e.g. dampening=0.1, amsgrad=true, alpha=0.9, centered=true")
    partition_min_bytes: int = _setting(DEFAULT_PARTITION_MIN_BYTES, "--partition-min-bytes", scopes=_SERVER,
                                        minimum=1, help="tensors larger than this many bytes are split by rows "
                                                        "over the shards")
    chunk_bytes: int = _setting(CHUNK_BYTES, "--chunk-bytes", scopes=_SERVER, minimum=1024,
                                help="size of the chunks tensors are streamed in, in bytes")
    lease_seconds: float = _setting(10.0, "--lease-seconds", scopes=_SERVER, positive=True,
                                    help="a worker not heard from for this many seconds leaves the quorum")
    rpc_threads: int = _setting(512, "--rpc-threads", scopes=_SERVER, minimum=4,
                                help="threads of the data-plane rpcs (Push, Pull, PushPull, PullRows, "
                                     "InitParameters, Barrier), made as needed: bounds the calls held at once, "
                                     "waits and stalled callers included; control rpcs (health, cluster info, "
                                     "membership, Admin) have 16 threads of their own")
    checkpoint_dir: str | None = _setting(None, "--checkpoint-dir", scopes=_SERVER, metavar="DIR",
                                          help="where the shard writes its checkpoints and restores from on start "
                                               "(ps-launch: DIR/shard<i> for shard i); unset: no checkpoints")
    checkpoint_every_steps: int = _setting(0, "--checkpoint-every-steps", scopes=_SERVER, minimum=0,
                                           help="checkpoint every this many global steps; 0: not by steps")
    checkpoint_every_seconds: float = _setting(0.0, "--checkpoint-every-seconds", scopes=_SERVER, minimum=0,
                                               help="checkpoint every this many seconds; 0: not by time")
    checkpoint_keep: int = _setting(3, "--checkpoint-keep", scopes=_SERVER, minimum=1,
                                    help="newest checkpoints kept in checkpoint_dir")
    metrics_port: int | None = _setting(None, "--metrics-port", scopes=_SERVER, minimum=0,
                                        help="serve Prometheus metrics at http://HOST:PORT/metrics (the READY "
                                             "line says which port); 0 picks one; unset: none. ps-launch: shard i "
                                             "serves on this port + i (0: a free port each) and prints where")
    tls_cert: str | None = _setting(None, "--tls-cert", scopes=frozenset({"server"}), metavar="PEM",
                                    help="the shard's certificate chain; with tls_key the port serves TLS "
                                         "(docs/security.md)")
    tls_key: str | None = _setting(None, "--tls-key", scopes=frozenset({"server"}), metavar="PEM",
                                   help="the private key of tls_cert")
    tls_client_ca: str | None = _setting(None, "--tls-client-ca", scopes=frozenset({"server"}), metavar="PEM",
                                         help="CA bundle client certificates must chain to: mutual TLS")
    admin_token_file: str | None = _setting(None, "--admin-token-file", scopes=_SERVER, metavar="FILE",
                                            default_doc="$PS_ADMIN_TOKEN, else none",
                                            help="file holding the admin token (ps.v1.Admin needs it); never a flag "
                                                 "value, so it stays out of process listings")
    reader_token_file: str | None = _setting(None, "--reader-token-file", scopes=_SERVER, metavar="FILE",
                                             default_doc="$PS_READER_TOKEN, else none",
                                             help="file holding the reader token: it may call only the read-only "
                                                  "rpcs (GetClusterInfo, Pull, PullRows, ReadState), e.g. for "
                                                  "ps-serve --follow; needs a worker token or mutual TLS "
                                                  "(docs/security.md)")
    insecure: bool = _setting(False, "--insecure", scopes=frozenset({"server"}),
                              help="allow plaintext gRPC on a non-loopback host (e.g. 0.0.0.0 from TF_CONFIG) "
                                   "without TLS")
    max_receive_message_bytes: int = _setting(MAX_MESSAGE_BYTES, "--max-receive-message-bytes", scopes=_SERVER,
                                              minimum=MAX_MESSAGE_BYTES,
                                              help="larger requests get RESOURCE_EXHAUSTED")
    max_concurrent_rpcs: int | None = _setting(None, "--max-concurrent-rpcs", scopes=_SERVER, minimum=1,
                                               default_doc="4 x rpc_threads + 64",
                                               help="more rpcs at once get RESOURCE_EXHAUSTED")
    data_plane_calls: int | None = _setting(None, "--data-plane-calls", scopes=_SERVER, minimum=1,
                                            default_doc="rpc_threads / 4, at most 64",
                                            help="data-plane calls served at once for callers that are not "
                                                 "registered live workers (anonymous, or naming no worker); one "
                                                 "more gets RESOURCE_EXHAUSTED (reason OVERLOADED, retried by "
                                                 "clients). A registered worker's calls have 8 slots of their "
                                                 "own, so stalled or waiting anonymous calls never starve it")
    stream_idle_seconds: float = _setting(30.0, "--stream-idle-seconds", scopes=_SERVER, positive=True,
                                          help="a client stream (Push, InitParameters) whose next message takes "
                                               "longer than this is cut (CANCELLED)")
    max_shard_bytes: int | None = _setting(None, "--max-shard-bytes", scopes=_SERVER, minimum=0,
                                           default_doc="the machine's memory",
                                           help="parameter bytes one shard takes; a parameter list putting more on "
                                                "it is refused (RESOURCE_EXHAUSTED) before anything is allocated")
    max_name_bytes: int = _setting(1024, "--max-name-bytes", scopes=_SERVER, minimum=1,
                                   help="longest tensor name, in UTF-8 bytes (INVALID_ARGUMENT beyond)")
    max_id_bytes: int = _setting(256, "--max-id-bytes", scopes=_SERVER, minimum=1,
                                 help="longest worker id, barrier name or participant id, in UTF-8 bytes")
    max_tensors: int = _setting(100_000, "--max-tensors", scopes=_SERVER, minimum=1,
                                help="most tensors in one parameter list")
    max_registered_workers: int = _setting(4096, "--max-registered-workers", scopes=_SERVER, minimum=1,
                                           help="most worker records a shard holds (live or gone); a new worker "
                                                "beyond it gets RESOURCE_EXHAUSTED; also the most barrier "
                                                "participants")
    max_barriers: int = _setting(1024, "--max-barriers", scopes=_SERVER, minimum=1,
                                 help="most barrier names a shard holds at once (idle ones are dropped first)")
    max_clock_ahead: int = _setting(1_000_000, "--max-clock-ahead", scopes=_SERVER, minimum=1,
                                    help="how far a push's clock may run ahead of the shard's record for its "
                                         "worker (INVALID_ARGUMENT beyond)")
    worker_retention_seconds: float = _setting(3600.0, "--worker-retention-seconds", scopes=_SERVER, positive=True,
                                               help="a worker that left or whose lease expired this long ago is "
                                                    "forgotten (its clock and recent outcomes with it)")
    barrier_retention_seconds: float = _setting(600.0, "--barrier-retention-seconds", scopes=_SERVER,
                                                positive=True,
                                                help="a barrier nobody has waited at for this long is forgotten")
    data_channel: bool = _setting(True, "--data-channel", scopes=_SERVER,
                                  help="serve PushPull's bytes to workers on other hosts on a TCP port of their "
                                       "own (the data channel: a one-time ticket from the authenticated gRPC "
                                       "call, TLS when the shard serves TLS; workers fall back to gRPC bytes "
                                       "where it cannot be had); --no-data-channel: gRPC bytes only "
                                       "(docs/protocol.md, \"The data channel between hosts\")")
    replicas: list[str] = _setting([], "--replicas", scopes=frozenset({"server"}), metavar="ADDR,...",
                                   tf_config="cluster.ps[task.index] split at |",
                                   help="a replicated shard: the addresses of its replicas in replica order, this "
                                        "process's among them (docs/replication.md); unset: not replicated")
    replica_index: int = _setting(0, "--replica-index", scopes=frozenset({"server"}), minimum=0,
                                  tf_config="task.replica",
                                  help="this process's place in --replicas (0 starts as the primary)")
    voters: list[str] = _setting([], "--voters", scopes=frozenset({"server"}), metavar="ADDR,...",
                                 tf_config="every replica of cluster.ps",
                                 default_doc="--replicas",
                                 help="every process that grants primacy leases: all replicas of all shards of "
                                      "the job, and any witness (a majority must be alive for a failover)")
    witness: bool = _setting(False, "--witness", scopes=frozenset({"server"}),
                             help="a voter only: holds no shard, grants primacy leases (a job with fewer than "
                                  "3 replica processes needs one to fail over)")
    data_channel_port: int = _setting(0, "--data-channel-port", scopes=frozenset({"server"}), minimum=0,
                                      help="the data channel's port, on the shard's host; 0 picks a free one "
                                           "(workers learn it from OpenDataChannel; the READY line says which)")


@dataclass
class WorkerSettings:
    """[worker]: one worker process (`ps-worker`)."""

    index: int = _setting(0, "--worker-index", scopes=frozenset({"worker"}), toml=False, minimum=0,
                          tf_config="0 for task.type chief/master; len(cluster.chief) + task.index for worker",
                          help="this worker's index, 0-based; worker 0 initializes the parameters and evaluates")
    worker_id: str | None = _setting(None, "--worker-id", scopes=frozenset({"worker"}), toml=False,
                                     default_doc="worker<index>",
                                     help="the id the shards know this worker by; a restarted worker with the "
                                          "same id resumes at its clock")
    servers: list[str] = _setting([], "--servers", scopes=frozenset({"worker"}), metavar="HOST:PORT,...",
                                  tf_config="cluster.ps", help="the shards' addresses, in shard order")
    model: str = _setting("mlp", "--model", scopes=_WORKER, metavar="PATH|NAME",
                          help="an ONNX model file, or a bundled model's name (mlp, lenet, embedding, transformer)")
    loss: str = _setting("cross_entropy", "--loss", scopes=_WORKER,
                         help="loss attached to the model's first output: cross_entropy (a label per example, or "
                              "per position of (batch, classes, d1, ...) logits), bce (binary cross-entropy on one "
                              "logit per example or per label, labels 0 or 1), mse or output:NAME")
    data: str = _setting("digits", "--data", scopes=_WORKER, metavar="SPEC",
                         help="dataset: digits, synthetic:<kind>[?key=value&...], a .npz file, or a folder of "
                              "Parquet files in train/ and test/, streamed (docs/data-format.md); each worker "
                              "trains on its own share")
    label_column: str = _setting("label", "--label-column", scopes=_WORKER, metavar="NAME",
                                 help="a Parquet dataset's label column")
    shuffle_rows: int = _setting(16384, "--shuffle-rows", scopes=_WORKER, minimum=1, metavar="ROWS",
                                 help="rows of a Parquet dataset's shuffle buffer: each block of this many rows of a "
                                      "worker's stream is shuffled whole; with one row group, what a worker holds of "
                                      "the data at once (docs/data-format.md, \"Memory\")")
    batch_size: int = _setting(32, "--batch-size", scopes=_WORKER, minimum=1, help="examples per gradient")
    include: list[str] = _setting([], "--include", scopes=_WORKER, metavar="PATTERN,...",
                                  help="train only the parameters matching one of these glob patterns; a "
                                       "pattern without wildcards that names a constant exactly trains it too "
                                       "(docs/models.md, \"Which initializers train\")")
    exclude: list[str] = _setting([], "--exclude", scopes=_WORKER, metavar="PATTERN,...",
                                  help="do not train the parameters matching one of these glob patterns")
    expect_parameters: int | None = _setting(None, "--expect-parameters", scopes=_WORKER, minimum=1,
                                             help="fail unless the model has exactly this many trainable "
                                                  "parameters (catches variables an exporter folded away)")
    sparse_tables: list[str] = _setting([], "--sparse-tables", scopes=_WORKER, metavar="NAME,...",
                                        help="embedding tables to train sparsely: each step pulls and pushes only "
                                             "the rows its batch touches (used only through Gather on axis 0; "
                                             "docs/protocol.md, \"Sparse rows\")")
    sparse_min_rows: int | None = _setting(None, "--sparse-min-rows", scopes=_WORKER, minimum=1,
                                           help="also train sparsely every such table with at least this many rows")
    sparse_min_bytes: int = _setting(1 << 20, "--sparse-min-bytes", scopes=_WORKER, minimum=0, metavar="BYTES",
                                     help="train sparsely, without being named, every table of at least this many "
                                          "bytes used only through Gather on axis 0 with indices computed from the "
                                          "inputs alone; 0: none by size (docs/models.md, \"Sparse by default\")")
    dense_tables: list[str] = _setting([], "--dense-tables", scopes=_WORKER, metavar="NAME,...",
                                       help="tables to train densely even when large enough to train sparsely")
    dynamic_tables: list[str] = _setting([], "--dynamic-tables", scopes=_WORKER, metavar="NAME,...",
                                         help="embedding tables the shards hold as dynamic tables: the ids are any "
                                              "int64 keys (hashed feature ids), not row indices, and a row exists "
                                              "once used; trains sparsely (implies --sparse-tables); the model's "
                                              "table gives only the row shape (docs/protocol.md, \"Dynamic tables\")")
    dynamic_initializer: str = _setting("normal:0.01", "--dynamic-initializer", scopes=_WORKER, metavar="INIT",
                                        help="how the shards create a dynamic table's unseen row (training or "
                                             "evaluation): zeros, normal:STD or uniform:A, seeded by the job's seed")
    evict_after_steps: int = _setting(0, "--evict-after-steps", scopes=_WORKER, minimum=0, metavar="N",
                                      help="a dynamic table forgets a row untouched for this many global steps "
                                           "(a later use creates it afresh); 0: never")
    overlap: bool = _setting(False, "--overlap", scopes=_WORKER,
                             help="async, without sparse tables: push a step's gradient and pull the next "
                                  "parameters while the next gradient is computed (one step of extra staleness "
                                  "of the worker's own updates, which with momentum and several workers can "
                                  "diverge: docs/protocol.md, \"Overlap\"); off by default: one after the other")
    steps: int | None = _setting(None, "--steps", scopes=_WORKER, minimum=1,
                                 default_doc=f"{DEFAULT_STEPS} when epochs is unset",
                                 help="stop when the shards' global step reaches this")
    epochs: int | None = _setting(None, "--epochs", scopes=_WORKER, minimum=1,
                                  help="stop after this many passes over the worker's share (and at `steps`, "
                                       "when both are set)")
    eval_every: int = _setting(100, "--eval-every", scopes=_WORKER, minimum=0,
                               help="worker 0 evaluates on the test split every this many global steps "
                                    "(a pipeline job: ps-launch evaluates the whole model); 0: only at the end")
    device: str = _setting("cpu", "--device", scopes=_WORKER,
                           help="cpu, cuda or cuda:N (needs onnxruntime-gpu); on CUDA products in full float32 (TF32 "
                                "off, so GPU and CPU workers push the same gradients) and Dropout masks drawn on the "
                                "GPU; each worker's result in run.json names its device and onnxruntime's providers")
    intra_op_threads: int | None = _setting(None, "--intra-op-threads", scopes=_WORKER, minimum=1,
                                            default_doc="onnxruntime's (ps-launch: cores / workers)",
                                            help="onnxruntime threads per gradient computation, at most: a graph "
                                                 "with a loop (a recurrent layer) tries one thread over its first "
                                                 "dozen steps and keeps it where faster")
    start_timeout: float = _setting(300.0, "--start-timeout", scopes=_WORKER, positive=True, metavar="SECONDS",
                                    help="longest wait for the shards to answer, be initialized, and for all "
                                         "workers at the start barrier")
    rpc_timeout: float = _setting(120.0, "--rpc-timeout", scopes=_WORKER, positive=True, metavar="SECONDS",
                                  help="deadline of one rpc (on top of any wait it carries)")
    reconnect_timeout: float = _setting(60.0, "--reconnect-timeout", scopes=_WORKER, minimum=0, metavar="SECONDS",
                                        help="how long a call retries a shard that is unavailable (restarting), "
                                             "with backoff, before the worker fails naming it; 0: 6 attempts")
    shared_memory: bool = _setting(True, "--shared-memory", scopes=_WORKER,
                                   help="move gradients and parameters through a shared-memory segment with each "
                                        "shard on the same host (anonymous memory handed over a Unix socket for a "
                                        "one-time ticket from the authenticated gRPC call; falls back to gRPC bytes "
                                        "where it cannot be had, and opens a new one after a shard restarts); "
                                        "--no-shared-memory: gRPC bytes only")
    shared_memory_min_bytes: int = _setting(0, "--shared-memory-min-bytes", scopes=_WORKER, minimum=0,
                                            metavar="BYTES",
                                            help="on one host, a shard holding fewer parameter bytes than this "
                                                 "moves them through the data channel when the shard offers one; "
                                                 "every other shard through a shared-memory segment, the call's "
                                                 "header over the data channel (default 0: shared memory for "
                                                 "every shard on this host)")
    tls_ca: str | None = _setting(None, "--tls-ca", scopes=frozenset({"worker"}), metavar="PEM",
                                  help="connect with TLS, trusting this CA bundle (the shards' issuer)")
    tls_cert: str | None = _setting(None, "--tls-cert", scopes=frozenset({"worker"}), metavar="PEM",
                                    help="client certificate for mutual TLS (with tls_key); turns TLS on")
    tls_key: str | None = _setting(None, "--tls-key", scopes=frozenset({"worker"}), metavar="PEM",
                                   help="the private key of the client certificate")
    insecure: bool = _setting(False, "--insecure", scopes=frozenset({"worker"}),
                              help="pipeline: allow this stage worker's exchange port plaintext on a non-loopback "
                                   "host (e.g. 0.0.0.0 from TF_CONFIG) without TLS, as a shard's --insecure does")
    progress_every: float = _setting(1.0, "--progress-every", scopes=_WORKER, positive=True, metavar="SECONDS",
                                     help="seconds between progress reports")
    stage: int = _setting(0, "--stage", scopes=frozenset({"worker"}), toml=False, minimum=0,
                          tf_config="task.stage",
                          help="pipeline: this worker's stage, 0-based (< stages); --worker-index is its replica")
    stage_plan: str | None = _setting(None, "--stage-plan", scopes=frozenset({"worker"}), toml=False, metavar="DIR",
                                      help="pipeline: a folder holding stages.json and stage<k>.onnx as ps-launch "
                                           "writes them, so the worker reads only its own stage's model; without "
                                           "it the worker cuts --model itself")
    stage_listen: str = _setting("127.0.0.1:0", "--stage-listen", scopes=frozenset({"worker"}), toml=False,
                                 metavar="HOST:PORT", tf_config="cluster.worker[index * stages + stage] (its port, "
                                                                "on 0.0.0.0 unless a loopback host)",
                                 help="pipeline: where this stage worker takes activations and gradients from its "
                                      "neighbour stages")
    stage_peers: list[str] = _setting([], "--stage-peers", scopes=frozenset({"worker"}), toml=False,
                                      metavar="PREV,NEXT", tf_config="cluster.worker[index * stages + stage -+ 1]",
                                      help="pipeline: the previous and the next stage's addresses in this replica "
                                           "('-' where there is none)")
    stage_rendezvous: str | None = _setting(None, "--stage-rendezvous", scopes=frozenset({"worker"}), toml=False,
                                            metavar="DIR",
                                            help="pipeline: a folder where the stage workers of a local job publish "
                                                 "their addresses and find their neighbours' (ps-launch sets it), "
                                                 "instead of --stage-peers")
    stage_peer_timeout: float = _setting(10.0, "--stage-peer-timeout", scopes=_WORKER, positive=True,
                                         metavar="SECONDS",
                                         help="pipeline: a neighbour stage unreachable this long abandons the step "
                                              "in flight (nothing of it is pushed) and takes this stage out of its "
                                              "shards' quorum until the neighbour is back")
    tensorboard: str | None = _setting(None, "--tensorboard", scopes=_WORKER, metavar="DIR",
                                       help="write TensorBoard scalars (training loss, samples/s, stale drops, test "
                                            "accuracy and loss by global step) to DIR; ps-worker: worker 0 only, "
                                            "unless tensorboard_every_worker; ps-launch: the whole job's numbers "
                                            "(needs tensorboardX: pip install 'onnx-ps[tensorboard]')")
    tensorboard_every_worker: bool = _setting(False, "--tensorboard-every-worker", scopes=_WORKER,
                                              help="every worker writes its own scalars to DIR/worker<i> "
                                                   "(ps-worker: instead of worker 0 alone into DIR; ps-launch: "
                                                   "besides the job's)")
    events: bool = _setting(False, "--events", scopes=frozenset({"worker"}), toml=False,
                            help="report progress as JSON lines on stdout (for ps-launch) instead of text")


@dataclass
class LaunchSettings:
    """[launch]: the local launcher (`ps-launch`)."""

    record: str | None = _setting(None, "--record", scopes=_LAUNCH, metavar="DIR",
                                  help="write DIR/run.json (summary, settings, events), DIR/model.onnx (the "
                                       "trained model) and DIR/plot.png (loss and accuracy over steps)")
    export: str | None = _setting(None, "--export", scopes=_LAUNCH, metavar="PATH",
                                  help="write the trained model to PATH when the job ends: the given ONNX model "
                                       "with the shards' values (docs/serving.md)")
    timeout: float = _setting(1800.0, "--timeout", scopes=_LAUNCH, positive=True, metavar="SECONDS",
                              help="longest run of the whole job; then everything is stopped")
    ready_timeout: float = _setting(60.0, "--ready-timeout", scopes=_LAUNCH, positive=True, metavar="SECONDS",
                                    help="longest wait for each shard's READY line")
    stop_timeout: float = _setting(10.0, "--stop-timeout", scopes=_LAUNCH, positive=True, metavar="SECONDS",
                                   help="grace between SIGTERM and SIGKILL when stopping a process")
    print_every: float = _setting(10.0, "--print-every", scopes=_LAUNCH, positive=True, metavar="SECONDS",
                                  help="seconds between progress lines when stderr is not a terminal (on a "
                                       "terminal: one live bar)")
    verbose: bool = _setting(False, "--verbose", scopes=_LAUNCH,
                             help="also show every process's INFO lines, the shards' READY lines, each worker's "
                                  "progress and evaluations, and a failed process's argv and last lines; by "
                                  "default ps-launch shows the progress, warnings, errors and the result")
    min_accuracy: float | None = _setting(None, "--min-accuracy", scopes=_LAUNCH, minimum=0,
                                          help="exit with status 1 when the final test accuracy is below this")


SECTIONS: dict[str, type] = {"job": JobSettings, "server": ServerSettings, "worker": WorkerSettings,
                             "launch": LaunchSettings}


@dataclass(frozen=True)
class SettingInfo:
    """One declared setting: section, key, type and the field metadata."""

    section: str
    key: str
    hint: Any
    default: Any
    flags: tuple[str, ...]
    help: str
    scopes: frozenset[str]
    toml: bool
    tf_config: str
    choices: tuple[str, ...] | None
    minimum: float | None
    positive: bool
    metavar: str | None
    default_doc: str | None

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def base(self) -> type:
        """The type without Optional: int, float, str, bool, list or dict."""
        hint = self.hint
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = args[0]
        origin = typing.get_origin(hint)
        return origin if origin is not None else hint

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.hint)

    def where(self) -> str:
        """How a user refers to it: "[section] key (--flag)"."""
        flag = f" ({self.flags[0]})" if self.flags else ""
        return f"[{self.section}] {self.key}{flag}"


def iter_settings() -> Iterator[SettingInfo]:
    """Every declared setting, section by section, in declaration order."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            m = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            yield SettingInfo(section, f.name, hints[f.name], default, m["flags"], m["help"], m["scopes"], m["toml"],
                              m["tf_config"], m["choices"], m["minimum"], m["positive"], m["metavar"],
                              m["default_doc"])


def settings_by_name() -> dict[str, SettingInfo]:
    return {info.name: info for info in iter_settings()}
