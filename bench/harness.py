"""What the side-by-side benchmarks (train_bench, pushpull_bench) share: child processes, ports, JSON lines.

Every child is started with ``python -P`` (the working directory stays off ``sys.path``),
in a session of its own, its stdout and stderr merged and drained by a thread, and stopped
by its PID only (`ps_common.process.stop`: SIGTERM, then SIGKILL). Every wait is bounded.
Shards are started with `ps_common.process.start_and_wait_ready` on 127.0.0.1, port 0 (or, on a host of
`ps_bench.netns`, on that host's address).

Measurements go to stdout as one JSON object a line: ``{"system", "metric", "size_mb",
"value", "unit", ...}``; everything for people goes to stderr.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from ps_bench import netns
from ps_common.process import ChildProcess as Child
from ps_common.process import start_and_wait_ready, stop

#: Our system's name in the JSON lines.
SYSTEM = "onnx-ps"
#: The baseline's name: PyTorch's RPC framework (TensorPipe agent, its TCP transport).
TORCH = "torch-rpc"
#: The shard's READY line (ps_server.cli.READY_PREFIX).
SHARD_READY = "PS_SERVER_READY "
#: Longest wait for a shard to start, in seconds.
SHARD_START_TIMEOUT = 60.0


def torch_available() -> bool:
    """True when torch can be imported here (it is a benchmark-only dependency, never the project's)."""
    return importlib.util.find_spec("torch") is not None


def tensorflow_available() -> bool:
    """True when tensorflow can be imported here (a benchmark-only peer, like torch)."""
    return importlib.util.find_spec("tensorflow") is not None


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def emit(system: str, metric: str, size_mb: float, value: float, unit: str, **extra: object) -> dict:
    """Prints one measurement as a JSON line (and returns it)."""
    record = {"system": system, "metric": metric, "size_mb": size_mb, "value": round(float(value), 4),
              "unit": unit, **extra}
    print(json.dumps(record), flush=True)
    return record


#: x86 vector extensions, widest first: the kernels of onnxruntime (MLAS) and torch (MKL, oneDNN) take the
#: widest the CPU has, and the engine's standing against torch moves with it (docs/benchmarks.md, 2026-11-30)
VECTOR_FLAGS = ("avx512f", "avx2", "avx", "sse4_2")


def cpu() -> dict[str, str]:
    """The CPU's model name and its widest x86 vector extension ("" where /proc/cpuinfo does not say)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "vector": next((flag for flag in VECTOR_FLAGS if flag in flags), "")}


def machine() -> dict[str, object]:
    """What the numbers were taken on: CPUs (count, model, widest vector extension), the load average at the
    time, Python."""
    try:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
    except OSError:
        load = []
    return {"cpus": os.cpu_count(), **cpu(), "loadavg": " ".join(load), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


#: The place of "steal" in /proc/stat's "cpu" line after the name (user, nice, system, idle, iowait, irq,
#: softirq, steal, ...): the time a virtual machine's CPUs were ready to run but the hypervisor ran another guest.
STEAL_FIELD = 7
#: A run during which the hypervisor took more than this share of the CPU is flagged in the benchmarks' lines
#: for people: on a shared host it measured a slower machine, not the system (docs/benchmarks.md, "Stolen CPU").
STEAL_FLAG = 0.05


def cpu_ticks() -> list[int] | None:
    """The machine's CPU time so far by kind, in clock ticks (/proc/stat's "cpu" line, every CPU together;
    a network namespace sees the same); None where there is no such file or line."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu "):
                    return [int(field) for field in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return None


def steal_share(before: Sequence[int] | None, after: Sequence[int] | None) -> float | None:
    """The share of the machine's CPU time between two `cpu_ticks` readings that the hypervisor gave to other
    guests (steal); None when either reading is missing, has no steal field (a kernel before 2.6.11, not a
    virtual machine's view) or no tick passed."""
    if before is None or after is None or min(len(before), len(after)) <= STEAL_FIELD:
        return None
    spent = [b - a for a, b in zip(before, after)]
    total = sum(spent[:STEAL_FIELD + 1])   # guest time (fields 9-10) is counted inside user and nice already
    return spent[STEAL_FIELD] / total if total > 0 else None


def steal_fields(stolen: Sequence[float | None]) -> dict[str, list[float | None]]:
    """A system's line's `steal_per_run` (each run's `steal_share`, rounded; None where a run had no reading), or
    no field when no run had one (no /proc/stat: no made-up zeros)."""
    if not any(share is not None for share in stolen):
        return {}
    return {"steal_per_run": [None if share is None else round(share, 4) for share in stolen]}


def stolen_note(share: float | None) -> str:
    """" (N% of the CPU stolen)" for a run whose steal share passed STEAL_FLAG, else ""."""
    return f" ({share:.0%} of the CPU stolen)" if share is not None and share > STEAL_FLAG else ""


def free_port() -> int:
    """A port free on 127.0.0.1 now (bound to 0 and released): for torch's rendezvous, which needs a fixed one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_iteration(iterator: Iterable, record: list[tuple[float, float]]) -> Iterator:
    """Yields `iterator`'s items; when it ends, appends (start, seconds spent inside next()) to `record`:
    the time a stream's producer took, as one call, without the consumer's time between items."""
    first, spent = time.monotonic(), 0.0
    iterator = iter(iterator)
    try:
        while True:
            t0 = time.monotonic()
            try:
                item = next(iterator)
            except StopIteration:
                spent += time.monotonic() - t0
                return
            spent += time.monotonic() - t0
            yield item
    finally:
        record.append((first, spent))


class Timings:
    """Per-call durations (start on the monotonic clock, seconds) of the functions wrapped with `timed`.

    A name's calls count once however they nest: a timed function called (on the same thread) inside another of
    the same name -- an encoder wrapped beside the message encoder it calls -- runs untimed."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float]]] = {}
        self._open = threading.local()   # .names: the names being timed on this thread

    def timed(self, name: str, fn: Callable) -> Callable:
        calls = self.calls.setdefault(name, [])
        open_ = self._open

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            names = open_.__dict__.setdefault("names", set())
            if name in names:
                return fn(*args, **kwargs)
            names.add(name)
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append((start, time.monotonic() - start))
                names.discard(name)

        return wrapper

    def timed_generator(self, name: str, fn: Callable[..., Iterator]) -> Callable[..., Iterator]:
        """fn returns an iterator: the time spent in each of its steps is summed into one call."""
        calls = self.calls.setdefault(name, [])

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return timed_iteration(fn(*args, **kwargs), calls)

        return wrapper


def side_by_side(repeats: int, ours: Callable[[], float], theirs: Callable[[], float] | None = None, *,
                 report: Callable[[int, dict[str, list[float]]], None] | None = None
                 ) -> tuple[dict[str, list[float]], list[float]]:
    """Measures `ours` and (when given) `theirs` `repeats` times, alternating which runs first so
    neither always meets a warmer or busier machine. Returns ({SYSTEM: [...], TORCH: [...]}, the
    ours / theirs ratio of each repeat); `report(repeat, runs)` after each repeat."""
    runs: dict[str, list[float]] = {SYSTEM: [], TORCH: []}
    ratios: list[float] = []
    for repeat in range(repeats):
        order = [SYSTEM, TORCH] if repeat % 2 == 0 else [TORCH, SYSTEM]
        for system in order:
            if system == SYSTEM:
                runs[SYSTEM].append(ours())
            elif theirs is not None:
                runs[TORCH].append(theirs())
        if theirs is not None:
            ratios.append(runs[SYSTEM][-1] / runs[TORCH][-1])
        if report is not None:
            report(repeat, runs)
    return runs, ratios


def emit_medians(runs: Mapping[str, list[float]], ratios: list[float], *, metric: str, ratio_metric: str,
                 size_mb: float, unit: str, digits: int, **extra: object) -> None:
    """One JSON line per system with the median of its runs, and one with the median ratio ours/torch."""
    for system, values in runs.items():
        if values:
            emit(system, metric, size_mb, median(values), unit, **extra, runs=[round(v, digits) for v in values])
    if ratios:
        emit(f"{SYSTEM}/{TORCH}", ratio_metric, size_mb, median(ratios), "x", **extra,
             runs=[round(r, 3) for r in ratios])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


#: glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, and the largest mmap threshold
#: glibc takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 1 << 30


def steady_heap() -> bool:
    """This process's glibc heap set to keep what it frees (blocks up to 32 MiB from the heap, never trimmed back to
    the system) -- what a user who runs torch on the CPU gets from the jemalloc or TCMalloc its performance tuning
    guide recommends; True where it took.

    torch's CPU tensors come from malloc, and glibc's default serves a large block by mmap and gives a freed heap top
    back: each step's activations then page-fault afresh, as the process's history allows. The zoo conv3d's torch
    step took 58-61 ms in some fresh processes and 40-44 in others, or after a larger model, or with these settings
    (2026-12-02). A peer at its best runs with them; the engine's onnxruntime arena keeps its memory either way. A
    no-op (False) off glibc."""
    import ctypes   # here: only the in-process benchmarks call it
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # the mmap threshold first: setting either turns glibc's sliding thresholds off, and the trim threshold alone
    # leaves the mmap one at 128 KiB -- every activation mapped afresh (the conv3d torch step 95 ms)
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


#: `steady_heap`'s settings for a child process, which glibc reads from its environment at start: every process a
#: benchmark starts, its own and its peers' alike (a torch RPC or DDP worker's tensors come from malloc too).
STEADY_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD_MAX), "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD)}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TF_CONFIG", None)   # a bench shard takes its settings from its flags only
    # TensorPipe's TCP transport (uv) listens on the interface named here: loopback only.
    env.setdefault("TP_SOCKET_IFNAME", "lo")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for name, value in STEADY_HEAP_ENV.items():   # each child keeps its freed heap blocks (steady_heap)
        env.setdefault(name, value)
    if extra:
        env.update(extra)
    return env


