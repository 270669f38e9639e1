"""Dynamic tables on one shard: rows keyed by int64 id, created on first use, evicted when untouched.

A `DynamicRows` holds the rows of one dynamic table whose ids hash to this shard
(ps_common/dynamic_ids.py): a dict id -> slot over arrays that grow by doubling, the
optimizer's slots per row (plus "row_step", so `Optimizer.apply_rows` updates them lazily
exactly as it does rows of a dense table), and the step at which each row was last
touched. Rules (docs/protocol.md, "Dynamic tables"):

- a row is created from the table's initializer the first time it is pulled or updated,
  with fresh optimizer state (row_step 0);
- pulling a row or applying a gradient to it touches it (records the shard's step);
- when the shard's step moves to t, every row with t - last_touched > evict_after_steps
  is evicted (value and optimizer state freed); a later use creates it afresh.

Not thread-safe: the shard calls it under its lock. Domain values only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ps_common.dynamic_ids import initial_rows
from ps_common.shard_map import ParamSpec
from ps_server.optimizers import Optimizer

#: The optimizer slot of per-row update counts (as ps_server/shard.py ROW_STEP).
ROW_STEP = "row_step"

_MIN_CAPACITY = 16


@dataclass
class DynamicSnapshot:
    """One dynamic table in a checkpoint: its live rows (ids sorted), their slots and touch steps,
    and the sync accumulator's rows (None when empty)."""

    name: str
    ids: np.ndarray                 # int64 (k,)
    values: np.ndarray              # (k, *row shape)
    slots: dict[str, np.ndarray]    # each (k, *row shape), and "row_step" (k,) int64
    touched: np.ndarray             # int64 (k,): the step of each row's last pull or update
    accumulator_ids: np.ndarray | None = None
    accumulator_values: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        acc = 0 if self.accumulator_values is None else self.accumulator_values.nbytes + self.accumulator_ids.nbytes
        return int(self.ids.nbytes + self.values.nbytes + self.touched.nbytes
                   + sum(s.nbytes for s in self.slots.values()) + acc)


