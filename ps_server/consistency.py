"""The consistency modes as interchangeable policies: sync (N of M), ssp (bound b) and async.

Each policy decides what a push does (apply now, add to the step's accumulator, or drop)
and whether a pull may be answered yet. The rules (docs/protocol.md, "Consistency modes"):

- sync: a push read at step s is dropped as stale when s < t; added to step t's
  accumulator when s == t (once per worker and step). When N_eff = max(1, min(N, live
  workers)) distinct workers have contributed, their mean is applied once and t becomes
  t + 1. Backup workers (M - N) never hold a step back. Each time the live workers cap
  N_eff below N (a lease expired, a worker left), and again when N is back, the policy
  logs it once and reports a "replicas_capped" event (ps_replicas_capped_total).
- ssp(b): a push is applied as it arrives (t += 1). A pull by worker w at clock c is held
  until every live worker's clock is >= c - b.
- async: a push is applied as it arrives (t += 1), unless max_staleness > 0 and
  t - s > max_staleness, when it is dropped as stale.
- ssp and async: a push without gradients moves only the worker's clock (never the step).
  sync: a push must carry a gradient for every trainable part of the shard; on a shard
  without trainable parts an empty push is the worker's contribution to the step.

A policy sees the shard only through a `PolicyHost`: the step, the live workers and their
clocks, and `apply`. It never advances the step or emits events itself: it returns a
`Decision` saying how many gradients it applied (the shard then advances t once) and
which events happened, so no call ever goes back up into the shard. A policy owns its
state (sync: the accumulator and the contributors) and its part of a checkpoint
(`snapshot` / `restore`). Policies are not thread-safe: the shard calls them under its lock.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ps_common.errors import InvalidTensorError
from ps_common.modes import DropReason, Mode
from ps_common.shard_map import PartKey
from ps_server import rows
from ps_server.rows import RowGrad

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Event:
    """Something a policy reports for metrics and logs (e.g. "replicas_capped")."""

    name: str
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What became of a push (or of a membership change): accepted or dropped, and what was applied.

    `applied` > 0 means the policy applied that many workers' gradients as one update:
    the shard advances its step by one. `events` are reported after the shard's lock.
    """

    accepted: bool = True
    drop_reason: DropReason = DropReason.NONE
    message: str = ""
    applied: int = 0
    events: tuple[Event, ...] = ()

    @classmethod
    def drop(cls, reason: DropReason, message: str) -> "Decision":
        return cls(False, reason, message)


class PolicyHost(Protocol):
    """The narrow view of a shard that a policy gets."""

    shard_index: int

    @property
    def step(self) -> int:
        """The shard's global step t."""

    def live_count(self) -> int:
        """Workers holding a lease."""

    def live_clocks(self) -> dict[str, int]:
        """Clock of every live worker."""

    def not_live(self) -> tuple[list[str], list[str]]:
        """(workers whose lease expired, workers that left), sorted."""

    def parts(self) -> set[PartKey]:
        """The parts this shard owns."""

    def apply(self, grads: Mapping[PartKey, np.ndarray]) -> None:
        """Runs the optimizer on the given parts, in place."""


@dataclass
class PolicySnapshot:
    """A policy's part of a checkpoint: sync's step contributors and accumulator (None/empty for the others).

    An accumulated sparse gradient is a RowGrad (rows of a dense table, or ids of a dynamic one)."""

    contributors: list[str] | None = None
    accumulator: dict[PartKey, np.ndarray | RowGrad] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyInfo:
    """What cluster info and metrics show of a policy: sync's quorum (0 for the others)."""

    mode: Mode
    effective_replicas: int = 0


class ConsistencyPolicy(ABC):
    """What a push does and when a pull may be served."""

    mode: Mode

    @abstractmethod
    def on_push(self, host: PolicyHost, worker_id: str, read_step: int,
                grads: Mapping[PartKey, np.ndarray]) -> Decision:
        """Applies, accumulates or drops one validated push (read_step <= host.step)."""

    def pull_blocker(self, host: PolicyHost, worker_id: str, clock: int) -> str | None:
        """What a pull by worker_id at clock still waits for, or None when it may be served."""
        return None

    def step_blocker(self, host: PolicyHost) -> str:
        """Why the step has not moved yet, for wait-timeout messages ("" when nothing to add)."""
        return ""

    def on_membership_change(self, host: PolicyHost) -> Decision | None:
        """Called when a lease expires or a worker leaves (sync may complete a step)."""
        return None

    def aggregated(self) -> int:
        """Gradients in the current step's accumulator (sync; 0 for the others): cheap, read on every push."""
        return 0

    def info(self, host: PolicyHost) -> PolicyInfo:
        return PolicyInfo(self.mode)

    def snapshot(self, copy: Callable[[np.ndarray], np.ndarray]) -> PolicySnapshot:
        """The policy's state for a checkpoint (arrays passed through `copy`)."""
        return PolicySnapshot()

    def restore(self, snapshot: PolicySnapshot) -> None:
        """Takes a checkpoint's policy state (already checked)."""

    def describe(self) -> str:
        return self.mode.value


