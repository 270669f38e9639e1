"""The job's figures from what its workers reported: the progress while it trains, the summary at the end.

Workers report JSON events (``start``, ``progress``, ``eval``, ``done``); the launcher keeps
each worker's latest in its `Child`. `job_progress` turns them into the bar's numbers,
`job_summary` into the fields of the final JSON line on stdout.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ps_common.jobconfig import JobConfig
from ps_tools.launch.children import Child
from ps_tools.launch.display import Progress

#: Guards divisions by a duration that may be 0.
MIN_SECONDS = 1e-9


def job_progress(config: JobConfig, workers: list[Child], evaluations: list[dict[str, Any]],
                 training_started: float | None) -> Progress | None:
    """The job's progress from the workers' latest reports (None before the first worker started)."""
    reports = [c.result or c.progress for c in workers if c.result or c.progress]
    if not reports or training_started is None:
        return None
    c = config
    step = max(r.get("step", r.get("steps", 0)) or 0 for r in reports)
    step = max([step] + [e.get("step", 0) for e in evaluations[-1:]])   # evaluations come between reports
    losses = [r["loss"] for r in reports if r.get("loss") is not None]
    if all(w.result for w in workers):
        seconds = max(w.result["seconds"] for w in workers if w.result)
        rate = sum(w.result["samples"] for w in workers if w.result) / max(seconds, MIN_SECONDS)
    else:
        rate = sum((w.progress or {}).get("samples_per_second", 0.0) for w in workers if w.result is None)
    stale = sum(r.get("stale_drops", 0) for r in reports)
    last_eval = evaluations[-1] if evaluations else {}
    elapsed = time.monotonic() - training_started
    if c.worker.steps:
        done, total, unit = min(step, c.worker.steps), c.worker.steps, "step"
        start = min((w.start or {}).get("step", 0) for w in workers)
    else:   # an epochs job: each worker pushes epochs x its batches per epoch
        starts = [w.start for w in workers if w.start]
        total = sum(s["batches_per_epoch"] * (s.get("epochs") or 1) for s in starts) if starts else None
        done = sum(int((w.result or w.progress or {}).get("clock", 0) or 0) for w in workers)
        unit, start = "push", sum(int(s.get("clock", 0)) for s in starts)
        if total and len(starts) < len(workers):
            total = None
    eta = None
    if total and done > start and elapsed > 0:
        eta = (total - done) * elapsed / (done - start)
    if all(w.result for w in workers):
        eta = 0.0
    return Progress(done=done, total=total, unit=unit, loss=sum(losses) / len(losses) if losses else None,
                    samples_per_second=rate, stale_drops=stale,
                    test_accuracy=last_eval.get("test_accuracy"), test_loss=last_eval.get("test_loss"),
                    elapsed=elapsed, eta=eta)


def _mean(values) -> float | None:
    """The mean of the values that are not None (None when none is)."""
    present = [v for v in values if v is not None]
    return round(sum(present) / len(present), 1) if present else None


def job_summary(config: JobConfig, workers: list[Child], *, started: float,
                evaluation: dict[str, Any] | None) -> dict[str, Any]:
    """The job's result: the fields of the final JSON line (`evaluation`: a pipeline job's, of the whole model)."""
    c = config
    results = [w.result for w in workers if w.result]
    chief = next((r for r in results if r.get("worker") == 0 and r.get("stage", 0) == 0),
                 results[0] if results else {})
    if evaluation is not None:   # a pipeline job: the launcher evaluated the whole model
        chief = {**chief, **evaluation}
    samples = sum(r["samples"] for r in results)
    train_seconds = max((r["seconds"] for r in results), default=0.0)
    return {
        "test_accuracy": chief.get("test_accuracy"), "test_loss": chief.get("test_loss"),
        "test_auc": chief.get("test_auc"),
        # per worker step, averaged over the workers: tensor bytes (rows and ids for sparse tables)
        "bytes_pulled_per_step": _mean(r.get("bytes_pulled_per_step") for r in results),
        "bytes_pushed_per_step": _mean(r.get("bytes_pushed_per_step") for r in results),
        "unique_rows_per_step": _mean(r.get("unique_rows_per_step") for r in results),
        "steps": chief.get("steps"), "seconds": round(time.monotonic() - started, 3),
        "train_seconds": train_seconds, "samples_per_second": round(samples / max(train_seconds, MIN_SECONDS), 1),
        "samples": samples, "mode": c.job.mode, "workers": c.job.workers, "shards": c.job.shards,
        "replicas_to_aggregate": c.job.replicas_to_aggregate if c.job.mode == "sync" else None,
        "stale_drops": sum(r["stale_drops"] for r in results), "dropped": sum(r["dropped"] for r in results),
        "batch_size": c.worker.batch_size, "optimizer": c.server.optimizer, "lr": c.server.lr,
        "model": c.worker.model, "data": c.worker.data,
        "record": str(Path(c.launch.record).resolve()) if c.launch.record else None,
        "tensorboard": str(Path(c.worker.tensorboard).resolve()) if c.worker.tensorboard else None,
        "stages": c.job.stages, **_pipeline_summary(c, results),
    }


def _pipeline_summary(config: JobConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    """A pipeline job's per-stage figures: micro-batches, parameter bytes, peak memory, abandoned steps."""
    if config.job.stages <= 1:
        return {}
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        by_stage.setdefault(int(r.get("stage", 0)), []).append(r)
    stages = range(config.job.stages)
    return {
        "micro_batches": next((r.get("micro_batches") for r in results), None),
        "shard_processes": config.job.shards * config.job.stages,
        "stage_parameter_bytes": [max((r.get("parameter_bytes", 0) for r in by_stage.get(k, [])), default=None)
                                  for k in stages],
        "stage_peak_rss_mb": [max((r.get("peak_rss_mb", 0) for r in by_stage.get(k, [])), default=None)
                              for k in stages],
        "abandoned_steps": sum(r.get("abandoned_steps", 0) for r in results),
    }
