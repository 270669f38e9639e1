"""The shard's data-plane operations as values: what a push carries, what a read asks for, what they return.

The service boundary (ps_server/service.py) decodes a request into these, calls one Shard
method (`push`, `pull`, `push_pull`) and encodes what comes back; the Shard does its work
in one locked section and returns values, never callbacks. Arrays are numpy, keyed by
PartKey (tensor name, first row); nothing here knows a wire type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ps_common.shard_map import PartKey
from ps_server.membership import PushResult

__all__ = ["Op", "Push", "PushPullResult", "PushResult", "Read", "ReplicationLog", "StateRead", "Values"]


@dataclass(frozen=True)
class Push:
    """One push: the worker, its clock, the step it read the parameters at, and its gradients.

    `grads` are dense gradients by part; `row_grads` sparse ones as (tensor name, global row
    ids, rows), cut per owned part (or by id, for a dynamic table) by the shard. `finite`: parts
    whose gradients are known to hold no NaN or inf (checked as they arrived: the data channel),
    which the shard does not check again.
    """

    worker_id: str
    clock: int
    read_step: int
    grads: Mapping[PartKey, np.ndarray]
    row_grads: Sequence[tuple[str, np.ndarray, np.ndarray]] = ()
    finite: frozenset[PartKey] = frozenset()

    def copied(self) -> "Push":
        """The same push holding copies of its arrays (a replicated push outlives its request's buffers, and a sync
        step's accumulator may take a gradient over and add into it)."""
        return Push(self.worker_id, self.clock, self.read_step, {k: np.array(v, copy=True) for k, v in self.grads.items()},
                    [(name, np.array(ids, copy=True), np.array(rows, copy=True)) for name, ids, rows in self.row_grads],
                    self.finite)


@dataclass(frozen=True)
class Read:
    """What a pull reads, and what it waits for first.

    - `names`: the dense parts of these tensors; None: every part this shard holds; (): none.
    - `rows`: sparse rows, as (tensor name, global row ids) (a dynamic table: any ids hashed here).
    - waits: `min_step` (sync); `ssp` holds the read until every live worker's clock is at
      least `clock` - staleness for `worker_id` (a PushPull's read uses the push's worker and
      its clock after the push); `wait_for_step` (PushPull only) waits for the step the push
      belongs to (ps_common.modes.step_to_wait_for). At most `timeout` seconds, then
      WaitTimeoutError (PushPull: no values).
    - where the values go: copies returned in Values.parts, float32 parts as `narrow` when
      set; or, with `into`, copied into those arrays (one per part read, e.g. a worker's
      shared-memory segment) and not returned.
    - `written(part key, bytes)`, with `into`: told how many leading bytes of a part's array
      hold their final values, as they land, so that a data channel sends them while the rest
      are written (Shard.push_pull: a PushPull's values are committed once written, and a read
      that follows its push without waiting is copied out block by block as the update writes
      them). Never called where the answer must wait after the read (a replicated shard) or
      may go without values (a dynamic table's rows asked).
    """

    names: Sequence[str] | None = None
    rows: Sequence[tuple[str, np.ndarray]] = ()
    min_step: int = 0
    wait_for_step: bool = False
    ssp: bool = False
    worker_id: str = ""
    clock: int = 0
    timeout: float = 0.0
    narrow: np.dtype | None = None
    into: Mapping[PartKey, np.ndarray] | None = None
    written: Callable[[PartKey, int], None] | None = None


@dataclass
class Values:
    """What a read returns: the step the values belong to, the dense parts (copies, unless `into` took them) and
    the rows, in the order asked."""

    step: int
    parts: dict[PartKey, np.ndarray] = field(default_factory=dict)
    rows: list[tuple[str, np.ndarray]] = field(default_factory=list)


@dataclass
class StateRead:
    """The shard's trained state, or what changed of it after a step, read at one step (Shard.read_state).

    `parts`: whole dense parts (copies); `rows`: (table, global row ids or dynamic keys,
    copies of the rows) of tables trained by rows; `live_rows`: each dynamic table's live
    rows now; `state_id` changes when the shard's state is replaced (restart, restore,
    reset): changes read under another id do not apply.
    """

    step: int
    state_id: str
    parts: dict[PartKey, np.ndarray] = field(default_factory=dict)
    rows: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    live_rows: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Op:
    """One change of a shard's state, in the order the shard made it: what a replicated shard's primary sends its
    backups, which replay it (Shard.replay) to the same state (ps_server/replication, docs/replication.md).

    `kind`: "init" (`specs`, `values` of this shard's parts), "register" (`worker_id` starting at `clock`),
    "deregister" (`worker_id`), "push" (`push`, and the `live_count` the policy decided with; `result`:
    (accepted, step after, the worker's clock after) for the backup to check), "membership" (a change of the
    live workers let the policy act: `live_count`), "reset".
    """

    kind: str
    worker_id: str = ""
    clock: int = 0
    push: Push | None = None
    live_count: int = 0
    specs: Sequence = ()
    values: Mapping[PartKey, np.ndarray] | None = None
    result: tuple[bool, int, int] | None = None


class ReplicationLog(Protocol):
    """Where a replicated shard tells its changes (the primary side of ps_server/replication): `record` is called under
    the shard's lock, in order, so it must not block; `wait` outside it, before an answer."""

    #: the sequence number of the last operation recorded (0: none yet)
    seq: int

    def record(self, op: Op) -> int:
        """Takes `op` for the backups; returns its sequence number."""

    def wait(self, seq: int) -> None:
        """Returns once every in-sync backup holds the operations up to `seq` and this replica may still answer
        (NotPrimaryError otherwise)."""


@dataclass
class PushPullResult:
    """A push and the read after it: `values` None when the read's wait ran out, or when new dynamic rows would
    pass max_shard_bytes (the push stands either way; `not_read` says why)."""

    push: PushResult
    values: Values | None
    not_read: str = ""
