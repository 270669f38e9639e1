"""One way to run the project's child processes: start one, read its READY line, follow its output, stop it by PID.

`ChildProcess` starts an argv with its own environment, working directory and session (so
a Ctrl-C at the terminal reaches only the parent, which stops its children itself;
``new_session=False`` keeps it in the caller's). Reader threads drain the child's stdout --
and its stderr, when that is piped -- for its whole life, so the child never blocks on a
full pipe, and sort every line:

- the READY line, ``<ready_prefix>{json}``: the first stdout line that starts with the
  prefix. Its JSON object becomes `ready` (a malformed one: `ready_error`); `wait_ready`
  returns it.
- events (``events=True``): every later stdout line that is a JSON object with an
  ``"event"`` key is appended to `events`; `wait_event` waits for one.
- any other line is plain output.

The last `TAIL_LINES` lines are kept to quote in errors, which name the process, its argv
and those lines. A `sink` callback, when given, receives every line as an `Output` (the
launcher prints them).

Stopping is by PID only, never by name: SIGTERM, then SIGKILL after a grace, each wait
bounded (`stop`, `stop_all`). Every child still running when the interpreter exits is
stopped the same way.

Child Python processes run as ``sys.executable -P -m MODULE`` (`python_module_argv`): -P
keeps the working directory off sys.path, so a user's own ``models/``, ``bench/`` or
``ps_common/`` folder can neither shadow the installed packages nor break a child.
`child_env` builds their environment: the parent's, with line-buffered output.

What blocks, and for how long:

    ChildProcess(...)           not at all: the process is started, the readers run in threads
    wait_ready(timeout)         until the READY line, the child's exit, or timeout s
    wait_event(match, timeout)  until a matching event, the end of stdout, or timeout s
    wait(timeout)               until the child exits, or timeout s
    wait_drained(timeout)       until the child's pipes are closed, or timeout s
    stop(grace), stop_all(...)  at most 2 x grace s: after SIGTERM, then after SIGKILL
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ps_common.errors import ProcessStartError

#: Longest wait for a READY line when the caller names none, in seconds.
READY_TIMEOUT = 60.0
#: Seconds between SIGTERM and SIGKILL, and the longest wait after SIGKILL.
STOP_GRACE = 10.0
#: Lines of a child's output kept, and quoted when it fails.
TAIL_LINES = 30
#: Longest wait, once a child has exited, for the rest of its output to be read.
EXIT_DRAIN_TIMEOUT = 2.0
#: How often a blocked wait also checks whether the child has exited, in seconds.
POLL_INTERVAL = 0.1
#: Bytes read from the end of a child's log file to quote its last lines.
LOG_TAIL_BYTES = 64 * 1024
#: The key that makes a JSON stdout line an event.
EVENT_KEY = "event"

#: Where a child's stderr goes: its own pipe, drained like stdout ...
PIPE = "pipe"
#: ... or into stdout, interleaved (otherwise: a path, the child's log file).
MERGE = "merge"

#: Output kinds.
LINE, READY, EVENT, CLOSED = "line", "ready", "event", "closed"

#: `-P` (Python 3.11+) keeps the working directory and script folder off a child's sys.path.
HAS_SAFE_PATH_FLAG = sys.version_info >= (3, 11)
#: Python 3.10 has no -P: this runs MODULE as -m would, after removing sys.path[0] -- the
#: working directory, which `python -c` puts there.
_SAFE_PATH_BOOTSTRAP = ("import runpy, sys; del sys.path[0]; sys.argv[:] = sys.argv[1:]; "
                        "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def python_module_argv(module: str, *args: str, safe_path_flag: bool = HAS_SAFE_PATH_FLAG) -> list[str]:
    """The argv that runs ``python -m module args`` in this interpreter, with the working directory off sys.path.

    ``sys.executable -P -m module ...`` on Python 3.11+; a ``-c`` bootstrap doing the same
    on 3.10 (``safe_path_flag=False`` picks it anywhere, for tests).
    """
    if safe_path_flag:
        return [sys.executable, "-P", "-m", module, *map(str, args)]
    return [sys.executable, "-c", _SAFE_PATH_BOOTSTRAP, module, *map(str, args)]


def child_env(extra: Mapping[str, str] | None = None, *, drop: Iterable[str] = ()) -> dict[str, str]:
    """A child's environment: this process's, without the variables in `drop`, with PYTHONUNBUFFERED=1, then `extra`.

    PYTHONPATH is left as the user set it: children import the same installed packages as
    the parent (python_module_argv runs the parent's interpreter).
    """
    dropped = set(drop)
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["PYTHONUNBUFFERED"] = "1"   # each line reaches the reader when it is printed
    if extra:
        env.update(extra)
    return env


@dataclass(frozen=True)
class Output:
    """One line of a child's output, as handed to a sink."""

    stream: str                      # "stdout" | "stderr"
    kind: str                        # LINE, READY, EVENT, or CLOSED (the stream ended; text is "")
    text: str = ""                   # the line as printed, without its line end
    data: dict[str, Any] | None = None   # READY: the JSON object (None when malformed); EVENT: the event


Sink = Callable[["ChildProcess", Output], None]

_running: dict[int, "ChildProcess"] = {}
_running_lock = threading.Lock()


class ChildProcess:
    """One started child process; see the module docstring."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, ready_prefix: str | None = None, events: bool = False,
                 keep_events: bool = True, stderr: str | os.PathLike[str] = PIPE, sink: Sink | None = None,
                 tail_lines: int = TAIL_LINES, new_session: bool = True) -> None:
        """Starts argv; it does not wait for anything (see wait_ready). ProcessStartError when it cannot start.

        `stderr` is PIPE (read like stdout), MERGE (into stdout) or a log file's path (appended
        to; its end is quoted in errors). `keep_events=False` parses events for the sink only.
        `new_session=False` keeps the child in the caller's session (and, where the kernel
        groups CPU time by session, in the caller's share of the CPU).
        """
        self.name = name
        self.argv = [str(a) for a in argv]
        self.ready_prefix = ready_prefix
        self.parse_events = events
        self.keep_events = keep_events
        self.sink = sink
        self.log_path: Path | None = None
        self.ready: dict[str, Any] | None = None
        self.ready_error: str | None = None
        self.events: list[dict[str, Any]] = []
        self._ready_seen = False
        self._tail: deque[tuple[str, str]] = deque(maxlen=tail_lines)
        self._changed = threading.Condition()
        log_file: IO[bytes] | None = None
        if stderr == PIPE:
            stderr_target: Any = subprocess.PIPE
        elif stderr == MERGE:
            stderr_target = subprocess.STDOUT
        else:
            self.log_path = Path(stderr)
            log_file = stderr_target = open(self.log_path, "ab")   # noqa: SIM115 -- closed below, the child keeps its copy
        try:
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr_target, text=True,
                encoding="utf-8", errors="replace", bufsize=1, env=None if env is None else dict(env), cwd=cwd,
                start_new_session=new_session)
        except OSError as exc:
            raise ProcessStartError(f"{name} could not start (argv: {shlex.join(self.argv)}): {exc}") from exc
        finally:
            if log_file is not None:
                log_file.close()
        with _running_lock:
            _running[self.popen.pid] = self
        self._open = {"stdout"} | ({"stderr"} if stderr == PIPE else set())
        for stream_name in sorted(self._open):
            threading.Thread(target=self._read, args=(stream_name, getattr(self.popen, stream_name)),
                             name=f"{name}-{stream_name}", daemon=True).start()

    # ------------------------------------------------------------------ reading

    def _read(self, stream_name: str, pipe: IO[str]) -> None:
        try:
            for raw in pipe:
                self._take(stream_name, raw.rstrip("\r\n"))
        finally:
            pipe.close()
            with self._changed:
                self._open.discard(stream_name)
                self._changed.notify_all()
            if self.sink is not None:
                self.sink(self, Output(stream_name, CLOSED))

    def _take(self, stream_name: str, text: str) -> None:
        output = Output(stream_name, LINE, text)
        with self._changed:
            self._tail.append((stream_name, text))
            if stream_name == "stdout":
                if self.ready_prefix is not None and not self._ready_seen and text.startswith(self.ready_prefix):
                    self._ready_seen = True
                    self.ready, self.ready_error = _ready_payload(text, self.ready_prefix)
                    output = Output(stream_name, READY, text, self.ready)
                elif self.parse_events and (self.ready_prefix is None or self._ready_seen):
                    event = _json_object(text)
                    if event is not None and EVENT_KEY in event:
                        if self.keep_events:
                            self.events.append(event)
                        output = Output(stream_name, EVENT, text, event)
            self._changed.notify_all()
        if self.sink is not None:
            self.sink(self, output)

    # ------------------------------------------------------------------ state

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def streams_open(self) -> bool:
        """Whether a pipe of the child is still being read (False once all its output is in)."""
        with self._changed:
            return bool(self._open)

    def last_lines(self, stream: str | None = None) -> list[str]:
        """The last lines read from the child (of one stream, or all), then the end of its log file if it has one."""
        with self._changed:
            lines = [text for name, text in self._tail if stream in (None, name)]
        if self.log_path is not None and stream in (None, "stderr"):
            lines += self.log_tail().splitlines()[-(self._tail.maxlen or TAIL_LINES):]
        return lines

    def log_tail(self, chars: int = LOG_TAIL_BYTES) -> str:
        """The last `chars` characters of the child's log file ("" when it has none or it cannot be read)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - chars))
                return log.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"(log {self.log_path} cannot be read: {exc})"

    def describe(self, why: str) -> str:
        """An error message: the child's name, pid and argv, `why`, and its last lines."""
        shown = "\n".join(f"  [{self.name}] {line}" for line in self.last_lines()) or "  (no output)"
        return f"{self.name} (pid {self.pid}; argv: {shlex.join(self.argv)}) {why}; its last lines:\n{shown}"

    # ------------------------------------------------------------------ waiting

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """The READY line's JSON object, waiting at most timeout s.

        When the child exits first, prints a malformed READY line or stays silent past the
        timeout, it is stopped (by PID) and ProcessStartError names it with its last lines.
        """
        if self.ready_prefix is None:
            raise ValueError(f"{self.name} was started without a ready_prefix; there is no READY line to wait for")
        deadline = time.monotonic() + timeout
        exited_at: float | None = None
        with self._changed:
            while not self._ready_seen:
                now = time.monotonic()
                if exited_at is None and self.popen.poll() is not None:
                    exited_at = now
                if exited_at is not None and ("stdout" not in self._open or now - exited_at > EXIT_DRAIN_TIMEOUT):
                    break
                if now >= deadline:
                    break
                self._changed.wait(min(deadline - now, POLL_INTERVAL))
            ready, error = self.ready, self.ready_error
        if ready is not None:
            return ready
        if error is not None:
            why = error
        elif exited_at is not None:
            why = f"exited with code {self.popen.poll()} before its READY line ({self.ready_prefix.strip()!r})"
        else:
            why = f"printed no READY line ({self.ready_prefix.strip()!r}) within {timeout:g} s"
        self.stop()
        raise ProcessStartError(self.describe(why))

    def wait_event(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """The first kept event (oldest first) for which match(event) holds; None at the timeout or the end of stdout."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self._changed:
            while True:
                for event in self.events[checked:]:
                    if match(event):
                        return event
                checked = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0 or "stdout" not in self._open:
                    return None
                self._changed.wait(min(left, POLL_INTERVAL))

    def wait(self, timeout: float) -> int | None:
        """The exit status, waiting at most timeout s for the child to exit; None if it still runs."""
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        _forget(self)
        return code

    def wait_drained(self, timeout: float) -> bool:
        """Waits at most timeout s until every line of the child's output was read; whether it was."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._open, timeout=timeout)

    # ------------------------------------------------------------------ signals

    def send_signal(self, signum: int) -> None:
        """Sends signum to this child's PID, if it still runs."""
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self, timeout: float = STOP_GRACE) -> int | None:
        """SIGKILL (no shutdown code runs) and waits at most timeout s; the exit status (None if it survived)."""
        self.send_signal(signal.SIGKILL)
        return self.wait(timeout)

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM, then SIGKILL after grace s; the exit status (None if it survived). Safe to call twice."""
        stop_all([self], grace=grace)
        return self.popen.poll()

    def __repr__(self) -> str:
        return f"ChildProcess(name={self.name!r}, pid={self.pid})"


def _ready_payload(text: str, prefix: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the READY line's JSON object, None), or (None, why it is malformed)."""
    payload = _json_object(text[len(prefix):])
    if payload is None:
        return None, f"printed a malformed READY line {text!r} (expected {prefix.strip()} and a JSON object)"
    return payload, None


