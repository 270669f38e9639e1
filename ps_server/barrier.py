"""Named, reusable barriers of N participants, each wait bounded by a timeout."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ps_common.errors import InvalidRequestError, ResourceExhaustedError, ShuttingDownError, WaitTimeoutError


@dataclass
class _Barrier:
    participants: int
    arrived: dict[str, int] = field(default_factory=dict)   # id -> its calls now waiting (counts once)
    generation: int = 0
    idle_since: float = field(default_factory=time.monotonic)   # when its last waiter left


class Barriers:
    """All the barriers of one shard. Thread-safe; `wait` blocks."""

    def __init__(self, *, max_barriers: int = 1024) -> None:
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}
        self.max_barriers = max_barriers
        self._stopped: str | None = None   # why, once stop() was called

    def stop(self, why: str) -> None:
        """Wakes every waiter, which fails with ShuttingDownError; later waits fail at once."""
        with self._cond:
            self._stopped = why
            self._cond.notify_all()

    def evict(self, idle_seconds: float) -> list[str]:
        """Forgets barriers nobody has waited at for `idle_seconds`; their names."""
        now = time.monotonic()
        with self._cond:
            gone = [n for n, b in self._barriers.items() if not b.arrived and now - b.idle_since > idle_seconds]
            for name in gone:
                del self._barriers[name]
        return gone

    def wait(self, name: str, participant: str, participants: int, timeout: float) -> tuple[int, int]:
        """Blocks until `participants` distinct ids arrived at `name`, or `timeout` seconds.

        Returns (generation, arrived). On timeout the caller's arrival is withdrawn (the
        barrier is as it was before the call) and WaitTimeoutError names who was there.
        """
        if not name:
            raise InvalidRequestError("barrier name must not be empty")
        if not participant:
            raise InvalidRequestError(f"barrier {name!r}: participant id must not be empty")
        if participants < 1:
            raise InvalidRequestError(f"barrier {name!r}: participants must be >= 1, got {participants}")
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._stopped is not None:
                raise ShuttingDownError(f"barrier {name!r}: {self._stopped}")
            barrier = self._barriers.get(name)
            if barrier is None or not barrier.arrived:
                if barrier is None:
                    if len(self._barriers) >= self.max_barriers:
                        self._evict_idle_locked()
                    if len(self._barriers) >= self.max_barriers:
                        raise ResourceExhaustedError(
                            f"barrier {name!r} refused: {len(self._barriers)} barriers in use, "
                            f"max_barriers={self.max_barriers}")
                    barrier = self._barriers[name] = _Barrier(participants)
                barrier.participants = participants
            elif barrier.participants != participants:
                raise InvalidRequestError(
                    f"barrier {name!r}: called with participants={participants} while "
                    f"{len(barrier.arrived)} waiting callers said {barrier.participants}")
            generation = barrier.generation
            barrier.arrived[participant] = barrier.arrived.get(participant, 0) + 1
            arrived = len(barrier.arrived)
            if arrived >= barrier.participants:
                barrier.generation += 1
                barrier.arrived = {}
                barrier.idle_since = time.monotonic()
                self._cond.notify_all()
                return barrier.generation, arrived
            while barrier.generation == generation:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped is not None:
                    here = sorted(barrier.arrived)
                    self._withdraw(barrier, participant)
                    if self._stopped is not None:
                        raise ShuttingDownError(f"barrier {name!r}: {self._stopped}")
                    raise WaitTimeoutError(
                        f"barrier {name!r}: waited {timeout:.1f} s for {barrier.participants} participants; "
                        f"{len(here)} arrived ({', '.join(here[:20])}{', ...' if len(here) > 20 else ''})")
                self._cond.wait(left)
            return barrier.generation, barrier.participants

    @staticmethod
    def _withdraw(barrier: _Barrier, participant: str) -> None:
        """Takes back one waiting call's arrival (another waiting call with the same id still counts)."""
        barrier.arrived[participant] -= 1
        if not barrier.arrived[participant]:
            del barrier.arrived[participant]
        if not barrier.arrived:
            barrier.idle_since = time.monotonic()

    def _evict_idle_locked(self) -> None:
        for name in [n for n, b in self._barriers.items() if not b.arrived]:
            del self._barriers[name]
