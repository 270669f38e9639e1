"""The launcher's child processes: what it knows of each one (`Child`) and their command lines.

Shards run as ``python -P -m ps_server`` on port 0 (their READY line gives the address),
workers as ``python -P -m worker_client --events --servers ...``; -P keeps the user's working
directory off the children's sys.path, so a folder of the user's cannot shadow the installed
packages. Every child logs JSON lines (``--log-json``) at the level the launcher shows and
runs with ``--stop-with-parent``, so it also exits if the launcher is killed outright.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_common import jobconfig, process
from ps_common.jobconfig import JobConfig
from ps_common.process import ChildProcess


@dataclass
class Child:
    """One started process (ps_common.process.ChildProcess): its role and what it reported."""

    name: str                       # "shard0", "worker1"
    role: str                       # "shard" | "worker"
    index: int
    process: ChildProcess
    open_streams: int = 2           # stdout and stderr until their ends were handled (then every line was)
    result: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    start: dict[str, Any] | None = None
    finished_at: float | None = None
    last_error: str | None = None   # the last WARNING-or-worse line or plain line it printed

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def argv(self) -> list[str]:
        return self.process.argv

    @property
    def ready(self) -> dict[str, Any] | None:
        """The READY line's fields (shards), once it arrived."""
        return self.process.ready


def logging_flags(level: str) -> list[str]:
    """Every child logs JSON lines (parsed by the launcher) at the level the launcher shows."""
    return ["--log-json", "--log-level", level]


@dataclass(frozen=True)
class Replication:
    """A replicated job's places (docs/replication.md): each shard's replica addresses, and every voter's."""

    replicas: list[list[str]]       # shard -> its replicas' HOST:PORT, replica 0 first
    voters: list[str]               # every replica of every shard, then the witness if there is one

    @property
    def witness(self) -> str | None:
        listed = {a for group in self.replicas for a in group}
        return next((v for v in self.voters if v not in listed), None)


def replication_plan(shards: int, replicas: int, ports: list[int]) -> Replication:
    """Addresses on 127.0.0.1 for `shards` x `replicas` processes, and a witness when they are fewer than 3 (a
    majority of the voters must survive one process lost): `ports` holds one port each, the witness's last."""
    groups = [[f"127.0.0.1:{ports[i * replicas + r]}" for r in range(replicas)] for i in range(shards)]
    voters = [a for group in groups for a in group]
    if len(voters) < 3:
        voters.append(f"127.0.0.1:{ports[len(voters)]}")
    return Replication(groups, voters)


def shard_argv(config: JobConfig, level: str, index: int, stage: int | None = None, *,
               replication: Replication | None = None, replica: int = 0) -> list[str]:
    """A shard's command line; a pipeline job's stage `stage` has shards of its own (their own checkpoint
    folders and metrics ports: the stage's shards come after the earlier stages'); a replicated shard's replica
    `replica` listens on its planned address and knows its peers and the voters."""
    c = config
    number = index if stage is None else stage * c.job.shards + index
    skip = ("server.shard_index", "server.host", "server.port", "server.metrics_port", "server.checkpoint_dir",
            "job.stop_with_parent", "job.log_json", "job.log_level")
    port = "0"
    extra: list[str] = []
    if replication is not None:
        group = replication.replicas[index]
        port = group[replica].rpartition(":")[2]
        extra = ["--replicas", ",".join(group), "--replica-index", str(replica),
                 "--voters", ",".join(replication.voters)]
        number = number * len(group) + replica
    argv = process.python_module_argv(
        "ps_server", *jobconfig.to_argv(c, scope="server", skip=skip), *logging_flags(level),
        "--shard-index", str(index), "--host", "127.0.0.1", "--port", port, "--stop-with-parent", *extra)
    folder = checkpoint_folder(c, index, stage, replica)
    if folder is not None:
        argv += ["--checkpoint-dir", str(folder)]
    if c.server.metrics_port is not None:   # one port each: the base plus the shard's number (0: any)
        argv += ["--metrics-port", str(c.server.metrics_port + number if c.server.metrics_port else 0)]
    return argv


def checkpoint_folder(config: JobConfig, index: int, stage: int | None = None, replica: int = 0) -> Path | None:
    """Shard `index`'s checkpoint folder under --checkpoint-dir (of stage `stage`, of replica `replica`: a folder
    belongs to one shard process), or None when the job keeps no checkpoints."""
    if config.server.checkpoint_dir is None:
        return None
    root = Path(config.server.checkpoint_dir)
    folder = root if stage is None else root / f"stage{stage}"
    return folder / (f"shard{index}" if replica == 0 else f"shard{index}-replica{replica}")


def witness_argv(config: JobConfig, level: str, replication: Replication) -> list[str]:
    """The witness of a replicated job of fewer than 3 replica processes: a voter that holds no shard."""
    address = replication.witness
    assert address is not None
    skip = ("server.shard_index", "server.host", "server.port", "server.metrics_port", "server.checkpoint_dir",
            "job.stop_with_parent", "job.log_json", "job.log_level")
    return process.python_module_argv(
        "ps_server", *jobconfig.to_argv(config, scope="server", skip=skip), *logging_flags(level), "--witness",
        "--host", "127.0.0.1", "--port", address.rpartition(":")[2], "--voters", ",".join(replication.voters),
        "--stop-with-parent")


def worker_argv(config: JobConfig, level: str, index: int, addresses: list[str], model_path: str) -> list[str]:
    """A data-parallel worker's command line: the shards' addresses, the model, its share of the CPU's threads."""
    c = config
    skip = ("worker.index", "worker.worker_id", "worker.servers", "worker.events", "worker.model",
            "job.stop_with_parent", "worker.intra_op_threads", "job.log_json", "job.log_level",
            "worker.tensorboard", "worker.tensorboard_every_worker")
    processes = (c.job.workers or 1) * c.job.stages
    threads = c.worker.intra_op_threads or max(1, (os.cpu_count() or 1) // processes)
    argv = process.python_module_argv(
        "worker_client", *jobconfig.to_argv(c, scope="worker", skip=skip), *logging_flags(level),
        "--model", model_path, "--worker-index", str(index), "--servers", ",".join(addresses),
        "--intra-op-threads", str(threads), "--events", "--stop-with-parent")
    if c.worker.tensorboard and c.worker.tensorboard_every_worker:   # DIR/worker<i>; the job's scalars in DIR
        argv += ["--tensorboard", c.worker.tensorboard, "--tensorboard-every-worker"]
    return argv


def stage_argv(config: JobConfig, level: str, replica: int, stage: int, addresses: list[str], *, model_path: Path,
               stage_plan: Path, rendezvous: Path) -> list[str]:
    """Stage `stage` of replica `replica`: its own stage model, its stage's shards, the rendezvous folder."""
    argv = worker_argv(config, level, replica, addresses, str(model_path))
    return argv + ["--stage", str(stage), "--stage-plan", str(stage_plan),
                   "--stage-rendezvous", str(rendezvous), "--worker-id", f"replica{replica}-stage{stage}"]
