"""Training steps/s of onnx-ps against its peers at their best: PyTorch RPC (two variants, two transports), DDP.

For each model, worker count and mode (sync with N = workers, ssp with b = 1, async) it
runs whole jobs of real processes -- the shards (`python -P -m ps_server`) and the workers
(`python -P -m ps_bench.train_worker`: the real `Trainer` loop on the model's ONNX file) --
once per data path of ours (`--paths`: ``shm``, through shared memory on one host; ``grpc``,
every byte through gRPC as between hosts), then the same shape in PyTorch RPC
(`ps_bench.torch_rpc`: one PS process per shard holding the same parts, torch autograd
workers on the same torch module and batches) once per variant and transport
(`--torch-variants`: ``two-call/tcp``, ``fused/tcp``, ``fused/shm``), in sync mode DDP
(`ps_bench.ddp`, gloo all-reduce, no parameter server), and in async mode TensorFlow's
ParameterServerStrategy where tensorflow is importable (`ps_bench.tf_ps`: ps tasks, worker
tasks and a coordinator scheduling ``--tf-steps-per-function`` steps a call); the order of
the systems flips every repeat. A worker's rate is its timed steps over its timed window (start-up, warm-up
and the end are outside it); a run's steps/s is the sum over its workers (one step: one
batch's gradient computed and pushed, and a pull), its samples/s that times the batch.

The models (`--models`, `ps_bench.peers.MODELS`): ``mlp`` (784-256-10), ``fm`` (the
recommendation example, tables by rows), ``transformer`` and ``resnet18``
(`ps_bench.torch_models`, exported to ONNX; they need torch). ``--peers`` runs the
comparison of docs/benchmarks.md, "Peers at their best": every model, 2 shards, 2
workers, batch 32, async and sync, both paths. ``--netns`` runs every shard, worker and
peer process on a host of its own: network namespaces on one switch, each host's link
shaped to ``--netns-rate`` both ways (`ps_bench.netns`; needs root); ``--netns-layout
two-hosts`` puts the shards (and DDP's rank 0) on one host and the workers on another
instead. Only the wire paths and TCP transports run there.

Prints one JSON line per system, ``{"system", "metric": "steps_per_s", "size_mb", "value",
"unit", "model", "workers", "mode", "path" | "variant", "transport" | "backend" | "strategy",
"samples_per_s", "runs", "machine", ...}`` (the median over repeats, each repeat in
"runs"), and ratio lines ``{"system": "onnx-ps/torch-rpc" | "onnx-ps/torch-ddp" | "onnx-ps/tf-ps",
"metric": "steps_per_s_ratio", "path", "against", "scope", ...}``: per path of ours, the median of
the repeats' ratios against the fastest peer of the path's scope (``one-host`` paths meet
every PyTorch RPC variant, ``wire`` paths those over TCP), above 1 we are faster.

Without torch in this environment it runs our side only (the models that need no torch to
exist) and says so on stderr. ``--profile`` also times one step of ours (the MLP, 1
worker, async and sync) part by part (`ps_bench.train_worker --profile` and
`ps_bench.profiled_shard`); JSON lines with ``"metric": "profile_ms"`` and a table on
stderr. docs/benchmarks.md says more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ps_common.modes import MODES
from ps_bench import harness, mlp, netns, peers, tf_ps
from ps_bench.harness import SYSTEM, TORCH, Proc, emit, log
from ps_bench.netns import Network, Placement
from ps_bench.peers import DDP, OURS, TF, ModelCase, System
from ps_bench.profiled_shard import OUT_ENV
from ps_bench.train_worker import RESULT_PREFIX, data_channel_supported

#: ssp's staleness bound in the benchmark.
STALENESS = 1
#: The shards' learning rate (SGD).
LR = 0.01
#: What --peers sets (each flag given explicitly wins).
PEERS_PRESET = {"models": "mlp,fm,transformer,resnet18", "shards": 2, "workers": "2", "batch": 32,
                "modes": "async,sync", "paths": "shm,channel,grpc"}
#: The defaults without --peers: the MLP table of docs/benchmarks.md.
CLASSIC = {"models": "mlp", "shards": 1, "workers": "1,2", "batch": mlp.BATCH, "modes": ",".join(MODES),
           "paths": "shm"}


@dataclass
class Case:
    """One comparison: a model, its files, a job shape, a mode, a network."""

    model: ModelCase
    onnx: Path
    data: Path
    cache: Path
    tables: list[str]
    size_mb: float
    shards: int
    workers: int
    mode: str
    batch: int
    warmup: int
    steps: int
    threads: int
    net: Network | None = None
    #: --netns: which host runs each process (`ps_bench.netns.Placement`)
    layout: str = "host-each"
    #: ours, async without tables by rows: a step's PushPull overlaps the next gradient (ps-worker's --overlap;
    #: off by default, as in ps-worker)
    overlap: bool = False
    #: TensorFlow's training steps in one scheduled function
    tf_steps_per_function: int = tf_ps.STEPS_PER_FUNCTION
    #: --netns: the MB the hosts sent each other in each run, by system label
    traffic: dict[str, list[float]] = field(default_factory=dict)
    #: the share of the machine's CPU the hypervisor took during each run, by system label (harness.steal_share)
    steal: dict[str, list[float | None]] = field(default_factory=dict)

    @property
    def overlapping(self) -> bool:
        return self.overlap and self.mode == "async" and not self.tables

    @property
    def timeout(self) -> float:
        """The longest a run may take: start-up plus the model's allowance per step of every worker."""
        return 120.0 + self.model.step_allowance * (self.warmup + self.steps) * self.workers

    @property
    def network(self) -> str:
        return "loopback" if self.net is None else f"netns {self.layout} veth tbf {self.net.rate}"

    @property
    def placement(self) -> Placement:
        return Placement(self.layout, self.shards, self.workers)

    def fields(self) -> dict[str, Any]:
        return {"model": self.model.name, "workers": self.workers, "shards": self.shards, "mode": self.mode,
                "batch": self.batch, "warmup": self.warmup, "steps": self.steps, "threads": self.threads,
                "network": self.network}


