"""Pipeline stages: steps/s for K = 1, 2, 4 on a deep MLP, and each stage's peak memory against the whole model's.

    python -m ps_bench.pipeline_bench [--stages 1,2,4] [--width 1024] [--depth 8] [--steps 60]
                                      [--batch-size 64] [--micro-batches 4] [--workers 1]

Each K is one `ps-launch --stages K` job (sync, --shards 1 per stage, --workers replicas) of
the deep MLP (ps_models.builders.build_deep_mlp: DEPTH hidden layers of WIDTH units) on the
digits data; K = 1 is the plain data-parallel worker holding the whole model. One JSON line
per K with steps/s (steps over the workers' training seconds), and one per stage with the
stage worker's peak resident memory (ru_maxrss) and its parameter bytes. The figures are
ratios within one run: the stages of one replica share this machine's cores, so a K-stage
pipeline here shows the cost of cutting (activations over gRPC, recomputation in the
backward pass) and the memory each stage saves, not the speed-up of K machines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

from ps_bench import harness
from ps_common.process import python_module_argv
from ps_models.builders import build_deep_mlp

#: The longest one job may run, in seconds.
JOB_TIMEOUT = 900


def run_job(model: Path, stages: int, args: argparse.Namespace, record: Path) -> dict:
    flags = ["--mode", "sync", "--shards", "1", "--workers", str(args.workers), "--model", str(model),
             "--data", "digits", "--batch-size", str(args.batch_size), "--steps", str(args.steps),
             "--eval-every", "0", "--optimizer", "momentum", "--lr", "0.01", "--log-level", "WARNING",
             "--timeout", str(JOB_TIMEOUT), "--record", str(record)]
    if stages > 1:
        flags += ["--stages", str(stages), "--micro-batches", str(args.micro_batches)]
    done = subprocess.run(python_module_argv("ps_tools.launch", *flags), capture_output=True, text=True,
                          env=harness.child_env(), timeout=JOB_TIMEOUT + 60)
    if done.returncode != 0:
        raise SystemExit(f"ps-launch --stages {stages} exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    run = json.loads((record / "run.json").read_text())
    summary["worker_results"] = run["workers"]
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="1,2,4", help="stage counts, comma-separated")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--workers", type=int, default=1, help="replicas of the pipeline")
    args = p.parse_args(argv)
    machine = harness.machine()
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as scratch:
        model = Path(scratch) / "deep_mlp.onnx"
        onnx.save(build_deep_mlp(width=args.width, depth=args.depth), str(model))
        size_mb = round(model.stat().st_size / 1e6, 1)
        harness.log(f"deep MLP 64-{args.width}x{args.depth}-10: {size_mb} MB of parameters")
        base_rate = None
        for stages in (int(k) for k in args.stages.split(",")):
            summary = run_job(model, stages, args, Path(scratch) / f"k{stages}")
            rate = summary["steps"] / max(summary["train_seconds"], 1e-9)
            base_rate = base_rate or rate
            harness.emit(harness.SYSTEM, "pipeline_steps_per_second", size_mb, rate, "steps/s", stages=stages,
                         micro_batches=summary.get("micro_batches"), workers=args.workers,
                         ratio_to_first=round(rate / base_rate, 3), test_accuracy=summary["test_accuracy"],
                         machine=machine)
            for result in summary["worker_results"]:
                if result.get("worker", 0) != 0:
                    continue
                harness.emit(harness.SYSTEM, "stage_peak_rss_mb", size_mb, result["peak_rss_mb"], "MiB",
                             stages=stages, stage=result.get("stage", 0),
                             parameter_bytes=result.get("parameter_bytes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
