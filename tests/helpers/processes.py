"""Real ``ps-server`` shard processes for tests: started on port 0, found by their READY line, stopped by pid.

``start_shard(*flags)`` runs ``python -m ps_server`` (``sys.executable``, the repository on
``PYTHONPATH``), reads the ``PS_SERVER_READY {...}`` line from its stdout within a timeout
and returns a ``ShardProcess``. ``ShardCluster`` starts the N shards of one job at once
and is a context manager; its ``addresses`` feed a ``PSClient``. ``WorkerProcess`` runs
one ``python -m worker_client --events`` and collects its JSON events as they arrive.

Stopping is always by process id, never by name: SIGTERM, then SIGKILL when the process
has not exited within the stop timeout. Every process started here is also recorded so
that an interpreter exit reaps whatever a crashed test left behind. A shard's stderr (its
log) goes to a temporary file, so a chatty shard never blocks on a full pipe, and its tail
is quoted in the error when a shard fails to start.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ps_common.process import stop as stop_by_pid

REPO_ROOT = Path(__file__).resolve().parents[2]

#: The prefix of the line a started shard prints on stdout (ps_server.cli.READY_PREFIX).
READY_PREFIX = "PS_SERVER_READY "
#: Longest wait for a shard's READY line, in seconds.
READY_TIMEOUT = 30.0
#: Longest wait for a shard to exit after SIGTERM (then SIGKILL), and after SIGKILL, in seconds.
STOP_TIMEOUT = 5.0

_started: dict[int, subprocess.Popen] = {}
_started_lock = threading.Lock()


class ShardStartError(RuntimeError):
    """A shard process exited or stayed silent instead of printing its READY line."""


def _reap_all() -> None:
    """At interpreter exit: stops (by pid) every shard process a test left running."""
    with _started_lock:
        leftovers = list(_started.values())
    for process in leftovers:
        _stop_process(process, STOP_TIMEOUT)


atexit.register(_reap_all)


def _stop_process(process: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM, then SIGKILL after timeout s (ps_common.process.stop), and forgets the process."""
    stop_by_pid(process, grace=timeout)
    with _started_lock:
        _started.pop(process.pid, None)
    return process.poll()


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TF_CONFIG", None)   # a test's shard takes its settings from its flags only
    if extra:
        env.update(extra)
    return env


class _ChildProcess:
    """A ``python -m MODULE`` child of a test: stdout piped, stderr in a temporary log file.

    Every signal goes to this process's pid only, and every wait is bounded.
    """

    def __init__(self, module: str, args: Sequence[str], *, log_prefix: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.args = [str(a) for a in args]
        fd, log_name = tempfile.mkstemp(prefix=f"ps-{log_prefix}-", suffix=".log")
        self.log_path = Path(log_name)
        with os.fdopen(fd, "wb") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, *self.args], cwd=REPO_ROOT, env=_child_env(env),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file, text=True,
            )
        with _started_lock:
            _started[self.process.pid] = self.process

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def _signal(self, signum: int) -> None:
        if self.process.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGKILL by pid (a crash: no shutdown code runs) and waits for the exit."""
        self._signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        with _started_lock:
            _started.pop(self.pid, None)
        return self.process.poll()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM by pid, SIGKILL after timeout s; returns the exit status. Safe to call twice."""
        return _stop_process(self.process, timeout)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def remove_log(self) -> None:
        if os.environ.get("PS_TEST_KEEP_LOGS"):
            return
        try:
            self.log_path.unlink()
        except OSError:
            pass


