"""Running ``ps-launch`` from a test: the job's final JSON line and its record, after the checks every run passes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from ps_common.process import python_module_argv

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_launch(record: Path, *flags: str, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs ``ps-launch --timeout TIMEOUT --record RECORD FLAGS``; returns (summary, run.json).

    Checks that it exited 0, printed only its summary on stdout, and that the record holds
    the same summary; a failure quotes the end of its stderr.
    """
    argv = python_module_argv("ps_tools.launch", "--timeout", str(timeout), "--record", str(record), *flags)
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout + 30)
    assert done.returncode == 0, f"ps-launch exited {done.returncode}:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout should hold only the summary line, got {lines}"
    summary = json.loads(lines[0])
    run = json.loads((record / "run.json").read_text())
    assert run["summary"] == summary
    return summary, run
