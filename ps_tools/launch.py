"""The `ps-launch` command: a whole job -- N shards and M workers as separate local processes -- with one progress line.

The launcher starts the shards (``python -P -m ps_server`` on port 0), reads each one's
``PS_SERVER_READY {json}`` line to learn its address, then starts the workers
(``python -P -m worker_client --events --servers ...``); -P keeps the user's working
directory off the children's sys.path, so a folder of the user's cannot shadow the
installed packages. Starting, reading and stopping the children is ps_common.process's.
It streams every child's log lines with a ``[shard0]`` / ``[worker1]`` prefix, keeps one
progress line for the job (step, loss, samples/s, stale drops: updated in place on a
terminal, printed every ``--print-every`` seconds otherwise), and ends with ONE JSON line
on stdout -- the job's summary (`test_accuracy`, `steps`, `seconds`, `samples_per_second`,
...). Everything else goes to stderr, so ``ps-launch ... | tail -1`` is the summary.

It stops everything, workers first, by PID (SIGTERM, then SIGKILL after
``--stop-timeout``), when a child fails (and prints that child's last lines), on Ctrl-C
or SIGTERM, and when the job runs past ``--timeout``. Children run in their own sessions
with ``--stop-with-parent``, so they also exit if the launcher is killed outright.

What blocks, and for how long: the shards' READY lines (``--ready-timeout``), the whole
job (``--timeout``), stopping (at most 2 x ``--stop-timeout`` per group: workers, then
shards), and quoting a failed child's last lines (`FAIL_DRAIN_TIMEOUT`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ps_common import jobconfig, process
from ps_common.errors import LaunchError, ProcessStartError
from ps_common.jobconfig import JobConfig, JobConfigError
from ps_common.process import ChildProcess, Output
from ps_server.cli import READY_PREFIX, server_config
from worker_client.cli import resolve_model
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
#: Returns to the start of the terminal line and clears it (the status line is redrawn there).
CLEAR_LINE = "\r\x1b[K"
#: Guards divisions by a duration that may be 0.
MIN_SECONDS = 1e-9


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
    finished_at: float | None = None

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


class StatusLine:
    """One job-wide status line on `stream`: redrawn in place on a terminal, printed periodically otherwise."""

    def __init__(self, stream: TextIO, *, tty: bool, every: float) -> None:
        self.stream = stream
        self.tty = tty
        self.every = every
        self.text = ""
        self._printed_at = time.monotonic()

    def log(self, line: str) -> None:
        """Prints a log line above the status line."""
        if self.tty and self.text:
            self.stream.write(CLEAR_LINE + line + "\n" + self.text)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def update(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if text != self.text:
                self.stream.write(CLEAR_LINE + text)
                self.stream.flush()
        elif text and (force or now - self._printed_at >= self.every):
            self.stream.write("[launch] " + text + "\n")
            self.stream.flush()
            self._printed_at = now
        self.text = text

    def close(self) -> None:
        if self.tty and self.text:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
        self.text = ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-launch",
        description="Run a whole training job on this machine as separate processes: N shards (ps-server) and M "
                    "workers (ps-worker). Settings come from the defaults, then --config JOB.toml, then these flags; "
                    "see docs/settings.md. The last line on stdout is the run's JSON summary.",
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


class Launcher:
    """Runs one job; `run()` returns the process exit status."""

    def __init__(self, config: JobConfig, *, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> None:
        self.config = config
        self.stdout = stdout
        self.stderr = stderr
        self.status = StatusLine(stderr, tty=stderr.isatty(), every=config.launch.print_every)
        self.children: list[Child] = []
        self.lines: queue.Queue[tuple[str, Output]] = queue.Queue()   # (child name, line), from the readers
        self._by_name: dict[str, Child] = {}
        self.evaluations: list[dict[str, Any]] = []
        self.progress: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.deadline = self.started + config.launch.timeout
        self._scratch = tempfile.TemporaryDirectory(prefix="ps-launch-")

    # ------------------------------------------------------------------ processes

    def _say(self, text: str) -> None:
        self.status.log(f"[launch] {text}")

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

    def shard_argv(self, index: int) -> list[str]:
        c = self.config
        skip = ("server.shard_index", "server.host", "server.port", "server.metrics_port", "server.checkpoint_dir",
                "job.stop_with_parent")
        argv = process.python_module_argv(
            "ps_server", *jobconfig.to_argv(c, scope="server", skip=skip),
            "--shard-index", str(index), "--host", "127.0.0.1", "--port", "0", "--stop-with-parent")
        if c.server.checkpoint_dir is not None:   # a checkpoint folder belongs to one shard
            argv += ["--checkpoint-dir", str(Path(c.server.checkpoint_dir) / f"shard{index}")]
        if c.server.metrics_port is not None:   # one port each: the job file's, plus the shard index (0: any)
            argv += ["--metrics-port", str(c.server.metrics_port + index if c.server.metrics_port else 0)]
        return argv

    def worker_argv(self, index: int, addresses: list[str], model_path: str) -> list[str]:
        c = self.config
        skip = ("worker.index", "worker.worker_id", "worker.servers", "worker.events", "worker.model",
                "job.stop_with_parent", "worker.intra_op_threads")
        threads = c.worker.intra_op_threads or max(1, (os.cpu_count() or 1) // max(1, c.job.workers or 1))
        return process.python_module_argv(
            "worker_client", *jobconfig.to_argv(c, scope="worker", skip=skip),
            "--model", model_path, "--worker-index", str(index), "--servers", ",".join(addresses),
            "--intra-op-threads", str(threads), "--events", "--stop-with-parent")

    # ------------------------------------------------------------------ output

    def _handle(self, name: str, output: Output) -> None:
        child = self._by_name[name]
        if output.kind == process.CLOSED:
            child.open_streams -= 1
            return
        if output.kind == process.READY:
            if output.data is None:
                raise LaunchError(child.process.describe(child.process.ready_error or "printed a malformed READY line"))
            self._say(f"{child.name} ready at {output.data.get('address')} (pid {child.pid})")
            return
        if output.kind == process.EVENT and output.data is not None:
            self._on_event(child, dict(output.data))
            return
        self.status.log(f"[{child.name}] {output.text}")

    def _on_event(self, child: Child, event: dict[str, Any]) -> None:
        """Takes a worker's JSON event; logs it in the worker's own wording (format_event)."""
        kind = event.pop("event")
        if kind == "progress":
            child.progress = event
            self.progress.append(event)
            return
        if kind == "eval":
            self.evaluations.append(event)
        elif kind == "done":
            child.result = event
        elif kind == "start":
            child.progress = {**event, "loss": None, "samples_per_second": 0.0, "stale_drops": 0}
        self.status.log(f"[{child.name}] {format_event(kind, event)}")

    def _status_text(self) -> str:
        workers = [c for c in self.children if c.role == "worker"]
        reports = [c.result or c.progress for c in workers if c.result or c.progress]
        if not reports:
            return ""
        step = max(r.get("step", r.get("steps", 0)) or 0 for r in reports)
        losses = [r["loss"] for r in reports if r.get("loss") is not None]
        if all(c.result for c in workers):
            seconds = max(c.result["seconds"] for c in workers if c.result)
            rate = sum(c.result["samples"] for c in workers if c.result) / max(seconds, MIN_SECONDS)
        else:
            rate = sum((c.progress or {}).get("samples_per_second", 0.0) for c in workers if c.result is None)
        stale = sum(r.get("stale_drops", 0) for r in reports)
        target = self.config.worker.steps
        accuracy = next((e["test_accuracy"] for e in reversed(self.evaluations)
                         if e.get("test_accuracy") is not None), None)
        parts = [f"step {step}" + (f"/{target}" if target else ""),
                 f"loss {_fmt(sum(losses) / len(losses) if losses else None, '.4f')}",
                 f"{rate:,.0f} samples/s", f"stale drops {stale}"]
        if accuracy is not None:
            parts.append(f"test acc {accuracy:.4f}")
        parts.append(f"{time.monotonic() - self.started:.0f} s")
        return " | ".join(parts)

    def _pump_once(self, timeout: float) -> None:
        """Handles the output lines that arrive within timeout s, then refreshes the status line."""
        end = time.monotonic() + timeout
        while True:
            try:
                item = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(*item)
            if time.monotonic() >= end:
                break
        self.status.update(self._status_text())

    def _check_time(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise LaunchError(f"the job ran past --timeout {self.config.launch.timeout:g} s while {what}")

    def _fail(self, child: Child, why: str) -> LaunchError:
        """A LaunchError naming the child, its argv and its last lines (read for at most FAIL_DRAIN_TIMEOUT s)."""
        drain_end = time.monotonic() + FAIL_DRAIN_TIMEOUT
        while child.open_streams > 0 and time.monotonic() < drain_end:
            try:
                self._handle(*self.lines.get(timeout=READY_POLL_INTERVAL))
            except queue.Empty:
                pass
        return LaunchError(child.process.describe(why))

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
        """Starts every shard and waits for all READY lines (at most --ready-timeout); their addresses in order."""
        shards = [self._start(f"shard{i}", "shard", i, self.shard_argv(i)) for i in range(self.config.job.shards)]
        ready_deadline = time.monotonic() + self.config.launch.ready_timeout
        while any(s.ready is None for s in shards):
            self._pump_once(READY_POLL_INTERVAL)
            self._check_children(shards_only=True)
            if time.monotonic() > ready_deadline:
                late = next(s for s in shards if s.ready is None)
                raise self._fail(late, f"printed no READY line within --ready-timeout "
                                       f"{self.config.launch.ready_timeout:g} s")
            self._check_time("waiting for the shards' READY lines")
        return [str(s.ready["address"]) for s in shards if s.ready]

    def run_workers(self, addresses: list[str]) -> None:
        """Starts every worker and waits until all finished with a result (or one fails, or the timeout)."""
        model_path, _ = resolve_model(self.config.worker.model, Path(self._scratch.name))
        workers = [self._start(f"worker{i}", "worker", i, self.worker_argv(i, addresses, str(model_path)))
                   for i in range(self.config.job.workers or 1)]
        while True:
            self._pump_once(RUN_POLL_INTERVAL)
            self._check_children()
            if all(w.finished_at is not None and (w.open_streams == 0 or
                                                  time.monotonic() - w.finished_at > DRAIN_TIMEOUT)
                   for w in workers):
                break
            self._check_time("the workers were training")
        for worker in workers:
            if worker.result is None:
                raise self._fail(worker, "exited without reporting a result (no \"done\" event)")

    def stop_all(self) -> None:
        """Stops every child still running, workers first: SIGTERM, then SIGKILL after --stop-timeout (by PID)."""
        grace = self.config.launch.stop_timeout

        def killing(p: ChildProcess) -> None:
            self._say(f"{p.name} (pid {p.pid}) did not stop within {grace:g} s; killing it")

        for role in ("worker", "shard"):
            group = [c.process for c in self.children if c.role == role]
            for p in process.stop_all(group, grace=grace, on_kill=killing):
                self._say(f"{p.name} (pid {p.pid}) survived SIGKILL for {grace:g} s")
        # show what the children said while stopping
        while True:
            try:
                name, output = self.lines.get_nowait()
            except queue.Empty:
                break
            if output.kind == process.LINE:
                self.status.log(f"[{name}] {output.text}")

    def summary(self) -> dict[str, Any]:
        """The job's result: the fields of the final JSON line."""
        c = self.config
        results = [w.result for w in self.children if w.role == "worker" and w.result]
        chief = next((r for r in results if r.get("worker") == 0), results[0] if results else {})
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
        }

    def run(self) -> int:
        """The whole job; the exit status: 0, 1 (a failure, timeout or accuracy below --min-accuracy), 128+signal."""
        try:
            return self._run()
        finally:
            self._scratch.cleanup()   # the bundled model written for the workers

    def _run(self) -> int:
        received: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if not received:
                received.append(signum)
                raise KeyboardInterrupt

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        c = self.config
        self._say(f"{c.job.mode} job: {c.job.shards} shard(s), {c.job.workers} worker(s), model {c.worker.model}, "
                  f"data {c.worker.data}, {c.server.optimizer} lr {c.server.lr:g}")
        try:
            addresses = self.start_shards()
            self.run_workers(addresses)
        except LaunchError as exc:
            self.status.close()
            self._say(f"FAILED: {exc}")
            self.stop_all()
            return 1
        except KeyboardInterrupt:
            self.status.close()
            name = signal.Signals(received[0]).name if received else "SIGINT"
            self._say(f"received {name}: stopping every process")
            self.stop_all()
            return 128 + (received[0] if received else signal.SIGINT)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self.status.close()
        self.stop_all()
        summary = self.summary()
        if c.launch.record:
            try:
                write_record(Path(c.launch.record), summary=summary, launcher=self)
            except OSError as exc:
                self._say(f"FAILED: cannot write the record to --record {c.launch.record}: {exc}")
                self.stdout.write(json.dumps(summary) + "\n")
                return 1
        self._say(f"test accuracy {_fmt(summary['test_accuracy'], '.4f')} after {summary['steps']} steps "
                  f"({c.job.mode}, {c.job.workers} worker(s), {c.job.shards} shard(s)) in {summary['seconds']:.1f} s; "
                  f"{summary['samples_per_second']:,.0f} samples/s, {summary['stale_drops']} stale drop(s)"
                  + (f"; record in {c.launch.record}" if c.launch.record else ""))
        status = 0
        if c.launch.min_accuracy is not None and not (summary["test_accuracy"] or 0.0) >= c.launch.min_accuracy:
            self._say(f"FAILED: test accuracy {_fmt(summary['test_accuracy'], '.4f')} is below --min-accuracy "
                      f"{c.launch.min_accuracy:g}")
            status = 1
        self.stdout.write(json.dumps(summary) + "\n")
        self.stdout.flush()
        return status


