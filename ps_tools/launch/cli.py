"""The `ps-launch` command line: its arguments, and the exit status of a job.

Exit status: 0 done; 1 the job failed while running (a process failed, the timeout, an
accuracy below ``--min-accuracy``); 2 a bad setting, model or data found before anything
started (one line on stderr, ``ps-launch: ...``, and no process started); 128 + N on signal N.
"""

from __future__ import annotations

import argparse
import sys

from ps_common import jobconfig
from ps_common.errors import PSError
from ps_common.jobconfig import JobConfigError
from ps_server.cli import server_config
from ps_tools.launch.supervise import Launcher


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-launch",
        description="Run a whole training job on this machine as separate processes: N shards (ps-server) and M "
                    "workers (ps-worker). Settings come from the defaults, then --config JOB.toml, then these flags; "
                    "see docs/settings.md. The last line on stdout is the run's JSON summary. Exit status: 0 done, "
                    "1 the job failed, 2 a bad setting, model or data (nothing was started).",
        epilog="example: ps-launch --mode sync --shards 2 --workers 2 --optimizer momentum --lr 0.05 "
               "--model mlp --data digits --steps 300 --record runs/demo")
    jobconfig.add_arguments(p, scope="launch")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: see the module docstring (2: a mistake found before anything started)."""
    args = build_parser().parse_args(argv)
    try:
        config = jobconfig.load_config(args, scope="launch")
        server_config(config)   # the shards' settings, checked before anything starts
    except (JobConfigError, ValueError) as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    launcher = Launcher(config)
    try:
        launcher.prepare()   # the model, the data and their fit: before any process starts
    except (PSError, ValueError) as exc:
        launcher.close()
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    return launcher.run()
