"""One worker of the training benchmark (our side): `worker_client.training.Trainer` on a model, timed.

Run by `ps_bench.train_bench` as ``python -P -m ps_bench.train_worker``. It builds the
same things `ps-worker` builds (a `GradientEngine`, a `PSClient`, a `TrainingPlan`) and
runs the real training loop, `Trainer.run()`: join (worker 0 initializes, start
barrier), then pull per the shards' mode, gradients, push, until its share of the
data is done (whole epochs: exactly warmup + steps iterations), deregister.

The model is ``--model`` (any ONNX file the engine trains; default: the MLP 784-256-10
written here) on ``--data`` (a dataset file or spec; default: the MLP's synthetic data),
with ps-worker's defaults for tables (those of 1 MiB or more train by rows) unless
``--sparse-tables`` names them. ``--data-path`` picks how bytes reach the shards:
``shm`` (ps-worker's defaults: a shared-memory segment with each shard on this host, the
call's header over the data channel; the data channel with other hosts, else gRPC), ``channel`` (the data channel, a TCP connection of its own per
shard, as between hosts, where this version has it) or ``grpc`` (gRPC bytes only:
``PSClient(shared_memory=False, data_channel=False)``). In async mode
without tables by rows a step's PushPull travels while the next gradient is computed
(``--overlap``, as ps-worker's opt-in ``--overlap``; by default each step waits for its round trip).

Timing excludes start-up: the window opens when iteration `warmup` starts (its call of
`engine.step`) and closes when the parameters after the last iteration are in hand, so it
covers exactly `steps` iterations, each one gradient, one push and one pull. The only
instrumentation of a plain run is a clock read at those two calls.

With ``--profile`` it also times, per call: the gradients (compute), the whole push and
pull, the client's encoding of push messages (`codec.pack_encoded`) and its decoding of
pull messages (`codec.decode_pull_response`, `PartAssembler.add/finish`). The shard's
side is timed by `ps_bench.profiled_shard`; `ps_bench.train_bench --profile` joins both.

Prints ``BENCH_RESULT {json}`` on stdout at the end.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from ps_bench import harness, mlp
from ps_common import codec, frames
from ps_common.modes import MODES
from ps_models.datasets import Dataset, load_dataset, num_batches
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from worker_client.training import Trainer, TrainingPlan

RESULT_PREFIX = "BENCH_RESULT "
#: ``--data-path``: our ways of moving a step's bytes (see the module docstring).
DATA_PATHS = ("shm", "channel", "grpc")


def data_channel_supported() -> bool:
    """True when this version's PSClient has the data channel (a TCP connection of its own per shard)."""
    return "data_channel" in inspect.signature(PSClient.__init__).parameters


def client_settings(path: str, *, profile: bool = False) -> dict[str, bool | int]:
    """PSClient's keywords for a data path: shm (the defaults on one host: shared memory with every shard, the
    call's header over the data channel), channel (the data channel even on this host), grpc (gRPC bytes only);
    ValueError for channel where there is none. A `profile`d shm run of a version that kept small shards out of
    shared memory takes it for them too (the profile's parts are the shared-memory path's)."""
    if path == "shm":
        takes_bound = "shared_memory_min_bytes" in inspect.signature(PSClient.__init__).parameters
        return {"shared_memory_min_bytes": 0} if profile and takes_bound else {}
    if path == "channel" and not data_channel_supported():
        raise ValueError("this version's PSClient has no data channel (--data-path channel)")
    return {"shared_memory": False, **({"data_channel": path == "channel"} if data_channel_supported() else {})}
#: ps-worker's default: tables of at least this many bytes train by rows.
SPARSE_MIN_BYTES = 1 << 20


