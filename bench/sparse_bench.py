"""Sparse vs dense use of one embedding table: steps/s and bytes per step for tables of 10^5 .. 10^7 rows.

    python -m ps_bench.sparse_bench [--rows 100000,1000000,10000000] [--dim 64] [--lookups 4096]
                                    [--steps 50] [--dense-max-rows 1000000]
    python -m ps_bench.sparse_bench --fm [--steps 600] [--seed 0]

Two shard processes (async, SGD) hold a table of ROWS x DIM float32 (10^7 x 64 is 2.56 GB, split
over both by the shard map) and a small dense tensor. One step of one worker:

* sparse: draws LOOKUPS uniform ids, pulls their unique rows (`PSClient.pull_rows`) and pushes a
  gradient for those rows and the dense tensor (`PSClient.push(row_gradients=...)`), as the
  training loop does with `--sparse-tables`;
* dense: pushes a gradient of the whole table and pulls it whole (Push then Pull streams), which
  is what a worker without sparse tables moves. Skipped above --dense-max-rows (at 10^7 rows it
  is 5 GB a step).

One JSON line per (mode, rows): steps_per_second, bytes_pulled_per_step, bytes_pushed_per_step,
unique_rows_per_step and need_bytes_per_step (the unique rows' float32 values and int64 ids).

``--fm`` instead trains the recommendation example (models/recsys/fm.onnx on synthetic:clicks,
docs/models.md) with ps-launch: 2 shards, 2 sync workers, Adagrad, its two tables sparse
(``--sparse-min-rows 1000``), dense, and dense with ``--no-shared-memory`` (gRPC bytes only,
as between hosts). One JSON line per run: steps_per_second (worker steps over the training
seconds), the bytes per step, unique rows per step, and test_auc.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from ps_bench import harness
from ps_common.process import python_module_argv
from ps_models.recsys import FM_PATH
from worker_client.client import PSClient

#: The shards' learning rate (SGD: no optimizer slots, so 10^7 x 64 fits in memory twice over).
LR = 0.01
#: The dense tensor beside the table (a model's other layers).
DENSE_SHAPE = (64, 64)
#: Untimed steps before the timed ones (connections, first allocations).
WARMUP_STEPS = 3


def run(rows: int, dim: int, lookups: int, steps: int, dense: bool, seed: int) -> list[dict]:
    shards = [harness.start_shard(["--shard-index", str(i), "--num-shards", "2", "--mode", "async",
                                   "--optimizer", "sgd", "--lr", str(LR), "--wait-timeout", "300"]) for i in range(2)]
    client = PSClient([s.ready["address"] for s in shards], worker_id="sparse-bench", rpc_timeout=600,
                      wait_timeout=300, shared_memory=False)
    out = []
    try:
        client.wait_ready(timeout=60)
        table = np.full((rows, dim), 0.01, np.float32)
        started = time.perf_counter()
        client.initialize({"emb": table, "dense": np.zeros(DENSE_SHAPE, np.float32)})
        harness.log(f"rows {rows}: initialized {table.nbytes / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s")
        del table
        client.register(heartbeat=True)
        rng = np.random.default_rng(seed)
        dense_grad = np.full(DENSE_SHAPE, 1e-3, np.float32)

        def sparse_step() -> int:
            ids = np.unique(rng.integers(0, rows, size=lookups, dtype=np.int64))
            values = client.pull_rows({"emb": ids})["emb"]
            client.push({"dense": dense_grad}, row_gradients={"emb": (ids, np.full_like(values, 1e-3))})
            client.pull(["dense"])
            return len(ids)

        modes = [("sparse", sparse_step)]
        if dense:
            table_grad = np.full((rows, dim), 1e-3, np.float32)

            def dense_step() -> int:
                client.push({"emb": table_grad, "dense": dense_grad})
                client.pull()
                return 0

            modes.append(("dense", dense_step))
        for mode, step in modes:
            for _ in range(WARMUP_STEPS):
                step()
            pulled, pushed, touched = client.bytes_pulled, client.bytes_pushed, 0
            started = time.perf_counter()
            for _ in range(steps):
                touched += step()
            seconds = time.perf_counter() - started
            record = {"system": harness.SYSTEM, "mode": mode,
                      "rows": rows, "dim": dim, "lookups": lookups, "steps": steps,
                      "steps_per_second": round(steps / seconds, 2),
                      "bytes_pulled_per_step": round((client.bytes_pulled - pulled) / steps),
                      "bytes_pushed_per_step": round((client.bytes_pushed - pushed) / steps),
                      "unique_rows_per_step": round(touched / steps, 1),
                      "need_bytes_per_step": round(touched / steps * (dim * 4 + 8))}
            print(json.dumps(record), flush=True)
            out.append(record)
    finally:
        client.close()
        harness.stop_all(shards)
    return out


#: The recommendation example's job (docs/models.md), less its steps and the mode's flags.
FM_JOB = ["--model", str(FM_PATH), "--data", "synthetic:clicks", "--shards", "2", "--workers", "2",
          "--mode", "sync", "--batch-size", "64", "--optimizer", "adagrad", "--lr", "0.05", "--eval-every", "0",
          "--log-level", "WARNING"]
FM_MODES = {"sparse": ["--sparse-min-rows", "1000"], "dense": [], "dense-grpc": ["--no-shared-memory"]}


def run_fm(steps: int, seed: int) -> list[dict]:
    """The FM trained by ps-launch in each of FM_MODES; one JSON line each."""
    out = []
    for mode, flags in FM_MODES.items():
        argv = python_module_argv("ps_tools.launch", *FM_JOB, "--steps", str(steps), "--seed", str(seed), *flags)
        done = subprocess.run(argv, capture_output=True, text=True, env=harness.child_env(), timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"ps-launch ({mode}) exited {done.returncode}: {done.stderr[-2000:]}")
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        record = {"system": harness.SYSTEM, "model": "fm", "mode": mode, "steps": summary["steps"],
                  "steps_per_second": round(summary["steps"] / summary["train_seconds"], 2),
                  **{k: summary[k] for k in ("bytes_pulled_per_step", "bytes_pushed_per_step",
                                             "unique_rows_per_step", "test_auc", "seconds")}}
        print(json.dumps(record), flush=True)
        out.append(record)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="100000,1000000,10000000", help="table sizes, comma-separated")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lookups", type=int, default=4096, help="ids per step (a batch's lookups)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 50; with --fm, 600 training steps)")
    p.add_argument("--dense-max-rows", type=int, default=1_000_000, help="largest table also run densely")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fm", action="store_true", help="train the recommendation example instead (see above)")
    args = p.parse_args(argv)
    if args.fm:
        run_fm(args.steps or 600, args.seed)
        return 0
    for rows in (int(r) for r in args.rows.split(",")):
        run(rows, args.dim, args.lookups, args.steps or 50, rows <= args.dense_max_rows, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
