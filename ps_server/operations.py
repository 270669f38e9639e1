"""The shard's data-plane operations as values: what a push carries, what a read asks for, what they return.

The service boundary (ps_server/service.py) decodes a request into these, calls one Shard
method (`push`, `pull`, `push_pull`) and encodes what comes back; the Shard does its work
in one locked section and returns values, never callbacks. Arrays are numpy, keyed by
PartKey (tensor name, first row); nothing here knows a wire type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ps_common.shard_map import PartKey
from ps_server.membership import PushResult

__all__ = ["Push", "PushPullResult", "PushResult", "Read", "StateRead", "Values"]


@dataclass(frozen=True)
class Push:
    """One push: the worker, its clock, the step it read the parameters at, and its gradients.

    `grads` are dense gradients by part; `row_grads` sparse ones as (tensor name, global row
    ids, rows), cut per owned part (or by id, for a dynamic table) by the shard.
    """

    worker_id: str
    clock: int
    read_step: int
    grads: Mapping[PartKey, np.ndarray]
    row_grads: Sequence[tuple[str, np.ndarray, np.ndarray]] = ()


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


@dataclass
class PushPullResult:
    """A push and the read after it: `values` None when the read's wait ran out, or when new dynamic rows would
    pass max_shard_bytes (the push stands either way; `not_read` says why)."""

    push: PushResult
    values: Values | None
    not_read: str = ""
