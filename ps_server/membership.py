"""Worker leases and clocks on one shard: who is live, how far each worker has pushed, and the
outcomes of its recent pushes (so a retried push is acknowledged, never applied twice)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ps_common.errors import UnknownWorkerError
from ps_common.modes import DropReason

#: How many recent push outcomes per worker are kept to answer retries.
DEDUP_WINDOW = 8


@dataclass(frozen=True)
class PushResult:
    """The outcome of one push, as reported to the worker and remembered for its retries."""

    accepted: bool
    drop_reason: DropReason
    message: str
    step: int
    clock: int
    duplicate: bool = False
    aggregated: int = 0
    # the shard's step minus the push's read step, on arrival: for metrics, not part of the outcome a retry gets
    staleness: int = field(default=0, compare=False, repr=False)


@dataclass
class WorkerRecord:
    """One worker as this shard knows it."""

    worker_id: str
    clock: int = 0                      # pushes taken from this worker (next push's clock)
    lease_expires: float = 0.0          # monotonic time
    gone_since: float | None = None     # monotonic time it left or its lease expired (None while live)
    outcomes: OrderedDict[int, PushResult] = field(default_factory=OrderedDict)  # clock -> first outcome


class Membership:
    """Leases and clocks. Not thread-safe: the shard calls it under its lock."""

    def __init__(self, lease_seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self._now = clock
        self.workers: dict[str, WorkerRecord] = {}

    def register(self, worker_id: str) -> WorkerRecord:
        """Joins or renews; a new worker starts at the slowest live worker's clock."""
        record = self.workers.get(worker_id)
        if record is None:
            live = self.live_clocks()
            start = min(live.values()) if live else 0
            record = self.workers[worker_id] = WorkerRecord(worker_id, clock=start)
        record.lease_expires = self._now() + self.lease_seconds
        record.gone_since = None
        return record

    def get(self, worker_id: str) -> WorkerRecord:
        """The record of a registered worker; UnknownWorkerError otherwise."""
        try:
            return self.workers[worker_id]
        except KeyError:
            raise UnknownWorkerError(f"worker {worker_id!r} is not registered on this shard; call RegisterWorker") from None

    def renew(self, worker_id: str) -> WorkerRecord:
        """Extends the lease of a registered worker."""
        record = self.get(worker_id)
        record.lease_expires = self._now() + self.lease_seconds
        record.gone_since = None
        return record

    def deregister(self, worker_id: str) -> bool:
        """Ends the worker's lease at once; its clock is kept for deduplication."""
        record = self.workers.get(worker_id)
        if record is None:
            return False
        record.lease_expires = 0.0
        record.gone_since = self._now()
        return True

    def is_live(self, record: WorkerRecord) -> bool:
        return record.lease_expires > self._now()

    def live_clocks(self) -> dict[str, int]:
        """Clock of every live worker."""
        now = self._now()
        return {w: r.clock for w, r in self.workers.items() if r.lease_expires > now}

    def live_count(self) -> int:
        return len(self.live_clocks())

    def not_live(self) -> tuple[list[str], list[str]]:
        """(workers whose lease expired, workers that left by deregistering or were not live at a restore), sorted."""
        now = self._now()
        expired = sorted(w for w, r in self.workers.items() if 0.0 < r.lease_expires <= now)
        left = sorted(w for w, r in self.workers.items() if r.lease_expires == 0.0)
        return expired, left

    def remaining(self, record: WorkerRecord) -> float:
        """Seconds left on the lease (0 when expired)."""
        return max(0.0, record.lease_expires - self._now())

    def remember(self, record: WorkerRecord, clock: int, outcome: PushResult) -> None:
        """Keeps the outcome of the push at `clock` for answering its retries."""
        record.outcomes[clock] = outcome
        while len(record.outcomes) > DEDUP_WINDOW:
            record.outcomes.popitem(last=False)

    def replace(self, workers: dict[str, WorkerRecord], live: list[str]) -> None:
        """Takes a checkpoint's workers; those live at the cut get a fresh lease (leases do not survive a process)."""
        self.workers = workers
        for worker_id in live:
            self.renew(worker_id)

    def evict(self, retention_seconds: float) -> list[str]:
        """Forgets workers that left or whose lease expired more than `retention_seconds` ago; their ids.

        A forgotten worker that comes back registers as new (at the slowest live clock);
        its push outcomes older than that are no longer answered as duplicates.
        """
        now = self._now()
        gone = []
        for worker_id, record in self.workers.items():
            if record.lease_expires > now:
                continue
            if record.gone_since is None:   # noticed now: the lease ran out since the last look
                record.gone_since = record.lease_expires or now
            if now - record.gone_since > retention_seconds:
                gone.append(worker_id)
        for worker_id in gone:
            del self.workers[worker_id]
        return gone

    def clear(self) -> None:
        """Forgets every worker (Admin.ResetParameters)."""
        self.workers.clear()