class ShardProcess(_ChildProcess):
    """One running ``python -m ps_server`` process."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        """Spawns the process (it does not wait for READY: call ``wait_ready``)."""
        super().__init__("ps_server", args, log_prefix="shard", env=env)
        self.address = ""
        self.port = 0
        self.shard_index = -1
        self.ready: dict = {}       # the READY line's fields (address, port, shard_index, metrics_port)
        self.stdout_lines: list[str] = []
        self._ready: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stdout, name=f"shard-stdout-{self.pid}", daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        """Drains stdout for the process's life; hands the READY line's JSON to wait_ready."""
        assert self.process.stdout is not None
        announced = False
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.stdout_lines.append(line)
            if not announced and line.startswith(READY_PREFIX):
                announced = True
                try:
                    self._ready.put(json.loads(line[len(READY_PREFIX):]))
                except json.JSONDecodeError:
                    self._ready.put(None)
        if not announced:
            self._ready.put(None)   # stdout closed without READY: the process exited

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> "ShardProcess":
        """Blocks until the READY line arrives (at most timeout s); ShardStartError otherwise."""
        try:
            ready = self._ready.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise ShardStartError(f"shard {self.args} printed no READY line within {timeout:.0f} s; "
                                  f"log tail:\n{self.log_tail()}") from None
        if ready is None:
            status = self.stop()
            raise ShardStartError(f"shard {self.args} exited (status {status}) without a READY line; "
                                  f"stdout: {self.stdout_lines[-5:]}; log tail:\n{self.log_tail()}")
        self.address, self.port, self.shard_index = ready["address"], int(ready["port"]), int(ready["shard_index"])
        self.ready = ready
        return self

    def __repr__(self) -> str:
        return f"ShardProcess(pid={self.pid}, address={self.address!r}, shard_index={self.shard_index})"


def start_shard(*flags: str, ready_timeout: float = READY_TIMEOUT, env: Mapping[str, str] | None = None) -> ShardProcess:
    """Starts ``python -m ps_server *flags`` (add ``--port`` to pin a port; the default is 0) and waits for READY."""
    return ShardProcess(flags, env=env).wait_ready(ready_timeout)


class ShardCluster:
    """The N shard processes of one job, each on a free port; a context manager.

    ``flags`` go to every shard (after ``--shard-index``, ``--num-shards`` and ``--mode``),
    ``shard_flags[i]`` to shard i only. ``addresses`` lists "host:port" in shard order.
    """

    def __init__(self, num_shards: int = 1, *, mode: str = "async", flags: Sequence[str] = (),
                 shard_flags: Mapping[int, Sequence[str]] | None = None, ready_timeout: float = READY_TIMEOUT,
                 stop_timeout: float = STOP_TIMEOUT, env: Mapping[str, str] | None = None) -> None:
        if num_shards < 1:
            raise ValueError(f"Invalid num_shards: {num_shards}")
        self.num_shards = num_shards
        self.mode = mode
        self.flags = [str(f) for f in flags]
        self.shard_flags = {i: [str(f) for f in fs] for i, fs in (shard_flags or {}).items()}
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.env = env
        self.shards: list[ShardProcess] = []

    def args_for(self, index: int, *, port: int = 0) -> list[str]:
        """The ps-server flags of shard `index`."""
        return ["--shard-index", str(index), "--num-shards", str(self.num_shards), "--mode", self.mode,
                "--port", str(port), *self.flags, *self.shard_flags.get(index, [])]

    def start(self) -> "ShardCluster":
        """Spawns every shard at once, then waits for each READY line (stopping them all on failure)."""
        if self.shards:
            raise RuntimeError("cluster already started")
        try:
            for i in range(self.num_shards):
                self.shards.append(ShardProcess(self.args_for(i), env=self.env))
            deadline = time.monotonic() + self.ready_timeout
            for shard in self.shards:
                shard.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.shards]

    @property
    def address_option(self) -> str:
        """The addresses as ``--ps-address`` takes them: comma-separated."""
        return ",".join(self.addresses)

    def kill(self, index: int) -> int | None:
        """SIGKILLs shard `index` (by pid)."""
        return self.shards[index].kill(self.stop_timeout)

    def restart(self, index: int, *, same_port: bool = True) -> ShardProcess:
        """Stops shard `index` if it still runs and starts it again (on its old port by default)."""
        old = self.shards[index]
        old.stop(self.stop_timeout)
        old.remove_log()
        port = old.port if same_port else 0
        self.shards[index] = ShardProcess(self.args_for(index, port=port), env=self.env).wait_ready(self.ready_timeout)
        return self.shards[index]

    def stop(self) -> None:
        """Stops every shard by pid (SIGTERM, then SIGKILL); failures to stop are not hidden."""
        stuck = []
        for shard in self.shards:
            shard.stop(self.stop_timeout)
            if shard.alive():
                stuck.append(shard.pid)
            else:
                shard.remove_log()
        if stuck:
            raise RuntimeError(f"shard processes {stuck} did not exit after SIGKILL")

    def __enter__(self) -> "ShardCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ShardCluster(mode={self.mode!r}, addresses={self.addresses})"


class WorkerProcess(_ChildProcess):
    """One running ``python -m worker_client --events`` process; its JSON events are collected as they arrive.

    Its log (stderr) goes to a temporary file. Every wait is bounded and every signal goes
    to this process's pid only: ``kill`` (SIGKILL), ``pause``/``resume`` (SIGSTOP/SIGCONT),
    ``stop`` (SIGTERM, then SIGKILL).
    """

    def __init__(self, args: Sequence[str], *, name: str = "worker", env: Mapping[str, str] | None = None) -> None:
        self.name = name
        super().__init__("worker_client", ["--events", *args], log_prefix=name, env=env)
        self.events: list[dict] = []
        self.other_lines: list[str] = []
        self._arrived = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout-{self.pid}", daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            with self._arrived:
                if isinstance(event, dict) and "event" in event:
                    self.events.append(event)
                else:
                    self.other_lines.append(line.rstrip("\n"))
                self._arrived.notify_all()
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        """The first event for which predicate(event) holds, waiting at most timeout s (AssertionError naming `what`)."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._arrived:
            while True:
                for event in self.events[seen:]:
                    if predicate(event):
                        return event
                seen = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    why = "exited" if self._closed else f"not within {timeout:.0f} s"
                    raise AssertionError(f"{self.name} (pid {self.pid}): no event for {what} ({why}); last events: "
                                         f"{self.events[-3:]}; log tail:\n{self.log_tail()}")
                self._arrived.wait(min(left, 0.5))

    def wait_for_step(self, step: int, timeout: float) -> dict:
        """The first progress (or done) event at a global step >= step."""
        return self.wait_for(lambda e: e["event"] in ("progress", "done") and e.get("step", e.get("steps", -1)) >= step,
                             timeout, f"step >= {step}")

    def finish(self, timeout: float) -> int:
        """Waits at most timeout s for the process to exit (then stops it and fails); returns its exit status."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.name} (pid {self.pid}) still ran after {timeout:.0f} s; last events: "
                                 f"{self.events[-3:]}; log tail:\n{self.log_tail()}") from None
        with _started_lock:
            _started.pop(self.pid, None)
        with self._arrived:   # let the reader take the last lines (bounded)
            self._arrived.wait_for(lambda: self._closed, timeout=5)
        return code

    @property
    def result(self) -> dict | None:
        """The fields of the "done" event, once it arrived."""
        return next((e for e in reversed(self.events) if e["event"] == "done"), None)

    def pause(self) -> None:
        """SIGSTOP: the process stands still (no heartbeats, no rpcs) until resume()."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGCONT (in case it is paused), then SIGTERM by pid, SIGKILL after timeout s; safe to call twice."""
        self.resume()
        return _stop_process(self.process, timeout)

    def __repr__(self) -> str:
        return f"WorkerProcess(name={self.name!r}, pid={self.pid})"
