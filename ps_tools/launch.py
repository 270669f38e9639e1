"""The `ps-launch` command: a whole job -- N shards and M workers as separate local processes -- with one progress bar.

Before it starts anything it checks the job: the settings, the model file (a missing,
truncated or corrupt .onnx is named), the data, and the two against each other
(worker_client.preflight: labels in range of the model's classes, class labels for
cross_entropy, a batch no larger than a worker's share, ...), the metrics ports and the
TensorBoard writer. A job that cannot run ends there, with one line and exit status 2,
and no process started.

It then starts the shards (``python -P -m ps_server`` on port 0), reads each one's
``PS_SERVER_READY {json}`` line to learn its address, then starts the workers
(``python -P -m worker_client --events --servers ...``); -P keeps the user's working
directory off the children's sys.path, so a folder of the user's cannot shadow the
installed packages. Starting, reading and stopping the children is ps_common.process's.
Every child logs JSON lines (``--log-json``), which the launcher parses and shows:

* on a terminal, one live progress bar for the job (percentage, step/total, loss,
  samples/s, stale drops, test accuracy, elapsed time and ETA; tqdm), with warnings and
  errors above it; otherwise the same fields as one line every ``--print-every`` seconds;
* with ``--verbose``, also every process's INFO lines, the shards' READY lines and each
  worker's progress and evaluations (``[shard0]`` / ``[worker1]`` prefixes);
* with ``--log-json``, only JSON lines: its own and its children's records, each with a
  ``process`` field, and the progress as records with ``"event": "progress"``.

It ends with ONE JSON line on stdout -- the job's summary (`test_accuracy`, `steps`,
`seconds`, `samples_per_second`, ...). Everything else goes to stderr, so
``ps-launch ... | tail -1`` is the summary. ``--metrics-port BASE`` serves shard i's
metrics on BASE + i (printed), ``--tensorboard DIR`` writes the job's scalars,
``--record DIR`` writes run.json and plot.png.

It stops everything, workers first, by PID (SIGTERM, then SIGKILL after
``--stop-timeout``), when a child fails (and prints that child's last error), on Ctrl-C
or SIGTERM, and when the job runs past ``--timeout``. Children run in their own sessions
with ``--stop-with-parent``, so they also exit if the launcher is killed outright.

Exit status: 0 done; 1 the job failed while running (a process failed, the timeout, an
accuracy below ``--min-accuracy``); 2 a bad setting, model or data found before anything
started; 128 + N on signal N.

What blocks, and for how long: the shards' READY lines (``--ready-timeout``), the whole
job (``--timeout``), stopping (at most 2 x ``--stop-timeout`` per group: workers, then
shards), and quoting a failed child's last lines (`FAIL_DRAIN_TIMEOUT`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import json
import logging
import math
import os
import queue
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ps_common import jobconfig, process
from ps_common.errors import LaunchError, ProcessStartError, PSError
from ps_common.jobconfig import JobConfig, JobConfigError
from ps_common.process import ChildProcess, Output
from ps_server.cli import READY_PREFIX, server_config
from ps_common.scratch import ScratchDir
from ps_common.tls import AUTH_TOKEN_ENV, client_security, token_from
from ps_models.datasets import Dataset
from worker_client.cli import prepare_worker
from worker_client.engine.load import load_model
from worker_client.engine.session import placement
from worker_client.pipeline.cut import plan_stages, write_stages
from worker_client.pipeline.evaluate import PipelineEvaluator
from worker_client.tensorboard import ScalarWriter, eval_scalars, progress_scalars, require_writer
from worker_client.training import format_event

#: Lines of each child's output kept to show when it fails.
TAIL_LINES = 30
#: Longest wait for a finished worker's output pipes to drain.
DRAIN_TIMEOUT = 10.0
#: Longest wait for a failed child's last lines before quoting them.
FAIL_DRAIN_TIMEOUT = 2.0
#: How long one pass of the loop handles output while waiting for the shards' READY lines, in seconds.
READY_POLL_INTERVAL = 0.1
#: How long one pass of the loop handles output while the workers train, in seconds.
RUN_POLL_INTERVAL = 0.2
#: Shortest time between two writes of the job's TensorBoard scalars, in seconds.
TENSORBOARD_EVERY = 1.0
#: Guards divisions by a duration that may be 0.
MIN_SECONDS = 1e-9
#: The level of every line a child prints that is not a JSON log record (a traceback, a final error line).
PLAIN = "PLAIN"
#: Level numbers by name; PLAIN lines are always shown.
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
          "CRITICAL": logging.CRITICAL, PLAIN: logging.CRITICAL + 1}
#: The keys of a JSON log record that are not its fields.
RECORD_KEYS = ("ts", "level", "logger", "msg")


@dataclass
class Child:
    """One started process (ps_common.process.ChildProcess): its role and what it reported."""

    name: str                       # "shard0", "worker1"
    role: str                       # "shard" | "worker"
    index: int
    process: ChildProcess
    open_streams: int = 2           # stdout and stderr until their ends were handled (then every line was)
    result: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    start: dict[str, Any] | None = None
    finished_at: float | None = None
    last_error: str | None = None   # the last WARNING-or-worse line or plain line it printed

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def argv(self) -> list[str]:
        return self.process.argv

    @property
    def ready(self) -> dict[str, Any] | None:
        """The READY line's fields (shards), once it arrived."""
        return self.process.ready


