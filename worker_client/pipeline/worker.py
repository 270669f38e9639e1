"""A pipeline stage worker: one stage of one replica, between its neighbour stages and its own shards.

The job (docs/pipeline.md): the model's graph cut into K stages (cut.py); R replicas of the
whole pipeline; stage k of every replica trains stage k's parameters, which live on stage k's
own shards -- a shard group of its own, so every consistency mode applies to each stage's
parameters exactly as it does to a data-parallel job's: the R stage-k workers are that
group's workers. A `StageTrainer` is a `Trainer` (joining, registration, the start barrier,
the mode's pulls and fused push-pulls, progress events) whose step is a pipeline step:

1. stage 0 chooses the step's id (milliseconds since the epoch, rising: ids never repeat,
   even across a restart) and reads the batch; every other stage waits for the id's first
   activations (`Inbox.next_step`), or for END;
2. forward, micro-batch by micro-batch (stage.py), activations sent on (`StageLink`);
3. backward, micro-batch by micro-batch, cotangents sent back;
4. commit: stage 0, its backward done, knows every stage has its gradients and sends COMMIT
   down the pipeline; each stage pushes its gradients (and running statistics) when the
   COMMIT reaches it, then pulls as the mode says. Without the COMMIT no stage pushes.

Faults. A neighbour that stays unreachable for `peer_timeout` seconds, or a wait that outlasts
the job's wait_timeout, abandons the step in flight: nothing of it is pushed, its messages
are discarded (later arrivals for it too), and the stage leaves its shard group
(deregisters) so the group's quorum does not wait for a replica that cannot push. It
re-registers once its neighbours answer again (a restarted stage worker publishes its new
address), and carries on with a fresh step. The other replicas train on meanwhile; a stage
whose neighbours never come back gives up after wait_timeout.

Stage 0 ends the run: when the shards' step reaches `steps` (or its epochs are done) it
sends END, which every stage passes on before it leaves. Evaluation needs the whole model,
which no stage worker holds: the launcher evaluates the final parameters (evaluate.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ps_common.errors import PSError, StageTimeoutError, StoppedError, TrainingError
from ps_common.jobconfig import JobConfig
from ps_common.scratch import ScratchDir
from ps_common.tls import AUTH_TOKEN_ENV, token_from
from ps_models.datasets import Dataset, load_dataset
from worker_client.client import PSClient, ServerError
from worker_client.client.from_job import client_for_job
from worker_client.engine.load import load_model
from worker_client.engine.sparse import SparsePlan
from worker_client.pipeline import rendezvous
from worker_client.pipeline.cut import StagePlan, plan_stages, stage_model
from worker_client.pipeline.exchange import Kind, StageLink, StageSecurity, StageServer
from worker_client.pipeline.stage import LABELS, StageRunner, split_batch
from worker_client.training.preflight import resolve_model
from worker_client.training import RECHECK_SECONDS, EventSink, Trainer, TrainingPlan
from worker_client.training.loop import _Step, _Tally

log = logging.getLogger(__name__)

#: How often a waiting stage checks that its neighbour is still reachable (seconds).
PEER_CHECK_SECONDS = 1.0
#: The longest one reachability probe waits for a connection (seconds).
PROBE_SECONDS = 0.5


class _PeerLost(Exception):
    """The step in flight cannot finish: a neighbour is gone or a wait ran out."""


class _StageEngineView:
    """What `Trainer` reads of an engine, for a stage: its own parameters, the whole model's inputs."""

    def __init__(self, runner: StageRunner, model_inputs: list[str], batch_size: int) -> None:
        self.runner = runner
        self.model_path = runner.engine.model_path
        self.batch_size = batch_size
        self.trainable_names = runner.trainable_names
        self.state_names = runner.state_names
        self.input_names = list(model_inputs)
        self.data_inputs = {name: (None, None) for name in model_inputs}   # the whole model's data inputs
        self.loss_kind = runner.engine.loss_kind
        self.takes_labels = True   # the batch's labels go to the last stage, whose loss reads them
        self.sparse = SparsePlan({}, [])
        self.device = runner.engine.device

    @property
    def providers(self) -> list[str]:
        """The stage engine's onnxruntime providers (GradientEngine.providers)."""
        return self.runner.engine.providers

    def server_parameters(self) -> dict[str, np.ndarray]:
        return self.runner.parameters()

    def state(self) -> dict[str, np.ndarray]:
        return self.runner.initial_state()

    def dynamic_tables(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {}   # pipelines train no sparse or dynamic tables (refused by the settings)


@dataclass
class StageLinks:
    """A stage worker's inbox and its links to the previous and next stage (None at the ends)."""

    server: StageServer
    prev: StageLink | None
    next: StageLink | None

    def close(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.close()
        self.server.close(0.5)


class StageTrainer(Trainer):
    """One stage worker's training run (module docstring)."""

    def __init__(self, client: PSClient, runner: StageRunner, dataset: Dataset, *, plan: TrainingPlan,
                 links: StageLinks, model_inputs: list[str], micro_batches: int, peer_timeout: float,
                 report: EventSink | None = None, stop: threading.Event | None = None,
                 expected_mode: str | None = None) -> None:
        super().__init__(client, _StageEngineView(runner, model_inputs, plan.batch_size), dataset, plan=plan,
                         report=report, stop=stop, expected_mode=expected_mode)
        self.runner = runner
        self.links = links
        self.micro_batches = micro_batches
        self.peer_timeout = peer_timeout
        self.stage = runner.index
        self.stages = runner.plan.count
        self.abandoned = 0
        self._last_step = -1

    # evaluation needs the whole model: the launcher does it (evaluate.py)
    def _maybe_evaluate(self, parameters: Mapping[str, np.ndarray], step: int, elapsed: float,
                        *, final: bool = False) -> dict[str, Any] | None:
        return None

    def _progress_extras(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        extras: dict[str, Any] = {"stage": self.stage, "abandoned_steps": self.abandoned}
        if not self.runner.last:   # the loss is the last stage's to report
            extras["loss"] = None
        if self.stage > 0:   # a batch is counted once: by stage 0
            extras.update(samples_per_second=0.0, samples=0)
        return extras

    def _result_extras(self, result: Mapping[str, Any]) -> dict[str, Any]:
        extras = {"stage": self.stage, "stages": self.stages, "micro_batches": self.micro_batches,
                  "abandoned_steps": self.abandoned, "parameters": len(self.runner.trainable_names),
                  "parameter_bytes": int(sum(v.nbytes for v in self.runner.parameters().values()))}
        if self.stage > 0:   # a batch is counted once: by stage 0
            extras.update(samples=0, samples_per_second=0.0)
        return extras

    # ------------------------------------------------------------------ the loop

    def _begin(self, tally: _Tally) -> None:
        self._data = self.part.batches(self.plan.batch_size, start=tally.start_clock, seed=self.plan.seed) \
            if self.stage == 0 else None

    def _step(self, tally: _Tally, parameters: dict[str, np.ndarray]) -> _Step:
        """One pipeline step (the module docstring): stage 0 starts it with a batch, the others wait for its
        activations; forward, backward, COMMIT, then the push with the pull the mode needs. END finishes the run;
        a neighbour lost abandons the step (nothing pushed) and returns fresh parameters."""
        if self.stage == 0:
            if self._done(tally):
                self._send_on(Kind.END, self._new_step())
                return _Step(finished=True)
            step = self._new_step()
            tally.epoch, inputs, y = next(self._data)
            micro = split_batch({**{n: inputs[n] for n in self.input_names}, LABELS: y}, self.micro_batches)
        else:
            found = self._next_step()
            if found is None:
                return _Step(stopped=True)
            kind, step = found
            if kind is Kind.END:
                self.links.server.inbox.take(Kind.END, step, 0, timeout=1.0, stop=self.stop)
                self._send_on(Kind.END, step)
                return _Step(finished=True)
            micro = None
        try:
            self._pipeline_step(step, parameters, micro)
        except _PeerLost as exc:
            if self.stop.is_set():
                return _Step(stopped=True)
            return _Step(parameters=self._abandon(step, str(exc)))
        outcome, parameters = self.client.push_pull({**self.runner.gradients(), **self.runner.new_state()},
                                                    wait_for_step=self.mode == "sync", ssp=self.mode == "ssp",
                                                    wait=RECHECK_SECONDS)
        return _Step(outcome, parameters, self.runner.loss if self.runner.last else None)

    def _new_step(self) -> int:
        """Stage 0's id for the next step: milliseconds since the epoch, above the last id."""
        self._last_step = max(self._last_step + 1, int(time.time() * 1000))
        return self._last_step

    def _next_step(self) -> tuple[Kind, int] | None:
        """Every stage but the first: waits for the next step's first activations (or END).

        While the previous stage is unreachable for peer_timeout s this stage is out of its
        shards' quorum (deregistered), and back in once it answers; wait_timeout s without a
        step at all is a TrainingError."""
        server, prev = self.links.server, self.links.prev
        assert prev is not None
        waited_since = time.monotonic()
        unreachable_since: float | None = None
        while True:
            try:
                found = server.next_step((Kind.ACTIVATIONS, Kind.END), self._last_step, timeout=PEER_CHECK_SECONDS,
                                         stop=self.stop)
            except StoppedError:
                return None
            if found is not None:
                self._last_step = found[1]
                if unreachable_since is not None and not self._registered:
                    self._rejoin()
                return found
            now = time.monotonic()
            if not prev.reachable(PROBE_SECONDS):
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= self.peer_timeout and self._registered:
                    log.warning("stage %d of replica %d: stage %d at %s unreachable for %.0f s; leaving the "
                                "shards' quorum until it is back", self.stage, self.plan.worker_index,
                                self.stage - 1, prev.address, now - unreachable_since)
                    self._leave()
            elif unreachable_since is not None:
                unreachable_since = None
                if not self._registered:
                    self._rejoin()
            if now - waited_since >= self.plan.wait_timeout:
                raise TrainingError(f"stage {self.stage} of replica {self.plan.worker_index}: no step from stage "
                                    f"{self.stage - 1} ({prev.address}) for {now - waited_since:.0f} s "
                                    f"(wait_timeout)")

    # ------------------------------------------------------------------ one pipeline step

    def _pipeline_step(self, step: int, parameters: Mapping[str, np.ndarray],
                       micro: list[dict[str, np.ndarray]] | None) -> None:
        runner, m = self.runner, self.micro_batches
        runner.begin()
        for i in range(m):   # every forward
            received = micro[i] if micro is not None else self._take(Kind.ACTIVATIONS, step, i)
            sent = runner.forward(i, parameters, received)
            if sent is not None:
                self._send(self.links.next, Kind.ACTIVATIONS, step, i, m, sent)
        for i in range(m):   # every backward
            cotangents = None if runner.last else self._take(Kind.COTANGENTS, step, i)
            back = runner.backward(i, parameters, cotangents)
            if self.stage > 0:
                self._send(self.links.prev, Kind.COTANGENTS, step, i, m, back)
        if self.stage > 0:   # stage 0's backward ends the step's computation: it commits
            self._take(Kind.COMMIT, step, 0)
        self._send_on(Kind.COMMIT, step)
        self.links.server.discard_through(step)

    def _send_on(self, kind: Kind, step: int) -> None:
        """COMMIT or END to the next stage, if there is one."""
        if self.links.next is not None:
            self._send(self.links.next, kind, step, 0, 1, {})

    def _send(self, link: StageLink | None, kind: Kind, step: int, micro: int, count: int,
              tensors: Mapping[str, np.ndarray]) -> None:
        assert link is not None
        try:
            link.send(kind, step, micro, count, tensors, timeout=self.peer_timeout, stop=self.stop)
        except StoppedError as exc:
            raise _PeerLost(f"stopped: {exc}") from exc
        except ServerError as exc:
            raise _PeerLost(f"{kind.name} of step {step} micro-batch {micro} to stage {link.to_stage} "
                            f"({link.address}) failed: {exc}") from exc

    def _take(self, kind: Kind, step: int, micro: int) -> dict[str, np.ndarray]:
        """The message, waiting while its sender is reachable (at most wait_timeout s in all)."""
        peer = self.links.prev if kind.sender(self.stage) < self.stage else self.links.next
        assert peer is not None
        started = time.monotonic()
        unreachable_since: float | None = None
        while True:
            try:
                return self.links.server.take(kind, step, micro, timeout=PEER_CHECK_SECONDS, stop=self.stop)
            except StageTimeoutError:
                pass
            except StoppedError as exc:
                raise _PeerLost(f"stopped: {exc}") from exc
            now = time.monotonic()
            if now - started >= self.plan.wait_timeout:
                raise _PeerLost(f"no {kind.name} of step {step} micro-batch {micro} from stage "
                                f"{kind.sender(self.stage)} in {now - started:.0f} s (wait_timeout)")
            if peer.reachable(PROBE_SECONDS):
                unreachable_since = None
                continue
            unreachable_since = unreachable_since or now
            if now - unreachable_since >= self.peer_timeout:
                raise _PeerLost(f"stage {peer.to_stage} at {peer.address} has been unreachable for "
                                f"{now - unreachable_since:.0f} s while this stage waited for its {kind.name} of "
                                f"step {step} micro-batch {micro}")

    # ------------------------------------------------------------------ faults

    @property
    def _registered(self) -> bool:
        return self.client.heartbeating

    def _leave(self) -> None:
        self.client.deregister()
        self.report("left", {"worker": self.plan.worker_index, "stage": self.stage})

    def _rejoin(self) -> None:
        clock = self.client.register(heartbeat=True)
        log.info("stage %d of replica %d: neighbours back; rejoined the shards at clock %d", self.stage,
                 self.plan.worker_index, clock)
        self.report("rejoined", {"worker": self.plan.worker_index, "stage": self.stage, "clock": clock})

    def _abandon(self, step: int, why: str) -> dict[str, np.ndarray] | None:
        """Drops the step (nothing of it is pushed), leaves the quorum until the neighbours are
        back, rejoins and pulls afresh; None when stopped."""
        self.abandoned += 1
        self.runner.begin()
        self.links.server.discard_through(step)
        self._last_step = max(self._last_step, step)
        log.warning("stage %d of replica %d abandons step %d (nothing of it is pushed): %s", self.stage,
                    self.plan.worker_index, step, why,
                    extra={"stage": self.stage, "step_id": step, "reason": why})
        self._leave()
        peers = [link for link in (self.links.prev, self.links.next) if link is not None]
        deadline = time.monotonic() + self.plan.wait_timeout
        while not all(link.reachable(PROBE_SECONDS) for link in peers):
            if self.stop.wait(PEER_CHECK_SECONDS):
                return None
            if time.monotonic() >= deadline:
                raise TrainingError(f"stage {self.stage} of replica {self.plan.worker_index}: its neighbour "
                                    f"stages {[link.address for link in peers]} did not come back within "
                                    f"{self.plan.wait_timeout:.0f} s (wait_timeout)")
        self._rejoin()
        return self._pull()


# ---------------------------------------------------------------------- setting a stage worker up


def stage_files(job: JobConfig, workdir: Path) -> tuple[StagePlan, Path]:
    """The plan and this stage's model file: from --stage-plan, or cut from --model here."""
    w, stages = job.worker, job.job.stages
    if w.stage_plan:
        folder = Path(w.stage_plan)
        try:
            plan = StagePlan.from_json((folder / "stages.json").read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TrainingError(f"--stage-plan {folder}: cannot read stages.json: {exc}") from exc
        if plan.count != stages:
            raise TrainingError(f"--stage-plan {folder} holds {plan.count} stages, but the job has stages = {stages}")
        return plan, folder / f"stage{w.stage}.onnx"
    model_path, _ = resolve_model(w.model, workdir)
    model = load_model(model_path)
    plan = plan_stages(model, stages, cuts=job.job.cuts, loss=w.loss,
                       include=w.include, exclude=w.exclude, source=str(model_path))
    path = workdir / f"stage{w.stage}.onnx"
    onnx.save(stage_model(model, plan, w.stage), str(path))
    return plan, path


def stage_security(job: JobConfig) -> StageSecurity:
    """The job's security for the stage exchange: the worker token; TLS with the worker's own
    certificate when it has one (mutual with its CA); otherwise plaintext, as a shard allows it:
    on loopback, or anywhere with the worker's `insecure`."""
    w = job.worker
    token = token_from(job.job.auth_token_file, env_var=AUTH_TOKEN_ENV)
    tls = bool(w.tls_cert and w.tls_key)
    return StageSecurity(token=token, server_cert=w.tls_cert if tls else None, server_key=w.tls_key if tls else None,
                         client_ca=w.tls_ca if tls else None, insecure=w.insecure, ca=w.tls_ca, cert=w.tls_cert,
                         key=w.tls_key)


def open_links(job: JobConfig, security: StageSecurity) -> StageLinks:
    """This stage's server (published to the rendezvous folder) and links to its neighbours."""
    w, stages = job.worker, job.job.stages
    replica, stage = w.index, w.stage
    server = StageServer(w.stage_listen, replica=replica, stage=stage, security=security)
    peers: list[StageLink | None] = []
    try:
        if w.stage_rendezvous:
            rendezvous.publish(w.stage_rendezvous, replica, stage, server.address)
        for neighbour in (stage - 1, stage + 1):
            if not 0 <= neighbour < stages:
                peers.append(None)
                continue
            if w.stage_rendezvous:
                folder = w.stage_rendezvous

                def resolve(n: int = neighbour, f: str = folder) -> str:
                    return rendezvous.lookup(f, replica, n, timeout=PROBE_SECONDS)

                address = rendezvous.lookup(folder, replica, neighbour, timeout=w.start_timeout)
                peers.append(StageLink(address, replica=replica, from_stage=stage, to_stage=neighbour,
                                       security=security, rpc_timeout=w.rpc_timeout, resolve=resolve))
            else:
                index = 0 if neighbour < stage else 1
                if len(w.stage_peers) != 2 or w.stage_peers[index] in ("", "-"):
                    raise TrainingError(f"stage {stage} of replica {replica} needs stage {neighbour}'s address: "
                                        f"give --stage-peers PREV,NEXT (or TF_CONFIG, or --stage-rendezvous)")
                peers.append(StageLink(w.stage_peers[index], replica=replica, from_stage=stage,
                                       to_stage=neighbour, security=security, rpc_timeout=w.rpc_timeout))
    except BaseException:
        for link in peers:
            if link is not None:
                link.close()
        server.close(0)
        raise
    return StageLinks(server, peers[0], peers[1])


def run_stage_worker(job: JobConfig, *, report: EventSink | None = None,
                     stop: threading.Event | None = None) -> dict[str, Any]:
    """Prepares this stage (its model only), connects to its shards and neighbours, trains."""
    w = job.worker
    with ScratchDir("ps-stage") as scratch:
        plan, path = stage_files(job, Path(scratch))
        micro_batches = job.job.micro_batches   # resolved and checked against the batch size by the settings
        runner = StageRunner(plan, w.stage, path, micro_batch_size=w.batch_size // micro_batches,
                             micro_batches=micro_batches, loss=w.loss, device=w.device, include=w.include,
                             exclude=w.exclude, seed=job.job.seed + w.index, intra_op_threads=w.intra_op_threads)
        _, kind = resolve_model(str(path), Path(scratch))
        dataset = load_dataset(w.data, seed=job.job.seed, model=kind)
        training = TrainingPlan(worker_index=w.index, num_workers=job.job.workers or 1, batch_size=w.batch_size,
                                steps=w.steps, epochs=w.epochs, seed=job.job.seed, eval_every=0,
                                progress_every=w.progress_every, start_timeout=w.start_timeout,
                                wait_timeout=job.job.wait_timeout)
        worker_id = w.worker_id if "worker.worker_id" in job.sources else f"replica{w.index}-stage{w.stage}"
        log.info("stage %d of %d, replica %d of %d (%s): %d parameters, %d micro-batches of %d, shards %s",
                 w.stage, plan.count, w.index, job.job.workers or 1, worker_id, len(runner.trainable_names),
                 micro_batches, w.batch_size // micro_batches, w.servers,
                 extra={"stage": w.stage, "replica": w.index, "servers": w.servers})
        links = open_links(job, stage_security(job))
        client = client_for_job(job, worker_id=worker_id, stop=stop)
        try:
            expected_mode = job.job.mode if "job.mode" in job.sources else None
            return StageTrainer(client, runner, dataset, plan=training, links=links, model_inputs=plan.model_inputs,
                                micro_batches=micro_batches, peer_timeout=w.stage_peer_timeout, report=report,
                                stop=stop, expected_mode=expected_mode).run()
        except PSError:
            raise
        finally:
            client.close()
            links.close()
