"""Replicated shards: what replication costs (steps/s with R = 2 against R = 1) and a failover's stall, per mode.

    python -m ps_bench.replication_bench [--modes async,ssp,sync] [--steps 600] [--repeats 1]

For each mode, real processes on 127.0.0.1: 2 shards (`python -m ps_server`) and 3 workers
(`python -m worker_client --events`, the real training loop on the bundled MLP and digits,
batch 32, one thread each), run in turn

* with R = 1 (one process per shard) and with R = 2 (a primary and a backup per shard,
  `--replicas/--replica-index/--voters`; the workers get `A|B` per shard): steps/s of the
  job (the global steps over the chief's training seconds) and the ratio R=2 / R=1;
* with R = 2 and shard 0's primary killed with SIGKILL a third of the way in (never
  restarted): the longest gap between consecutive progress events (0.1 s apart when all is
  well) of any worker around the kill -- the stall a failover costs as workers see it --
  and the test accuracy against the run without the kill.

One JSON line per figure (harness.emit): ``steps_per_s`` (replicas: 1 or 2),
``replication_cost`` (R=2 / R=1), ``failover_stall_s`` (and accuracy, accuracy_without).
Everything shares this machine's cores.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from ps_bench import harness
from ps_common.process import MERGE, ChildProcess, stop_all
from ps_models.builders import write_model
from ps_proto.v1 import replication_pb2 as rpb
from ps_proto.v1 import replication_pb2_grpc as rpb_grpc
from ps_tools.launch.supervise import free_ports

SHARDS, WORKERS = 2, 3
#: the fault tests' settings: momentum SGD at a learning rate stable with 3 stale workers
FLAGS = ["--optimizer", "momentum", "--lr", "0.02", "--lease-seconds", "3", "--wait-timeout", "60",
         "--workers", str(WORKERS), "--log-level", "WARNING"]
READY = "PS_SERVER_READY "
JOB_TIMEOUT = 300.0


def mode_flags(mode: str) -> list[str]:
    return {"sync": ["--replicas-to-aggregate", str(WORKERS)], "ssp": ["--staleness", "2"]}.get(mode, [])


def start_shards(mode: str, replicas: int) -> tuple[list[ChildProcess], list[list[str]]]:
    """The shard processes (replica-major per shard) and each shard's replica addresses."""
    children: list[ChildProcess] = []
    if replicas == 1:
        for s in range(SHARDS):
            child = ChildProcess(f"shard{s}", [sys.executable, "-P", "-m", "ps_server", "--shard-index", str(s),
                                               "--num-shards", str(SHARDS), "--mode", mode, "--host", "127.0.0.1",
                                               "--port", "0", *FLAGS, *mode_flags(mode)],
                                 env=harness.child_env(), ready_prefix=READY, stderr=MERGE)
            children.append(child)
        for child in children:
            child.wait_ready(60)
        return children, [[c.ready["address"]] for c in children]
    ports = free_ports(SHARDS * replicas)
    groups = [[f"127.0.0.1:{ports[s * replicas + r]}" for r in range(replicas)] for s in range(SHARDS)]
    voters = ",".join(a for g in groups for a in g)
    for s, group in enumerate(groups):
        for r in range(replicas):
            children.append(ChildProcess(
                f"shard{s}r{r}", [sys.executable, "-P", "-m", "ps_server", "--shard-index", str(s), "--num-shards",
                                  str(SHARDS), "--mode", mode, "--host", "127.0.0.1", "--port", "0", *FLAGS,
                                  *mode_flags(mode), "--replicas", ",".join(group), "--replica-index", str(r),
                                  "--voters", voters], env=harness.child_env(), ready_prefix=READY, stderr=MERGE))
    for child in children:
        child.wait_ready(60)
    return children, groups


def start_workers(model: Path, groups: list[list[str]], steps: int) -> list[ChildProcess]:
    servers = ",".join("|".join(g) for g in groups)
    return [ChildProcess(f"worker{i}", [sys.executable, "-P", "-m", "worker_client", "--events", "--servers",
                                        servers, "--worker-index", str(i), "--workers", str(WORKERS), "--model",
                                        str(model), "--data", "digits", "--batch-size", "32", "--steps", str(steps),
                                        "--eval-every", "0", "--progress-every", "0.1", "--intra-op-threads", "1",
                                        "--wait-timeout", "60", "--reconnect-timeout", "30", "--log-level",
                                        "WARNING"], env=harness.child_env(), events=True, stderr=MERGE)
            for i in range(WORKERS)]