def _now_iso() -> str:
    now = _dt.datetime.now(tz=_dt.timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _duration(seconds: float | None) -> str:
    """A duration for people: 42 s, 3 min 05 s, 1 h 02 min; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@dataclass
class Progress:
    """The job's progress as the bar and the progress lines show it."""

    done: int                        # global steps (or, for an epochs job, pushes of all workers)
    total: int | None
    unit: str                        # "step" | "push"
    loss: float | None
    samples_per_second: float
    stale_drops: int
    test_accuracy: float | None
    test_loss: float | None
    elapsed: float                   # seconds since the workers started training
    eta: float | None                # seconds left, from the rate so far

    @property
    def percent(self) -> float | None:
        return None if not self.total else min(100.0, 100.0 * self.done / self.total)

    def fields(self) -> dict[str, Any]:
        """As JSON fields (the --log-json progress record, the TensorBoard scalars)."""
        return {"step" if self.unit == "step" else "pushes": self.done, "total": self.total,
                "percent": None if self.percent is None else round(self.percent, 1),
                "loss": self.loss, "samples_per_second": round(self.samples_per_second, 1),
                "stale_drops": self.stale_drops, "test_accuracy": self.test_accuracy,
                "elapsed_seconds": round(self.elapsed, 1), "eta_seconds": None if self.eta is None else round(self.eta)}

    def postfix(self) -> str:
        """Loss, samples/s, stale drops and test accuracy, as the bar's and the lines' text."""
        parts = [f"loss {_fmt(self.loss, '.4f')}", f"{self.samples_per_second:,.0f} samples/s",
                 f"stale drops {self.stale_drops}"]
        if self.test_accuracy is not None:
            parts.append(f"test acc {self.test_accuracy:.4f}")
        elif self.test_loss is not None:
            parts.append(f"test loss {self.test_loss:.4f}")
        return " | ".join(parts)

    def line(self) -> str:
        """One progress line (no terminal): the same fields as the bar."""
        where = f"{self.unit} {self.done}" + (f"/{self.total}" if self.total else "")
        percent = f"{self.percent:3.0f}% | " if self.percent is not None else ""
        return (f"{percent}{where} | {self.postfix()} | {_duration(self.elapsed)} elapsed, "
                f"ETA {_duration(self.eta)}")


class Display:
    """Everything ps-launch writes to stderr: log lines (text or JSON) and the progress (a bar, lines or JSON).

    `threshold` is the lowest level shown (plain lines of a child are always shown). On a
    terminal (and without JSON) the progress is one tqdm bar, redrawn in place, with every
    other line printed above it; otherwise a line (or a JSON record) every `every` s.
    """

    def __init__(self, stream: TextIO, *, tty: bool, json_lines: bool, every: float, threshold: int) -> None:
        self.stream = stream
        self.tty = tty and not json_lines
        self.json = json_lines
        self.every = every
        self.threshold = threshold
        self.bar: Any = None
        self._printed_at = time.monotonic()

    def shows(self, level: str) -> bool:
        return LEVELS.get(level, logging.INFO) >= self.threshold

    def record(self, process_name: str, level: str, msg: str, fields: dict[str, Any] | None = None,
               *, logger: str = "ps_tools.launch", ts: str | None = None, always: bool = False) -> None:
        """One log line of `process_name` ("launch", "shard0", ...), when its level is shown (or `always`)."""
        if not always and not self.shows(level):
            return
        if self.json:
            entry = {"ts": ts or _now_iso(), "level": "ERROR" if level == PLAIN else level, "logger": logger,
                     "msg": msg, "process": process_name, **(fields or {})}
            self._write(json.dumps(entry, default=repr, ensure_ascii=False))
            return
        tag = "" if level in ("INFO", "DEBUG", PLAIN) else f"{level}: "
        self._write(f"[{process_name}] {tag}{msg}")

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, p: Progress | None, *, force: bool = False) -> None:
        """Shows the progress: the bar redrawn, or a line / JSON record when `every` s passed (or `force`)."""
        if p is None:
            return
        if self.tty:
            self._draw(p)
            return
        now = time.monotonic()
        if not force and now - self._printed_at < self.every:
            return
        self._printed_at = now
        if self.json:
            self._write(json.dumps({"ts": _now_iso(), "level": "INFO", "logger": "ps_tools.launch",
                                    "msg": p.line(), "process": "launch", "event": "progress", **p.fields()}))
        else:
            self._write("[launch] " + p.line())

    def _draw(self, p: Progress) -> None:
        if self.bar is None:
            self.bar = _bar(p, self.stream)
        if p.done > self.bar.n:
            self.bar.update(p.done - self.bar.n)   # tqdm's rate, hence its ETA, follows the updates
        self.bar.stats = p.postfix()
        self.bar.refresh()

    def close(self) -> None:
        """Leaves the bar as it last was (its final state stays on the screen)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _bar(p: Progress, stream: TextIO) -> Any:
    """A tqdm bar for the job: percentage, steps done of the total, the ETA, then the job's numbers (`stats`)."""
    from tqdm import tqdm

    class JobBar(tqdm):  # type: ignore[misc]
        """tqdm's documented way to show fields of one's own: the bar format reads them from format_dict."""

        stats = ""

        @property
        def format_dict(self) -> dict[str, Any]:
            return {**super().format_dict, "stats": self.stats}

    known = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}s | ETA {remaining} | {stats}"
    return JobBar(total=p.total, file=stream, unit=p.unit, dynamic_ncols=True, leave=True, smoothing=0.1,
                  mininterval=0.2, bar_format=known if p.total else "{n_fmt} {unit}s | {elapsed} | {stats}")


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


