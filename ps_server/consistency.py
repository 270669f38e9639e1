"""The consistency modes as interchangeable policies: sync (N of M), ssp (bound b) and async.

Each policy decides what a push does (apply now, add to the step's accumulator, or drop)
and whether a pull may be answered yet. The rules, exactly as SPEC.md states them:

- sync: a push read at step s is dropped as stale when s < t; added to step t's
  accumulator when s == t (once per worker and step). When N_eff = max(1, min(N, live
  workers)) distinct workers have contributed, their mean is applied once and t becomes
  t + 1. Backup workers (M - N) never hold a step back. Each time the live workers cap
  N_eff below N (a lease expired, a worker left), and again when N is back, the shard
  logs it once and emits a "replicas_capped" event (ps_replicas_capped_total).
- ssp(b): a push is applied as it arrives (t += 1). A pull by worker w at clock c is held
  until every live worker's clock is >= c - b.
- async: a push is applied as it arrives (t += 1), unless max_staleness > 0 and
  t - s > max_staleness, when it is dropped as stale.

Policies are not thread-safe: the shard calls them under its lock.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common.errors import InvalidTensorError

if TYPE_CHECKING:
    from ps_server.shard import Shard

log = logging.getLogger(__name__)

PartKey = tuple[str, int]


@dataclass(frozen=True)
class Decision:
    """What became of a push."""

    accepted: bool
    drop_reason: int = pb.DROP_REASON_UNSPECIFIED
    message: str = ""

    @classmethod
    def drop(cls, reason: int, message: str) -> "Decision":
        return cls(False, reason, message)


ACCEPTED = Decision(True)


class ConsistencyPolicy(ABC):
    """What a push does and when a pull may be served."""

    name: str
    wire_mode: int

    @abstractmethod
    def on_push(self, shard: "Shard", worker_id: str, read_step: int, grads: Mapping[PartKey, np.ndarray]) -> Decision:
        """Applies, accumulates or drops one validated push (read_step <= shard.step)."""

    def pull_blocker(self, shard: "Shard", worker_id: str, clock: int) -> str | None:
        """What a pull by worker_id at clock still waits for, or None when it may be served."""
        return None

    def on_membership_change(self, shard: "Shard") -> None:
        """Called when a lease expires or a worker leaves (sync may complete a step)."""

    def describe(self) -> str:
        return self.name


class SyncPolicy(ConsistencyPolicy):
    """N of M synchronous replicas with backup workers and stale-gradient drops."""

    name = "sync"
    wire_mode = pb.MODE_SYNC

    def __init__(self, replicas_to_aggregate: int, total_replicas: int) -> None:
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_replicas = total_replicas
        self.contributors: list[str] = []
        self.accumulator: dict[PartKey, np.ndarray] = {}
        self.capped_at: int | None = None   # N_eff while the live workers cap it below N (as last reported)

    def effective_replicas(self, shard: "Shard") -> int:
        """N capped by the live workers (never below 1), so a dead worker never stalls a step."""
        return max(1, min(self.replicas_to_aggregate, shard.membership.live_count()))

    def _report_cap(self, shard: "Shard", effective: int) -> None:
        """Logs and emits "replicas_capped" when the cap changes (once per change, never per push).

        Quiet until training is under way (a step done or a gradient in): while the workers
        are still registering one by one, the quorum is not capped by a failure.
        """
        capped = effective if effective < self.replicas_to_aggregate else None
        if capped == self.capped_at or (self.capped_at is None and not (shard.step or self.contributors)):
            return
        before, self.capped_at = self.capped_at, capped
        index, n = shard.config.shard_index, self.replicas_to_aggregate
        if capped is None:
            log.info("shard %d: sync steps wait for replicas_to_aggregate=%d gradients again (%d live workers)",
                     index, n, shard.membership.live_count())
        else:
            expired, left = shard.membership.not_live()
            log.log(logging.WARNING if expired else logging.INFO,
                    "shard %d: replicas_to_aggregate=%d capped at %d from step %d: %d live worker(s); "
                    "expired leases: %s; left: %s", index, n, capped, shard.step, shard.membership.live_count(),
                    ", ".join(expired) or "none", ", ".join(left) or "none")
        shard._emit("replicas_capped", effective=effective, replicas=n,
                    shrunk=capped is not None and (before is None or capped < before))

    def on_push(self, shard: "Shard", worker_id: str, read_step: int, grads: Mapping[PartKey, np.ndarray]) -> Decision:
        t = shard.step
        if read_step < t:
            return Decision.drop(pb.DROP_STALE, f"gradient read at step {read_step}, shard is at step {t}: dropped as stale")
        if worker_id in self.contributors:
            return Decision.drop(pb.DROP_ALREADY_CONTRIBUTED,
                                 f"worker {worker_id!r} already contributed to step {t}: dropped")
        missing = sorted(set(shard.store.parts) - set(grads))
        if missing:
            shown = ", ".join(f"{n!r} rows from {r}" for n, r in missing[:5])
            raise InvalidTensorError(
                f"sync mode needs a gradient for every part of the shard; {len(missing)} missing: {shown}")
        for key, grad in grads.items():
            acc = self.accumulator.get(key)
            if acc is None:
                # a decoded multi-chunk gradient is a fresh array nobody else holds: take it as is
                fresh = grad.flags.writeable and grad.flags.owndata
                self.accumulator[key] = grad if fresh else np.array(grad, copy=True)
            else:
                np.add(acc, grad, out=acc)
        self.contributors.append(worker_id)
        self.maybe_complete(shard)
        return ACCEPTED

    def maybe_complete(self, shard: "Shard") -> None:
        """Applies the mean and advances the step once enough workers contributed."""
        effective = self.effective_replicas(shard)
        self._report_cap(shard, effective)
        if not self.contributors or len(self.contributors) < effective:
            return
        count = len(self.contributors)
        if count > 1:
            for acc in self.accumulator.values():
                np.multiply(acc, 1.0 / count, out=acc)
        shard.store.apply(self.accumulator)
        self.contributors, self.accumulator = [], {}
        shard.advance(applied=count)

    def on_membership_change(self, shard: "Shard") -> None:
        self.maybe_complete(shard)

    def describe(self) -> str:
        return f"sync (N={self.replicas_to_aggregate} of M={self.total_replicas})"


class SSPPolicy(ConsistencyPolicy):
    """Stale-synchronous parallel: apply on arrival, hold pulls that run more than b clocks ahead."""

    name = "ssp"
    wire_mode = pb.MODE_SSP

    def __init__(self, staleness: float) -> None:
        self.staleness = staleness

    def on_push(self, shard: "Shard", worker_id: str, read_step: int, grads: Mapping[PartKey, np.ndarray]) -> Decision:
        shard.store.apply(grads)
        shard.advance(applied=1)
        return ACCEPTED

    def pull_blocker(self, shard: "Shard", worker_id: str, clock: int) -> str | None:
        if not worker_id or math.isinf(self.staleness):
            return None
        need = clock - int(self.staleness)
        behind = {w: c for w, c in shard.membership.live_clocks().items() if c < need}
        if not behind:
            return None
        shown = ", ".join(f"{w} at {c}" for w, c in sorted(behind.items(), key=lambda x: x[1])[:5])
        return (f"every live worker's clock >= {need} (worker {worker_id!r} at clock {clock}, "
                f"staleness {int(self.staleness)}); behind: {shown}")

    def describe(self) -> str:
        return f"ssp (staleness={self.staleness})"


class AsyncPolicy(ConsistencyPolicy):
    """Apply every gradient on arrival; optionally drop those read too many steps ago."""

    name = "async"
    wire_mode = pb.MODE_ASYNC

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness

    def on_push(self, shard: "Shard", worker_id: str, read_step: int, grads: Mapping[PartKey, np.ndarray]) -> Decision:
        lag = shard.step - read_step
        if self.max_staleness and lag > self.max_staleness:
            return Decision.drop(pb.DROP_STALE,
                                 f"gradient read at step {read_step}, shard is at step {shard.step}: "
                                 f"{lag} steps behind, over max_staleness {self.max_staleness}")
        shard.store.apply(grads)
        shard.advance(applied=1)
        return ACCEPTED

    def describe(self) -> str:
        return f"async (max_staleness={self.max_staleness or 'none'})"


def make_policy(mode: str, *, replicas_to_aggregate: int = 1, total_replicas: int = 1,
                staleness: float = 0, max_staleness: int = 0) -> ConsistencyPolicy:
    """The policy for a job's mode."""
    if mode == "sync":
        return SyncPolicy(replicas_to_aggregate, total_replicas)
    if mode == "ssp":
        return SSPPolicy(staleness)
    if mode == "async":
        return AsyncPolicy(max_staleness)
    raise ValueError(f"Invalid mode: {mode!r} (choose one of sync, ssp, async)")