def shard_flags(mode: str, workers: int, *, index: int = 0, shards: int = 1) -> list[str]:
    flags = ["--mode", mode, "--workers", str(workers), "--optimizer", "sgd", "--lr", str(LR),
             "--shard-index", str(index), "--shards", str(shards)]
    if mode == "sync":
        flags += ["--replicas-to-aggregate", str(workers)]
    if mode == "ssp":
        flags += ["--staleness", str(STALENESS)]
    return flags


def start_shards(case: Case, *, module: str = "ps_server", env: dict[str, str] | None = None) -> list:
    """The case's shards, after their READY lines: on 127.0.0.1, or bound to the server namespace's address."""
    shards: list = []
    try:
        for i in range(case.shards):
            flags = shard_flags(case.mode, case.workers, index=i, shards=case.shards)
            if case.net is None:
                shards.append(harness.start_shard(flags, module=module, env=env))
            else:
                host = case.net.host(case.placement.shard(i))
                shards.append(harness.start_shard(flags, module=module, env=env, namespace=host.namespace,
                                                  host=host.address, name=f"shard {i} ({host.namespace})"))
    except BaseException:
        harness.stop_all(shards)
        raise
    return shards


def proc(case: Case, name: str, host: int, module: str, args: list, env: dict[str, str] | None = None) -> Proc:
    """A child running `module`: here, or on host `host` of the namespace network."""
    if case.net is None:
        return Proc(name, module, args, env=env)
    started = netns.trampoline(case.net.host(host).namespace, module, args)
    return Proc(name, started[0], started[1:], env=env)


def address(case: Case, host: int) -> str:
    """Host `host`'s address (127.0.0.1 without the namespace network)."""
    return "127.0.0.1" if case.net is None else case.net.host(host).address


