"""Named, reusable barriers of N participants, each wait bounded by a timeout."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ps_common.errors import InvalidRequestError, WaitTimeoutError


@dataclass
class _Barrier:
    participants: int
    arrived: dict[str, int] = field(default_factory=dict)   # id -> its calls now waiting (counts once)
    generation: int = 0


class Barriers:
    """All the barriers of one shard. Thread-safe; `wait` blocks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}

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
            barrier = self._barriers.get(name)
            if barrier is None or not barrier.arrived:
                if barrier is None:
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
                self._cond.notify_all()
                return barrier.generation, arrived
            while barrier.generation == generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    here = sorted(barrier.arrived)
                    # withdraw this call's arrival (another waiting call with the same id still counts)
                    barrier.arrived[participant] -= 1
                    if not barrier.arrived[participant]:
                        del barrier.arrived[participant]
                    raise WaitTimeoutError(
                        f"barrier {name!r}: waited {timeout:.1f} s for {barrier.participants} participants; "
                        f"{len(here)} arrived ({', '.join(here)})")
                self._cond.wait(left)
            return barrier.generation, barrier.participants