class DynamicRows:
    """The rows of one dynamic table held by this shard."""

    def __init__(self, spec: ParamSpec, optimizer: Optimizer) -> None:
        assert spec.dynamic is not None
        self.spec = spec
        self.name = spec.name
        self.rule = spec.dynamic
        self.dtype = np.dtype(spec.dtype)
        self.row_shape = tuple(spec.shape)
        self.optimizer = optimizer
        fresh = optimizer.init_state(np.zeros((1, *self.row_shape), self.dtype))
        self._fill = {k: v[0] for k, v in fresh.items() if k != "step"}   # one fresh row of each slot
        self.index: dict[int, int] = {}
        self.created = 0
        self.evicted = 0
        self._allocate(_MIN_CAPACITY)

    # ------------------------------------------------------------------ storage

    def _allocate(self, capacity: int) -> None:
        self.ids = np.zeros(capacity, np.int64)
        self.used = np.zeros(capacity, bool)
        self.touched = np.zeros(capacity, np.int64)
        self.updated = np.zeros(capacity, np.int64)   # the first step whose values hold the row's last change
        self.values = np.zeros((capacity, *self.row_shape), self.dtype)
        self.slots = {k: np.zeros((capacity, *self.row_shape), fill.dtype) for k, fill in self._fill.items()}
        self.slots[ROW_STEP] = np.zeros(capacity, np.int64)
        self._free = list(range(capacity - 1, -1, -1))

    def _grow(self, need: int) -> None:
        old = len(self.used)
        capacity = max(_MIN_CAPACITY, old * 2, old + need)
        grown = {"ids": self.ids, "used": self.used, "touched": self.touched, "updated": self.updated,
                 "values": self.values}
        slots = self.slots
        self._allocate(capacity)
        for attr, array in grown.items():
            getattr(self, attr)[:old] = array
        for k, array in slots.items():
            self.slots[k][:old] = array
        self._free = [i for i in range(capacity - 1, -1, -1) if i >= old or not self.used[i]]

    @property
    def rows(self) -> int:
        """Live rows."""
        return len(self.index)

    @property
    def nbytes(self) -> int:
        """Bytes of the live rows' values."""
        return self.rows * self.values[:1].nbytes

    @property
    def row_state_bytes(self) -> int:
        """Bytes one live row takes with its optimizer state and bookkeeping."""
        return int(self.values[:1].nbytes + sum(s[:1].nbytes for s in self.slots.values()) + 17)

    def missing(self, ids: np.ndarray) -> int:
        """How many distinct ids of `ids` have no row yet."""
        index = self.index
        return len({i for i in ids.tolist() if i not in index})

    # ------------------------------------------------------------------ use

    def locate(self, ids: np.ndarray, step: int) -> np.ndarray:
        """The slot of each id, creating missing rows from the initializer; touches them all at `step`."""
        index = self.index
        id_list = ids.tolist()
        missing = {i for i in id_list if i not in index}
        if len(missing) > len(self._free):
            self._grow(len(missing))
        new = {i: self._free.pop() for i in missing}
        slots = np.fromiter((index[i] if i in index else new[i] for i in id_list), np.int64, len(id_list))
        if new:
            fresh = np.fromiter(new.values(), np.int64, len(new))
            created = np.fromiter(new.keys(), np.int64, len(new))
            self.values[fresh] = initial_rows(self.name, self.rule, created, self.row_shape, self.dtype)
            for k, fill in self._fill.items():
                self.slots[k][fresh] = fill
            self.slots[ROW_STEP][fresh] = 0
            self.ids[fresh] = created
            self.used[fresh] = True
            self.updated[fresh] = step   # a new row: changed as of this step
            index.update(new)
            self.created += len(new)
        self.touched[slots] = step
        return slots

    def read(self, ids: np.ndarray, step: int) -> np.ndarray:
        """A copy of the rows of `ids` (in order, repeats allowed), created when missing; touched at `step`."""
        slots = self.locate(ids, step)   # first: creating rows may grow (replace) the arrays
        return self.values[slots]

    def apply(self, ids: np.ndarray, grad: np.ndarray, step: int) -> None:
        """One lazy optimizer update of the rows `ids` (unique) with `grad`; missing rows are created first."""
        slots = self.locate(ids, step)
        self.optimizer.apply_rows(self.values, slots, grad, self.slots)
        self.updated[slots] = step + 1

    def rows_since(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, copies of the rows) of the live rows created or updated after `step` (every live row for step < 0),
        sorted by id."""
        live = self.used if step < 0 else self.used & (self.updated > step)
        found = np.flatnonzero(live)
        found = found[np.argsort(self.ids[found], kind="stable")]
        return self.ids[found].copy(), self.values[found].copy()

    def evict(self, step: int) -> int:
        """Evicts every row with step - last touched > evict_after_steps; returns how many."""
        after = self.rule.evict_after_steps
        if not after or not self.index:
            return 0
        stale = np.flatnonzero(self.used & (step - self.touched > after))
        if not len(stale):
            return 0
        for slot, i in zip(stale.tolist(), self.ids[stale].tolist()):
            del self.index[i]
            self._free.append(slot)
        self.used[stale] = False
        self.values[stale] = 0
        self.evicted += len(stale)
        return len(stale)

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self) -> DynamicSnapshot:
        """Copies of the live rows, sorted by id."""
        live = np.flatnonzero(self.used)
        live = live[np.argsort(self.ids[live], kind="stable")]
        return DynamicSnapshot(self.name, self.ids[live].copy(), self.values[live].copy(),
                               {k: v[live].copy() for k, v in self.slots.items()}, self.touched[live].copy())

    def restore(self, snap: DynamicSnapshot) -> None:
        """Replaces the rows with a checked snapshot's."""
        k = len(snap.ids)
        self._allocate(max(_MIN_CAPACITY, k))
        self.ids[:k], self.values[:k], self.touched[:k] = snap.ids, snap.values, snap.touched
        for name, array in snap.slots.items():
            self.slots[name][:k] = array
        self.used[:k] = True
        self.index = {int(i): pos for pos, i in enumerate(snap.ids.tolist())}
        self._free = list(range(len(self.used) - 1, k - 1, -1))
