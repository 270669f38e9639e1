"""TF_CONFIG, as TensorFlow and Kubeflow's TFJob write it, read into the settings of a ps or worker task.

``{"cluster": {"ps": [...], "chief": [...], "worker": [...]}, "task": {"type": ..., "index": i}}``.
A ``ps`` task is shard ``index`` of ``len(cluster.ps)`` shards; it binds the port of its own
address and, because that address is how *other* pods reach it (a service name or IP that
need not be a local interface), binds ``0.0.0.0`` unless the address's host is a loopback
one (``localhost``, ``127.0.0.0/8``, ``::1``), which it binds as given. A ``chief`` (or
``master``) task is worker 0 and ``worker`` task i is worker ``len(chief) + i``; the job
has ``len(chief) + len(worker)`` workers, and the workers' servers are ``cluster.ps`` in
order. ``evaluator`` tasks are refused.

Replicated shards (docs/replication.md): a ``cluster.ps`` entry may list one shard's replica
addresses joined by ``|`` (``"ps-0a:50051|ps-0b:50051"``), and a ps task says which of them
it is in ``task.replica`` (default 0). Its voters are every replica of every shard (at least
three processes: 2 shards x 2 replicas, or 3 replicas of one shard); workers take the
entries as they are.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from ps_common.errors import JobConfigError

#: The environment variable TensorFlow (and Kubeflow's TFJob) uses to describe the cluster.
TF_CONFIG_ENV = "TF_CONFIG"


@dataclass(frozen=True)
class TFConfig:
    """The parts of TF_CONFIG this project reads."""

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int
    task_stage: int | None = None     # a pipeline job's stage of this worker task
    task_replica: int = 0             # a replicated shard's replica this ps task is (its place in the entry)

    @property
    def ps(self) -> list[str]:
        return list(self.cluster.get("ps", []))

    @property
    def workers(self) -> list[str]:
        """The training workers: chief (or master) first, then the workers."""
        return [*self.cluster.get("chief", []), *self.cluster.get("master", []), *self.cluster.get("worker", [])]

    def worker_index(self) -> int:
        """This task's index among `workers`."""
        if self.task_type in ("chief", "master"):
            return self.task_index
        chiefs = len(self.cluster.get("chief", [])) + len(self.cluster.get("master", []))
        return chiefs + self.task_index


