"""Reader throughput: reading and batching a Parquet dataset alone, against the training step of the DLRM example.

    python -m ps_bench.reader_bench [--data DIR] [--rows 1000000] [--batch-size 256] [--seconds 20]
                                    [--workers 2] [--model models/recsys/dlrm.onnx]

The training data must never be what a job waits for. With the DLRM example's model and
the synthetic Criteo-like data (`python -m ps_models.recsys.criteo_synthetic`, written into a
temporary folder unless --data names one), in one process on this machine:

* ``reader``: worker 0 of --workers takes its part (`ParquetDataset.part`) and draws batches
  of --batch-size from it exactly as a training worker does (row groups read in the epoch's
  order, shuffle blocks, every value checked), for --seconds; samples/s.
* ``step``: the worker's gradient step alone on those batches -- the unique ids of each
  table, the rows parameter (random rows: no shard), the positions feeds, `engine.step` --
  the step with no network, which is the fastest a worker can consume data; samples/s.

One JSON line each (harness.emit: system, metric, value, unit), then one with their ratio
(``reader_over_step``): the reader must deliver at least 5x what the step consumes. The
step here has no pulls or pushes, so a training job consumes fewer samples/s than this and
the real margin is larger. Run it alone: the two measurements share the machine's cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ps_bench import harness

#: The bound the reader must clear: its samples/s over the step's.
REQUIRED_RATIO = 5.0


def _dataset(args: argparse.Namespace, scratch: Path) -> Path:
    if args.data:
        return Path(args.data)
    from ps_models.recsys import criteo_synthetic

    folder = scratch / "criteo"
    harness.log(f"writing {args.rows:,} training rows of synthetic Criteo-like data to {folder}")
    criteo_synthetic.write_dataset(folder, rows=args.rows, test_rows=max(1000, args.rows // 100), files=4, seed=0)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reader_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a Parquet folder with train/ and test/ (default: write a synthetic one)")
    p.add_argument("--rows", type=int, default=1_000_000, help="training rows of the written data set")
    p.add_argument("--model", default=None, help="the model (default: the DLRM example)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="the job's workers: worker 0's part is read")
    p.add_argument("--seconds", type=float, default=20.0, help="time of each measurement")
    args = p.parse_args(argv)

    from ps_models.recsys import DLRM_PATH
    from worker_client.training.preflight import prepare

    with tempfile.TemporaryDirectory(prefix="reader-bench-") as scratch:
        data = _dataset(args, Path(scratch))
        model = Path(args.model) if args.model else DLRM_PATH
        prepared = prepare(model, None, model=str(model), data=str(data), loss="bce", batch_size=args.batch_size,
                           workers=args.workers, seed=0, device="cpu", include=(), exclude=(),
                           expect_parameters=None, worker_index=0, intra_op_threads=None, sparse_tables=(),
                           sparse_min_rows=None, sparse_min_bytes=1 << 20, dense_tables=(), dynamic_tables=(),
                           label_column="label", shuffle_rows=16384)
        engine, dataset = prepared.engine, prepared.dataset
        part = dataset.part(0, args.workers)
        harness.log(f"{dataset.describe()}; worker 0 of {args.workers} reads {part.num_rows:,} rows")

        batches = part.batches(args.batch_size, start=0, seed=0)
        reader_samples, started = 0, time.perf_counter()
        kept = []
        while time.perf_counter() - started < args.seconds:
            _, inputs, labels = next(batches)
            reader_samples += len(labels)
            if len(kept) < 64:
                kept.append((inputs, labels))
        reader_rate = reader_samples / (time.perf_counter() - started)
        harness.emit("onnx-ps", "reader_samples_per_second", 0.0, reader_rate, "samples/s",
                     batch_size=args.batch_size, rows=part.num_rows, **harness.machine())

        sparse = engine.sparse
        rng = np.random.default_rng(0)
        parameters = engine.parameters()
        step_samples, steps, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds or steps < 3:
            inputs, labels = kept[steps % len(kept)]
            batch = {**inputs, "labels": labels}
            if sparse.tables:
                ids = sparse.unique_ids(batch)
                rows = {n: rng.standard_normal((len(ids[n]), *t.shape[1:])).astype(t.initial.dtype) * 0.1
                        for n, t in sparse.tables.items()}
                params = {**parameters, **{t.rows_name: sparse.rows_parameter(n, rows[n])
                                           for n, t in sparse.tables.items()}}
                batch = sparse.feeds(batch, ids)
            else:
                params = parameters
            engine.step(params, batch)
            step_samples += len(labels)
            steps += 1
        step_rate = step_samples / (time.perf_counter() - started)
        harness.emit("onnx-ps", "step_samples_per_second", 0.0, step_rate, "samples/s", batch_size=args.batch_size,
                     model=str(model))
        ratio = reader_rate / step_rate
        harness.emit("onnx-ps", "reader_over_step", 0.0, ratio, "x", required=REQUIRED_RATIO,
                     ok=ratio >= REQUIRED_RATIO)
    return 0 if ratio >= REQUIRED_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