def primary_of(group: list[str]) -> int | None:
    """The index in `group` of the replica that says it is the primary."""
    for i, address in enumerate(group):
        with grpc.insecure_channel(address) as channel:
            try:
                if rpb_grpc.ReplicationStub(channel).Status(rpb.ReplicaStatusRequest(), timeout=2).role == "PRIMARY":
                    return i
            except grpc.RpcError:
                continue
    return None


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:g} s")
        time.sleep(0.05)


def progress_times(worker: ChildProcess) -> list[float]:
    return [e["time"] for e in worker.events if e.get("event") == "progress"]


def run(model: Path, mode: str, replicas: int, steps: int, *, kill: bool = False) -> dict:
    """One job; {steps_per_s, accuracy, stall_s (kill only)}."""
    shards, groups = start_shards(mode, replicas)
    workers: list[ChildProcess] = []
    try:
        workers = start_workers(model, groups, steps)
        struck = None
        if kill:
            chief = workers[0]
            wait_for(lambda: any(e.get("event") == "progress" and e.get("step", 0) >= steps // 3
                                 for e in chief.events), 120, f"{mode}: step {steps // 3}")
            index = primary_of(groups[0])
            if index is None:
                raise RuntimeError(f"{mode}: shard 0 has no primary among {groups[0]}")
            struck = time.time()
            shards[index].popen.send_signal(signal.SIGKILL)   # shard 0's replicas come first in `shards`
        wait_for(lambda: not any(w.alive() for w in workers), JOB_TIMEOUT, f"{mode} R={replicas}: the job's end")
        results = [next((e for e in w.events if e.get("event") == "done"), None) for w in workers]
        if any(r is None for r in results) or any(w.returncode for w in workers):
            tails = "\n".join(f"{w.name}: {w.last_lines()[-5:]}" for w in workers)
            raise RuntimeError(f"{mode} R={replicas}: a worker failed:\n{tails}")
        chief = results[0]
        out = {"steps_per_s": chief["steps"] / max(chief["seconds"], 1e-9), "accuracy": chief.get("test_accuracy")}
        if struck is not None:
            gaps = []
            for w in workers:
                times = progress_times(w)
                before = [t for t in times if t < struck][-1:]
                after = [t for t in times if t >= struck]
                seq = before + after
                gaps.append(max((b - a for a, b in zip(seq, seq[1:])), default=float("nan")))
            out["stall_s"] = max(gaps)
        return out
    finally:
        stop_all([c.popen for c in [*workers, *shards]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="async,ssp,sync", help="comma-separated modes (default all three)")
    p.add_argument("--steps", type=int, default=600, help="global steps of each job (default 600)")
    p.add_argument("--repeats", type=int, default=1, help="R=1/R=2 pairs per mode (default 1)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="replication-bench-") as tmp:
        model = write_model("mlp", Path(tmp) / "mlp.onnx", seed=0)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            single, double = [], []
            for k in range(args.repeats):
                order = (1, 2) if k % 2 == 0 else (2, 1)
                for replicas in order:
                    harness.log(f"{mode}: R={replicas} (repeat {k + 1})")
                    (single if replicas == 1 else double).append(run(model, mode, replicas, args.steps))
            common = {"mode": mode, "shards": SHARDS, "workers": WORKERS, "steps": args.steps,
                      "machine": harness.machine()}
            for replicas, runs in ((1, single), (2, double)):
                harness.emit(harness.SYSTEM, "steps_per_s", 0.0, harness.median([r["steps_per_s"] for r in runs]),
                             "steps/s", replicas=replicas, runs=[round(r["steps_per_s"], 2) for r in runs], **common)
            ratios = [d["steps_per_s"] / s["steps_per_s"] for s, d in zip(single, double)]
            harness.emit(harness.SYSTEM, "replication_cost", 0.0, harness.median(ratios), "x",
                         against="replicas=1", runs=[round(r, 3) for r in ratios], **common)
            harness.log(f"{mode}: R=2 with shard 0's primary killed at step {args.steps // 3}")
            killed = run(model, mode, 2, args.steps, kill=True)
            harness.emit(harness.SYSTEM, "failover_stall_s", 0.0, killed["stall_s"], "s",
                         accuracy=killed["accuracy"], accuracy_without=double[0]["accuracy"], **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
