"""The consistency modes and the rules both sides apply: one definition for the shard, the client and the tools.

The rules themselves (what a push does in each mode) live in ps_server/consistency.py; what
a worker must know of them is here: the modes' names, why a push is dropped, and which step a
sync worker's next pull waits for (`step_to_wait_for`), which the shard applies to a
PushPull's pull and the client to a Pull after a Push. Wire values are the codec's
(ps_common/codec.py `mode_to_wire` / `mode_from_wire`).
"""

from __future__ import annotations

import enum

__all__ = ["MODES", "DropReason", "Mode", "step_to_wait_for"]


class Mode(enum.Enum):
    """The consistency modes, by their job-config names."""

    SYNC = "sync"
    SSP = "ssp"
    ASYNC = "async"

    @classmethod
    def named(cls, name: str) -> "Mode":
        """The mode called `name`; ValueError naming the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"Invalid mode: {name!r} (choose one of {', '.join(MODES)})") from None


#: The modes' names, in the order the docs list them.
MODES: tuple[str, ...] = tuple(m.value for m in Mode)


class DropReason(enum.IntEnum):
    """Why a push was not applied; the values and names are those of ps.v1.DropReason."""

    NONE = 0
    STALE = 1
    ALREADY_CONTRIBUTED = 2
    STEP_AHEAD = 3


def step_to_wait_for(accepted: bool, drop_reason: DropReason | int, read_step: int, step: int) -> int:
    """The step a sync worker's next pull waits for after a push (0: no wait).

    Accepted: the step after the one it read (its gradient is in that step). Already
    contributed: the step after the shard's current one. Dropped as stale, or step-ahead
    (the shard rolled back to an older checkpoint): nothing to wait for; pull the state as
    it is and compute again.
    """
    if accepted:
        return read_step + 1
    if drop_reason == DropReason.ALREADY_CONTRIBUTED:
        return step + 1
    return 0
