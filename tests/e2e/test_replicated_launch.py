"""ps-launch --shard-replicas: a replicated job trains to the figures of an unreplicated one, with a witness when it
has fewer than 3 replica processes, and a pipeline job with replicas is refused before anything starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ps_common.process import python_module_argv
from tests.helpers.launch import REPO_ROOT, run_launch

pytestmark = pytest.mark.slow

FLAGS = ["--data", "digits", "--batch-size", "32", "--optimizer", "momentum", "--lr", "0.02", "--eval-every", "0",
         "--log-level", "WARNING", "--workers", "2", "--steps", "300"]


@pytest.mark.parametrize("shards, witness", [(1, True), (2, False)])
def test_a_replicated_job_trains_with_every_replica_and_a_witness_only_when_needed(tmp_path: Path, shards: int,
                                                                                    witness: bool) -> None:
    summary, run = run_launch(tmp_path / "record", *FLAGS, "--mode", "async", "--shards", str(shards),
                              "--shard-replicas", "2", timeout=150)
    assert summary["test_accuracy"] >= 0.9 and summary["steps"] >= 300, summary
    names = sorted(p["name"] for p in run["processes"])
    replicas = [n for n in names if n.startswith("shard")]
    assert len(replicas) == 2 * shards, names
    assert ("witness" in names) is witness, names
    assert all(p["exit_code"] == 0 for p in run["processes"]), run["processes"]


def test_replicas_with_pipeline_stages_are_refused_before_anything_starts(tmp_path: Path) -> None:
    argv = python_module_argv("ps_tools.launch", *FLAGS, "--shards", "1", "--shard-replicas", "2", "--stages", "2",
                              "--timeout", "60")
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--shard-replicas 2 with --stages 2" in done.stderr
