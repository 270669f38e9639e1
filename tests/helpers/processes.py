"""Real ``ps-server`` shard and ``ps-worker`` processes for tests: started on port 0, found by their READY line, stopped by pid.

``start_shard(*flags)`` runs ``python -P -m ps_server`` (``sys.executable``; the installed
packages, never the working directory), reads the ``PS_SERVER_READY {...}`` line from its
stdout within a timeout and returns a ``ShardProcess``. ``ShardCluster`` starts the N shards
of one job at once and is a context manager; its ``addresses`` feed a ``PSClient``.
``WorkerProcess`` runs one ``python -P -m worker_client --events`` and collects its JSON
events as they arrive.

Starting, reading and stopping are ps_common.process's (ChildProcess): stopping is always by
process id, never by name -- SIGTERM, then SIGKILL when the process has not exited within
the stop timeout -- and whatever a crashed test left running is stopped at interpreter exit.
A child's stderr (its log) goes to a temporary file, so a chatty process never blocks on a
full pipe, and its tail is quoted when a process fails.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ps_common.errors import ProcessStartError
from ps_common.process import ChildProcess, child_env, python_module_argv
from ps_common.tf_config import TF_CONFIG_ENV
from ps_server.cli import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Longest wait for a shard's READY line, in seconds.
READY_TIMEOUT = 30.0
#: Longest wait for a shard to exit after SIGTERM (then SIGKILL), and after SIGKILL, in seconds.
STOP_TIMEOUT = 5.0
#: The least time each shard of a cluster gets for its READY line, even when the cluster's deadline passed.
MIN_READY_WAIT = 0.1
#: Longest wait, after a worker exited, for its last output lines to be read.
DRAIN_TIMEOUT = 5.0
#: Characters of a child's log quoted by log_tail() unless the caller asks for more.
LOG_TAIL_CHARS = 4000
#: Events quoted when a wait for one fails.
QUOTED_EVENTS = 3


class ShardStartError(ProcessStartError):
    """A shard process exited or stayed silent instead of printing its READY line."""


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """The test process's environment without TF_CONFIG (a test's child takes its settings from its flags), plus extra."""
    return child_env(extra, drop=[TF_CONFIG_ENV])


class _ChildProcess:
    """A ``python -P -m MODULE`` child of a test (a ps_common.process.ChildProcess): stdout read, stderr in a log file.

    ``process`` is its subprocess.Popen. Every signal goes to this process's pid only, and
    every wait is bounded.
    """

    def __init__(self, module: str, args: Sequence[str], *, name: str, env: Mapping[str, str] | None = None,
                 ready_prefix: str | None = None, events: bool = False) -> None:
        self.args = [str(a) for a in args]
        fd, log_name = tempfile.mkstemp(prefix=f"ps-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        # In the test session's own session: with the kernel's per-session CPU groups
        # (sched_autogroup) a child in a session of its own gets a CPU share of its own,
        # which speeds a job up against the machine's other load and upsets the timing the
        # fault tests rely on (a worker paused for a fixed time must resume mid-job).
        self.child = ChildProcess(name, python_module_argv(module, *self.args), env=_child_env(env), cwd=REPO_ROOT,
                                  ready_prefix=ready_prefix, events=events, stderr=self.log_path, new_session=False)
        self.process = self.child.popen

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()

    def kill(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGKILL by pid (a crash: no shutdown code runs) and waits at most timeout s for the exit."""
        return self.child.kill(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM by pid, SIGKILL after timeout s; returns the exit status. Safe to call twice."""
        return self.child.stop(timeout)

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.child.log_tail(chars) or "(no log)"

    def remove_log(self) -> None:
        if os.environ.get("PS_TEST_KEEP_LOGS"):
            return
        try:
            self.log_path.unlink()
        except OSError:
            pass


class ShardProcess(_ChildProcess):
    """One running ``python -P -m ps_server`` process."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        """Spawns the process (it does not wait for READY: call ``wait_ready``)."""
        args = [str(a) for a in args]
        index = args[args.index("--shard-index") + 1] if "--shard-index" in args[:-1] else ""
        super().__init__("ps_server", args, name=f"shard{index}", env=env, ready_prefix=READY_PREFIX)
        self.address = ""
        self.port = 0
        self.shard_index = -1
        self.ready: dict = {}       # the READY line's fields (address, port, shard_index, metrics_port)

    @property
    def stdout_lines(self) -> list[str]:
        """The last lines the shard printed on stdout."""
        return self.child.last_lines("stdout")

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> "ShardProcess":
        """Blocks until the READY line arrives (at most timeout s); ShardStartError otherwise (the shard stopped)."""
        try:
            ready = self.child.wait_ready(timeout)
        except ProcessStartError as exc:
            raise ShardStartError(str(exc)) from None
        self.address, self.port, self.shard_index = ready["address"], int(ready["port"]), int(ready["shard_index"])
        self.ready = ready
        return self

    def __repr__(self) -> str:
        return f"ShardProcess(pid={self.pid}, address={self.address!r}, shard_index={self.shard_index})"


def start_shard(*flags: str, ready_timeout: float = READY_TIMEOUT, env: Mapping[str, str] | None = None) -> ShardProcess:
    """Starts ``python -P -m ps_server *flags`` (add ``--port`` to pin a port; the default is 0) and waits for READY."""
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
                shard.wait_ready(max(MIN_READY_WAIT, deadline - time.monotonic()))
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
    """One running ``python -P -m worker_client --events`` process; its JSON events are collected as they arrive.

    Its log (stderr) goes to a temporary file. Every wait is bounded and every signal goes
    to this process's pid only: ``kill`` (SIGKILL), ``pause``/``resume`` (SIGSTOP/SIGCONT),
    ``stop`` (SIGTERM, then SIGKILL).
    """

    def __init__(self, args: Sequence[str], *, name: str = "worker", env: Mapping[str, str] | None = None) -> None:
        self.name = name
        super().__init__("worker_client", ["--events", *args], name=name, env=env, events=True)

    @property
    def events(self) -> list[dict]:
        """Every event so far, oldest first."""
        return self.child.events

    @property
    def other_lines(self) -> list[str]:
        """The last stdout lines that were not events."""
        return [line for line in self.child.last_lines("stdout") if not line.startswith("{")]

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """The first event for which predicate(event) holds, waiting at most timeout s (AssertionError naming `what`)."""
        event = self.child.wait_event(predicate, timeout)
        if event is None:
            why = "exited" if not self.child.streams_open else f"not within {timeout:.0f} s"
            raise AssertionError(f"{self.name} (pid {self.pid}): no event for {what} ({why}); last events: "
                                 f"{self.events[-QUOTED_EVENTS:]}; log tail:\n{self.log_tail()}")
        return event

    def wait_for_step(self, step: int, timeout: float) -> dict:
        """The first progress (or done) event at a global step >= step."""
        return self.wait_for(lambda e: e["event"] in ("progress", "done") and e.get("step", e.get("steps", -1)) >= step,
                             timeout, f"step >= {step}")

    def finish(self, timeout: float) -> int:
        """Waits at most timeout s for the process to exit (then stops it and fails); returns its exit status."""
        code = self.child.wait(timeout)
        if code is None:
            self.stop()
            raise AssertionError(f"{self.name} (pid {self.pid}) still ran after {timeout:.0f} s; last events: "
                                 f"{self.events[-QUOTED_EVENTS:]}; log tail:\n{self.log_tail()}")
        self.child.wait_drained(DRAIN_TIMEOUT)   # let the reader take the last lines
        return code

    @property
    def result(self) -> dict[str, Any] | None:
        """The fields of the "done" event, once it arrived."""
        return next((e for e in reversed(self.events) if e["event"] == "done"), None)

    def pause(self) -> None:
        """SIGSTOP: the process stands still (no heartbeats, no rpcs) until resume()."""
        self.child.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self.child.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGCONT (in case it is paused), then SIGTERM by pid, SIGKILL after timeout s; safe to call twice."""
        self.resume()
        return super().stop(timeout)

    def __repr__(self) -> str:
        return f"WorkerProcess(name={self.name!r}, pid={self.pid})"


# ---------------------------------------------------------------------- leftovers of a test session

#: Seconds a leftover descendant gets between SIGTERM and SIGKILL, and after SIGKILL.
REAP_GRACE = 5.0
#: How often reap_descendants checks whether the signalled processes are gone, in seconds.
REAP_POLL_INTERVAL = 0.05
_PROC = Path("/proc")


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process from /proc/PID/stat; None when it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()   # after "pid (comm) ": the comm may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def _command_line(pid: int) -> str:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part) or "?"


def descendants(root: int) -> dict[int, int]:
    """Every live (not zombie) descendant of process `root`, from /proc: {pid: start time}. {} without /proc."""
    if not _PROC.is_dir():
        return {}
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append((int(entry.name), stat[2]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found and pid != root:
                found[pid] = started
                todo.append(pid)
    return found


def _same_process_alive(pid: int, started: int) -> bool:
    """Whether `pid` still runs and is the process first seen (not a new one that reused the pid)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started


def reap_descendants(root: int, *, grace: float = REAP_GRACE) -> list[str]:
    """Stops every descendant of process `root` by PID: SIGTERM, then SIGKILL after grace s; what it stopped.

    Each stopped process is described as "pid N (COMMAND LINE): stopped by SIGTERM|SIGKILL"
    (or "survived SIGKILL"). A pid is signalled only while it is still the process first
    seen (same start time), and never by name. Blocks at most 2 x grace s.
    """
    found = descendants(root)
    commands = {pid: _command_line(pid) for pid in found}
    how: dict[int, str] = {}
    for signum in (signal.SIGTERM, signal.SIGKILL):
        targets = [pid for pid, started in found.items() if _same_process_alive(pid, started)]
        for pid in targets:
            try:
                os.kill(pid, signum)
                how[pid] = f"stopped by {signal.Signals(signum).name}"
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(_same_process_alive(pid, found[pid]) for pid in targets) and time.monotonic() < deadline:
            _reap_zombie_children(targets)
            time.sleep(REAP_POLL_INTERVAL)
        _reap_zombie_children(targets)
    for pid, started in found.items():
        if _same_process_alive(pid, started):
            how[pid] = "survived SIGKILL"
    return [f"pid {pid} ({commands[pid]}): {what}" for pid, what in sorted(how.items())]


def _reap_zombie_children(pids: Sequence[int]) -> None:
    """Collects the exit status of those of pids that are this process's exited children (no zombies left)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass   # not our child, or already collected