def parse_tf_config(text: str) -> TFConfig:
    """Reads and checks a TF_CONFIG value; JobConfigError naming the bad part and its value."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobConfigError(f"TF_CONFIG is not valid JSON ({exc}): {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise JobConfigError(f"TF_CONFIG must be a JSON object, got {text[:200]!r}")
    cluster, task = data.get("cluster"), data.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise JobConfigError(f"TF_CONFIG needs a non-empty \"cluster\" object, got {cluster!r}")
    for kind, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) and a for a in addresses):
            raise JobConfigError(f"TF_CONFIG cluster.{kind} must be a list of \"host:port\" strings, got {addresses!r}")
    if not isinstance(task, dict):
        raise JobConfigError(f"TF_CONFIG needs a \"task\" object ({{\"type\": ..., \"index\": ...}}), got {task!r}")
    task_type, index = task.get("type"), task.get("index", 0)
    if not isinstance(task_type, str) or not task_type:
        raise JobConfigError(f"TF_CONFIG task.type must be a non-empty string, got {task_type!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise JobConfigError(f"TF_CONFIG task.index must be an integer >= 0, got {index!r}")
    members = cluster.get(task_type)
    if members is None:
        raise JobConfigError(f"TF_CONFIG task.type {task_type!r} has no cluster.{task_type} list "
                             f"(cluster has {', '.join(sorted(cluster))})")
    if index >= len(members):
        raise JobConfigError(f"TF_CONFIG task.index {index} is out of range for cluster.{task_type} "
                             f"({len(members)} entries)")
    stage = task.get("stage")
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int) or stage < 0):
        raise JobConfigError(f"TF_CONFIG task.stage must be an integer >= 0, got {stage!r}")
    replica = task.get("replica", 0)
    if isinstance(replica, bool) or not isinstance(replica, int) or replica < 0:
        raise JobConfigError(f"TF_CONFIG task.replica must be an integer >= 0, got {replica!r}")
    if replica >= len(members[index].split("|")):
        raise JobConfigError(f"TF_CONFIG task.replica {replica} is out of range for cluster.{task_type}[{index}] "
                             f"{members[index]!r} ({len(members[index].split('|'))} replica(s))")
    return TFConfig({k: list(v) for k, v in cluster.items()}, task_type, index, stage, replica)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; JobConfigError otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise JobConfigError(f"address {address!r} is not host:port with a port in 1..65535")
    return host.strip("[]"), int(port_text)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tf_config_settings(tf: TFConfig, *, scope: str) -> dict[str, Any]:
    """The settings ("section.key" -> value) TF_CONFIG gives a ps (scope "server") or worker (scope "worker") task."""
    out: dict[str, Any] = {}
    if tf.workers:
        out["job.workers"] = len(tf.workers)
    if scope == "server":
        if tf.task_type != "ps":
            raise JobConfigError(f"TF_CONFIG task.type is {tf.task_type!r}, but ps-server runs a 'ps' task")
        replicas = tf.ps[tf.task_index].split("|")
        host, port = split_address(replicas[tf.task_replica])
        out.update({"server.shard_index": tf.task_index, "job.shards": len(tf.ps), "server.port": port,
                    "server.host": host if is_loopback(host) else "0.0.0.0"})
        if len(replicas) > 1:
            voters = [a for entry in tf.ps for a in entry.split("|")]
            for address in voters:
                split_address(address)
            if len(voters) < 3:
                raise JobConfigError(f"TF_CONFIG cluster.ps {tf.ps!r} has {len(voters)} replica processes: a "
                                     "replicated job needs at least 3 (a majority must outlive one)")
            out.update({"server.replicas": replicas, "server.replica_index": tf.task_replica,
                        "server.voters": voters})
    elif scope == "worker":
        if tf.task_type not in ("worker", "chief", "master"):
            raise JobConfigError(f"TF_CONFIG task.type is {tf.task_type!r}, but ps-worker runs a 'worker' or "
                                 f"'chief' task")
        if not tf.ps:
            raise JobConfigError("TF_CONFIG has no cluster.ps: a worker needs the parameter servers' addresses")
        for address in (a for entry in tf.ps for a in entry.split("|")):
            split_address(address)
        out.update({"worker.index": tf.worker_index(), "worker.servers": tf.ps, "job.shards": len(tf.ps)})
    else:
        raise ValueError(f"TF_CONFIG applies to scope 'server' or 'worker', not {scope!r}")
    return out


def pipeline_settings(tf: TFConfig, stages: int, *, scope: str) -> dict[str, Any]:
    """The settings TF_CONFIG gives a task of a pipeline job of `stages` stages (docs/pipeline.md).

    ``cluster.ps`` lists every stage's shards, stage by stage (``len(ps) / stages`` each);
    ``cluster.worker`` (after any chief) lists every stage worker, replica by replica
    (``index * stages + stage``); a worker task says its replica in ``task.index`` and its
    stage in ``task.stage``. A ps task is shard ``index % shards`` of its stage's shards.
    """
    ps = tf.ps
    if len(ps) % stages:
        raise JobConfigError(f"TF_CONFIG cluster.ps has {len(ps)} addresses, not a multiple of stages = {stages} "
                             "(every stage has the same number of shards, listed stage by stage)")
    shards = len(ps) // stages
    if scope == "server":
        return {"server.shard_index": tf.task_index % shards, "job.shards": shards}
    workers = tf.workers
    if len(workers) % stages:
        raise JobConfigError(f"TF_CONFIG lists {len(workers)} workers, not a multiple of stages = {stages} "
                             "(every replica has one worker per stage, listed replica by replica)")
    if tf.task_stage is None:
        raise JobConfigError(f"TF_CONFIG task has no \"stage\", but the job has stages = {stages}: give each "
                             "worker task {\"type\": \"worker\", \"index\": REPLICA, \"stage\": STAGE}")
    stage, replica = tf.task_stage, tf.worker_index()
    if stage >= stages or replica >= len(workers) // stages:
        raise JobConfigError(f"TF_CONFIG task (replica {replica}, stage {stage}) is outside the cluster's "
                             f"{len(workers) // stages} replicas of {stages} stages")
    me = workers[replica * stages + stage]
    host, port = split_address(me)
    listen = f"{host if is_loopback(host) else '0.0.0.0'}:{port}"
    peers = [workers[replica * stages + stage - 1] if stage > 0 else "-",
             workers[replica * stages + stage + 1] if stage < stages - 1 else "-"]
    return {"worker.index": replica, "worker.stage": stage, "job.workers": len(workers) // stages,
            "worker.servers": ps[stage * shards:(stage + 1) * shards], "job.shards": shards,
            "worker.stage_listen": listen, "worker.stage_peers": peers}
