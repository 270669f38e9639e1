"""End to end: ps-launch --stages K --workers R trains like data-parallel training.

In sync mode a pipeline step's gradients equal the whole model's on the same batch, and
replica r reads the same share of the data as data-parallel worker r: the two jobs follow
the same trajectory up to float rounding, so their test accuracies agree within a point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.launch import run_launch
from tests.helpers.tensorboard import read_scalars

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 150
#: (model, data, steps, accuracy floor): every bundled model, and the deep MLP.
MODELS = [
    ("mlp", "digits", 200, 0.93),
    ("deep_mlp", "digits", 200, 0.90),
    ("lenet", "digits", 200, 0.80),
    ("transformer", "synthetic:ids?n=1200&vocab=100&bag=8&classes=2", 150, 0.75),
    ("embedding", "synthetic:ids?n=1200&vocab=100&bag=8&classes=2", 150, 0.75),
]


def launch(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    summary, run = run_launch(tmp_path / name, "--optimizer", "momentum", "--lr", "0.05", "--batch-size", "32",
                              "--eval-every", "0", "--log-level", "WARNING", *flags, timeout=JOB_TIMEOUT)
    assert all(p["exit_code"] == 0 for p in run["processes"]), run["processes"]
    return summary


@pytest.mark.parametrize("model,data,steps,floor", MODELS, ids=[m[0] for m in MODELS])
def test_two_stages_of_two_replicas_reach_the_data_parallel_accuracy(model: str, data: str, steps: int,
                                                                     floor: float, tmp_path: Path) -> None:
    common = ["--mode", "sync", "--workers", "2", "--shards", "1", "--model", model, "--data", data,
              "--steps", str(steps)]
    parallel = launch(tmp_path, "data-parallel", *common)
    pipeline = launch(tmp_path, "pipeline", *common, "--stages", "2", "--micro-batches", "2")
    assert pipeline["stages"] == 2 and parallel["stages"] == 1
    assert pipeline["steps"] == steps and pipeline["micro_batches"] == 2
    assert pipeline["shard_processes"] == 2 and pipeline["abandoned_steps"] == 0
    assert pipeline["test_accuracy"] >= floor, pipeline
    assert abs(pipeline["test_accuracy"] - parallel["test_accuracy"]) <= 0.01, (pipeline, parallel)
    # each stage holds its own parameters only: together they are the model's, none holds them all
    whole = parallel["bytes_pushed_per_step"]
    assert sum(pipeline["stage_parameter_bytes"]) == pytest.approx(whole, rel=0.01)
    assert max(pipeline["stage_parameter_bytes"]) < whole
    assert len(pipeline["stage_peak_rss_mb"]) == 2 and min(pipeline["stage_peak_rss_mb"]) > 0


def test_three_stages_from_a_job_file_with_named_cuts(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[job]\nmode = "async"\nstages = 3\nworkers = 1\nmicro_batches = 4\n'
                   'cuts = ["relu2_4", "relu4_8"]\n'
                   '[worker]\nmodel = "deep_mlp"\ndata = "digits"\nsteps = 150\n')
    summary = launch(tmp_path, "job-file", "--config", str(job))
    assert (summary["stages"], summary["micro_batches"], summary["mode"]) == (3, 4, "async")
    assert summary["test_accuracy"] >= 0.85, summary
    run = json.loads((tmp_path / "job-file" / "run.json").read_text())
    stages = sorted(w["stage"] for w in run["workers"])
    assert stages == [0, 1, 2]


def test_the_launcher_evaluates_the_whole_model_every_eval_every_steps_while_the_stages_train(tmp_path: Path) -> None:
    every, steps = 40, 200
    summary = launch(tmp_path, "evaluations", "--mode", "sync", "--workers", "1", "--stages", "2", "--model", "mlp",
                     "--data", "digits", "--steps", str(steps), "--eval-every", str(every),
                     "--tensorboard", str(tmp_path / "tb"))
    evaluations = json.loads((tmp_path / "evaluations" / "run.json").read_text())["evaluations"]
    during = [e for e in evaluations if not e["final"]]
    final = [e for e in evaluations if e["final"]]
    # one evaluation per eval_every bucket the shards' step passed (read within a poll of the boundary), none
    # of them at the last step, which the final evaluation covers
    buckets = [e["step"] // every for e in during]
    assert buckets == sorted(set(buckets)) and len(buckets) >= 2, during
    assert all(b >= 1 and e["step"] < steps for b, e in zip(buckets, during)), during
    assert [e["step"] for e in final] == [steps]
    assert final[0]["test_accuracy"] == summary["test_accuracy"]
    assert during[0]["test_accuracy"] < summary["test_accuracy"] and summary["test_accuracy"] >= 0.93, evaluations
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["test/accuracy"]] == [e["step"] for e in evaluations]


def test_each_stage_worker_peaks_below_the_whole_model_worker(tmp_path: Path) -> None:
    import onnx

    from ps_models.builders import build_deep_mlp

    model = tmp_path / "deep.onnx"   # 30 MB of parameters: enough to show above a worker's own ~150 MB
    onnx.save(build_deep_mlp(width=1024, depth=8), str(model))
    common = ["--mode", "sync", "--workers", "1", "--model", str(model), "--data", "digits", "--steps", "10"]
    launch(tmp_path, "whole", *common)
    stages = launch(tmp_path, "stages", *common, "--stages", "2")
    whole_peak = json.loads((tmp_path / "whole" / "run.json").read_text())["workers"][0]["peak_rss_mb"]
    assert all(peak < whole_peak for peak in stages["stage_peak_rss_mb"]), (stages["stage_peak_rss_mb"], whole_peak)
    assert max(stages["stage_parameter_bytes"]) < 0.7 * sum(stages["stage_parameter_bytes"])
