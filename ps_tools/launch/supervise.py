"""Supervising one job: the checks before anything starts, then the shards and workers as child processes.

`Launcher.prepare()` checks the job -- the settings, the model file (a missing, truncated or
corrupt .onnx is named), the data, and the two against each other (worker_client.training.preflight),
the metrics ports and the TensorBoard writer -- and builds the workers' gradient graph once.
`Launcher.run()` starts the shards, reads each one's ``PS_SERVER_READY {json}`` line to learn
its address, starts the workers (their command lines: `children`), and runs the event loop:
every line a child prints arrives on one queue (ps_common.process's reader threads), is
parsed and shown (`display`), and the workers' events make the job's progress (`reports`).
A pipeline job's whole model is evaluated here too (`pipeline_evaluation`).

It stops everything, workers first, by PID (SIGTERM, then SIGKILL after ``--stop-timeout``),
when a child fails (and shows that child's last error), on Ctrl-C or SIGTERM, and when the
job runs past ``--timeout``; then it writes the record (`record`) and the summary line.

What blocks, and for how long: the shards' READY lines (``--ready-timeout``), the whole job
(``--timeout``), stopping (at most 2 x ``--stop-timeout`` per group: workers, then shards),
and quoting a failed child's last lines (`FAIL_DRAIN_TIMEOUT`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import random
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ps_common import jobconfig, process
from ps_common.errors import LaunchError, ProcessStartError, PSError
from ps_common.jobconfig import JobConfig, JobConfigError
from ps_common.process import ChildProcess, Output
from ps_common.scratch import ScratchDir
from ps_models.datasets import Dataset
from ps_server.checkpoints import CheckpointDirectory
from ps_server.checkpoints.directory import OWNER_FILE
from ps_server.cli import READY_PREFIX
from ps_common.tls import AUTH_TOKEN_ENV, client_security, token_from
from ps_tools import export
from ps_tools.launch.children import (Child, Replication, checkpoint_folder, replication_plan, shard_argv, stage_argv,
                                      witness_argv, worker_argv)
from ps_tools.launch.display import LEVELS, PLAIN, Display, Progress, display_level, format_number
from ps_tools.launch.pipeline_evaluation import PipelineEvaluations
from ps_tools.launch.record import JobScalars, run_record, write_record
from ps_tools.launch.reports import job_progress, job_summary
from worker_client.cli import prepare_worker
from worker_client.engine.load import load_model
from worker_client.engine.session import placement
from worker_client.pipeline.cut import plan_stages, write_stages
from worker_client.training import format_event
from worker_client.training.preflight import sparse_summary

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
#: The keys of a JSON log record that are not its fields.
RECORD_KEYS = ("ts", "level", "logger", "msg")


#: Where the kernel keeps the ports it gives to port-0 binds and to outgoing connections' source ports.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: The lowest port `free_ports` picks: above the registered services most machines run.
LOWEST_PICKED_PORT = 10000


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (low, high), None where it cannot be read (not Linux)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as handle:
            low, high = (int(field) for field in handle.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def free_ports(count: int, *, attempts: int = 200) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now: a replicated job's processes must know each other's addresses
    before they start, so the ports are picked, released, and bound again by the processes.

    They are picked at random between LOWEST_PICKED_PORT and the kernel's ephemeral range where there is room:
    a port from port 0 lies inside that range, where any outgoing connection on the machine may take it as its
    source port between the pick and the bind ("Address already in use" at a replica's start). Where the range
    cannot be read or leaves no room, or `attempts` random ports were taken, the rest are port-0 choices."""
    kernel = ephemeral_range()
    below = kernel is not None and kernel[0] - LOWEST_PICKED_PORT > 4 * count
    sockets: list[socket.socket] = []
    try:
        tries = 0
        while len(sockets) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = 0
            if below and tries < attempts:
                port = random.randint(LOWEST_PICKED_PORT, kernel[0] - 1)
                tries += 1
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                if port == 0:
                    raise
                continue
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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
        self.sparse_note: str | None = None
        self.stage_plan: Path | None = None      # pipeline jobs: the stage models and stages.json
        self.rendezvous: Path | None = None      # ... where the stage workers find each other
        self.evaluation: dict[str, Any] | None = None   # ... the launcher's final evaluation of the whole model
        self._evaluations: PipelineEvaluations | None = None   # ... its evaluator, open while the stages train
        self.tensorboard: JobScalars | None = None
        self.replication: Replication | None = None   # a replicated job's places (--shard-replicas)

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
        self.sparse_note = sparse_summary(prepared.engine)   # said with the job's first line
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
            self.tensorboard = JobScalars(c.worker.tensorboard)
        if c.job.shard_replicas > 1 and c.job.stages > 1:
            raise JobConfigError(f"Invalid --shard-replicas {c.job.shard_replicas} with --stages {c.job.stages}: a "
                                 "pipeline job's shards are not replicated yet; use one of the two")
        # folders the job writes into only late (the record at its end, checkpoints in the shards): a file there,
        # or a path that cannot be made, was found after the whole run (the record, and the result, lost)
        for value, what in ((c.launch.record, "--record"), (c.server.checkpoint_dir, "--checkpoint-dir")):
            if value:
                _make_folder(Path(value), what)
        self._check_checkpoint_owners()
        if c.launch.export:
            out = Path(c.launch.export)
            if out.is_dir() or not (out.parent if str(out.parent) else Path(".")).is_dir():
                raise JobConfigError(f"Invalid --export {c.launch.export!r}: give a file name in an existing folder "
                                     "(e.g. runs/model.onnx)")

    def _check_checkpoint_owners(self) -> None:
        """Refuses a --checkpoint-dir whose shard folders another job's shards own (another --shards), before any
        shard starts: each shard would refuse its folder on its own, but only after the others had started and made
        folders of their own there (a stray shard1/ beside a 1-shard job's checkpoints, which `ps-ctl export` of
        the folder then trips on)."""
        c = self.config
        if c.server.checkpoint_dir is None:
            return
        stages = [None] if c.job.stages == 1 else list(range(c.job.stages))
        for stage in stages:
            for index in range(c.job.shards):
                for replica in range(c.job.shard_replicas):
                    folder = checkpoint_folder(c, index, stage, replica)
                    assert folder is not None   # the job keeps checkpoints
                    directory = CheckpointDirectory(folder)
                    if directory.mismatch(index, c.job.shards) is None:
                        continue
                    owner = directory.owner() or {}
                    newest = directory.checkpoints()[:1]
                    holds = f", newest checkpoint at step {newest[0][0]}" if newest else ", no checkpoint yet"
                    total = owner.get("num_shards")
                    raise JobConfigError(
                        f"Invalid --checkpoint-dir {c.server.checkpoint_dir!r}: {folder} belongs to shard "
                        f"{owner.get('shard_index')} of a {total}-shard job ({OWNER_FILE}{holds}), and this job has "
                        f"--shards {c.job.shards}: resume with --shards {total}, or point --checkpoint-dir at "
                        "another folder")

    # ------------------------------------------------------------------ processes

    def _say(self, text: str, level: str = "INFO", *, always: bool = False, **fields: Any) -> None:
        """A line of the launcher's own; `always`: one a user must see at any level (the job, where, the result)."""
        self.display.record("launch", level, text, fields, always=always)

    def _start(self, name: str, role: str, index: int, argv: list[str]) -> Child:
        """Starts one child; its output lines arrive in self.lines (LaunchError when it cannot start).

        The only place a process starts: `ChildProcess` is looked up in this module when called
        (tests replace ``supervise.ChildProcess`` to prove that a refused job starts nothing).
        """
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
                self.tensorboard.evaluation(event)
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
        return job_progress(self.config, workers, self.evaluations, self.training_started)

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
        if self.tensorboard is not None:
            self.tensorboard.progress(p)

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
                if self.replication is not None and self._replicas_left(child):
                    if child.finished_at is None:   # a replica lost: its shard fails over (docs/replication.md)
                        child.finished_at = time.monotonic()
                        self._say(f"{child.name} (pid {child.process.pid}) exited with code {code}: its shard goes on "
                                  "on its other replicas", "WARNING", always=True)
                    continue
                raise self._fail(child, f"exited with code {code} while the job was running")
            if shards_only:
                continue
            if code != 0:
                raise self._fail(child, f"failed with exit code {code}")
            if child.finished_at is None:
                child.finished_at = time.monotonic()

    # ------------------------------------------------------------------ phases

    def _replicas_left(self, gone: Child) -> bool:
        """Whether the shard of a replica that exited still has a replica running (and the voters a majority)."""
        shard = gone.index // self.config.job.shard_replicas
        running = [c for c in self.children if c.role == "shard" and c.process.returncode is None]
        alive_voters = len(running)
        voters = len(self.replication.voters) if self.replication is not None else 0
        same = [c for c in running if c.name != "witness" and c.index // self.config.job.shard_replicas == shard]
        return gone.name != "witness" and bool(same) and alive_voters > voters // 2

    def start_shards(self) -> list[str]:
        """Starts every shard and waits for all READY lines (at most --ready-timeout); their addresses in order.

        A pipeline job's stages each have `shards` shards: the addresses are stage by stage. A replicated job
        (--shard-replicas R) starts R processes per shard (and a witness when they are fewer than 3); a shard's
        address is then its replicas' joined by '|'."""
        c = self.config
        if c.job.shard_replicas > 1:
            replicas = c.job.shard_replicas
            count = c.job.shards * replicas
            plan = self.replication = replication_plan(c.job.shards, replicas, free_ports(count + (count < 3)))
            shards = [self._start(f"shard{i}" if r == 0 else f"shard{i}-replica{r}", "shard", i * replicas + r,
                                  shard_argv(c, self.level, i, replication=plan, replica=r))
                      for i in range(c.job.shards) for r in range(replicas)]
            if plan.witness is not None:
                shards.append(self._start("witness", "shard", count, witness_argv(c, self.level, plan)))
            self._wait_ready(shards)
            self._say(f"{c.job.shards} shard(s) x {replicas} replicas: " + "; ".join(
                f"shard{i} {'|'.join(g)}" for i, g in enumerate(plan.replicas))
                + (f"; witness {plan.witness}" if plan.witness else ""), always=True,
                replicas=plan.replicas, voters=plan.voters)
            return ["|".join(group) for group in plan.replicas]
        if c.job.stages > 1:
            shards = [self._start(f"stage{k}-shard{i}", "shard", k * c.job.shards + i,
                                  shard_argv(c, self.level, i, k))
                      for k in range(c.job.stages) for i in range(c.job.shards)]
        else:
            shards = [self._start(f"shard{i}", "shard", i, shard_argv(c, self.level, i)) for i in range(c.job.shards)]
        self._wait_ready(shards)
        if self.config.server.metrics_port is not None:
            where = [f"http://127.0.0.1:{s.ready['metrics_port']}/metrics" for s in shards
                     if s.ready and s.ready.get("metrics_port")]
            self._say("metrics: " + ", ".join(f"shard{i} {url}" for i, url in enumerate(where)), always=True,
                      metrics=where)
        return [str(s.ready["address"]) for s in shards if s.ready]

    def _wait_ready(self, shards: list[Child]) -> None:
        """Until every one printed its READY line (at most --ready-timeout)."""
        ready_deadline = time.monotonic() + self.config.launch.ready_timeout
        while any(s.ready is None for s in shards):
            self._pump_once(READY_POLL_INTERVAL)
            self._check_children(shards_only=True)
            if time.monotonic() > ready_deadline:
                late = next(s for s in shards if s.ready is None)
                raise self._fail(late, f"printed no READY line within --ready-timeout "
                                       f"{self.config.launch.ready_timeout:g} s")
            self._check_time("waiting for the shards' READY lines")

    def run_workers(self, addresses: list[str]) -> None:
        """Starts every worker and waits until all finished with a result (or one fails, or the timeout)."""
        assert self.model_path is not None, "prepare() first"
        c = self.config
        if c.job.stages > 1:   # replica r's stage k trains against stage k's shards
            assert self.dataset is not None and self.stage_plan is not None and self.rendezvous is not None
            groups = [addresses[k * c.job.shards:(k + 1) * c.job.shards] for k in range(c.job.stages)]
            self._evaluations = PipelineEvaluations(c, self.model_path, self.dataset, groups)
            workers = [self._start(f"replica{r}-stage{k}", "worker", r,
                                   stage_argv(c, self.level, r, k, groups[k], model_path=self.model_path,
                                              stage_plan=self.stage_plan, rendezvous=self.rendezvous))
                       for r in range(c.job.workers or 1) for k in range(c.job.stages)]
        else:
            workers = [self._start(f"worker{i}", "worker", i,
                                   worker_argv(c, self.level, i, addresses, str(self.model_path)))
                       for i in range(c.job.workers or 1)]
        while True:
            self._pump_once(RUN_POLL_INTERVAL)
            self._check_children()
            if self._evaluations is not None:
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
        if self.tensorboard is not None:
            self.tensorboard.final(p)
        if self._evaluations is not None:
            self.evaluate_pipeline()

    # ------------------------------------------------------------------ a pipeline job's whole model

    def _evaluate_pipeline_when_due(self) -> None:
        """Every eval_every global steps of a pipeline job, the whole model's test metrics (pipeline_evaluation)."""
        if self._evaluations is None or not self._evaluations.periodic or self.training_started is None:
            return
        try:
            record = self._evaluations.when_due()
        except (PSError, ValueError) as exc:   # a shard restarting, say: the next one may do; the final one must
            self._say(f"evaluating the whole model mid-job failed (training goes on): {exc}", "WARNING")
            return
        if record is not None:
            self._record_pipeline_evaluation(record, final=False)

    def _record_pipeline_evaluation(self, evaluation: dict[str, Any], *, final: bool) -> None:
        record = {**evaluation, "final": final,
                  "elapsed": round(time.monotonic() - (self.training_started or self.started), 3)}
        self.evaluations.append(record)
        if self.tensorboard is not None:
            self.tensorboard.evaluation(record)
        self._say(f"whole model at step {record['step']}{' (final)' if final else ''}: test accuracy "
                  f"{format_number(record.get('test_accuracy'), '.4f')}, test loss "
                  f"{format_number(record.get('test_loss'), '.4g')}", **record)

    def evaluate_pipeline(self) -> None:
        """The whole model's test metrics at the stages' final parameters (no stage worker holds them all)."""
        assert self._evaluations is not None
        record = self._evaluations.final()
        self.evaluation = {k: v for k, v in record.items() if k != "step"}
        self._record_pipeline_evaluation(record, final=True)

    # ------------------------------------------------------------------ stopping, the whole run

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
        workers = [c for c in self.children if c.role == "worker"]
        return job_summary(self.config, workers, started=self.started, evaluation=self.evaluation)

    def run(self) -> int:
        """The whole job; the exit status: 0, 1 (a failure, timeout or accuracy below --min-accuracy), 128+signal."""
        try:
            return self._run()
        finally:
            if self._evaluations is not None:   # a pipeline job that failed or was stopped while training
                self._evaluations.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            self._scratch.cleanup()   # the bundled model written for the workers

    def close(self) -> None:
        """Releases what prepare() made, for a job that never ran."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        self._scratch.cleanup()

    def export_model(self, addresses: list[str]) -> list[Path]:
        """Writes the trained model (ps_tools/export.py) to --export and to --record's model.onnx, read from the
        live shards at one step (every stage's shards, for a pipeline job). LaunchError when it cannot."""
        c = self.config
        targets = [Path(p) for p in (c.launch.export, c.launch.record and str(Path(c.launch.record) / "model.onnx"))
                   if p]
        if not targets:
            return []
        assert self.model_path is not None
        credentials, metadata = client_security(c.worker.tls_ca, c.worker.tls_cert, c.worker.tls_key,
                                                token_from(c.job.auth_token_file, env_var=AUTH_TOKEN_ENV))
        groups = [addresses[k * c.job.shards:(k + 1) * c.job.shards] for k in range(c.job.stages)]
        job = json.dumps({"model": c.worker.model, "data": c.worker.data, "mode": c.job.mode, "shards": c.job.shards,
                          "workers": c.job.workers, "stages": c.job.stages, "optimizer": c.server.optimizer,
                          "lr": c.server.lr})
        try:
            state = export.TrainedState.merged([
                export.read_servers(group, channel_credentials=credentials, call_metadata=metadata,
                                    timeout=c.job.wait_timeout) for group in groups])
            model = export.build_model(self.model_path, state, job=job)
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
                export.write_model(model, target)
        except (PSError, ValueError, OSError) as exc:
            raise LaunchError(f"cannot export the trained model to {', '.join(map(str, targets))}: {exc}") from exc
        self._say(f"trained model at step {state.step} written to {', '.join(map(str, targets))}", always=True,
                  exported=[str(t) for t in targets], step=state.step)
        return targets

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
        if self.sparse_note:
            self._say(self.sparse_note, always=True)
        try:
            addresses = self.start_shards()
            self.run_workers(addresses)
            self.export_model(addresses)
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
                no_plot = write_record(Path(c.launch.record), run_record(
                    summary=summary, config=c, children=self.children, evaluations=self.evaluations,
                    progress=self.progress))
                if no_plot:
                    self._say(no_plot, "WARNING", always=True)
            except OSError as exc:
                self._say(f"cannot write the record to --record {c.launch.record}: {exc}", "ERROR")
                self.stdout.write(json.dumps(summary) + "\n")
                return 1
        accuracy, loss = summary["test_accuracy"], summary["test_loss"]
        result = (f"test accuracy {format_number(accuracy, '.4f')}" if accuracy is not None
                  else f"test loss {format_number(loss, '.4f')}")
        saved = [f"record in {c.launch.record}"] if c.launch.record else []
        saved += [f"TensorBoard: tensorboard --logdir {c.worker.tensorboard}"] if c.worker.tensorboard else []
        target = c.worker.steps
        idle = (f"nothing trained (the job was already at step {summary['steps']}, at or past --steps {target}); "
                if target is not None and not summary["samples"] and summary["steps"] >= target else "")
        self._say(f"done: {idle}{result} after {summary['steps']} steps in {summary['seconds']:.1f} s; "
                  f"{summary['samples_per_second']:,.0f} samples/s, {summary['stale_drops']} stale drop(s)"
                  + "".join(f"; {s}" for s in saved), always=True,
                  **{k: summary[k] for k in ("test_accuracy", "test_loss", "steps", "seconds", "samples_per_second",
                                             "stale_drops")})
        status = 0
        if c.launch.min_accuracy is not None and not (summary["test_accuracy"] or 0.0) >= c.launch.min_accuracy:
            self._say(f"test accuracy {format_number(summary['test_accuracy'], '.4f')} is below --min-accuracy "
                      f"{c.launch.min_accuracy:g}", "ERROR")
            status = 1
        self.stdout.write(json.dumps(summary) + "\n")
        self.stdout.flush()
        return status


def _make_folder(path: Path, what: str) -> None:
    """`path` as a folder (made, with its parents, when missing); JobConfigError naming `what` otherwise."""
    if path.exists() and not path.is_dir():
        raise JobConfigError(f"Invalid {what} {str(path)!r}: it is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JobConfigError(f"Invalid {what} {str(path)!r}: cannot make the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise JobConfigError(f"Invalid {what} {str(path)!r}: the folder is not writable")