class SyncPolicy(ConsistencyPolicy):
    """N of M synchronous replicas with backup workers and stale-gradient drops."""

    mode = Mode.SYNC

    def __init__(self, replicas_to_aggregate: int, total_replicas: int) -> None:
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_replicas = total_replicas
        self.contributors: list[str] = []
        self.accumulator: dict[PartKey, np.ndarray] = {}
        self.capped_at: int | None = None   # N_eff while the live workers cap it below N (as last reported)

    def effective_replicas(self, host: PolicyHost) -> int:
        """N capped by the live workers (never below 1), so a dead worker never stalls a step."""
        return max(1, min(self.replicas_to_aggregate, host.live_count()))

    def _cap_event(self, host: PolicyHost, effective: int) -> tuple[Event, ...]:
        """Logs and reports "replicas_capped" when the cap changes (once per change, never per push).

        Quiet until training is under way (a step done or a gradient in): while the workers
        are still registering one by one, the quorum is not capped by a failure.
        """
        capped = effective if effective < self.replicas_to_aggregate else None
        if capped == self.capped_at or (self.capped_at is None and not (host.step or self.contributors)):
            return ()
        before, self.capped_at = self.capped_at, capped
        n = self.replicas_to_aggregate
        expired: list[str] = []
        if capped is None:
            log.info("shard %d: sync steps wait for replicas_to_aggregate=%d gradients again (%d live workers)",
                     host.shard_index, n, host.live_count())
        else:
            expired, left = host.not_live()
            log.log(logging.WARNING if expired else logging.INFO,
                    "shard %d: replicas_to_aggregate=%d capped at %d from step %d: %d live worker(s); "
                    "expired leases: %s; left: %s", host.shard_index, n, capped, host.step, host.live_count(),
                    ", ".join(expired) or "none", ", ".join(left) or "none")
        # Only a lease that ran out is a failure worth counting: workers that deregistered (a
        # normal finish, a stop) shrink the quorum too, but an alert on the count must not fire
        # after every clean run.
        shrunk = capped is not None and bool(expired) and (before is None or capped < before)
        return (Event("replicas_capped", {"effective": effective, "replicas": n, "shrunk": shrunk}),)

    def on_push(self, host: PolicyHost, worker_id: str, read_step: int,
                grads: Mapping[PartKey, np.ndarray]) -> Decision:
        t = host.step
        if read_step < t:
            return Decision.drop(DropReason.STALE, f"gradient read at step {read_step}, shard is at step {t}: "
                                                   "dropped as stale")
        if worker_id in self.contributors:
            return Decision.drop(DropReason.ALREADY_CONTRIBUTED,
                                 f"worker {worker_id!r} already contributed to step {t}: dropped")
        missing = sorted(host.parts() - set(grads))
        if missing:
            shown = ", ".join(f"{n!r} rows from {r}" for n, r in missing[:5])
            raise InvalidTensorError(
                f"sync mode needs a gradient for every part of the shard; {len(missing)} missing: {shown}")
        for key, grad in grads.items():
            acc = self.accumulator.get(key)
            if acc is None:
                # a decoded multi-chunk gradient (or a RowGrad, built fresh) is held by nobody else: take it as is
                fresh = isinstance(grad, RowGrad) or (grad.flags.writeable and grad.flags.owndata)
                self.accumulator[key] = grad if fresh else np.array(grad, copy=True)
            else:
                self.accumulator[key] = rows.add(acc, grad)
        self.contributors.append(worker_id)
        return self._maybe_complete(host, accepted=True)

    def _maybe_complete(self, host: PolicyHost, *, accepted: bool) -> Decision:
        """Applies the mean once enough workers contributed; the Decision says how many were applied."""
        effective = self.effective_replicas(host)
        events = self._cap_event(host, effective)
        if not self.contributors or len(self.contributors) < effective:
            return Decision(accepted, events=events)
        count = len(self.contributors)
        if count > 1:
            for acc in self.accumulator.values():
                rows.scale(acc, 1.0 / count)
        host.apply(self.accumulator)
        self.contributors, self.accumulator = [], {}
        return Decision(accepted, applied=count, events=events)

    def on_membership_change(self, host: PolicyHost) -> Decision:
        return self._maybe_complete(host, accepted=True)

    def step_blocker(self, host: PolicyHost) -> str:
        return f"; {len(self.contributors)} of {self.effective_replicas(host)} gradients in for step {host.step}"

    def aggregated(self) -> int:
        return len(self.contributors)

    def info(self, host: PolicyHost) -> PolicyInfo:
        return PolicyInfo(self.mode, effective_replicas=self.effective_replicas(host))

    def snapshot(self, copy: Callable[[np.ndarray], np.ndarray]) -> PolicySnapshot:
        # row accumulators stay rows (the shard writes a dense table's densely, a dynamic table's by id)
        return PolicySnapshot(list(self.contributors),
                              {k: RowGrad(v.rows.copy(), v.values.copy(), v.part_rows) if isinstance(v, RowGrad)
                               else copy(v) for k, v in self.accumulator.items()})

    def restore(self, snapshot: PolicySnapshot) -> None:
        self.contributors = list(snapshot.contributors or [])
        self.accumulator = dict(snapshot.accumulator) if self.contributors else {}

    def describe(self) -> str:
        return f"sync (N={self.replicas_to_aggregate} of M={self.total_replicas})"


