"""End to end on a GPU: ps-launch's workers compute their gradients with onnxruntime's CUDA provider.

Skipped, with the reason, where onnxruntime offers no CUDAExecutionProvider (onnxruntime-gpu is the
``gpu`` extra; CI has no GPU). Where it is offered, a GPU that cannot be used fails the job
(DeviceUnavailableError), never a silent run on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from tests.helpers.launch import run_launch

pytestmark = [
    pytest.mark.cuda, pytest.mark.slow,
    pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                       reason="needs onnxruntime-gpu with CUDAExecutionProvider, which this onnxruntime "
                              f"({ort.__version__}) lacks (providers: {ort.get_available_providers()})"),
]

#: Longest run of the launched job, in seconds (the launcher stops everything after it).
JOB_TIMEOUT = 180


@pytest.mark.parametrize("mode, steps", [("sync", 300), ("async", 600)])
def test_a_job_whose_workers_run_on_cuda_reaches_95_percent(tmp_path: Path, mode: str, steps: int) -> None:
    summary, run = run_launch(tmp_path / "record", "--optimizer", "momentum", "--lr", "0.05", "--data", "digits",
                              "--batch-size", "32", "--eval-every", "50", "--log-level", "WARNING",
                              "--mode", mode, "--workers", "2", "--shards", "2", "--steps", str(steps),
                              "--device", "cuda", timeout=JOB_TIMEOUT)
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["steps"] >= steps
    assert all(p["exit_code"] == 0 for p in run["processes"]), run["processes"]
    workers = run["workers"]
    assert len(workers) == 2
    for worker in workers:
        assert worker["device"] == "cuda", worker
        assert worker["providers"][0] == "CUDAExecutionProvider", worker
