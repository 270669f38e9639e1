"""The `ps-worker` command: one training worker (model, data, shards from flags, a job file or TF_CONFIG)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import onnxruntime as ort

from ps_common import jobconfig
from ps_common.errors import PSError
from ps_common.jobconfig import JobConfig, JobConfigError
from ps_common.logs import configure_logging
from ps_common.scratch import ScratchDir
from worker_client.client.from_job import client_for_job
from worker_client.engine import GradientEngine
from worker_client.pipeline.worker import run_stage_worker
from worker_client.training.preflight import Prepared, prepare, resolve_model, sparse_summary
from worker_client.training.tensorboard import TensorBoardSink
from worker_client.training import EventSink, JsonLinesSink, TextSink, Trainer, TrainingPlan

log = logging.getLogger("worker_client")

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-worker", description="Run one training worker against the shards of a job. Settings come from "
                                      "the defaults, then --config JOB.toml, then TF_CONFIG, then these flags; the "
                                      "learning rate and optimizer are the shards'. See docs/settings.md.")
    jobconfig.add_arguments(p, scope="worker")
    return p


def prepare_worker(job: JobConfig, workdir: Path, *, device: str | None = None) -> Prepared:
    """The model file, engine and data from the settings, checked against each other (worker_client.training.preflight).

    Every error is a user mistake found before anything connects: ModelLoadError,
    UnsupportedModelError, DeviceUnavailableError, DatasetError or JobConfigError (a
    bundled model is written into `workdir`). `device` overrides the setting (the
    launcher checks on the CPU).
    """
    w = job.worker
    model_path, kind = resolve_model(w.model, workdir)
    return prepare(model_path, kind, model=w.model, data=w.data, loss=w.loss, batch_size=w.batch_size,
                   workers=job.job.workers or 1, seed=job.job.seed, device=device or w.device, include=w.include,
                   exclude=w.exclude, expect_parameters=w.expect_parameters, worker_index=w.index,
                   intra_op_threads=w.intra_op_threads, sparse_tables=w.sparse_tables,
                   sparse_min_rows=w.sparse_min_rows, sparse_min_bytes=w.sparse_min_bytes,
                   dense_tables=w.dense_tables, dynamic_tables=w.dynamic_tables, label_column=w.label_column,
                   shuffle_rows=w.shuffle_rows)


def train_worker(job: JobConfig, prepared: Prepared, *, report: EventSink | None = None,
                 stop: threading.Event | None = None) -> dict[str, Any]:
    """Connects to the shards and runs one worker's training with a prepared engine and dataset."""
    w = job.worker
    engine, dataset = prepared.engine, prepared.dataset
    _log_parameters(engine, chief=w.index == 0)
    note = sparse_summary(engine)
    if note:
        log.info("%s", note)
    plan = TrainingPlan(worker_index=w.index, num_workers=job.job.workers or 1, batch_size=w.batch_size,
                        steps=w.steps, epochs=w.epochs, seed=job.job.seed, eval_every=w.eval_every,
                        progress_every=w.progress_every, start_timeout=w.start_timeout,
                        wait_timeout=job.job.wait_timeout, dynamic_initializer=w.dynamic_initializer,
                        evict_after_steps=w.evict_after_steps, overlap=w.overlap)
    log.info("worker %d of %d (%s): model %s, %s, shards %s", w.index, plan.num_workers, w.worker_id,
             prepared.model_path, dataset.describe(), w.servers,
             extra={"worker": w.index, "model": str(prepared.model_path), "servers": w.servers})
    client = client_for_job(job, worker_id=w.worker_id, stop=stop)
    try:
        expected_mode = job.job.mode if "job.mode" in job.sources else None   # else: follow the shards
        return Trainer(client, engine, dataset, plan=plan, report=report, stop=stop,
                       expected_mode=expected_mode).run()
    finally:
        client.close()