#: What an ssp or async push without gradients does: it moves the worker's clock (a client
#: sends one to each shard its update does not touch, so SSP clocks stay in step) and nothing else.
CLOCK_ONLY = "no gradients: the worker's clock moved, nothing was applied and the step did not move"


class SSPPolicy(ConsistencyPolicy):
    """Stale-synchronous parallel: apply on arrival, hold pulls that run more than b clocks ahead."""

    mode = Mode.SSP

    def __init__(self, staleness: float) -> None:
        self.staleness = staleness

    def on_push(self, host: PolicyHost, worker_id: str, read_step: int,
                grads: Mapping[PartKey, np.ndarray]) -> Decision:
        if not grads:
            return Decision(message=CLOCK_ONLY)
        host.apply(grads)
        return Decision(applied=1)

    def pull_blocker(self, host: PolicyHost, worker_id: str, clock: int) -> str | None:
        if not worker_id or math.isinf(self.staleness):
            return None
        need = clock - int(self.staleness)
        behind = {w: c for w, c in host.live_clocks().items() if c < need}
        if not behind:
            return None
        shown = ", ".join(f"{w} at {c}" for w, c in sorted(behind.items(), key=lambda x: x[1])[:5])
        return (f"every live worker's clock >= {need} (worker {worker_id!r} at clock {clock}, "
                f"staleness {int(self.staleness)}); behind: {shown}")

    def describe(self) -> str:
        return f"ssp (staleness={self.staleness})"


class AsyncPolicy(ConsistencyPolicy):
    """Apply every gradient on arrival; optionally drop those read too many steps ago."""

    mode = Mode.ASYNC

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness

    def on_push(self, host: PolicyHost, worker_id: str, read_step: int,
                grads: Mapping[PartKey, np.ndarray]) -> Decision:
        if not grads:
            return Decision(message=CLOCK_ONLY)
        lag = host.step - read_step
        if self.max_staleness and lag > self.max_staleness:
            return Decision.drop(DropReason.STALE,
                                 f"gradient read at step {read_step}, shard is at step {host.step}: "
                                 f"{lag} steps behind, over max_staleness {self.max_staleness}")
        host.apply(grads)
        return Decision(applied=1)

    def describe(self) -> str:
        return f"async (max_staleness={self.max_staleness or 'none'})"


def make_policy(mode: str, *, replicas_to_aggregate: int = 1, total_replicas: int = 1,
                staleness: float = 0, max_staleness: int = 0) -> ConsistencyPolicy:
    """The default policy for a job's mode."""
    chosen = Mode.named(mode)
    if chosen is Mode.SYNC:
        return SyncPolicy(replicas_to_aggregate, total_replicas)
    if chosen is Mode.SSP:
        return SSPPolicy(staleness)
    return AsyncPolicy(max_staleness)
