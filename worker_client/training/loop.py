"""The worker's training loop: pull, compute, push under the job's consistency mode, with evaluation and progress.

One `Trainer` is one worker of a job. `Trainer.run()`:

1. waits (at most `start_timeout`) until every shard answers; worker 0 initializes the
   parameters from the model's initializers (idempotent: a restarted worker 0 changes
   nothing), the others wait until every shard is initialized;
2. registers on every shard (leases kept alive by heartbeats) and adopts the clock the
   shards hold for it, then waits at the start barrier for all workers -- unless the job
   is already running (a restarted worker), which simply rejoins: nothing a worker holds
   has to survive a restart;
3. trains on its own strided share of the training split: gradients of one batch at the
   parameters it pulled, pushed with the steps it read them at; then it pulls again as
   the shards' mode says (read from GetClusterInfo): sync waits for the next step of every
   shard (min_step = read step + 1), ssp pulls with its clock (the shards hold the pull
   while it is more than the staleness bound ahead), async does not wait;
4. stops when the shards' global step reaches `steps`, or after `epochs` passes over its
   share (the position is its clock, so a restarted worker continues where it was);
5. deregisters (so no sync step waits for it); worker 0 then waits until every other
   worker left (deregistered, or its lease ran out: a dead worker is not waited for) and
   evaluates the final parameters on the test split.

A waiting pull (sync step, SSP hold) is the client's `pull_after`: cut into short waits,
between which the worker stops if asked to (`stop`: it abandons the step, deregisters and
returns) and pulls a shard that lost progress it saw (restarted from an older checkpoint)
as it is. The loop (`_train`) is the same for every kind of worker; what one step does is
`_step`'s: a data-parallel step here, a pipeline stage's step in worker_client/pipeline/worker.py.

Overlap (async, no sparse table, `plan.overlap`): a step's PushPull runs on a thread of its
own while the next gradient is computed on the parameters the step before it read, so the
wire and the shard's work hide behind the computation. It adds exactly one step of
staleness to the worker's own updates: the gradient of iteration t is computed on
parameters that hold the worker's pushes up to t - 2 (not t - 1), and others' as they
were when that read happened. SSP and sync never overlap (their bounds stay exact).

Worker 0 also evaluates every `eval_every` global steps. Progress, evaluations and the
result are reported as events (`JsonLinesSink` for launchers, `TextSink` for people).
Every wait is bounded: start_timeout for joining, wait_timeout for one pull in all and for
worker 0's wait at the end. Not thread-safe: one thread runs a Trainer (set `stop` from
another).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ps_common.errors import StoppedError, TrainingError, WaitTimeoutError
from ps_models.datasets import Dataset, num_batches
from worker_client.client import PSClient, PushReport, ServerError
from worker_client.client.rows import dynamic_table
from worker_client.engine import GradientEngine
from worker_client.training.evaluate import finite, metrics_of
from worker_client.training.events import EventSink, peak_rss_mb

log = logging.getLogger(__name__)

#: The barrier every worker of a job meets at before training.
START_BARRIER = "training-start"
#: How often a worker polls the shards while it waits for them to be reachable or initialized.
POLL_SECONDS = 0.2
#: Test examples predicted at once in an evaluation (without sparse tables: the model's batch axis is free).
TEST_BATCH = 4096
#: The longest single wait of a pull after a push; between two, a worker checks `stop` and lost progress.
RECHECK_SECONDS = 2.0


@dataclass(frozen=True)
class TrainingPlan:
    """What one worker does; see the module docstring and docs/settings.md ([worker], [job])."""

    worker_index: int
    num_workers: int
    batch_size: int
    steps: int | None = None          # stop when the shards' global step reaches this
    epochs: int | None = None         # stop after this many passes over the worker's share
    seed: int = 0
    eval_every: int = 100             # global steps between evaluations by worker 0; 0: only at the end
    progress_every: float = 1.0       # seconds between progress events
    start_timeout: float = 300.0      # joining: shards reachable, initialized, start barrier
    wait_timeout: float = 300.0       # one pull's wait (sync step, SSP hold), and worker 0's wait at the end
    dynamic_initializer: str = "normal:0.01"   # how the shards create a dynamic table's unseen rows
    evict_after_steps: int = 0        # a dynamic table's rows untouched this many steps are evicted; 0: never
    overlap: bool = False             # async, dense, opt-in: a step's push/pull overlaps the next gradient (module docstring)

    def __post_init__(self) -> None:
        if not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"Invalid worker_index: {self.worker_index} (must be in [0, {self.num_workers}))")
        if self.batch_size < 1:
            raise ValueError(f"Invalid batch_size: {self.batch_size} (must be >= 1)")
        if self.steps is None and self.epochs is None:
            raise ValueError("Invalid plan: set steps or epochs (or both)")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"Invalid steps: {self.steps} (must be >= 1)")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"Invalid epochs: {self.epochs} (must be >= 1)")
        if self.eval_every < 0:
            raise ValueError(f"Invalid eval_every: {self.eval_every} (must be >= 0)")
        for name in ("progress_every", "start_timeout", "wait_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)} (must be > 0)")

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0


class _Window:
    """Loss sum and sample count since the window was last read."""

    def __init__(self) -> None:
        self.loss_sum, self.count, self.samples, self.started = 0.0, 0, 0, time.monotonic()

    def add(self, loss: float, samples: int) -> None:
        self.loss_sum += loss
        self.count += 1
        self.samples += samples

    def take(self) -> tuple[float | None, float]:
        """(mean loss, samples per second) since the last take, and starts over."""
        now = time.monotonic()
        loss = finite(self.loss_sum / self.count) if self.count else None
        rate = self.samples / max(now - self.started, 1e-9)
        self.loss_sum, self.count, self.samples, self.started = 0.0, 0, 0, now
        return loss, rate


@dataclass
class _Tally:
    """What one worker did in this run: pushes and their outcomes, the last loss, where in the data it is."""

    start_clock: int                  # the clock this run started at (0, or where a restarted worker resumes)
    epoch: int = 0
    iterations: int = 0               # pushes in this run
    accepted: int = 0                 # ... accepted by every shard
    dropped: int = 0                  # ... dropped by at least one shard
    stale: int = 0                    # ... dropped as stale by at least one shard
    loss: float = math.nan
    bytes_pulled: int = 0             # the client's byte counters when the loop started
    bytes_pushed: int = 0
    rows: int = 0                     # unique sparse-table rows the batches touched

    def count(self, outcome: PushReport) -> None:
        self.iterations += 1
        if outcome.accepted:
            self.accepted += 1
            return
        self.dropped += 1
        if outcome.stale:
            self.stale += 1
        log.debug("push at clock %d dropped: %s", outcome.clock, outcome.drops(),
                  extra={"clock": outcome.clock, "dropped_by": [i for i, _ in outcome.dropped],
                         "reason": outcome.drop_reasons})


@dataclass
class _Step:
    """What one step of the loop did (`Trainer._step`): its push's report and the parameters for the next step
    (None: pull them), its loss; or that the run is over (`finished`), or `stop` was set while it waited
    (`stopped`). A step abandoned before its push (a pipeline neighbour gone) has no outcome, and so has the first
    overlapped step, whose push is still in flight (`pending`: its report comes with the next step)."""

    outcome: PushReport | None = None
    parameters: dict[str, np.ndarray] | None = None
    loss: float | None = None
    finished: bool = False
    stopped: bool = False
    pending: bool = False
    read_steps: list[int] | None = None   # overlapped: the steps `parameters` were read at


class Trainer:
    """One worker's training run against the shards `client` talks to."""

    def __init__(self, client: PSClient, engine: GradientEngine, dataset: Dataset, *, plan: TrainingPlan,
                 report: EventSink | None = None, stop: threading.Event | None = None,
                 expected_mode: str | None = None) -> None:
        if engine.batch_size != plan.batch_size:
            raise ValueError(f"the engine's batch_size {engine.batch_size} differs from the plan's {plan.batch_size}")
        self.client = client
        self.engine = engine
        self.dataset = dataset
        self.plan = plan
        self.report: EventSink = report or (lambda event, fields: None)
        self.stop = stop or threading.Event()
        self.expected_mode = expected_mode   # when set, the shards' mode must be this one
        self.sparse = engine.sparse   # sparse tables (engine/sparse.py)
        rows_names = {t.rows_name for t in self.sparse.tables.values()}
        #: what a pull asks for: None (everything) when no table is sparse, else the dense tensors
        self.dense_names = None if not self.sparse.tables else \
            [n for n in [*engine.trainable_names, *engine.state_names] if n not in rows_names]
        #: the model's data inputs, fed by name from the dataset (checked by training/preflight.py)
        self.input_names = list(engine.data_inputs) or list(dataset.input_names)
        # a loss read off the model's own output (loss="output:NAME") adds no labels input: the data's labels are
        # then not fed (they were, and the engine refused the unknown input after the job had started)
        self._feeds_labels = engine.takes_labels
        missing = [n for n in self.input_names if n not in dataset.input_names]
        if missing:
            raise ValueError(f"dataset {dataset.name!r} feeds inputs {dataset.input_names}, but the model also takes "
                             f"{missing}")
        self.part = dataset.part(plan.worker_index, plan.num_workers)
        self.batches_per_epoch = num_batches(self.part.num_rows, plan.batch_size)
        #: what the model's first output is, for metrics: class logits, one binary logit, or targets
        self.output_kind = "binary" if engine.loss_kind == "bce" else \
            ("classes" if dataset.is_classification else "targets")
        self.mode = "?"
        self.resumed = False
        self.evaluations: list[dict[str, Any]] = []
        self._last_eval_bucket = -1
        self._eval_window = _Window()
        #: async overlap (module docstring): the PushPull in flight and its step's loss
        self._in_flight: tuple[Future, float] | None = None
        self._overlap_pool: ThreadPoolExecutor | None = None
        self._read_steps: list[int] = []   # ... the steps the parameters of the next gradient were read at

    # ------------------------------------------------------------------ joining

    def _wait_until(self, what: str, deadline: float, check: Callable[[], bool]) -> None:
        """Polls check() (True when done) until the deadline; TrainingError naming what was awaited."""
        started = time.monotonic()
        last_error = ""
        while True:
            try:
                if check():
                    return
            except ServerError as exc:
                if not exc.transient:   # a shard not up yet, or slow, is waited for; anything else is final
                    raise
                last_error = f"; last error: {exc}"
            if self.stop.is_set():
                raise TrainingError(f"stopped while waiting for {what}")
            if time.monotonic() >= deadline:
                raise TrainingError(f"waited {time.monotonic() - started:.1f} s for {what}{last_error}")
            time.sleep(POLL_SECONDS)

    def join(self) -> None:
        """Steps 1 and 2 of the module docstring: shards ready and initialized, registered, start barrier."""
        plan, client = self.plan, self.client
        deadline = time.monotonic() + plan.start_timeout
        self._check_stop("joining the job")
        try:
            client.wait_ready(timeout=plan.start_timeout)
        except TimeoutError as exc:
            raise TrainingError(
                f"{exc}. Tried --servers {','.join(client.addresses)} (shard order). Check: each ps-server's READY "
                f"line or log says the address it serves; `ps-ctl status HOST:PORT` asks one; a shard bound to "
                f"--host 127.0.0.1 (the default) takes no calls from other hosts; a firewall may drop them; a TLS "
                f"shard needs --tls-ca") from exc
        info = client.shard_status(0)
        if info.num_shards != client.num_shards:
            raise TrainingError(f"shard 0 ({client.addresses[0]}) says the job has {info.num_shards} shards, but this "
                                f"worker was given {client.num_shards} addresses: {client.addresses}")
        self.mode = info.mode.value
        if self.expected_mode is not None and self.mode != self.expected_mode:
            raise TrainingError(f"this worker was configured for mode {self.expected_mode!r}, but the shards at "
                                f"{client.addresses} run mode {self.mode!r}")
        known = info.workers
        if plan.is_chief:
            already = client.initialize({**self.engine.server_parameters(), **self.engine.state()},
                                        state=self.engine.state_names, dynamic=self._dynamic_specs())
            log.info("parameters %s on %d shard(s)", "were already initialized" if already else "initialized",
                     client.num_shards, extra={"shards": client.num_shards, "already_initialized": already})
        else:
            def initialized() -> bool:
                return all(client.shard_status(i).initialized for i in range(client.num_shards))
            self._wait_until(f"worker 0 to initialize the parameters on shards {client.addresses}", deadline,
                             initialized)
        self._check_parameters(client.fetch_shard_map())
        steps_before = [client.shard_status(i).step for i in range(client.num_shards)]
        self.resumed = client.worker_id in known or any(s > 0 for s in steps_before)
        client.register(heartbeat=True)
        if self.resumed:
            log.info("rejoining a running job as %s at clock %d (step %d): no start barrier", client.worker_id,
                     client.clock, client.step,
                     extra={"worker_id": client.worker_id, "clock": client.clock, "step": client.step})
            return
        left = max(0.1, deadline - time.monotonic())
        try:
            self._check_stop("the start barrier")
            client.barrier(START_BARRIER, plan.num_workers, timeout=left)
        except TrainingError:
            client.deregister()
            raise
        except ServerError as exc:
            client.deregister()
            raise TrainingError(f"start barrier: not all {plan.num_workers} workers arrived within {left:.1f} s: "
                                f"{exc}") from exc

    def _check_stop(self, what: str) -> None:
        if self.stop.is_set():
            raise TrainingError(f"stopped before {what}")

    def _dynamic_specs(self) -> list[Any]:
        """The dynamic tables to declare at init: each with its row shape, the plan's initializer and eviction."""
        return [dynamic_table(name, shape, dtype=dtype.name, initializer=self.plan.dynamic_initializer,
                              evict_after_steps=self.plan.evict_after_steps, seed=self.plan.seed)
                for name, (shape, dtype) in self.engine.dynamic_tables().items()]

    def _check_parameters(self, shard_map: Any) -> None:
        mine = {**self.engine.server_parameters(), **self.engine.state()}
        theirs = shard_map.specs
        dynamic = self.engine.dynamic_tables()
        problems = [f"{n!r} is not on the shards as a dynamic table" for n, (shape, dtype) in dynamic.items()
                    if n not in theirs or theirs[n].dynamic is None or tuple(theirs[n].shape) != shape
                    or np.dtype(theirs[n].dtype) != dtype]
        theirs = {n: spec for n, spec in theirs.items() if n not in dynamic}
        problems += [f"{n!r} is not on the shards" for n in mine if n not in theirs]
        problems += [f"the shards hold {n!r}, the model does not" for n in theirs if n not in mine]
        problems += [f"{n!r} is {theirs[n].dtype}{list(theirs[n].shape)} on the shards, "
                     f"{mine[n].dtype}{list(mine[n].shape)} in the model"
                     for n in mine if n in theirs and (tuple(theirs[n].shape) != mine[n].shape
                                                       or np.dtype(theirs[n].dtype) != mine[n].dtype)]
        problems += [f"{n!r} is {'state' if n in self.engine.state_names else 'a parameter'} in the model, "
                     f"{'state' if theirs[n].state else 'a parameter'} on the shards"
                     for n in mine if n in theirs and theirs[n].state != (n in self.engine.state_names)]
        if problems:
            raise TrainingError(f"the shards' parameters differ from model {self.engine.model_path}: "
                                + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))

    # ------------------------------------------------------------------ training

    def _pull(self, after: PushReport | None = None) -> dict[str, np.ndarray] | None:
        """The next parameters as the mode says after the push `after` (PSClient.pull_after); None when `stop` was
        set while it waited; TrainingError when it waited wait_timeout in all."""
        try:
            return self.client.pull_after(after, self.dense_names, sync=self.mode == "sync", ssp=self.mode == "ssp",
                                          timeout=self.plan.wait_timeout, recheck=RECHECK_SECONDS,
                                          last_step=self.plan.steps)
        except WaitTimeoutError as exc:
            raise TrainingError(str(exc)) from exc

    def _maybe_evaluate(self, parameters: Mapping[str, np.ndarray], step: int, elapsed: float,
                        *, final: bool = False) -> dict[str, Any] | None:
        plan = self.plan
        if not plan.is_chief:
            return None
        if not final:
            if plan.eval_every <= 0 or (plan.steps is not None and step >= plan.steps):
                return None   # the final evaluation covers the last step
            bucket = step // plan.eval_every
            if bucket <= self._last_eval_bucket:
                return None
            self._last_eval_bucket = bucket
        train_loss, _ = self._eval_window.take()
        counted = self.client.bytes_pulled   # an evaluation's pulls are not a training step's
        outputs, labels = [], []
        for inputs, y in self.dataset.test_batches(self.engine.batch_size if self.sparse.tables else TEST_BATCH):
            outputs.append(self._predict(parameters, inputs))
            labels.append(y)
        if self.sparse.tables:   # only then does an evaluation pull (and no overlapped push is in flight)
            self.client.bytes_pulled = counted
        metrics = metrics_of(np.concatenate(outputs), np.concatenate(labels), self.dataset.num_classes,
                             kind=self.output_kind, activation=self.engine.output_activation)
        record = {"worker": plan.worker_index, "step": step, "train_loss": train_loss, **metrics,
                  "elapsed": round(elapsed, 3), "final": final}
        self.evaluations.append(record)
        self.report("eval", record)
        return record

    def _predict(self, parameters: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The model's first output for a batch of inputs; with sparse tables, the batch's rows pulled and fed."""
        engine = self.engine
        inputs = {n: inputs[n] for n in self.input_names}
        if not self.sparse.tables:
            return engine.predict(parameters, inputs)[engine.output_names[0]]
        dense = {k: v for k, v in parameters.items() if k in set(self.dense_names or ())}
        ids = self.sparse.unique_ids(inputs)
        rows = self.client.pull_rows(ids, timeout=self.plan.wait_timeout)
        params = {**dense, **{t.rows_name: self.sparse.rows_parameter(n, rows[n]) for n, t in self.sparse.tables.items()}}
        return engine.predict(params, self.sparse.feeds(inputs, ids))[engine.output_names[0]]

    def run(self) -> dict[str, Any]:
        """Joins, trains and leaves (see the module docstring); returns the result (also reported as "done")."""
        plan, client = self.plan, self.client
        self.join()
        tally = _Tally(start_clock=client.clock, epoch=client.clock // self.batches_per_epoch)
        self.report("start", {
            "worker": plan.worker_index, "worker_id": client.worker_id, "mode": self.mode,
            "shards": client.num_shards, "workers": plan.num_workers, "step": client.step,
            "clock": tally.start_clock, "resumed": self.resumed, "train_examples": self.part.num_rows,
            "batch_size": plan.batch_size, "batches_per_epoch": self.batches_per_epoch,
            "target_steps": plan.steps, "epochs": plan.epochs})
        if plan.steps is not None and client.step >= plan.steps:   # resumed from a finished job's checkpoints
            log.warning("the shards are already at step %d, at or past --steps %d: nothing to train (raise --steps "
                        "to train further)", client.step, plan.steps, extra={"step": client.step, "steps": plan.steps})
        started = time.monotonic()
        try:
            stopped = self._train(tally, started)
        except StoppedError:   # a wait of the client ended by `stop` (SIGTERM): the step is abandoned
            stopped = True
        finally:
            seconds = time.monotonic() - started
            self._drain_quietly()
            client.deregister()   # at once, so no sync step waits for this worker
        final: dict[str, Any] | None = None
        if not stopped and plan.is_chief:
            self._wait_for_the_others()
            if not self.stop.is_set():
                parameters = client.pull(self.dense_names, timeout=plan.wait_timeout)
                final = self._maybe_evaluate(parameters, client.step, time.monotonic() - started, final=True)
        samples = tally.iterations * plan.batch_size
        result: dict[str, Any] = {
            "worker": plan.worker_index, "worker_id": client.worker_id, "mode": self.mode,
            "shards": client.num_shards, "workers": plan.num_workers, "steps": client.step,
            "iterations": tally.iterations, "clock": client.clock, "samples": samples, "seconds": round(seconds, 3),
            "samples_per_second": round(samples / max(seconds, 1e-9), 1), "accepted": tally.accepted,
            "dropped": tally.dropped, "stale_drops": tally.stale, "loss": finite(tally.loss),
            "epochs_done": round((tally.start_clock + tally.iterations) / self.batches_per_epoch, 3),
            "resumed": self.resumed, "stopped": stopped,
            "test_accuracy": final["test_accuracy"] if final else None,
            "test_loss": final["test_loss"] if final else None,
            "test_auc": final.get("test_auc") if final else None,
            "bytes_pulled_per_step": round((client.bytes_pulled - tally.bytes_pulled) / max(1, tally.iterations), 1),
            "bytes_pushed_per_step": round((client.bytes_pushed - tally.bytes_pushed) / max(1, tally.iterations), 1),
            "unique_rows_per_step": round(tally.rows / max(1, tally.iterations), 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "device": self.engine.device, "providers": self.engine.providers}
        result.update(self._result_extras(result))
        self.report("done", result)
        return result

    def _result_extras(self, result: Mapping[str, Any]) -> dict[str, Any]:
        """Fields a kind of worker adds to (or changes in) its result before it is reported (none here)."""
        return {}

    def _done(self, tally: _Tally) -> bool:
        """True once the shards reached `steps` or this worker finished its `epochs`."""
        plan = self.plan
        in_flight = self._in_flight is not None   # an overlapped push on its way moves the step by one more
        if plan.steps is not None and self.client.step + in_flight >= plan.steps:
            return True
        pushed = tally.iterations + in_flight
        return plan.epochs is not None and tally.start_clock + pushed >= plan.epochs * self.batches_per_epoch

    def _last_iteration(self, tally: _Tally) -> bool:
        """Whether the step being pushed is plainly this worker's last (sync: the step it completes is
        `steps`; epochs: the last batch), so its PushPull need not read the next batch's rows. In async
        and ssp other workers move the step too: there the last step's rows may be read for nothing
        (for a dynamic table, that creates them, as an evaluation of unseen ids does)."""
        plan = self.plan
        if plan.epochs is not None and tally.start_clock + tally.iterations + 1 >= plan.epochs * self.batches_per_epoch:
            return True
        return plan.steps is not None and self.mode == "sync" and self.client.step + 1 >= plan.steps

    def _first_pull(self, tally: _Tally) -> dict[str, np.ndarray] | None:
        """The loop's first parameters (None when stopped), evaluated at the start; from here the
        byte counters count the loop's own bytes."""
        parameters = self._pull()
        if parameters is not None:
            self._maybe_evaluate(parameters, self.client.step, 0.0)
            tally.bytes_pulled, tally.bytes_pushed = self.client.bytes_pulled, self.client.bytes_pushed
        return parameters


    def _train(self, tally: _Tally, started: float) -> bool:
        """Step 3 of the module docstring until the run is over (False) or `stop` is set (True): one `_step` after
        another, each pushed, counted and followed by the pull the mode needs, evaluations and progress."""
        plan = self.plan
        window = _Window()
        last_progress = started
        parameters = self._first_pull(tally)
        if parameters is None:
            return True
        self._begin(tally)
        while True:
            if self.stop.is_set():
                return True
            step = self._step(tally, parameters)
            if step.finished or step.stopped:
                return step.stopped
            if step.outcome is None:   # abandoned before its push; its parameters are the next step's
                if step.parameters is None:
                    return True
                parameters = step.parameters
                continue
            if step.loss is not None:
                tally.loss = step.loss
            tally.count(step.outcome)
            window.add(step.loss or 0.0, plan.batch_size)
            self._eval_window.add(step.loss or 0.0, plan.batch_size)
            parameters = step.parameters if step.parameters is not None else self._pull(step.outcome)
            if parameters is None:
                return True   # stopped while waiting: the step is abandoned (its gradient may still count)
            now = time.monotonic()
            self._maybe_evaluate(parameters, self.client.step, now - started)
            if now - last_progress >= plan.progress_every:
                last_progress = now
                self._report_progress(tally, window, now - started)

    # ------------------------------------------------------------------ one data-parallel step

    def _begin(self, tally: _Tally) -> None:
        """Before the first step: where in the data this run starts (a restarted worker continues at its clock)."""
        self._data = self.part.batches(self.plan.batch_size, start=tally.start_clock, seed=self.plan.seed)
        row = tally.start_clock * self.plan.batch_size
        log.info("reading its part of the training data (%d rows) from row %d, epoch %d", self.part.num_rows, row,
                 row // self.part.num_rows, extra={"data_row": row, "part_rows": self.part.num_rows})
        self._upcoming = next(self._data)
        # sparse tables: (ids, rows) of the upcoming batch, rows None when the last PushPull did not read them
        self._prefetched: tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None] | None = None
        self._wait_steps: list[int] | None = None   # sync: the steps the next rows must be read at

    def _overlapping(self) -> bool:
        return self.plan.overlap and self.mode == "async" and not self.sparse.tables

    def _overlapped(self, client: PSClient, gradients: dict[str, np.ndarray], loss: float,
                    parameters: dict[str, np.ndarray], wait: dict[str, Any]) -> _Step:
        """Waits for the step before this one (its push and the read after it, on the overlap thread), then sends
        this step's on that thread and returns the one before: its report and the parameters it read, which the
        next gradient is computed on while this step's push travels. The first step returns no report (`pending`)
        and `parameters` for the next.

        Each push says the steps its gradient's parameters were read at (`read_steps`), not the client's latest:
        the shards judge its staleness by them."""
        if self._overlap_pool is None:
            self._overlap_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap")
            self._read_steps = list(client.steps)   # nothing in flight yet: the steps `parameters` were read at
        read_steps = self._read_steps
        previous, self._in_flight = self._in_flight, None
        done = self._finish(previous) if previous is not None else None
        if done is not None and done.parameters is None:   # stopped while it read: nothing more is sent
            return _Step(stopped=True)

        def exchange() -> tuple[PushReport, dict[str, np.ndarray] | None, list[int]]:
            outcome, read = client.push_pull(gradients, read_steps=read_steps, **wait)
            if read is None:
                read = self._pull(outcome)
            return outcome, read, list(client.steps)   # the steps `read` belongs to, taken on this thread

        self._in_flight = (self._overlap_pool.submit(exchange), loss)
        if done is None:
            return _Step(None, parameters, loss, pending=True)
        self._read_steps = done.read_steps
        return done

    @staticmethod
    def _finish(in_flight: tuple[Future, float]) -> _Step:
        future, loss = in_flight
        outcome, read, steps = future.result()
        return _Step(outcome, read, loss, read_steps=steps)

    def _drain_quietly(self) -> None:
        """Waits for an overlapped push still in flight when the run ends early (stop, an error): its failure is
        logged, not raised over the run's own outcome."""
        try:
            self._drain()
        except (ServerError, StoppedError, TrainingError) as exc:
            log.warning("the overlapped push in flight when the run ended failed: %s", exc)

    def _drain(self) -> _Step | None:
        """The PushPull still in flight, waited for (the loop's last step, or before leaving); None if none."""
        in_flight, self._in_flight = self._in_flight, None
        step = None
        if in_flight is not None:
            step = self._finish(in_flight)
            if step.parameters is None:
                step = _Step(stopped=True)
        if self._overlap_pool is not None:
            self._overlap_pool.shutdown(wait=True)
            self._overlap_pool = None
        return step

    def _step(self, tally: _Tally, parameters: dict[str, np.ndarray]) -> _Step:
        """One batch: gradients at `parameters`, pushed in one round trip per shard with the pull the mode needs
        next (at most RECHECK_SECONDS of waiting; past that `_pull` takes over). The push carries the running
        statistics too (the shards replace them: sync takes the mean). With sparse tables the row gradients ride
        in the push, and the pull reads the dense tensors and the next batch's rows (unless this is plainly the
        last step)."""
        if self._done(tally):
            last = self._drain()   # an overlapped push still in flight is the run's last step: count it
            return last if last is not None else _Step(finished=True)
        client, plan = self.client, self.plan
        (tally.epoch, inputs, y), self._upcoming = self._upcoming, next(self._data)
        batch = {n: inputs[n] for n in self.input_names}
        if self._feeds_labels:
            batch["labels"] = y
        ids = None
        if self.sparse.tables:   # the rows this batch touches (docs/protocol.md, "Sparse rows")
            # the rows the last step's PushPull read, at this step's values; else pulled now
            ids, rows = self._prefetched if self._prefetched is not None else (self.sparse.unique_ids(batch), None)
            if rows is None:
                rows = client.pull_rows(ids, min_steps=self._wait_steps, timeout=plan.wait_timeout)
            tally.rows += sum(len(v) for v in ids.values())
            parameters = {**parameters, **{t.rows_name: self.sparse.rows_parameter(n, rows[n])
                                           for n, t in self.sparse.tables.items()}}
            batch = self.sparse.feeds(batch, ids)
        result = self.engine.step(parameters, batch)
        gradients = result.gradients
        wait = dict(wait_for_step=self.mode == "sync", ssp=self.mode == "ssp", wait=RECHECK_SECONDS)
        self._prefetched = None
        if ids is None and self._overlapping():
            return self._overlapped(client, {**gradients, **result.state}, result.loss, parameters, wait)
        read_steps = self._declared_read_steps()
        if ids is None:
            outcome, parameters = client.push_pull({**gradients, **result.state}, read_steps=read_steps, **wait)
        else:
            row_gradients = self.sparse.row_gradients(gradients, ids)
            rows_names = {t.rows_name for t in self.sparse.tables.values()}
            gradients = {k: v for k, v in gradients.items() if k not in rows_names}
            next_ids = None if self._last_iteration(tally) else \
                self.sparse.unique_ids(self._upcoming[1])
            if next_ids is None:
                outcome, parameters = client.push_pull({**gradients, **result.state}, read_steps=read_steps, **wait,
                                                       row_gradients=row_gradients, names=self.dense_names)
            else:
                outcome, parameters, next_rows = client.push_pull_rows(
                    {**gradients, **result.state}, row_gradients, names=self.dense_names, rows=next_ids,
                    read_steps=read_steps, **wait)
                self._prefetched = (next_ids, next_rows)
        self._wait_steps = outcome.wait_steps if self.mode == "sync" else None
        return _Step(outcome, parameters, result.loss)

    def _declared_read_steps(self) -> list[int] | None:
        """The read steps a push declares: the client's (None), except in sync mode with --steps for a shard that
        already reached the last step while another lags. Sync shards move independently, so a worker can read
        one at the last step and another a step behind; the gradient the lagging shard needs then reaches the
        other too, and there it would begin a step past the job's end, which either waits for a second gradient
        no finished worker sends (the job hung) or is applied when the workers leave (the shard ends a step
        past --steps). Declared read one step before that shard's, it is dropped there as stale."""
        steps, last = self.client.steps, self.plan.steps
        if self.mode != "sync" or last is None or not any(step >= last for step in steps):
            return None
        return [step - 1 if step >= last else step for step in steps]

    def _report_progress(self, tally: _Tally, window: _Window, elapsed: float) -> None:
        """A "progress" event: the loss and rate since the last one (`window`), the counts so far."""
        mean_loss, rate = window.take()
        fields = {"worker": self.plan.worker_index, "step": self.client.step, "iteration": tally.iterations,
                  "clock": self.client.clock, "epoch": tally.epoch, "loss": mean_loss,
                  "samples_per_second": round(rate, 1), "samples": tally.iterations * self.plan.batch_size,
                  "accepted": tally.accepted, "dropped": tally.dropped, "stale_drops": tally.stale,
                  "elapsed": round(elapsed, 3)}
        self.report("progress", {**fields, **self._progress_extras(fields)})

    def _progress_extras(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Fields a subclass adds to (or overrides in) a progress event (the stage worker's)."""
        return {}

    def _wait_for_the_others(self) -> None:
        """Worker 0, done: waits until no other worker is live on shard 0, so its evaluation sees every update.

        A worker is live until it deregisters or its lease runs out, so a dead one is waited
        for one lease at most. Bounded by wait_timeout; running out (or `stop`) only warns.
        """
        client = self.client

        def others_left() -> bool:
            return not (client.shard_status(0).live_workers - {client.worker_id})

        try:
            self._wait_until("the other workers to finish (deregister, or their leases to run out)",
                             time.monotonic() + self.plan.wait_timeout, others_left)
        except TrainingError as exc:
            log.warning("%s; evaluating the parameters as they are", exc)
