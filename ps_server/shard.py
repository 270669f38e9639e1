"""One shard's domain logic: where a push goes, when a pull is answered, who is live.

The shard owns the store (values and optimizer state), the membership (leases and
clocks), the consistency policy and the barriers. Every state change happens under one
condition variable, and every change that could release a waiter notifies it. Requests
are fully decoded and checked before the lock is taken, so a rejected request changes
nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common.codec import PartAssembler, spec_to_wire
from ps_common.errors import (
    InvalidRequestError,
    NotInitializedError,
    ShuttingDownError,
    WaitTimeoutError,
)
from ps_common.shard_map import ParamSpec
from ps_server.barrier import Barriers
from ps_server.config import ServerConfig
from ps_server.consistency import ConsistencyPolicy, Decision, SyncPolicy, make_policy
from ps_server.membership import Membership
from ps_server.optimizers import make_optimizer
from ps_server.store import EncodedChunk, ParameterStore, PartKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    """The outcome of one push, as reported to the worker."""

    accepted: bool
    drop_reason: int
    message: str
    step: int
    clock: int
    duplicate: bool = False
    aggregated: int = 0


class Shard:
    """The domain object behind one shard process. Thread-safe; pull and barrier block."""

    def __init__(self, config: ServerConfig, *, now=time.monotonic) -> None:
        self.config = config
        self.optimizer = make_optimizer(config.optimizer, **config.optimizer_params)
        self.store = ParameterStore(shard_index=config.shard_index, num_shards=config.num_shards,
                                    partition_min_bytes=config.partition_min_bytes, optimizer=self.optimizer)
        self.membership = Membership(config.lease_seconds, clock=now)
        self.policy: ConsistencyPolicy = make_policy(
            config.mode, replicas_to_aggregate=config.replicas_to_aggregate, total_replicas=config.total_replicas,
            staleness=config.staleness, max_staleness=config.max_staleness)
        self.barriers = Barriers()
        self.step = 0
        self.dropped = 0
        self.applied_gradients = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._resets = 0            # bumped by reset(): a waiter that sees it change fails with UNAVAILABLE
        self._now = now
        self.listeners: list = []   # callables(event: str, **fields), e.g. metrics and checkpoints

    # ------------------------------------------------------------------ helpers

    def _emit(self, event: str, **fields) -> None:
        for listener in self.listeners:
            listener(event, **fields)

    def advance(self, *, applied: int) -> None:
        """Called by the policy (under the lock) after it applied gradients: t += 1."""
        self.step += 1
        self.applied_gradients += applied
        self._emit("step", step=self.step)

    def _check_running(self) -> None:
        if self._stopping:
            raise ShuttingDownError(f"shard {self.config.shard_index} is shutting down")

    def _wait(self, blocker, timeout: float, what: str) -> None:
        """Waits (lock held) until blocker() returns None, or raises WaitTimeoutError after timeout s.

        The timeout is real time (time.monotonic), like the condition's wait: the injected
        `now` clock drives leases only, so a frozen test clock cannot make a wait endless.
        """
        deadline = time.monotonic() + timeout
        resets = self._resets
        reason = blocker()
        while reason is not None:
            self._check_running()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(f"{what} waited {timeout:.1f} s for {reason}")
            self._cond.wait(min(left, 1.0))
            if self._resets != resets:
                raise ShuttingDownError(f"{what}: the parameters of shard {self.config.shard_index} were reset "
                                        "while it waited")
            reason = blocker()

    def wait_timeout(self, requested_ms: int, rpc_remaining: float | None) -> float:
        """The wait bound: the request's (or the default), the shard's maximum and the rpc deadline."""
        if requested_ms < 0:
            raise InvalidRequestError(f"wait_timeout_ms must be >= 0, got {requested_ms}")
        timeout = self.config.wait_timeout_seconds if requested_ms == 0 else min(requested_ms / 1000, self.config.wait_timeout_seconds)
        if rpc_remaining is not None:
            timeout = min(timeout, max(0.0, rpc_remaining))
        return timeout

    # ------------------------------------------------------------------ init

    def initialize(self, specs: Sequence[ParamSpec], chunks: Iterable[pb.TensorChunk], worker_id: str = "") -> tuple[bool, int, int]:
        """Installs the initial values; returns (already_initialized, step, parts owned)."""
        self._check_running()
        with self._cond:
            shard_map, already = self.store.plan(specs)
        assembler = PartAssembler(ParameterStore.expected_from(shard_map, self.config.shard_index))
        for chunk in chunks:
            assembler.add(chunk)
        values = assembler.finish()
        with self._cond:
            shard_map, already = self.store.plan(specs)   # again: another init may have won the race
            if already:
                return True, self.step, len(self.store.parts)
            self.store.install(shard_map, values)
            self._cond.notify_all()
        log.info("shard %d initialized by %r: %d tensors, %d parts here (%d bytes)", self.config.shard_index,
                 worker_id, len(specs), len(self.store.parts), sum(p.value.nbytes for p in self.store.parts.values()))
        self._emit("init")
        return False, self.step, len(self.store.parts)

    # ------------------------------------------------------------------ push

    def decode(self, chunks: Iterable[pb.TensorChunk]) -> dict[PartKey, np.ndarray]:
        """Decodes and checks a push's gradients against the parts this shard owns (no lock, no state)."""
        if not self.store.initialized:
            raise NotInitializedError(
                f"shard {self.config.shard_index} has no parameters yet: push before InitParameters")
        assembler = PartAssembler(self.store.expected)
        for chunk in chunks:
            assembler.add(chunk)
        return assembler.finish()

    def push(self, worker_id: str, clock: int, read_step: int, grads: dict[PartKey, np.ndarray]) -> PushResult:
        """Applies, accumulates or drops one decoded push; answers retries without re-applying."""
        if not worker_id:
            raise InvalidRequestError("push header: worker_id must not be empty")
        if clock < 0 or read_step < 0:
            raise InvalidRequestError(f"push from {worker_id!r}: clock {clock} and read_step {read_step} must be >= 0")
        for (name, row_start), grad in grads.items():
            # min and max propagate NaN and show inf: two fast reductions, no temporary array
            if grad.dtype.kind == "f" and grad.size and not (np.isfinite(grad.min()) and np.isfinite(grad.max())):
                raise InvalidRequestError(
                    f"push from {worker_id!r} at clock {clock}: gradient of {name!r} rows from {row_start} holds NaN or inf")
        with self._cond:
            self._check_running()
            record = self.membership.get(worker_id)
            if clock < record.clock:
                return self._duplicate(record, clock)
            staleness = self.step - read_step   # on arrival, before this push can advance the step
            if read_step > self.step:
                # Only a shard restored from an older checkpoint can be behind a worker's read.
                decision = Decision.drop(pb.DROP_STEP_AHEAD, (
                    f"gradient read at step {read_step}, but shard {self.config.shard_index} is at step {self.step} "
                    f"(restored from an older checkpoint?): dropped; pull again"))
            else:
                decision = self.policy.on_push(self, worker_id, read_step, grads)
            record.clock = clock + 1
            self.membership.renew(worker_id)
            if not decision.accepted:
                self.dropped += 1
            aggregated = len(self.policy.contributors) if isinstance(self.policy, SyncPolicy) else 0
            result = PushResult(decision.accepted, decision.drop_reason, decision.message, self.step, record.clock,
                                aggregated=aggregated)
            self.membership.remember(record, clock, result)
            self._cond.notify_all()
        self._emit("push", worker_id=worker_id, accepted=decision.accepted, reason=decision.drop_reason,
                   staleness=staleness, nbytes=sum(g.nbytes for g in grads.values()))
        return result

    def _duplicate(self, record, clock: int) -> PushResult:
        first = record.outcomes.get(clock)
        self._emit("duplicate", worker_id=record.worker_id)
        if first is not None:
            return PushResult(first.accepted, first.drop_reason, first.message, self.step, record.clock, duplicate=True,
                              aggregated=first.aggregated)
        return PushResult(True, pb.DROP_REASON_UNSPECIFIED,
                          f"clock {clock} was taken before (worker {record.worker_id!r} is at clock {record.clock}); not applied again",
                          self.step, record.clock, duplicate=True)

    # ------------------------------------------------------------------ pull

    def pull(self, names: Sequence[str], *, min_step: int, worker_id: str, clock: int,
             timeout: float) -> list[pb.PullResponse | bytes]:
        """Waits for min_step and the SSP bound (at most timeout s), then returns the messages to stream.

        The first message carries the step (and the small parts, grouped); large chunks
        follow as cached PullResponses already serialized (bytes), which the service's
        Pull serializer passes through unchanged.
        """
        if min_step < 0:
            raise InvalidRequestError(f"min_step must be >= 0, got {min_step}")
        with self._cond:
            self._check_running()
            parts = self.store.select(names)
            if worker_id and worker_id in self.membership.workers:
                self.membership.renew(worker_id)

            def blocker() -> str | None:
                if self.step < min_step:
                    extra = ""
                    if isinstance(self.policy, SyncPolicy):
                        extra = (f"; {len(self.policy.contributors)} of {self.policy.effective_replicas(self)} "
                                 f"gradients in for step {self.step}")
                    return f"step >= {min_step} (shard {self.config.shard_index} is at step {self.step}{extra})"
                return self.policy.pull_blocker(self, worker_id, clock)

            self._wait(blocker, timeout, f"pull by {worker_id or 'a client'!r} on shard {self.config.shard_index}")
            step = self.step
            small: list[pb.TensorChunk] = []
            large: list[EncodedChunk] = []
            for state in parts:
                for encoded in state.encoded(self.config.chunk_bytes, step):
                    if encoded.chunk is not None:
                        small.append(encoded.chunk)
                    else:
                        large.append(encoded)
        self._emit("pull", nbytes=sum(p.value.nbytes for p in parts))
        # Every message costs a round through gRPC's event loop (measured ~1-2 ms for a 1 MB
        # pull): when the first cached message already says the current step, it leads the
        # stream itself, and no separate head message is sent.
        wire = [e.wire for e in large]
        if small or not large or large[0].step != step:
            return [pb.PullResponse(step=step, chunks=small), *wire]
        return wire

    # ------------------------------------------------------------------ membership

    def register(self, worker_id: str) -> tuple[int, int, float]:
        """(clock to resume at, step, lease seconds)."""
        if not worker_id:
            raise InvalidRequestError("worker_id must not be empty")
        with self._cond:
            self._check_running()
            record = self.membership.register(worker_id)
            self._cond.notify_all()
            log.info("worker %r registered on shard %d at clock %d (step %d)", worker_id, self.config.shard_index,
                     record.clock, self.step)
            return record.clock, self.step, self.membership.lease_seconds

    def heartbeat(self, worker_id: str) -> tuple[float, int]:
        if not worker_id:
            raise InvalidRequestError("worker_id must not be empty")
        with self._cond:
            self.membership.renew(worker_id)
            return self.membership.lease_seconds, self.step

    def deregister(self, worker_id: str) -> None:
        with self._cond:
            if self.membership.deregister(worker_id):
                log.info("worker %r left shard %d", worker_id, self.config.shard_index)
                self.policy.on_membership_change(self)
                self._cond.notify_all()

    def tick(self) -> None:
        """Periodic: lets the policy react to expired leases and wakes waiters to re-check."""
        with self._cond:
            self.policy.on_membership_change(self)
            self._cond.notify_all()

    def barrier(self, name: str, participant: str, participants: int, timeout: float) -> tuple[int, int]:
        self._check_running()
        return self.barriers.wait(name, participant, participants, timeout)

    def stop(self) -> None:
        """Refuses new work and wakes every waiter so it can fail fast with UNAVAILABLE."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def reset(self) -> int:
        """Drops the parameters, optimizer state, step, worker clocks and the policy's state (Admin.ResetParameters).

        Afterwards the shard is as if just started: the next InitParameters may set a
        different parameter list, and workers register again. Waiting pulls wake and fail
        with UNAVAILABLE. Returns the step before the reset.
        """
        with self._cond:
            self._check_running()
            before = self.step
            self.store.shard_map, self.store.parts = None, {}
            self.membership.workers.clear()
            c = self.config
            self.policy = make_policy(c.mode, replicas_to_aggregate=c.replicas_to_aggregate,
                                      total_replicas=c.total_replicas, staleness=c.staleness,
                                      max_staleness=c.max_staleness)
            self.step = self.dropped = self.applied_gradients = 0
            self._resets += 1
            self._cond.notify_all()
        self._emit("reset", step=before)
        return before

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self):
        """A copy of the whole state (values, optimizer slots, step, clocks, outcomes, sync step), one consistent cut.

        Copies under the lock (about a memcpy of the shard); see ps_server.checkpoint.
        """
        from ps_server.checkpoint import capture

        with self._cond:
            return capture(self)

    def restore(self, state) -> None:
        """Replaces the whole state with a checkpoint's (before serving); checked first, so a bad one changes nothing."""
        from ps_server.checkpoint import install

        with self._cond:
            install(self, state)
            self._cond.notify_all()

    # ------------------------------------------------------------------ info

    def cluster_info(self) -> pb.ClusterInfo:
        c = self.config
        with self._cond:
            info = pb.ClusterInfo(
                shard_index=c.shard_index, num_shards=c.num_shards, mode=self.policy.wire_mode,
                replicas_to_aggregate=c.replicas_to_aggregate, total_replicas=c.total_replicas,
                staleness=-1 if c.staleness == float("inf") else int(c.staleness), max_staleness=c.max_staleness,
                step=self.step, initialized=self.store.initialized, optimizer=self.optimizer.name,
                partition_min_bytes=c.partition_min_bytes, chunk_bytes=c.chunk_bytes, dropped_stale=self.dropped,
                effective_replicas=(self.policy.effective_replicas(self) if isinstance(self.policy, SyncPolicy) else 0),
            )
            shard_map = self.store.shard_map
            if shard_map is not None:
                for spec in sorted(shard_map.specs.values(), key=lambda s: s.name):
                    info.parameters.append(spec_to_wire(spec.name, spec.dtype, spec.shape))
                for part in shard_map.parts:
                    info.parts.add(name=part.name, row_start=part.row_start, row_end=part.row_end, shard=part.shard)
            for record in sorted(self.membership.workers.values(), key=lambda r: r.worker_id):
                info.workers.add(worker_id=record.worker_id, clock=record.clock, live=self.membership.is_live(record),
                                 lease_remaining_ms=int(self.membership.remaining(record) * 1000))
        return info