def wait_results(case: Case, procs: list[Proc]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + case.timeout
    return [p.wait_for(RESULT_PREFIX, max(1.0, deadline - time.monotonic())) for p in procs]


def run_ours(case: Case, path: str, *, profile_out: Path | None = None) -> list[dict[str, Any]]:
    """One job of ours; the workers' results."""
    children: list = []
    try:
        children += start_shards(case, module="ps_bench.profiled_shard" if profile_out else "ps_server",
                                 env={OUT_ENV: str(profile_out)} if profile_out else None)
        common = ["--servers", ",".join(s.ready["address"] for s in children), "--workers", case.workers,
                  "--mode", case.mode, "--batch", case.batch, "--warmup", case.warmup, "--steps", case.steps,
                  "--threads", case.threads, "--model", case.onnx, "--data", case.data, "--cache-dir", case.cache,
                  "--data-path", path, "--wait-timeout", case.timeout,
                  "--overlap" if case.overlap and not profile_out else "--no-overlap"]
        if case.model.sparse_tables:
            common += ["--sparse-tables", ",".join(case.model.sparse_tables)]
        procs = [proc(case, f"{SYSTEM} worker {i}", case.placement.worker(i), "ps_bench.train_worker",
                      [*common, "--index", i, *(["--profile"] if profile_out else [])]) for i in range(case.workers)]
        children += procs
        results = wait_results(case, procs)
    finally:
        harness.stop_all(children)   # the shard's SIGTERM writes its profile
    if path == "channel" and any(r["data_channels"] < case.shards for r in results):
        log(f"train_bench: {case.model.name}: a worker had the data channel of only "
            f"{min(r['data_channels'] for r in results)} of {case.shards} shard(s), gRPC bytes with the rest")
    # on one host the defaults take shared memory for large shards and the data channel for small ones
    fast = [r["shared_memory_segments"] + r["data_channels"] for r in results]
    if path == "shm" and case.net is None and min(fast) < case.shards:
        log(f"train_bench: {case.model.name}: a worker moved its bytes through shared memory or the data channel "
            f"with only {min(fast)} of {case.shards} shard(s), over gRPC with the rest")
    return results


def tp_env(case: Case, host: int) -> dict[str, str] | None:
    """Where TensorPipe and gloo listen: the host's card (loopback: harness.child_env's "lo")."""
    if case.net is None:
        return None
    dev = case.net.host(host).device
    return {"TP_SOCKET_IFNAME": dev, "GLOO_SOCKET_IFNAME": dev}


def run_torch(case: Case, variant: str, transport: str) -> list[dict[str, Any]]:
    """The same job in PyTorch RPC; the workers' results."""
    port = harness.free_port()
    place = case.placement
    common = ["--port", port, "--host", address(case, place.shard(0)), "--transport", transport, "--variant", variant,
              "--shards", case.shards, "--workers", case.workers, "--mode", case.mode, "--aggregate", case.workers,
              "--staleness", STALENESS, "--model-name", case.model.name, "--model", case.onnx,
              "--tables", ",".join(case.tables)]
    children: list = []
    try:
        children += [proc(case, f"{TORCH} ps{i}", place.shard(i), "ps_bench.torch_rpc",
                          ["train-ps", *common, "--index", i, "--lr", LR], env=tp_env(case, place.shard(i)))
                     for i in range(case.shards)]
        procs = [proc(case, f"{TORCH} worker {i}", place.worker(i), "ps_bench.torch_rpc",
                      ["train-worker", *common, "--index", i, "--data", case.data, "--batch", case.batch,
                       "--warmup", case.warmup, "--steps", case.steps, "--threads", case.threads],
                      env=tp_env(case, place.worker(i))) for i in range(case.workers)]
        children += procs
        results = wait_results(case, procs)
    finally:
        harness.stop_all(children)
    return results


def run_ddp(case: Case) -> list[dict[str, Any]]:
    """The job as DDP over gloo (sync, no parameter server); under --netns, each rank on the placement's host."""
    port = harness.free_port()
    place = case.placement
    common = ["--world", case.workers, "--host", address(case, place.ddp_rank(0)), "--port", port,
              "--model-name", case.model.name, "--model", case.onnx, "--data", case.data,
              "--tables", ",".join(case.tables), "--lr", LR, "--batch", case.batch, "--warmup", case.warmup,
              "--steps", case.steps, "--threads", case.threads]
    procs: list[Proc] = []
    try:
        for rank in range(case.workers):
            host = place.ddp_rank(rank)
            procs.append(proc(case, f"{DDP} rank {rank}", host, "ps_bench.ddp", [*common, "--rank", rank],
                              env=tp_env(case, host)))
        return wait_results(case, procs)
    finally:
        harness.stop_all(procs)


def run_tf(case: Case) -> list[dict[str, Any]]:
    """The job in TensorFlow's ParameterServerStrategy (async): ps tasks where our shards run, worker tasks
    where our workers run, the coordinator beside worker 0; the coordinator's result (the steps/s of all
    workers together)."""
    place = case.placement

    def endpoint(host: int) -> str:
        return f"{address(case, host)}:{harness.free_port()}"

    hosts = {"ps": [place.shard(i) for i in range(case.shards)],
             "worker": [place.worker(i) for i in range(case.workers)]}
    cluster = tf_ps.cluster_spec([endpoint(h) for h in hosts["ps"]], [endpoint(h) for h in hosts["worker"]],
                                 endpoint(place.worker(0)))
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    children: list[Proc] = []
    try:
        for job in ("ps", "worker"):
            for i in range(len(cluster[job])):
                children.append(proc(case, f"{TF} {job} {i}", hosts[job][i], "ps_bench.tf_ps",
                                     ["server", "--job", job, "--index", i, "--cluster", json.dumps(cluster),
                                      "--threads", case.threads], env=env))
        for child in children:
            child.wait_for(tf_ps.READY_PREFIX, harness.SHARD_START_TIMEOUT)
        coordinator = proc(case, f"{TF} coordinator", place.worker(0), "ps_bench.tf_ps",
                           ["coordinator", "--cluster", json.dumps(cluster), "--model-name", case.model.name,
                            "--model", case.onnx, "--data", case.data, "--tables", ",".join(case.tables),
                            "--cache-dir", case.cache, "--workers", case.workers, "--batch", case.batch,
                            "--warmup", case.warmup, "--steps", case.steps, "--steps-per-function",
                            case.tf_steps_per_function, "--lr", LR, "--threads", case.threads], env=env)
        children.append(coordinator)
        return wait_results(case, [coordinator])
    finally:
        harness.stop_all(children)


def rate(results: list[dict[str, Any]]) -> float:
    return sum(r["steps_per_s"] for r in results)


def runner(case: Case, system: System):
    def run() -> float:
        sent = case.net.bytes_sent() if case.net is not None else 0
        ticks = harness.cpu_ticks()
        try:
            if system.kind == OURS:
                value = rate(run_ours(case, system.path))
            elif system.kind == DDP:
                value = rate(run_ddp(case))
            elif system.kind == TF:
                value = rate(run_tf(case))
            else:
                value = rate(run_torch(case, system.variant, system.transport))
        except RuntimeError:
            raise
        except Exception as exc:   # a child that could not start, a bad answer: this system fails, not the run
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        if case.net is not None:   # the evidence that the bytes went between the hosts (start-up included)
            case.traffic.setdefault(system.label, []).append((case.net.bytes_sent() - sent) / 1e6)
        case.steal.setdefault(system.label, []).append(harness.steal_share(ticks, harness.cpu_ticks()))
        return value
    return run


def bench_case(args: argparse.Namespace, case: Case, systems: list[System]) -> dict[System, list[float]]:
    where = f"{case.model.name}, {case.workers} worker(s), {case.shards} shard(s), {case.mode}, {case.network}"

    def report(repeat: int, runs: dict[System, list[float]]) -> None:
        log(f"train_bench: {where}, repeat {repeat + 1}/{args.repeats}: "
            + ", ".join(f"{s.label} {v[-1] * case.batch:.1f} samples/s"
                        + harness.stolen_note(case.steal.get(s.label, [None])[-1]) for s, v in runs.items() if v))

    def failed(system: System, exc: Exception) -> None:
        log(f"train_bench: {where}: {system.label} failed and is left out: {exc}")

    case.traffic, case.steal = {}, {}
    runs = peers.alternate(args.repeats, {s: runner(case, s) for s in systems}, report=report, on_error=failed)
    machine = harness.machine()
    for system, values in runs.items():
        if values:
            value = peers.median(values)
            mine = {"overlap": case.overlapping} if system.kind == OURS else {}
            if system.kind == TF:
                mine["steps_per_function"] = case.tf_steps_per_function
            if system.label in case.traffic:
                mine["veth_mb_per_run"] = round(peers.median(case.traffic[system.label]), 1)
            mine.update(harness.steal_fields(case.steal.get(system.label, [])))
            emit(system.kind, "steps_per_s", case.size_mb, value, "steps/s", **case.fields(), **system.fields(),
                 **mine, samples_per_s=round(value * case.batch, 2), runs=[round(v, 2) for v in values],
                 machine=machine)
    for c in peers.comparisons(runs):
        if c.ratios:
            emit(f"{OURS}/{c.peer.kind}", "steps_per_s_ratio", case.size_mb, c.value, "x", **case.fields(),
                 path=c.ours.path, against=c.peer.label, scope=c.ours.scope, runs=[round(r, 3) for r in c.ratios],
                 machine=machine)
    return runs


# ---------------------------------------------------------------------------------- profile

#: (part, how it is computed) in the order of the table; see docs/benchmarks.md.
PROFILE_PARTS = ("step", "compute", "push_pull", "server.push_pull", "wire.push_pull", "push", "client.encode",
                 "server.push", "server.receive", "server.decode", "server.domain", "server.apply", "wire.push", "pull",
                 "server.pull", "server.wait", "server.encode", "server.serialize", "client.decode", "wire.pull",
                 "loop")


def breakdown(result: dict[str, Any], server_calls: dict[str, list[list[float]]]) -> dict[str, float]:
    """Milliseconds per timed step of each part (client calls from the worker, server calls inside its window)."""
    steps = result["timed_steps"]
    opened, closed = result["window"]
    ms: dict[str, float] = {"step": 1e3 * result["seconds"] / steps}
    for name, calls in result["calls"].items():
        ms[name] = 1e3 * sum(d for _, d in calls) / steps
    for name, calls in server_calls.items():
        ms[name] = 1e3 * sum(d for s, d in calls if opened <= s <= closed) / steps
    get = lambda name: ms.get(name, 0.0)   # noqa: E731
    # The Push handler starts with the call: its wait for the request's bytes is the wire's.
    ms["server.decode"] = get("server.decode") - get("server.receive")
    ms["wire.push"] = get("push") - get("client.encode") - (get("server.push") - get("server.receive"))
    ms["wire.pull"] = get("pull") - get("client.decode") - get("server.pull") - get("server.serialize")
    # The training loop's round trip (PushPull): what the client waited for, less the handler and the
    # client's own encoding and decoding, is gRPC and the socket (or, with shared memory, gRPC alone).
    if get("push_pull"):
        ms["wire.push_pull"] = get("push_pull") - get("server.push_pull") - get("client.encode") - get("client.decode")
        ms["wire.push"] = ms["wire.pull"] = 0.0
    ms["loop"] = get("step") - get("compute") - get("push_pull") - get("push") - get("pull")
    return {part: round(ms.get(part, 0.0), 4) for part in PROFILE_PARTS}


def profile(args: argparse.Namespace, case: Case, with_torch: bool) -> None:
    out = case.cache.parent / f"shard-profile-{case.mode}.json"
    result = run_ours(case, "shm", profile_out=out)[0]
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server_calls = json.loads(out.read_text()) if out.exists() else {}
    if not server_calls:
        log(f"train_bench: the shard wrote no profile to {out}; server parts are 0")
    parts = breakdown(result, server_calls)
    extra = {"workers": 1, "mode": case.mode, "batch": case.batch, "steps": case.steps, "threads": case.threads}
    for part, value in parts.items():
        emit(SYSTEM, "profile_ms", case.size_mb, value, "ms/step", part=part, **extra)
    torch_parts: dict[str, float] = {}
    if with_torch:
        torch_result = run_torch(case, "two-call", "tcp")[0]
        torch_parts = {"step": 1e3 * torch_result["seconds"] / case.steps, **torch_result["per_step_ms"]}
        torch_parts["loop"] = torch_parts["step"] - sum(torch_parts[k] for k in ("compute", "push", "pull"))
        for part, value in torch_parts.items():
            emit(TORCH, "profile_ms", case.size_mb, value, "ms/step", part=part, variant="two-call", transport="tcp",
                 **extra)
    log(f"\nprofile of one step, 1 worker, {case.mode} (ms per step; instrumented, so slower than the plain run):")
    log(f"  {'part':<18}{SYSTEM:>10}{TORCH if torch_parts else '':>12}")
    for part, value in parts.items():
        theirs = f"{torch_parts[part]:>12.3f}" if part in torch_parts else ""
        log(f"  {part:<18}{value:>10.3f}{theirs}")


# ---------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ps_bench.train_bench", description=__doc__.splitlines()[0])
    p.add_argument("--peers", action="store_true",
                   help="the peers-at-their-best comparison: "
                        + ", ".join(f"--{k} {v}" for k, v in PEERS_PRESET.items()) + " (flags given explicitly win)")
    p.add_argument("--models", default=None,
                   help=f"models, of {','.join(peers.MODELS)} (default {CLASSIC['models']})")
    p.add_argument("--shards", type=int, default=None,
                   help=f"shards (and peer PS processes) (default {CLASSIC['shards']})")
    p.add_argument("--workers", default=None, help=f"worker counts (default {CLASSIC['workers']})")
    p.add_argument("--modes", default=None, help=f"modes (default {CLASSIC['modes']})")
    p.add_argument("--paths", default=None,
                   help=f"our data paths, of {','.join(peers.PATHS)} or all (default {CLASSIC['paths']})")
    p.add_argument("--torch-variants", default=",".join(peers.TORCH_VARIANTS),
                   help=f"PyTorch RPC's variant/transport pairs, of {','.join(peers.ALL_TORCH_VARIANTS)} or all "
                        f"(default {','.join(peers.TORCH_VARIANTS)})")
    p.add_argument("--no-ddp", action="store_true", help="leave DDP out of sync mode")
    p.add_argument("--no-tf", action="store_true",
                   help="leave TensorFlow's ParameterServerStrategy out of async mode (it runs where tensorflow is "
                        "importable)")
    p.add_argument("--tf-steps-per-function", type=int, default=tf_ps.STEPS_PER_FUNCTION,
                   help=f"TensorFlow: training steps in one scheduled function (default {tf_ps.STEPS_PER_FUNCTION})")
    p.add_argument("--overlap", action="store_true",
                   help="ours: overlap a step's PushPull with the next gradient in async mode (ps-worker's "
                        "--overlap; off by default, as in ps-worker)")
    p.add_argument("--netns", action="store_true",
                   help="shards and workers on hosts of their own: network namespaces on one switch, each host's "
                        "link shaped (root)")
    p.add_argument("--netns-rate", default="10gbit", help="each host link's tbf rate, both ways (default 10gbit)")
    p.add_argument("--netns-layout", choices=netns.LAYOUTS, default="host-each",
                   help="host-each: every shard, worker and peer process on a host of its own, as a cluster runs "
                        "them (default); two-hosts: the shards on one host, the workers on another, one link "
                        "carrying all workers' bytes")
    p.add_argument("--batch", type=int, default=None, help=f"batch size per worker (default {CLASSIC['batch']})")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per worker first (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per worker (default: the model's: "
                   + ", ".join(f"{m.name} {m.steps[1]}" for m in peers.MODELS.values()) + ")")
    p.add_argument("--repeats", type=int, default=3, help="runs of each system per case; medians count (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads per worker: onnxruntime intra-op = torch.set_num_threads (default 1)")
    p.add_argument("--profile", action="store_true", help="also profile one step of ours (the MLP, 1 worker)")
    p.add_argument("--profile-only", action="store_true", help="only the profile")
    p.add_argument("--profile-modes", default="async,sync", help="modes of the profile (default async,sync)")
    p.add_argument("--no-torch", action="store_true",
                   help="our side only, even when torch is importable (which still exports the torch models)")
    args = p.parse_args(argv)
    preset = PEERS_PRESET if args.peers else CLASSIC
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.model_list = peers.parse_list(args.models, list(peers.MODELS), "--models")
        args.path_list = peers.parse_list(args.paths, list(peers.PATHS), "--paths")
        args.variant_list = peers.parse_list(args.torch_variants, peers.ALL_TORCH_VARIANTS, "--torch-variants")
        args.mode_list = peers.parse_list(args.modes, MODES, "--modes")
        args.profile_mode_list = peers.parse_list(args.profile_modes, MODES, "--profile-modes")
        args.workers_list = [int(w) for w in args.workers.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0) \
            or args.repeats < 1 or args.batch < 1 or args.shards < 1 or any(w < 1 for w in args.workers_list) \
            or args.tf_steps_per_function < 1:
        p.error("--steps, --repeats, --batch, --shards, --workers and --tf-steps-per-function must be >= 1, "
                "--warmup >= 0")
    if args.netns and all(peers.PATHS[p_] == "one-host" for p_ in args.path_list):
        p.error("--netns runs the wire paths only (shared memory does not cross hosts): add --paths grpc")
    return args


def prepare(args: argparse.Namespace, model: ModelCase, work: Path, workers: int) -> Case:
    """The model's files and sizes for `workers` workers (its ONNX file, its data, the engine's tables)."""
    warmup = model.steps[0] if args.warmup is None else args.warmup
    steps = model.steps[1] if args.steps is None else args.steps
    onnx_path = peers.model_file(model, work)
    data = peers.write_data(model, work / f"{model.name}-{workers}w-{args.batch}b-{warmup + steps}.npz",
                            workers=workers, batch=args.batch, total=warmup + steps)
    # The gradient model is built once here, so no run's start-up includes building it.
    from worker_client.engine import GradientEngine
    from ps_bench.train_worker import SPARSE_MIN_BYTES
    tables = list(model.sparse_tables or ())
    engine = GradientEngine(onnx_path, batch_size=args.batch, loss="cross_entropy", cache_dir=work / "cache",
                            sparse_tables=tables, sparse_min_bytes=None if tables else SPARSE_MIN_BYTES)
    size_mb = round(sum(v.nbytes for v in engine.server_parameters().values()) / 1e6, 4)   # tables whole
    return Case(model, onnx_path, data, work / "cache", sorted(engine.sparse.tables), size_mb, args.shards, workers,
                "", args.batch, warmup, steps, args.threads, overlap=args.overlap,
                tf_steps_per_function=args.tf_steps_per_function)


def run_all(args: argparse.Namespace, work: Path, with_torch: bool, net: Network | None) -> None:
    if "channel" in args.path_list and not data_channel_supported():
        log("train_bench: this version has no data channel: --paths channel left out")
        args.path_list = [p for p in args.path_list if p != "channel"]
    for name in args.model_list:
        model = peers.MODELS[name]
        if model.needs_torch and not harness.torch_available():   # --no-torch still exports with torch
            log(f"train_bench: {name} left out: its ONNX file is exported from torch, not importable here")
            continue
        for workers in args.workers_list:
            case = prepare(args, model, work, workers)
            case.net, case.layout = net, args.netns_layout
            log(f"train_bench: {model.description}; {case.size_mb} MB of parameters; trained by rows: "
                f"{', '.join(case.tables) or 'none'}; {case.warmup} + {case.steps} steps per worker")
            if not args.profile_only:
                for mode in args.mode_list:
                    case.mode = mode
                    systems = peers.systems_for(mode, args.path_list, args.variant_list, ddp=not args.no_ddp,
                                                with_torch=with_torch, netns=net is not None,
                                                with_tf=args.with_tf)
                    bench_case(args, case, systems)
    if args.profile or args.profile_only:
        case = prepare(args, peers.MODELS["mlp"], work, 1)
        case.shards = 1
        for mode in args.profile_mode_list:
            case.mode = mode
            profile(args, case, with_torch)


def with_tensorflow(args: argparse.Namespace, with_torch: bool) -> bool:
    """Whether TensorFlow's peer runs: with the other peers (not under --no-torch), unless --no-tf, where
    tensorflow is importable; says on stderr when it is not."""
    if not with_torch or args.no_tf:
        return False
    if not harness.tensorflow_available():
        log(f"train_bench: tensorflow is not importable in this environment ({sys.executable}): TensorFlow's "
            "ParameterServerStrategy left out of async mode (docs/benchmarks.md: the torch environment)")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with_torch = not args.no_torch and harness.torch_available()
    if not with_torch:
        log("train_bench: " + ("--no-torch: " if args.no_torch else "torch is not importable in this environment "
            f"({sys.executable}): ") + "running onnx-ps only (docs/benchmarks.md: the torch environment)")
    args.with_tf = with_tensorflow(args, with_torch)
    log(f"train_bench: machine {json.dumps(harness.machine())}")
    with tempfile.TemporaryDirectory(prefix="ps-train-bench-") as tmp:
        if args.netns:
            hosts = Placement(args.netns_layout, args.shards, max(args.workers_list)).hosts
            with netns.network(hosts=hosts, rate=args.netns_rate, log=log) as net:
                run_all(args, Path(tmp), with_torch, net)
        else:
            run_all(args, Path(tmp), with_torch, None)
    log(f"train_bench: loadavg at the end {harness.machine()['loadavg']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
