"""End to end: ps-launch trains the bundled MLP on digits from separate processes in every consistency mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ps_models.builders import write_model
from ps_models.datasets import load_dataset
from ps_server.config import ServerConfig
from ps_server.server import create_server
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from tests.helpers.launch import run_launch
from worker_client.training import Trainer, TrainingPlan

pytestmark = pytest.mark.slow

#: The optimizer every run here uses (the demo's): SGD with momentum 0.9 on the shards.
OPTIMIZER = ["--optimizer", "momentum", "--lr", "0.05"]
#: Longest run of one launched job, in seconds (the launcher stops everything after it).
JOB_TIMEOUT = 150


def launch(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """Runs ps-launch with flags; returns its final JSON line, after checking the exit status and the record."""
    summary, run = run_launch(tmp_path / "record", *OPTIMIZER, "--data", "digits", "--batch-size", "32",
                              "--eval-every", "50", "--log-level", "WARNING", *flags, timeout=JOB_TIMEOUT)
    for key in ("test_accuracy", "steps", "seconds", "samples_per_second", "mode", "workers", "shards", "stale_drops"):
        assert key in summary, key
    assert (tmp_path / "record" / "plot.png").stat().st_size > 10_000
    assert all(p["exit_code"] == 0 for p in run["processes"]), run["processes"]
    return summary


def test_sync_with_a_backup_worker_reaches_95_percent_and_drops_the_late_gradients(tmp_path: Path) -> None:
    summary = launch(tmp_path, "--mode", "sync", "--workers", "3", "--replicas-to-aggregate", "2", "--shards", "2",
                     "--steps", "300")
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["steps"] == 300
    assert summary["stale_drops"] > 0, "with N=2 of M=3 the third gradient of a step arrives late"
    assert (summary["mode"], summary["workers"], summary["shards"]) == ("sync", 3, 2)


def test_ssp_reaches_95_percent(tmp_path: Path) -> None:
    summary = launch(tmp_path, "--mode", "ssp", "--staleness", "2", "--workers", "2", "--shards", "2",
                     "--steps", "600")
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["steps"] >= 600 and summary["stale_drops"] == 0


def test_async_reaches_95_percent(tmp_path: Path) -> None:
    summary = launch(tmp_path, "--mode", "async", "--workers", "2", "--shards", "2", "--steps", "600")
    assert summary["test_accuracy"] >= 0.95, (summary, _course(tmp_path / "record"))
    assert summary["steps"] >= 600


def _course(record: Path) -> dict[str, Any]:
    """How a job went, for a failure's message: each worker's iterations and seconds, and the accuracy curve.

    An async job's 600 steps take about a second here; a worker descheduled under load pushes gradients of
    parameters hundreds of steps old, so its share of the steps tells whether staleness cost the accuracy.
    """
    run = json.loads((record / "run.json").read_text())
    return {"workers": [(w["worker"], w["iterations"], w["seconds"]) for w in run["workers"]],
            "accuracy": [(e["step"], round(e["test_accuracy"], 3)) for e in run["evaluations"]]}


def single_process_accuracy(model: Path, *, batch_size: int, steps: int) -> float:
    """The same model, data, optimizer and seed trained in this process: one in-process shard, one worker."""
    config = ServerConfig(mode="sync", optimizer="momentum", optimizer_params={"lr": 0.05})
    server, _ = create_server(config)
    client = PSClient([server.address], worker_id="reference", wait_timeout=60)
    try:
        engine = GradientEngine(model, batch_size=batch_size, intra_op_threads=1)
        plan = TrainingPlan(worker_index=0, num_workers=1, batch_size=batch_size, steps=steps, eval_every=0,
                            start_timeout=30, wait_timeout=60)
        result = Trainer(client, engine, load_dataset("digits", model="mlp"), plan=plan).run()
    finally:
        client.close()
        server.stop()
    assert result["steps"] == steps
    return result["test_accuracy"]


def test_two_worker_sync_matches_single_process_training_on_the_same_samples(tmp_path: Path) -> None:
    model = write_model("mlp", tmp_path / "mlp.onnx", seed=0)
    steps = 600
    # 2 workers x batch 32 averaged per step == one batch of 64 per step: the same samples and updates
    distributed = launch(tmp_path, "--model", str(model), "--mode", "sync", "--workers", "2", "--shards", "2",
                         "--steps", str(steps))
    reference = single_process_accuracy(model, batch_size=64, steps=steps)
    assert distributed["steps"] == steps
    assert reference >= 0.95 and distributed["test_accuracy"] >= 0.95, (reference, distributed)
    assert abs(distributed["test_accuracy"] - reference) <= 0.01 + 1e-9, (reference, distributed)
