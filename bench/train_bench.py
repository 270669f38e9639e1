"""Training steps/s of the MLP 784-256-10 (batch 64, SGD, synthetic data): onnx-ps against PyTorch RPC.

For each worker count (1, 2) and mode (sync with N = workers, ssp with b = 1, async) it
runs a whole job of real processes on 127.0.0.1 -- one shard (`python -P -m ps_server`)
and the workers (`python -P -m ps_bench.train_worker`: the real `Trainer` loop) -- and
then the same shape in PyTorch RPC (`ps_bench.torch_rpc`: one PS process, TensorPipe over
TCP, torch autograd workers), with the same warm-up and timed step counts, the order of
the two flipping every repeat. A worker's rate is its timed steps over its timed window
(start-up, warm-up and the end are outside it); a run's steps/s is the sum over its
workers (one step: one batch's gradient computed and pushed, and a pull).

Prints one JSON line per measurement, ``{"system", "metric": "steps_per_s", "size_mb",
"value", "unit", "workers", "mode", "runs"}`` (the median over repeats, each repeat in
"runs"), and a ratio line ``{"system": "onnx-ps/torch-rpc", "metric": "steps_per_s_ratio",
...}`` per pair: the median of the repeats' ratios, ours over theirs (above 1: we are faster).

Without torch in this environment it runs our side only and says so on stderr.
``--profile`` also times one step of ours (1 worker, async and sync) part by part
(`ps_bench.train_worker --profile` and `ps_bench.profiled_shard`): compute, client
encode/decode, wire, server decode/apply/encode, waiting, the loop; JSON lines with
``"metric": "profile_ms"`` and a table on stderr. docs/benchmarks.md says more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ps_common.modes import MODES
from ps_bench import harness, mlp
from ps_bench.harness import SYSTEM, TORCH, Proc, emit, log
from ps_bench.profiled_shard import OUT_ENV
from ps_bench.train_worker import RESULT_PREFIX

#: ssp's staleness bound in the benchmark.
STALENESS = 1
#: The shards' learning rate (SGD).
LR = 0.01


def shard_flags(mode: str, workers: int) -> list[str]:
    flags = ["--mode", mode, "--workers", str(workers), "--optimizer", "sgd", "--lr", str(LR)]
    if mode == "sync":
        flags += ["--replicas-to-aggregate", str(workers)]
    if mode == "ssp":
        flags += ["--staleness", str(STALENESS)]
    return flags


def run_timeout(args: argparse.Namespace, workers: int) -> float:
    """The longest a run may take: start-up plus a generous 50 ms per step of every worker."""
    return 120.0 + 0.05 * (args.warmup + args.steps) * workers


def run_ours(args: argparse.Namespace, workers: int, mode: str, work: Path, *,
             profile_out: Path | None = None) -> list[dict[str, Any]]:
    """One job of ours; the workers' results."""
    children: list = []
    try:
        shard = harness.start_shard(shard_flags(mode, workers),
                                    module="ps_bench.profiled_shard" if profile_out else "ps_server",
                                    env={OUT_ENV: str(profile_out)} if profile_out else None)
        children.append(shard)
        common = ["--servers", shard.ready["address"], "--workers", workers, "--mode", mode, "--batch", args.batch,
                  "--warmup", args.warmup, "--steps", args.steps, "--threads", args.threads,
                  "--model", work / "mlp.onnx", "--cache-dir", work / "cache"]
        procs = [Proc(f"{SYSTEM} worker {i}", "ps_bench.train_worker",
                      [*common, "--index", i, *(["--profile"] if profile_out else [])]) for i in range(workers)]
        children += procs
        deadline = time.monotonic() + run_timeout(args, workers)
        results = [p.wait_for(RESULT_PREFIX, max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        harness.stop_all(children)   # the shard's SIGTERM writes its profile
    return results


def run_torch(args: argparse.Namespace, workers: int, mode: str, work: Path) -> list[dict[str, Any]]:
    """The same job in PyTorch RPC; the workers' results."""
    port = harness.free_port()
    common = ["--port", port, "--workers", workers, "--mode", mode, "--aggregate", workers, "--staleness", STALENESS]
    children: list = []
    try:
        children.append(Proc(f"{TORCH} ps", "ps_bench.torch_rpc",
                             ["train-ps", *common, "--lr", LR, "--model", work / "mlp.onnx"]))
        procs = [Proc(f"{TORCH} worker {i}", "ps_bench.torch_rpc",
                      ["train-worker", *common, "--index", i, "--batch", args.batch, "--warmup", args.warmup,
                       "--steps", args.steps, "--threads", args.threads]) for i in range(workers)]
        children += procs
        deadline = time.monotonic() + run_timeout(args, workers)
        results = [p.wait_for(RESULT_PREFIX, max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        harness.stop_all(children)
    return results


def rate(results: list[dict[str, Any]]) -> float:
    return sum(r["steps_per_s"] for r in results)


def bench_case(args: argparse.Namespace, workers: int, mode: str, work: Path, size_mb: float,
               with_torch: bool) -> dict[str, list[float]]:
    def report(repeat: int, runs: dict[str, list[float]]) -> None:
        log(f"train_bench: {workers} worker(s), {mode}, repeat {repeat + 1}/{args.repeats}: "
            + ", ".join(f"{s} {v[-1]:.1f} steps/s" for s, v in runs.items() if v))

    runs, ratios = harness.side_by_side(
        args.repeats, lambda: rate(run_ours(args, workers, mode, work)),
        (lambda: rate(run_torch(args, workers, mode, work))) if with_torch else None, report=report)
    harness.emit_medians(runs, ratios, metric="steps_per_s", ratio_metric="steps_per_s_ratio", size_mb=size_mb,
                         unit="steps/s", digits=2, workers=workers, mode=mode, batch=args.batch, steps=args.steps,
                         threads=args.threads)
    return runs


# ---------------------------------------------------------------------------------- profile

#: (part, how it is computed) in the order of the table; see docs/benchmarks.md.
PROFILE_PARTS = ("step", "compute", "push_pull", "server.push_pull", "wire.push_pull", "push", "client.encode",
                 "server.push", "server.receive", "server.decode", "server.domain", "server.apply", "wire.push", "pull",
                 "server.pull", "server.wait", "server.encode", "server.serialize", "client.decode", "wire.pull", "loop")


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


def profile(args: argparse.Namespace, mode: str, work: Path, size_mb: float, with_torch: bool) -> None:
    out = work / f"shard-profile-{mode}.json"
    result = run_ours(args, 1, mode, work, profile_out=out)[0]
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server_calls = json.loads(out.read_text()) if out.exists() else {}
    if not server_calls:
        log(f"train_bench: the shard wrote no profile to {out}; server parts are 0")
    parts = breakdown(result, server_calls)
    extra = {"workers": 1, "mode": mode, "batch": args.batch, "steps": args.steps, "threads": args.threads}
    for part, value in parts.items():
        emit(SYSTEM, "profile_ms", size_mb, value, "ms/step", part=part, **extra)
    torch_parts: dict[str, float] = {}
    if with_torch:
        torch_result = run_torch(args, 1, mode, work)[0]
        torch_parts = {"step": 1e3 * torch_result["seconds"] / args.steps, **torch_result["per_step_ms"]}
        torch_parts["loop"] = torch_parts["step"] - sum(torch_parts[k] for k in ("compute", "push", "pull"))
        for part, value in torch_parts.items():
            emit(TORCH, "profile_ms", size_mb, value, "ms/step", part=part, **extra)
    log(f"\nprofile of one step, 1 worker, {mode} (ms per step; instrumented, so slower than the plain run):")
    log(f"  {'part':<18}{SYSTEM:>10}{TORCH if torch_parts else '':>12}")
    for part, value in parts.items():
        theirs = f"{torch_parts[part]:>12.3f}" if part in torch_parts else ""
        log(f"  {part:<18}{value:>10.3f}{theirs}")


# ---------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.train_bench", description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes (default {','.join(MODES)})")
    p.add_argument("--batch", type=int, default=mlp.BATCH, help=f"batch size (default {mlp.BATCH})")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps per worker first (default 50)")
    p.add_argument("--steps", type=int, default=500, help="timed steps per worker (default 500)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each system per case; medians count (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads per worker: onnxruntime intra-op = torch.set_num_threads (default 1)")
    p.add_argument("--profile", action="store_true", help="also profile one step of ours (1 worker, async and sync)")
    p.add_argument("--profile-only", action="store_true", help="only the profile")
    p.add_argument("--profile-modes", default="async,sync", help="modes of the profile (default async,sync)")
    p.add_argument("--no-torch", action="store_true", help="our side only, even when torch is importable")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.batch < 1:
        p.error("--steps, --repeats and --batch must be >= 1, --warmup >= 0")
    workers_list = [int(w) for w in args.workers.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    profile_modes = [m.strip() for m in args.profile_modes.split(",")]
    if any(m not in MODES for m in modes + profile_modes) or any(w < 1 for w in workers_list):
        p.error(f"--modes takes {', '.join(MODES)}; --workers counts >= 1")
    with_torch = not args.no_torch and harness.torch_available()
    if not with_torch:
        log("train_bench: " + ("--no-torch: " if args.no_torch else "torch is not importable in this environment "
            f"({sys.executable}): ") + "running onnx-ps only (docs/benchmarks.md: the torch environment)")
    log(f"train_bench: machine {json.dumps(harness.machine())}")
    with tempfile.TemporaryDirectory(prefix="ps-train-bench-") as tmp:
        work = Path(tmp)
        mlp.write_mlp(work / "mlp.onnx")
        size_mb = round(sum(v.nbytes for v in mlp.initial_values(work / "mlp.onnx").values()) / 1e6, 4)
        # The gradient model is built once here, so no run's start-up includes building it.
        from worker_client.engine import GradientEngine
        GradientEngine(work / "mlp.onnx", batch_size=args.batch, loss="cross_entropy", cache_dir=work / "cache")
        if not args.profile_only:
            for workers in workers_list:
                for mode in modes:
                    bench_case(args, workers, mode, work, size_mb, with_torch)
        if args.profile or args.profile_only:
            for mode in profile_modes:
                profile(args, mode, work, size_mb, with_torch)
    log(f"train_bench: loadavg at the end {harness.machine()['loadavg']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