def start_shard(flags: Sequence[str], *, module: str = "ps_server", env: Mapping[str, str] | None = None,
                namespace: str | None = None, host: str = "127.0.0.1", name: str | None = None) -> Child:
    """One shard process (`python -P -m ps_server FLAGS --port 0`), after its READY line; `.ready["address"]`.
    With `namespace` (a host of `ps_bench.netns`), started there through its trampoline and bound to `host`,
    that host's address, in plaintext (`--insecure`: off loopback, on the benchmark's private network)."""
    args = ["--host", host, "--port", "0", "--log-level", "WARNING", *flags]
    started = [module, *args] if namespace is None else netns.trampoline(namespace, module, ["--insecure", *args])
    where = module if namespace is None else namespace
    return start_and_wait_ready(name or f"shard ({where})", [sys.executable, "-P", "-m", *started], SHARD_READY,
                                timeout=SHARD_START_TIMEOUT, env=child_env(env))


class Proc:
    """A ``python -P -m MODULE ARGS`` child whose output lines are collected; lines with a prefix are awaited.

    stdin is a pipe when `stdin` is true (for children driven by commands, see
    `send`), else /dev/null.
    """

    def __init__(self, name: str, module: str, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 stdin: bool = False) -> None:
        self.name = name
        self.argv = [sys.executable, "-P", "-m", module, *[str(a) for a in args]]
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=child_env(env),
                                      start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._drain, name=f"drain-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def wait_for(self, prefix: str, timeout: float) -> dict:
        """The JSON after the next line starting with `prefix`, waiting at most timeout s (RuntimeError otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.01, left)) if left > 0 else None
            except queue.Empty:
                line = None
            if line is None:
                why = f"exited with code {self.popen.poll()}" if left > 0 else f"said no {prefix.strip()} in {timeout:.0f} s"
                tail = "\n  ".join(self.seen[-25:])
                raise RuntimeError(f"{self.name} (pid {self.pid}) {why}; last output:\n  {tail}")
            self.seen.append(line)
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL, to this PID only (bounded); its exit code."""
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        return stop(self.popen, grace=grace)


def stop_all(children: Sequence[Child | Proc]) -> None:
    """Stops every child by PID, the last started first."""
    for child in reversed(children):
        if isinstance(child, Proc):
            child.stop()
        else:
            stop(child.popen)