def epochs_for(dataset: Dataset, *, workers: int, batch: int, total: int) -> int:
    """Whole epochs over the smallest worker share that make exactly `total` iterations (ValueError if none do)."""
    per_epoch = num_batches(dataset.num_train // workers, batch)
    if total % per_epoch or dataset.num_train % workers:
        raise ValueError(f"{dataset.name}: {dataset.num_train} rows give {workers} workers shares of {per_epoch} "
                         f"batches of {batch} per epoch, which whole epochs cannot make {total} iterations of")
    return total // per_epoch


def profile_client(timings: harness.Timings) -> None:
    """Wraps the client's encoding and decoding of tensor messages and of PushPull's (this process only)."""
    codec.pack_encoded = timings.timed_generator("client.encode", codec.pack_encoded)
    codec.decode_pull_response = timings.timed("client.decode", codec.decode_pull_response)
    codec.encode_message = timings.timed("client.encode", codec.encode_message)
    codec.decode_with_extras = timings.timed("client.decode", codec.decode_with_extras)
    codec.PartAssembler.add = timings.timed("client.decode", codec.PartAssembler.add)
    codec.PartAssembler.finish = timings.timed("client.decode", codec.PartAssembler.finish)
    frames.encode_request = timings.timed("client.encode", frames.encode_request)   # (the codec's inside it once)
    frames.decode_response = timings.timed("client.decode", frames.decode_response)


def run(args: argparse.Namespace) -> dict[str, Any]:
    total = args.warmup + args.steps
    timings = harness.Timings()
    if args.profile:
        profile_client(timings)
    with tempfile.TemporaryDirectory(prefix="ps-bench-worker-") as scratch:
        model = Path(args.model) if args.model else mlp.write_mlp(Path(scratch) / "mlp.onnx")
        tables = [t for t in args.sparse_tables.split(",") if t]
        engine = GradientEngine(model, batch_size=args.batch, loss="cross_entropy", intra_op_threads=args.threads,
                                inter_op_threads=1, cache_dir=args.cache_dir, seed=(args.seed, args.index),
                                sparse_tables=tables, sparse_min_bytes=None if tables else SPARSE_MIN_BYTES)
        if args.data:
            dataset = load_dataset(args.data, seed=args.seed)
            epochs = epochs_for(dataset, workers=args.workers, batch=args.batch, total=total)
        else:
            dataset = mlp.synthetic_dataset(workers=args.workers, steps_per_worker=total, batch=args.batch,
                                            seed=args.seed)
            epochs = mlp.epochs_for(total)
        plan = TrainingPlan(worker_index=args.index, num_workers=args.workers, batch_size=args.batch,
                            epochs=epochs, seed=args.seed, eval_every=0, start_timeout=120.0,
                            wait_timeout=args.wait_timeout, overlap=args.overlap)
        client = PSClient(args.servers.split(","), worker_id=f"bench-worker-{args.index}",
                          wait_timeout=args.wait_timeout, **client_settings(args.data_path, profile=args.profile))
        # Iteration boundaries: when each gradient step starts, and when the next parameters are
        # in hand (PushPull returned them, or the pull after it returned), with the number of
        # iterations started when that call was made (with overlap it returns during the next one).
        starts: list[float] = []
        pulls_done: list[tuple[int, float]] = []
        step = timings.timed("compute", engine.step) if args.profile else engine.step

        def marked_step(*a, **k):
            starts.append(time.monotonic())
            return step(*a, **k)

        def timed_or(name, fn):
            return timings.timed(name, fn) if args.profile else fn

        push_pull = timed_or("push_pull", client.push_pull)

        def marked_push_pull(*a, **k):
            issued = len(starts)
            report, values = push_pull(*a, **k)
            if values is not None:
                pulls_done.append((issued, time.monotonic()))
            return report, values

        push_pull_rows = timed_or("push_pull", client.push_pull_rows)

        def marked_push_pull_rows(*a, **k):
            issued = len(starts)
            report, values, rows = push_pull_rows(*a, **k)
            if values is not None:
                pulls_done.append((issued, time.monotonic()))
            return report, values, rows

        pull = timings.timed("pull", client.pull) if args.profile else client.pull

        def marked_pull(*a, **k):
            issued = len(starts)
            try:
                return pull(*a, **k)
            finally:
                pulls_done.append((issued, time.monotonic()))

        engine.step = marked_step             # type: ignore[method-assign]
        client.pull = marked_pull             # type: ignore[method-assign]
        client.push_pull = marked_push_pull   # type: ignore[method-assign]
        client.push_pull_rows = marked_push_pull_rows   # type: ignore[method-assign]
        if args.profile:
            client.push = timings.timed("push", client.push)   # type: ignore[method-assign]
        try:
            trainer = Trainer(client, engine, dataset, plan=plan, expected_mode=args.mode)
            result = trainer.run()
            # how many shards this worker reached through shared memory, and through a data channel:
            # what its path really used (a path falls back to gRPC bytes where it cannot be had)
            segments = len(client._segments)
            links = len(getattr(client, "_links", {}))
        finally:
            client.close()
    if len(starts) != total:
        raise SystemExit(f"train_worker: expected {total} iterations, the trainer ran {len(starts)}")
    opened = starts[args.warmup]
    # the first parameters in hand from a call made after the last gradient (worker 0's evaluation pulls later)
    closed = min(t for issued, t in pulls_done if issued == total)
    out: dict[str, Any] = {"worker": args.index, "mode": result["mode"], "iterations": len(starts),
                           "timed_steps": args.steps, "seconds": closed - opened,
                           "steps_per_s": args.steps / (closed - opened), "window": [opened, closed],
                           "accepted": result["accepted"], "dropped": result["dropped"], "loss": result["loss"],
                           "data_path": args.data_path, "sparse_tables": sorted(engine.sparse.tables),
                           "overlap": args.overlap and result["mode"] == "async" and not engine.sparse.tables,
                           "shared_memory_segments": segments, "data_channels": links}
    if args.profile:
        out["calls"] = {name: [c for c in calls if opened <= c[0] <= closed]
                        for name, calls in timings.calls.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.train_worker", description=__doc__.splitlines()[0])
    p.add_argument("--servers", required=True, help="shard addresses, comma-separated")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--mode", choices=MODES, required=True, help="the shards' mode (checked)")
    p.add_argument("--batch", type=int, default=mlp.BATCH)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="the model's .onnx (default: the MLP, written here)")
    p.add_argument("--data", default=None, help="a dataset file or spec (default: the MLP's synthetic data)")
    p.add_argument("--sparse-tables", default="",
                   help="tables trained by rows, comma-separated (default: those of 1 MiB or more)")
    p.add_argument("--data-path", choices=DATA_PATHS, default="shm",
                   help="shm: shared memory with shards on this host (ps-worker's default); channel: the data "
                        "channel (a TCP connection per shard), even on this host; grpc: gRPC bytes only "
                        "(default shm)")
    p.add_argument("--wait-timeout", type=float, default=120.0, help="longest wait of one pull, seconds")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="async, no table by rows: a step's PushPull travels while the next gradient is computed "
                        "(ps-worker's --overlap; by default each step waits for its round trip)")
    p.add_argument("--cache-dir", default=None, help="gradient-model cache (default: the engine's)")
    p.add_argument("--profile", action="store_true", help="time compute, push, pull, encode and decode per call")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ort.set_default_logger_severity(3)
    print(RESULT_PREFIX + json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