def tensorboard_sink(job: JobConfig, sink: EventSink) -> EventSink:
    """`sink`, writing TensorBoard scalars too when --tensorboard is set: worker 0 into DIR, or with
    --tensorboard-every-worker each worker into DIR/worker<i>; JobConfigError when tensorboardX is missing."""
    w = job.worker
    if not w.tensorboard:
        return sink
    if w.tensorboard_every_worker:
        return TensorBoardSink(Path(w.tensorboard) / f"worker{w.index}", inner=sink)
    return TensorBoardSink(w.tensorboard, inner=sink) if w.index == 0 else sink


def _log_parameters(engine: GradientEngine, *, chief: bool) -> None:
    """The parameters that train, name and shape, one a line (INFO on worker 0, else DEBUG)."""
    level = logging.INFO if chief else logging.DEBUG
    values = engine.parameters()
    total = sum(int(v.size) for v in values.values())
    log.log(level, "training %d parameters (%d values) of %s:", len(values), total, engine.model_path)
    for name, value in values.items():
        log.log(level, "  %s %s %s", name, tuple(value.shape), value.dtype)
    for name, value in engine.state().items():
        log.log(level, "  %s %s %s: state (running statistics), kept on the shards, not trained", name,
                tuple(value.shape), value.dtype)


#: After its parent is gone, the seconds a worker has to stop on its own before it is ended.
ORPHAN_GRACE = 10.0


def _watch_parent(parent: int) -> None:
    """Once the parent is gone (polled every 0.5 s): SIGTERM to this process, then exit after ORPHAN_GRACE s."""
    pause = threading.Event()
    while os.getppid() == parent:
        pause.wait(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    pause.wait(ORPHAN_GRACE)
    os._exit(128 + signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parent = os.getppid()   # read first: --stop-with-parent watches for it to change
    args = build_parser().parse_args(argv)
    try:
        job = jobconfig.load_config(args, scope="worker")
    except JobConfigError as exc:
        print(f"ps-worker: {exc}", file=sys.stderr)
        return 2
    configure_logging(job.job.log_level, job.job.log_json, fields={"worker": job.worker.index})
    if job.job.log_level != "DEBUG":   # onnxruntime's own warnings (e.g. unused initializers) are noise here
        ort.set_default_logger_severity(3)
    received: list[int] = []
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # The first signal asks the loop to stop after the current step (and deregister); a
        # second one ends the process at once. No exception is raised from here: one raised
        # inside a gRPC call could leave the channel's locks held.
        if received:
            os._exit(128 + signum)
        received.append(signum)
        log.info("received %s: stopping after this step (again to stop at once)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if job.job.stop_with_parent:
        threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    sink: EventSink = JsonLinesSink(sys.stdout) if job.worker.events else TextSink(sys.stdout)
    if job.job.stages > 1:   # one stage of a pipeline: only its own part of the model (docs/pipeline.md)
        try:
            run_stage_worker(job, report=sink, stop=stop)
        except (PSError, ValueError) as exc:
            if received:
                return 128 + received[0]
            log.debug("stage worker failed", exc_info=True)
            print(f"ps-worker: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return 128 + received[0] if received else 0
    with ScratchDir("ps-worker") as scratch:
        try:   # the model, the data and the settings checked against each other before any shard is called
            prepared = prepare_worker(job, Path(scratch))
            sink = tensorboard_sink(job, sink)
        except (PSError, ValueError) as exc:
            log.debug("the worker's model or data cannot be used", exc_info=True)
            print(f"ps-worker: {exc}", file=sys.stderr)
            return 2
        try:
            train_worker(job, prepared, report=sink, stop=stop)
        except (PSError, ValueError) as exc:   # every catalog error, and bad values the settings let through
            if received:
                return 128 + received[0]
            log.debug("worker failed", exc_info=True)
            print(f"ps-worker: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    if received:
        return 128 + received[0]
    return 0


if __name__ == "__main__":
    sys.exit(main())