def write_record(directory: Path, *, summary: dict[str, Any], launcher: Launcher) -> None:
    """DIR/run.json (summary, settings, processes, worker results, evaluations, progress) and DIR/plot.png."""
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
    except ImportError as exc:
        launcher.status.log(f"[launch] no plot ({exc}); install matplotlib (pip install 'onnx-ps[demo]')")


def plot_run(record: dict[str, Any], path: Path) -> None:
    """Loss (training and test) and test accuracy over the global step, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, evals = record["summary"], record["evaluations"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    workers = sorted({p["worker"] for p in record["progress"]})
    for worker in workers:
        points = [(p["step"], p["loss"]) for p in record["progress"] if p["worker"] == worker and p["loss"] is not None]
        if points:
            ax_loss.plot(*zip(*points), ".", alpha=0.5, label=f"training loss, worker {worker}")
    train = [(e["step"], e["train_loss"]) for e in evals if e.get("train_loss") is not None]
    test = [(e["step"], e["test_loss"]) for e in evals if e.get("test_loss") is not None]
    if train:
        ax_loss.plot(*zip(*train), "-", label="training loss, worker 0 (between evaluations)")
    if test:
        ax_loss.plot(*zip(*test), "-o", markersize=3, label="test loss")
    ax_loss.set_xlabel("global step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    accuracy = [(e["step"], e["test_accuracy"]) for e in evals if e.get("test_accuracy") is not None]
    if accuracy:
        ax_acc.plot(*zip(*accuracy), "-o", markersize=3, color="tab:green")
    ax_acc.set_xlabel("global step")
    ax_acc.set_ylabel("test accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.grid(True, alpha=0.3)
    final = summary.get("test_accuracy")
    ax_acc.set_title(f"final test accuracy {_fmt(final, '.4f')}")
    fig.suptitle(f"{summary['model']} on {summary['data']}: {summary['mode']}, {summary['workers']} worker(s), "
                 f"{summary['shards']} shard(s), {summary['optimizer']} lr {summary['lr']:g}, "
                 f"{summary['samples_per_second']:,.0f} samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = jobconfig.load_config(args, scope="launch")
        server_config(config)   # the shards' settings, checked before anything starts
    except (JobConfigError, ValueError) as exc:
        print(f"ps-launch: {exc}", file=sys.stderr)
        return 2
    return Launcher(config).run()


if __name__ == "__main__":
    sys.exit(main())
