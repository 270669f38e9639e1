"""ps-launch from a user's project folder: folders named like ours (models/, protos/, bench/, ps_common/ ...) change nothing.

The folder holds decoy packages that record being imported and then raise. The launcher's
children run as ``python -P -m ...``, so the working directory is never on their sys.path
and every import name of ours is the installed package's, never the user's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Longest run of the launched job, in seconds (the launcher stops everything after it).
JOB_TIMEOUT = 120
#: Extra seconds for the test's own wait, beyond the launcher's --timeout and its stopping.
WAIT_MARGIN = 30
#: Steps of the tiny job.
STEPS = 50
#: Decoy packages in the user's folder: the folders our code lives in, and our import names.
DECOYS = ("models", "protos", "bench", "ps_common", "ps_server", "worker_client", "ps_tools", "ps_models",
          "ps_proto", "ps_bench")


def write_decoys(folder: Path) -> Path:
    """Decoy packages that write a marker file naming themselves, then raise; returns the markers' folder."""
    markers = folder / "imported"
    markers.mkdir()
    for name in DECOYS:
        package = folder / name
        package.mkdir()
        body = (f"import pathlib\npathlib.Path({str(markers / name)!r}).touch()\n"
                f"raise ImportError('the user folder shadowed {name}')\n")
        (package / "__init__.py").write_text(body)
    (folder / "models" / "builders.py").write_text("raise ImportError('the user folder shadowed models.builders')\n")
    (folder / "protos" / "ps").mkdir()
    (folder / "protos" / "ps" / "__init__.py").write_text("raise ImportError('the user folder shadowed protos.ps')\n")
    return markers


def test_ps_launch_from_a_folder_with_a_models_package_of_its_own_trains_and_prints_its_summary(
        tmp_path: Path) -> None:
    launcher = Path(sys.executable).with_name("ps-launch")
    assert launcher.exists(), f"{launcher} is missing: install the project (make venv)"
    user = tmp_path / "project"
    user.mkdir()
    markers = write_decoys(user)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TF_CONFIG")}
    argv = [str(launcher), "--model", "mlp", "--data", "digits", "--steps", str(STEPS), "--shards", "1",
            "--workers", "2", "--eval-every", "0", "--log-level", "WARNING", "--timeout", str(JOB_TIMEOUT)]
    try:
        done = subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT + WAIT_MARGIN)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"ps-launch ran past {JOB_TIMEOUT + WAIT_MARGIN} s in {user}; stderr tail:\n"
                    f"{(exc.stderr or b'')[-4000:]!r}")
    assert done.returncode == 0, f"ps-launch exited {done.returncode} in {user}:\n{done.stderr[-4000:]}"
    assert sorted(p.name for p in markers.iterdir()) == [], "a decoy package of the user's folder was imported"
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout should hold only the summary line, got {lines}"
    summary = json.loads(lines[0])
    assert (summary["model"], summary["data"], summary["shards"], summary["workers"]) == ("mlp", "digits", 1, 2)
    assert summary["steps"] >= STEPS
    assert 0.0 <= summary["test_accuracy"] <= 1.0