def _json_object(text: str) -> dict[str, Any] | None:
    if not text.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _forget(child: ChildProcess) -> None:
    with _running_lock:
        if _running.get(child.pid) is child:
            del _running[child.pid]


def start_and_wait_ready(name: str, argv: Sequence[str], ready_prefix: str, *, timeout: float = READY_TIMEOUT,
                         env: Mapping[str, str] | None = None, cwd: str | None = None) -> ChildProcess:
    """Starts argv (stderr merged into stdout) and waits for its READY line (ChildProcess.wait_ready)."""
    child = ChildProcess(name, argv, env=env, cwd=cwd, ready_prefix=ready_prefix, stderr=MERGE)
    child.wait_ready(timeout)
    return child


def stop(popen: subprocess.Popen, *, grace: float = STOP_GRACE) -> int | None:
    """SIGTERM, then SIGKILL after `grace` s, to this process only (by PID); its exit status (None if it survived)."""
    stop_all([popen], grace=grace)
    return popen.poll()


def stop_all(processes: Iterable[ChildProcess | subprocess.Popen], *, grace: float = STOP_GRACE,
             on_kill: Callable[[ChildProcess | subprocess.Popen], None] | None = None) -> list:
    """Stops processes together, by PID: SIGTERM to all, SIGKILL to those still running after grace s.

    `on_kill(process)` is called before each SIGKILL. Blocks at most 2 x grace s in all;
    returns the processes that survived even SIGKILL (normally none). A process that had
    already exited is fine.
    """
    group = list(processes)

    def popen_of(p: ChildProcess | subprocess.Popen) -> subprocess.Popen:
        return p.popen if isinstance(p, ChildProcess) else p

    for signum, hook in ((signal.SIGTERM, None), (signal.SIGKILL, on_kill)):
        running = [p for p in group if popen_of(p).poll() is None]
        for p in running:
            if hook is not None:
                hook(p)
            try:
                os.kill(popen_of(p).pid, signum)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        for p in running:
            try:
                popen_of(p).wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in group:
        if isinstance(p, ChildProcess) and p.popen.poll() is not None:
            _forget(p)
    return [p for p in group if popen_of(p).poll() is None]


def running_children() -> list[ChildProcess]:
    """Every child started through this module in this process that has not been seen to exit."""
    with _running_lock:
        children = list(_running.values())
    return [c for c in children if c.alive()]


@atexit.register
def _stop_leftovers() -> None:
    """At interpreter exit: stops (by PID) every child started here that still runs."""
    stop_all(running_children(), grace=STOP_GRACE)
