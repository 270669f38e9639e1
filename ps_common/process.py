"""Starting child processes that announce readiness with one stdout line, and stopping them by PID."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Child:
    """A started child process, its ready-line payload, and the output lines read after it."""

    name: str
    popen: subprocess.Popen
    ready: dict
    lines: "queue.Queue[str | None]" = field(default_factory=queue.Queue)  # after the ready line; None ends
    before: list[str] = field(default_factory=list)                        # lines before the ready line

    @property
    def pid(self) -> int:
        return self.popen.pid


def start_and_wait_ready(name: str, argv: Sequence[str], ready_prefix: str, *, timeout: float = 60.0,
                         env: dict[str, str] | None = None, cwd: str | None = None) -> Child:
    """Starts argv (stdout+stderr merged) and waits for a line `<ready_prefix>{json}`, at most timeout s.

    Lines before and after the ready line are kept in `Child.lines` (a reader thread drains
    the pipe so the child never blocks on it). On timeout or early exit the child is
    stopped and RuntimeError names it with its last lines of output.
    """
    popen = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env=env, cwd=cwd, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=drain, name=f"drain-{name}", daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(0.01, left)) if left > 0 else None
        except queue.Empty:
            line = None
        if line is None:
            stop(popen)
            why = f"exited with code {popen.returncode}" if left > 0 else f"not ready after {timeout:.0f} s"
            tail = "\n  ".join(seen[-20:])
            raise RuntimeError(f"{name} ({' '.join(argv[:4])} ...) {why}; last output:\n  {tail}")
        seen.append(line)
        if line.startswith(ready_prefix):
            return Child(name, popen, json.loads(line[len(ready_prefix):]), lines, seen[:-1])


def stop(popen: subprocess.Popen, *, grace: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after `grace` s, to this process only (by PID); its exit code (None if it survived).

    Every wait is bounded by `grace`; a process that already exited is fine.
    """
    for signum in (signal.SIGTERM, signal.SIGKILL):
        if popen.poll() is not None:
            break
        try:
            os.kill(popen.pid, signum)
        except ProcessLookupError:
            pass
        try:
            popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    return popen.poll()