def _mean(values) -> float | None:
    """The mean of the values that are not None (None when none is)."""
    present = [v for v in values if v is not None]
    return round(sum(present) / len(present), 1) if present else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def display_level(config: JobConfig) -> str:
    """The lowest level ps-launch shows and its children log: --log-level when given, else WARNING (INFO: --verbose)."""
    if config.source("job.log_level") != "default":
        return config.job.log_level
    return "INFO" if config.launch.verbose else "WARNING"


def check_port_free(port: int, what: str) -> None:
    """JobConfigError naming the port and the fix when something on 127.0.0.1 already listens on it."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return   # let the shard say what else is wrong
            raise JobConfigError(f"Invalid [server] metrics_port (--metrics-port): {what} needs port {port} on "
                                 f"127.0.0.1, which is in use: choose another --metrics-port (0 picks a free port "
                                 f"for each shard)") from None


class Launcher:
    """Runs one job; `prepare()` checks it (errors: exit 2), `run()` returns the process exit status."""

    def __init__(self, config: JobConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.config = config
        self.stdout = stdout if stdout is not None else sys.stdout   # read at call time (tests replace them)
        self.stderr = stderr = stderr if stderr is not None else sys.stderr
        self.level = display_level(config)
        self.display = Display(stderr, tty=stderr.isatty(), json_lines=config.job.log_json,
                               every=config.launch.print_every, threshold=LEVELS[self.level])
        self.children: list[Child] = []
        self.lines: queue.Queue[tuple[str, Output]] = queue.Queue()   # (child name, line), from the readers
        self._by_name: dict[str, Child] = {}
        self.evaluations: list[dict[str, Any]] = []
        self.progress: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.training_started: float | None = None
        self.deadline = self.started + config.launch.timeout
        self._scratch = ScratchDir("ps-launch")
        self.model_path: Path | None = None
        self.dataset: Dataset | None = None
        self.stage_plan: Path | None = None      # pipeline jobs: the stage models and stages.json
        self.rendezvous: Path | None = None      # ... where the stage workers find each other
        self.evaluation: dict[str, Any] | None = None   # ... the launcher's final evaluation of the whole model
        self._evaluator: PipelineEvaluator | None = None   # ... its evaluator, open while the stages train
        self._eval_bucket = 0                               # ... the last eval_every bucket evaluated
        self.tensorboard: ScalarWriter | None = None
        self._tb_written_at = 0.0
        self._tb_step = -1

    # ------------------------------------------------------------------ checks before anything starts

    def prepare(self) -> None:
        """Checks the model, the data, their fit, the metrics ports and TensorBoard; raises the error to show.

        Builds the workers' gradient graph once (cached on disk, so the workers find it), on
        the CPU: the device itself is each worker's to check.
        """
        c = self.config
        prepared = prepare_worker(c, Path(self._scratch.name), device="cpu")
        self.model_path = prepared.model_path
        self.dataset = prepared.dataset
        placement(c.worker.device)   # the workers' device: DeviceUnavailableError naming what to install
        if c.job.stages > 1:   # cut once; every stage worker reads only its own stage's model
            model = load_model(self.model_path)
            plan = plan_stages(model, c.job.stages, cuts=c.job.cuts, loss=c.worker.loss, include=c.worker.include,
                               exclude=c.worker.exclude, source=str(self.model_path))
            self.stage_plan = Path(self._scratch.name) / "stages"
            write_stages(model, plan, self.stage_plan)
            self.rendezvous = Path(self._scratch.name) / "rendezvous"
            self.rendezvous.mkdir()
            self._say(f"pipeline: {plan.count} stages, cut after "
                      + ", ".join(repr(s.sends) for s in plan.stages[:-1])
                      + "; cost shares " + ", ".join(f"{x:.2f}" for x in plan.costs), stages=plan.count,
                      cuts=[s.sends for s in plan.stages[:-1]], costs=plan.costs)
        base = c.server.metrics_port
        if base:
            for i in range(c.job.shards * c.job.stages):
                check_port_free(base + i, f"shard {i}'s metrics endpoint (--metrics-port {base} + {i})")
        if c.worker.tensorboard:
            require_writer()
            self.tensorboard = ScalarWriter(c.worker.tensorboard)

    # ------------------------------------------------------------------ processes

    def _say(self, text: str, level: str = "INFO", *, always: bool = False, **fields: Any) -> None:
        """A line of the launcher's own; `always`: one a user must see at any level (the job, where, the result)."""
        self.display.record("launch", level, text, fields, always=always)

    def _start(self, name: str, role: str, index: int, argv: list[str]) -> Child:
        """Starts one child; its output lines arrive in self.lines (LaunchError when it cannot start)."""
        try:
            started = ChildProcess(name, argv, env=process.child_env(drop=[jobconfig.TF_CONFIG_ENV]),  # a local cluster
                                   ready_prefix=READY_PREFIX if role == "shard" else None, events=role == "worker",
                                   keep_events=False, sink=lambda child, output: self.lines.put((child.name, output)),
                                   tail_lines=TAIL_LINES)
        except ProcessStartError as exc:
            raise LaunchError(str(exc)) from exc
        child = self._by_name[name] = Child(name, role, index, started)
        self.children.append(child)
        return child

    def _logging_flags(self) -> list[str]:
        """Every child logs JSON lines (parsed here) at the level the launcher shows."""
        return ["--log-json", "--log-level", self.level]

    def shard_argv(self, index: int, stage: int | None = None) -> list[str]:
        """A shard's command line; a pipeline job's stage `stage` has shards of its own (their own checkpoint
        folders and metrics ports: the stage's shards come after the earlier stages')."""
        c = self.config
        number = index if stage is None else stage * c.job.shards + index
        skip = ("server.shard_index", "server.host", "server.port", "server.metrics_port", "server.checkpoint_dir",
                "job.stop_with_parent", "job.log_json", "job.log_level")
        argv = process.python_module_argv(
            "ps_server", *jobconfig.to_argv(c, scope="server", skip=skip), *self._logging_flags(),
            "--shard-index", str(index), "--host", "127.0.0.1", "--port", "0", "--stop-with-parent")
        if c.server.checkpoint_dir is not None:   # a checkpoint folder belongs to one shard
            folder = Path(c.server.checkpoint_dir) if stage is None else Path(c.server.checkpoint_dir) / f"stage{stage}"
            argv += ["--checkpoint-dir", str(folder / f"shard{index}")]
        if c.server.metrics_port is not None:   # one port each: the base plus the shard's number (0: any)
            argv += ["--metrics-port", str(c.server.metrics_port + number if c.server.metrics_port else 0)]
        return argv

    def worker_argv(self, index: int, addresses: list[str], model_path: str) -> list[str]:
        c = self.config
        skip = ("worker.index", "worker.worker_id", "worker.servers", "worker.events", "worker.model",
                "job.stop_with_parent", "worker.intra_op_threads", "job.log_json", "job.log_level",
                "worker.tensorboard", "worker.tensorboard_every_worker")
        processes = (c.job.workers or 1) * c.job.stages
        threads = c.worker.intra_op_threads or max(1, (os.cpu_count() or 1) // processes)
        argv = process.python_module_argv(
            "worker_client", *jobconfig.to_argv(c, scope="worker", skip=skip), *self._logging_flags(),
            "--model", model_path, "--worker-index", str(index), "--servers", ",".join(addresses),
            "--intra-op-threads", str(threads), "--events", "--stop-with-parent")
        if c.worker.tensorboard and c.worker.tensorboard_every_worker:   # DIR/worker<i>; the job's scalars in DIR
            argv += ["--tensorboard", c.worker.tensorboard, "--tensorboard-every-worker"]
        return argv

    def stage_argv(self, replica: int, stage: int, addresses: list[str]) -> list[str]:
        """Stage `stage` of replica `replica`: its own stage model, its stage's shards, the rendezvous folder."""
        assert self.stage_plan is not None and self.rendezvous is not None and self.model_path is not None
        argv = self.worker_argv(replica, addresses, str(self.model_path))
        return argv + ["--stage", str(stage), "--stage-plan", str(self.stage_plan),
                       "--stage-rendezvous", str(self.rendezvous), "--worker-id", f"replica{replica}-stage{stage}"]

    # ------------------------------------------------------------------ output

    def _handle(self, name: str, output: Output) -> None:
        child = self._by_name[name]
        if output.kind == process.CLOSED:
            child.open_streams -= 1
            return
        if output.kind == process.READY:
            if output.data is None:
                raise LaunchError(child.process.describe(child.process.ready_error or "printed a malformed READY line"))
            self._say(f"{child.name} ready at {output.data.get('address')} (pid {child.pid})", process_pid=child.pid,
                      shard=child.index, address=output.data.get("address"))
            return
        if output.kind == process.EVENT and output.data is not None:
            self._on_event(child, dict(output.data))
            return
        self._on_line(child, output.text)

    def _on_line(self, child: Child, text: str) -> None:
        """A child's log line: a JSON record (shown by its level, with its fields) or plain text (always shown)."""
        record: Any = None
        if text.startswith("{"):
            try:
                record = json.loads(text)
            except ValueError:
                record = None
        if isinstance(record, dict) and "msg" in record and "level" in record:
            level = str(record["level"])
            fields = {k: v for k, v in record.items() if k not in RECORD_KEYS}
            if LEVELS.get(level, 0) >= logging.WARNING:
                child.last_error = str(record["msg"])
            self.display.record(child.name, level, str(record["msg"]), fields, logger=str(record.get("logger", "")),
                                ts=record.get("ts"))
            return
        if text.strip():
            child.last_error = text.strip()
        self.display.record(child.name, PLAIN, text)

    def _on_event(self, child: Child, event: dict[str, Any]) -> None:
        """Takes a worker's JSON event; shows it (--verbose) in the worker's own wording (format_event)."""
        kind = event.pop("event")
        fields = {k: v for k, v in event.items() if k != "time"}
        if kind == "progress":
            child.progress = event
            self.progress.append(event)
        elif kind == "eval":
            self.evaluations.append(event)
            if self.tensorboard is not None:
                self.tensorboard.scalars(event["step"], eval_scalars(event))
        elif kind == "done":
            child.result = event
        elif kind == "start":
            child.start = event
            child.progress = {**event, "loss": None, "samples_per_second": 0.0, "stale_drops": 0, "iteration": 0}
            if self.training_started is None:
                self.training_started = time.monotonic()
        self.display.record(child.name, "INFO", format_event(kind, event), {"event": kind, **fields},
                            logger="worker_client.training")

    def current_progress(self) -> Progress | None:
        """The job's progress from the workers' latest reports (None before the first worker started)."""
        workers = [c for c in self.children if c.role == "worker"]
        reports = [c.result or c.progress for c in workers if c.result or c.progress]
        if not reports or self.training_started is None:
            return None
        c = self.config
        step = max(r.get("step", r.get("steps", 0)) or 0 for r in reports)
        step = max([step] + [e.get("step", 0) for e in self.evaluations[-1:]])   # evaluations come between reports
        losses = [r["loss"] for r in reports if r.get("loss") is not None]
        if all(w.result for w in workers):
            seconds = max(w.result["seconds"] for w in workers if w.result)
            rate = sum(w.result["samples"] for w in workers if w.result) / max(seconds, MIN_SECONDS)
        else:
            rate = sum((w.progress or {}).get("samples_per_second", 0.0) for w in workers if w.result is None)
        stale = sum(r.get("stale_drops", 0) for r in reports)
        last_eval = self.evaluations[-1] if self.evaluations else {}
        elapsed = time.monotonic() - self.training_started
        if c.worker.steps:
            done, total, unit = min(step, c.worker.steps), c.worker.steps, "step"
            start = min((w.start or {}).get("step", 0) for w in workers)
        else:   # an epochs job: each worker pushes epochs x its batches per epoch
            starts = [w.start for w in workers if w.start]
            total = sum(s["batches_per_epoch"] * (s.get("epochs") or 1) for s in starts) if starts else None
            done = sum(int((w.result or w.progress or {}).get("clock", 0) or 0) for w in workers)
            unit, start = "push", sum(int(s.get("clock", 0)) for s in starts)
            if total and len(starts) < len(workers):
                total = None
        eta = None
        if total and done > start and elapsed > 0:
            eta = (total - done) * elapsed / (done - start)
        if all(w.result for w in workers):
            eta = 0.0
        return Progress(done=done, total=total, unit=unit, loss=sum(losses) / len(losses) if losses else None,
                        samples_per_second=rate, stale_drops=stale,
                        test_accuracy=last_eval.get("test_accuracy"), test_loss=last_eval.get("test_loss"),
                        elapsed=elapsed, eta=eta)

    def _write_scalars(self, p: Progress | None) -> None:
        if self.tensorboard is None or p is None or p.unit != "step":
            return
        now = time.monotonic()
        if p.done != self._tb_step and now - self._tb_written_at >= TENSORBOARD_EVERY:
            self.tensorboard.scalars(p.done, progress_scalars(p.fields()))
            self._tb_step, self._tb_written_at = p.done, now

    def _pump_once(self, timeout: float) -> None:
        """Handles the output lines that arrive within timeout s, then refreshes the progress."""
        end = time.monotonic() + timeout
        while True:
            try:
                item = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(*item)
            if time.monotonic() >= end:
                break
        p = self.current_progress()
        self.display.progress(p)
        self._write_scalars(p)

    def _check_time(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise LaunchError(f"the job ran past --timeout {self.config.launch.timeout:g} s while {what}")

    def _fail(self, child: Child, why: str) -> LaunchError:
        """A LaunchError naming the child and its last error (read for at most FAIL_DRAIN_TIMEOUT s).

        With --verbose, its argv and last lines too.
        """
        drain_end = time.monotonic() + FAIL_DRAIN_TIMEOUT
        while child.open_streams > 0 and time.monotonic() < drain_end:
            try:
                self._handle(*self.lines.get(timeout=READY_POLL_INTERVAL))
            except queue.Empty:
                pass
        if self.config.launch.verbose:
            return LaunchError(child.process.describe(why))
        last = f": {child.last_error}" if child.last_error else " (it printed no error; --verbose shows its argv and last lines)"
        return LaunchError(f"{child.name} (pid {child.pid}) {why}{last}")

    def _check_children(self, *, shards_only: bool = False) -> None:
        for child in self.children:
            code = child.process.returncode
            if code is None:
                continue
            if child.role == "shard":
                raise self._fail(child, f"exited with code {code} while the job was running")
            if shards_only:
                continue
            if code != 0:
                raise self._fail(child, f"failed with exit code {code}")
            if child.finished_at is None:
                child.finished_at = time.monotonic()

    # ------------------------------------------------------------------ phases

    def start_shards(self) -> list[str]:
        """Starts every shard and waits for all READY lines (at most --ready-timeout); their addresses in order.

        A pipeline job's stages each have `shards` shards: the addresses are stage by stage."""
        c = self.config
        if c.job.stages > 1:
            shards = [self._start(f"stage{k}-shard{i}", "shard", k * c.job.shards + i, self.shard_argv(i, k))
                      for k in range(c.job.stages) for i in range(c.job.shards)]
        else:
            shards = [self._start(f"shard{i}", "shard", i, self.shard_argv(i)) for i in range(c.job.shards)]
        ready_deadline = time.monotonic() + self.config.launch.ready_timeout
        while any(s.ready is None for s in shards):
            self._pump_once(READY_POLL_INTERVAL)
            self._check_children(shards_only=True)
            if time.monotonic() > ready_deadline:
                late = next(s for s in shards if s.ready is None)
                raise self._fail(late, f"printed no READY line within --ready-timeout "
                                       f"{self.config.launch.ready_timeout:g} s")
            self._check_time("waiting for the shards' READY lines")
        if self.config.server.metrics_port is not None:
            where = [f"http://127.0.0.1:{s.ready['metrics_port']}/metrics" for s in shards
                     if s.ready and s.ready.get("metrics_port")]
            self._say("metrics: " + ", ".join(f"shard{i} {url}" for i, url in enumerate(where)), always=True,
                      metrics=where)
        return [str(s.ready["address"]) for s in shards if s.ready]

    def run_workers(self, addresses: list[str]) -> None:
        """Starts every worker and waits until all finished with a result (or one fails, or the timeout)."""
        assert self.model_path is not None, "prepare() first"
        c = self.config
        if c.job.stages > 1:   # replica r's stage k trains against stage k's shards
            groups = [addresses[k * c.job.shards:(k + 1) * c.job.shards] for k in range(c.job.stages)]
            self._evaluator = self._open_evaluator(groups)
            workers = [self._start(f"replica{r}-stage{k}", "worker", r, self.stage_argv(r, k, groups[k]))
                       for r in range(c.job.workers or 1) for k in range(c.job.stages)]
        else:
            workers = [self._start(f"worker{i}", "worker", i, self.worker_argv(i, addresses, str(self.model_path)))
                       for i in range(c.job.workers or 1)]
        while True:
            self._pump_once(RUN_POLL_INTERVAL)
            self._check_children()
            if self._evaluator is not None:
                self._evaluate_pipeline_when_due()
            if all(w.finished_at is not None and (w.open_streams == 0 or
                                                  time.monotonic() - w.finished_at > DRAIN_TIMEOUT)
                   for w in workers):
                break
            self._check_time("the workers were training")
        for worker in workers:
            if worker.result is None:
                raise self._fail(worker, "exited without reporting a result (no \"done\" event)")
        p = self.current_progress()
        self.display.progress(p, force=True)
        if p is not None and self.tensorboard is not None and p.unit == "step":
            self.tensorboard.scalars(p.done, progress_scalars(p.fields()))
        if self._evaluator is not None:
            self.evaluate_pipeline()

    def _open_evaluator(self, groups: list[list[str]]) -> PipelineEvaluator:
        """The launcher's evaluator of a pipeline job's whole model (no stage worker holds it)."""
        c = self.config
        assert self.model_path is not None and self.dataset is not None
        credentials, metadata = client_security(c.worker.tls_ca, c.worker.tls_cert, c.worker.tls_key,
                                                token_from(c.job.auth_token_file, env_var=AUTH_TOKEN_ENV))
        try:
            return PipelineEvaluator(self.model_path, groups, self.dataset, timeout=c.job.wait_timeout,
                                     channel_credentials=credentials, call_metadata=metadata)
        except (PSError, ValueError) as exc:
            raise LaunchError(f"cannot evaluate the pipeline's whole model {self.model_path}: {exc}") from exc

    def _evaluate_pipeline_when_due(self) -> None:
        """Every eval_every global steps of a pipeline job (stage 0's, asked of its first shard), the whole
        model's test metrics, as worker 0 reports them in a data-parallel job; the final evaluation covers
        the last step."""
        every, steps = self.config.worker.eval_every, self.config.worker.steps
        if not every or self.training_started is None:
            return
        assert self._evaluator is not None
        try:
            step = self._evaluator.step()
            if step // every <= self._eval_bucket or (steps and step >= steps):
                return
            self._eval_bucket = step // every
            record = self._evaluator.evaluate()
        except (PSError, ValueError) as exc:   # a shard restarting, say: the next one may do; the final one must
            self._say(f"evaluating the whole model mid-job failed (training goes on): {exc}", "WARNING")
            return
        self._record_pipeline_evaluation(record, final=False)

    def _record_pipeline_evaluation(self, evaluation: dict[str, Any], *, final: bool) -> None:
        record = {**evaluation, "final": final,
                  "elapsed": round(time.monotonic() - (self.training_started or self.started), 3)}
        self.evaluations.append(record)
        if self.tensorboard is not None:
            self.tensorboard.scalars(record["step"], eval_scalars(record))
        self._say(f"whole model at step {record['step']}{' (final)' if final else ''}: test accuracy "
                  f"{_fmt(record.get('test_accuracy'), '.4f')}, test loss {_fmt(record.get('test_loss'), '.4g')}",
                  **record)

    def evaluate_pipeline(self) -> None:
        """The whole model's test metrics at the stages' final parameters (no stage worker holds them all)."""
        assert self._evaluator is not None
        try:
            record = self._evaluator.evaluate()
        except (PSError, ValueError) as exc:
            raise LaunchError(f"evaluating the pipeline's final parameters failed: {exc}") from exc
        finally:
            self._evaluator.close()
        self.evaluation = {k: v for k, v in record.items() if k != "step"}
        self._record_pipeline_evaluation(record, final=True)

    def stop_all(self) -> None:
        """Stops every child still running, workers first: SIGTERM, then SIGKILL after --stop-timeout (by PID)."""
        grace = self.config.launch.stop_timeout

        def killing(p: ChildProcess) -> None:
            self._say(f"{p.name} (pid {p.pid}) did not stop within {grace:g} s; killing it", "WARNING")

        for role in ("worker", "shard"):
            group = [c.process for c in self.children if c.role == role]
            for p in process.stop_all(group, grace=grace, on_kill=killing):
                self._say(f"{p.name} (pid {p.pid}) survived SIGKILL for {grace:g} s", "ERROR")
        # show what the children said while stopping
        while True:
            try:
                name, output = self.lines.get_nowait()
            except queue.Empty:
                break
            if output.kind == process.LINE:
                self._on_line(self._by_name[name], output.text)

    def summary(self) -> dict[str, Any]:
        """The job's result: the fields of the final JSON line."""
        c = self.config
        results = [w.result for w in self.children if w.role == "worker" and w.result]
        chief = next((r for r in results if r.get("worker") == 0 and r.get("stage", 0) == 0),
                     results[0] if results else {})
        if self.evaluation is not None:   # a pipeline job: the launcher evaluated the whole model
            chief = {**chief, **self.evaluation}
        samples = sum(r["samples"] for r in results)
        train_seconds = max((r["seconds"] for r in results), default=0.0)
        return {
            "test_accuracy": chief.get("test_accuracy"), "test_loss": chief.get("test_loss"),
            "test_auc": chief.get("test_auc"),
            # per worker step, averaged over the workers: tensor bytes (rows and ids for sparse tables)
            "bytes_pulled_per_step": _mean(r.get("bytes_pulled_per_step") for r in results),
            "bytes_pushed_per_step": _mean(r.get("bytes_pushed_per_step") for r in results),
            "unique_rows_per_step": _mean(r.get("unique_rows_per_step") for r in results),
            "steps": chief.get("steps"), "seconds": round(time.monotonic() - self.started, 3),
            "train_seconds": train_seconds, "samples_per_second": round(samples / max(train_seconds, MIN_SECONDS), 1),
            "samples": samples, "mode": c.job.mode, "workers": c.job.workers, "shards": c.job.shards,
            "replicas_to_aggregate": c.job.replicas_to_aggregate if c.job.mode == "sync" else None,
            "stale_drops": sum(r["stale_drops"] for r in results), "dropped": sum(r["dropped"] for r in results),
            "batch_size": c.worker.batch_size, "optimizer": c.server.optimizer, "lr": c.server.lr,
            "model": c.worker.model, "data": c.worker.data,
            "record": str(Path(c.launch.record).resolve()) if c.launch.record else None,
            "tensorboard": str(Path(c.worker.tensorboard).resolve()) if c.worker.tensorboard else None,
            "stages": c.job.stages, **self._pipeline_summary(results),
        }

    def _pipeline_summary(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """A pipeline job's per-stage figures: micro-batches, parameter bytes, peak memory, abandoned steps."""
        if self.config.job.stages <= 1:
            return {}
        by_stage: dict[int, list[dict[str, Any]]] = {}
        for r in results:
            by_stage.setdefault(int(r.get("stage", 0)), []).append(r)
        stages = range(self.config.job.stages)
        return {
            "micro_batches": next((r.get("micro_batches") for r in results), None),
            "shard_processes": self.config.job.shards * self.config.job.stages,
            "stage_parameter_bytes": [max((r.get("parameter_bytes", 0) for r in by_stage.get(k, [])), default=None)
                                      for k in stages],
            "stage_peak_rss_mb": [max((r.get("peak_rss_mb", 0) for r in by_stage.get(k, [])), default=None)
                                  for k in stages],
            "abandoned_steps": sum(r.get("abandoned_steps", 0) for r in results),
        }

    def run(self) -> int:
        """The whole job; the exit status: 0, 1 (a failure, timeout or accuracy below --min-accuracy), 128+signal."""
        try:
            return self._run()
        finally:
            if self._evaluator is not None:   # a pipeline job that failed or was stopped while training
                self._evaluator.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            self._scratch.cleanup()   # the bundled model written for the workers

    def close(self) -> None:
        """Releases what prepare() made, for a job that never ran."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        self._scratch.cleanup()

    def _run(self) -> int:
        received: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if not received:
                received.append(signum)
                raise KeyboardInterrupt

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        c = self.config
        self._say(f"{c.job.mode} job: {c.job.shards} shard(s), {c.job.workers} worker(s); model {c.worker.model}, "
                  f"data {c.worker.data}; {c.server.optimizer} lr {c.server.lr:g}", always=True,
                  mode=c.job.mode, shards=c.job.shards, workers=c.job.workers, model=c.worker.model,
                  data=c.worker.data)
        try:
            addresses = self.start_shards()
            self.run_workers(addresses)
        except LaunchError as exc:
            self.display.close()
            self._say(str(exc), "ERROR")
            self.stop_all()
            return 1
        except KeyboardInterrupt:
            self.display.close()
            name = signal.Signals(received[0]).name if received else "SIGINT"
            self._say(f"received {name}: stopping every process", "WARNING")
            self.stop_all()
            return 128 + (received[0] if received else signal.SIGINT)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self.display.close()
        self.stop_all()
        summary = self.summary()
        if c.launch.record:
            try:
                write_record(Path(c.launch.record), summary=summary, launcher=self)
            except OSError as exc:
                self._say(f"cannot write the record to --record {c.launch.record}: {exc}", "ERROR")
                self.stdout.write(json.dumps(summary) + "\n")
                return 1
        result = (f"test accuracy {_fmt(summary['test_accuracy'], '.4f')}" if summary["test_accuracy"] is not None
                  else f"test loss {_fmt(summary['test_loss'], '.4f')}")
        saved = [f"record in {c.launch.record}"] if c.launch.record else []
        saved += [f"TensorBoard: tensorboard --logdir {c.worker.tensorboard}"] if c.worker.tensorboard else []
        self._say(f"done: {result} after {summary['steps']} steps in {summary['seconds']:.1f} s; "
                  f"{summary['samples_per_second']:,.0f} samples/s, {summary['stale_drops']} stale drop(s)"
                  + "".join(f"; {s}" for s in saved), always=True,
                  **{k: summary[k] for k in ("test_accuracy", "test_loss", "steps", "seconds", "samples_per_second",
                                             "stale_drops")})
        status = 0
        if c.launch.min_accuracy is not None and not (summary["test_accuracy"] or 0.0) >= c.launch.min_accuracy:
            self._say(f"test accuracy {_fmt(summary['test_accuracy'], '.4f')} is below --min-accuracy "
                      f"{c.launch.min_accuracy:g}", "ERROR")
            status = 1
        self.stdout.write(json.dumps(summary) + "\n")
        self.stdout.flush()
        return status


def write_record(directory: Path, *, summary: dict[str, Any], launcher: Launcher) -> None:
    """DIR/run.json (summary, settings, processes, worker results, evaluations, progress) and DIR/plot.png.

    Without matplotlib (the ``demo`` extra) there is no plot: one line says so and how to get it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "summary": summary,
        "settings": launcher.config.as_dict(),
        "processes": [{"name": c.name, "pid": c.pid, "argv": c.argv, "exit_code": c.process.returncode}
                      for c in launcher.children],
        "workers": [c.result for c in launcher.children if c.role == "worker"],
        "evaluations": launcher.evaluations,
        "progress": launcher.progress,
    }
    tmp = directory / "run.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    tmp.replace(directory / "run.json")
    try:
        plot_run(record, directory / "plot.png")
    except ImportError as exc:   # matplotlib is an extra: without it the record lacks only its plot
        launcher._say(f"no plot in {directory} ({exc}): install matplotlib (pip install 'onnx-ps[demo]')",
                      "WARNING", always=True)


def short_name(spec: str | None) -> str:
    """A model's or data set's name for a title: a file's stem, a bundled name, a synthetic kind; not a path."""
    if not spec:
        return "?"
    if spec.startswith("synthetic:"):
        return spec.split("?", 1)[0]
    path = Path(spec)
    return path.stem if path.suffix in (".onnx", ".npz") or "/" in spec or os.sep in spec else spec


def plot_run(record: dict[str, Any], path: Path) -> None:
    """Loss (training and test) and the test accuracy (regression: the test loss) over the global step, as a PNG."""
    import matplotlib.pyplot as plt

    fig = plot_figure(record)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_figure(record: dict[str, Any]) -> Any:
    """The plot of a run record (see plot_run) as a matplotlib figure (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, evals = record["summary"], record["evaluations"]
    fig, (ax_loss, ax_test) = plt.subplots(1, 2, figsize=(11, 4.4))
    workers = sorted({p["worker"] for p in record["progress"]})
    for worker in workers:
        points = [(p["step"], p["loss"]) for p in record["progress"] if p["worker"] == worker and p["loss"] is not None]
        if points:
            ax_loss.plot(*zip(*points), ".", alpha=0.5, label=f"worker {worker}: training loss (mean per report)")
    train = [(e["step"], e["train_loss"]) for e in evals if e.get("train_loss") is not None]
    test = [(e["step"], e["test_loss"]) for e in evals if e.get("test_loss") is not None]
    if train:
        ax_loss.plot(*zip(*train), "-", label="worker 0: training loss (mean since the last evaluation)")
    if test:
        ax_loss.plot(*zip(*test), "-o", markersize=3, label="test loss (whole test split)")
    ax_loss.set_xlabel("global step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    accuracy = [(e["step"], e["test_accuracy"]) for e in evals if e.get("test_accuracy") is not None]
    if accuracy:
        ax_test.plot(*zip(*accuracy), "-o", markersize=3, color="tab:green")
        ax_test.set_ylabel("test accuracy")
        ax_test.set_ylim(0, 1)
        ax_test.set_title(f"final test accuracy {_fmt(summary.get('test_accuracy'), '.4f')}", fontsize=10)
    else:   # regression (or a loss of the model's own): the test loss is what there is to watch
        if test:
            ax_test.plot(*zip(*test), "-o", markersize=3, color="tab:red")
            ax_test.set_yscale("log")
        ax_test.set_ylabel("test loss")
        ax_test.set_title(f"final test loss {_fmt(summary.get('test_loss'), '.4g')}", fontsize=10)
    ax_test.set_xlabel("global step")
    ax_test.grid(True, alpha=0.3)
    fig.suptitle(f"{short_name(summary['model'])} on {short_name(summary['data'])}", fontsize=13)
    fig.text(0.5, 0.915, f"{summary['mode']}, {summary['workers']} worker(s), {summary['shards']} shard(s), "
                         f"{summary['optimizer']} lr {summary['lr']:g}, batch {summary['batch_size']}, "
                         f"{summary['samples_per_second']:,.0f} samples/s", ha="center", fontsize=9, color="dimgray")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


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


if __name__ == "__main__":
    sys.exit(main())
