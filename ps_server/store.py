"""The parameter store of one shard: the parts it owns, their values and optimizer state.

Domain values only: arrays in, arrays out. Encoding parts for the wire is the service
boundary's job (ps_server/service.py, with the codec).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ps_common.errors import InitMismatchError, InvalidTensorError, NotInitializedError, UnknownTensorError
from ps_common.shard_map import ParamSpec, Part, PartKey, ShardMap, build_shard_map
from ps_server.dynamic import DynamicRows
from ps_server.optimizers import Optimizer
from ps_server.rows import RowGrad



def _role(state: bool) -> str:
    return "state (replaced by pushes)" if state else "a parameter (optimized)"


@dataclass(eq=False)   # compared and hashed by identity: the boundary's pull cache keys on it
class PartState:
    """One owned part: its value, its optimizer slots, and a version bumped by every update."""

    part: Part
    value: np.ndarray
    slots: dict[str, np.ndarray]
    version: int = 0
    #: the first step whose values hold the last update (0: the initial values); what a reader of changes compares
    updated: int = 0
    #: for a part updated by rows (a sparse table): that step per row, made on the first row update
    row_updated: np.ndarray | None = None


class ParameterStore:
    """The parts this shard owns. Not thread-safe: the shard calls it under its lock."""

    def __init__(self, *, shard_index: int, num_shards: int, partition_min_bytes: int, optimizer: Optimizer) -> None:
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.partition_min_bytes = partition_min_bytes
        self.optimizer = optimizer
        self.shard_map: ShardMap | None = None
        self.parts: dict[PartKey, PartState] = {}
        self.dynamic: dict[str, DynamicRows] = {}   # dynamic tables: the rows whose ids hash to this shard

    @property
    def initialized(self) -> bool:
        return self.shard_map is not None

    def plan(self, specs: Sequence[ParamSpec]) -> tuple[ShardMap, bool]:
        """The shard map for `specs`, and whether the store already holds exactly these specs.

        Raises InitMismatchError naming the first difference when a different parameter list
        is already in place, InvalidTensorError when the list itself is invalid.
        """
        try:
            shard_map = build_shard_map(specs, self.num_shards, partition_min_bytes=self.partition_min_bytes)
        except ValueError as exc:
            raise InvalidTensorError(f"invalid parameter list: {exc}") from exc
        if self.shard_map is None:
            return shard_map, False
        have, want = self.shard_map.specs, shard_map.specs
        for name in sorted(set(have) | set(want)):
            if name not in want:
                raise InitMismatchError(f"already initialized with tensor {name!r}, which the new parameter list lacks")
            if name not in have:
                raise InitMismatchError(f"already initialized without tensor {name!r}, which the new parameter list has")
            a, b = have[name], want[name]
            if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
                raise InitMismatchError(
                    f"tensor {name!r} is initialized as {a.dtype}{list(a.shape)}, re-init asks for {b.dtype}{list(b.shape)}")
            if a.state != b.state:
                raise InitMismatchError(f"tensor {name!r} is initialized as {_role(a.state)}, re-init asks for "
                                        f"{_role(b.state)}")
            if a.dynamic != b.dynamic:
                raise InitMismatchError(f"tensor {name!r} is initialized with dynamic={a.dynamic}, re-init asks for "
                                        f"dynamic={b.dynamic}")
        return self.shard_map, True

    @staticmethod
    def expected_from(shard_map: ShardMap, shard_index: int):
        """A lookup (name, row_start) -> (dtype, shape) for the parts `shard_index` owns under shard_map."""

        def expected(name: str, row_start: int) -> tuple[np.dtype, tuple[int, ...]]:
            if name not in shard_map.specs:
                raise UnknownTensorError(f"tensor {name!r} is not a parameter of this model")
            if shard_map.specs[name].dynamic is not None:
                raise InvalidTensorError(f"tensor {name!r} is a dynamic table: it has no parts; its rows travel by "
                                         "id (PullRows, RowGradient), never in chunks")
            try:
                part = shard_map.part(name, row_start)
            except KeyError:
                starts = [p.row_start for p in shard_map.parts_of(name)]
                raise UnknownTensorError(f"tensor {name!r} has no part starting at row {row_start} (parts start at {starts})") from None
            if part.shard != shard_index:
                raise InvalidTensorError(
                    f"tensor {name!r} rows [{part.row_start}, {part.row_end}) belong to shard {part.shard}, not shard {shard_index}")
            return np.dtype(part.dtype), tuple(part.shape)

        return expected

    def expected(self, name: str, row_start: int) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of an owned part; UnknownTensorError / NotInitializedError otherwise."""
        if self.shard_map is None:
            raise NotInitializedError(f"tensor {name!r}: parameters are not initialized on shard {self.shard_index}; call InitParameters")
        return self.expected_from(self.shard_map, self.shard_index)(name, row_start)

    def install(self, shard_map: ShardMap, values: Mapping[PartKey, np.ndarray]) -> None:
        """Takes the initial values of exactly this shard's parts (checked), with fresh optimizer state."""
        own = {p.key: p for p in shard_map.parts_on(self.shard_index)}
        missing = sorted(set(own) - set(values))
        if missing:
            shown = ", ".join(f"{n!r} rows from {r}" for n, r in missing[:5])
            raise InvalidTensorError(f"initial values missing for {len(missing)} part(s) of shard {self.shard_index}: {shown}")
        parts: dict[PartKey, PartState] = {}
        for key, part in own.items():
            value = np.array(values[key], dtype=part.dtype, copy=True, order="C")
            parts[key] = PartState(part=part, value=value, slots=self.optimizer.init_state(value))
        self.shard_map, self.parts = shard_map, parts
        self.dynamic = {s.name: DynamicRows(s, self.optimizer) for s in shard_map.specs.values() if s.dynamic is not None}

    def check_names(self, names: Iterable[str]) -> None:
        """UnknownTensorError naming the tensors the model lacks (NotInitializedError before initialization)."""
        if self.shard_map is None:
            raise NotInitializedError(f"parameters are not initialized on shard {self.shard_index}; call InitParameters")
        unknown = [n for n in names if n not in self.shard_map.specs]
        if unknown:
            raise UnknownTensorError(f"tensor(s) {', '.join(repr(n) for n in unknown)} are not parameters of this model")

    def select(self, names: Iterable[str] | None) -> list[PartState]:
        """The owned parts of the named tensors (None: every owned part), in shard-map order."""
        if names is None:
            if self.shard_map is None:
                raise NotInitializedError(f"parameters are not initialized on shard {self.shard_index}; call "
                                          "InitParameters")
            return list(self.parts.values())
        names = list(names)
        self.check_names(names)
        wanted = set(names)
        return [s for s in self.parts.values() if s.part.name in wanted]

    def apply(self, grads: Mapping[PartKey, np.ndarray | RowGrad], *, step: int = 0,
              updated: Callable[[PartKey, np.ndarray, int, int], None] | None = None) -> None:
        """Runs the optimizer on each given part (in place) and bumps its version. A state
        part (ParamSpec.state: running statistics) takes the pushed value itself instead.
        A dynamic table's gradient (key (name, 0), a RowGrad by id) updates its rows lazily,
        creating missing ones, and touches them at `step`. `updated(key, value, start, stop)`,
        when given, is told of each dense part's flat elements [start, stop) as they take their
        final value (Optimizer.apply's blocks; a state part whole)."""
        assert self.shard_map is not None
        for key, grad in grads.items():
            table = self.dynamic.get(key[0])
            if table is not None:
                assert isinstance(grad, RowGrad)
                table.apply(grad.rows, grad.values, step)
                continue
            state = self.parts[key]
            if isinstance(grad, RowGrad):   # sparse: only the touched rows (checked by the shard: not state)
                self.optimizer.apply_rows(state.value, grad.rows, grad.values, state.slots)
                if state.row_updated is None:
                    state.row_updated = np.full(len(state.value), state.updated, np.int64)
                state.row_updated[grad.rows] = step + 1
            else:
                state.row_updated = None   # the whole part changed: a reader of changes takes it whole
                value = state.value
                if self.shard_map.specs[key[0]].state:
                    value[...] = grad
                    if updated is not None:
                        updated(key, value, 0, value.size)
                else:
                    self.optimizer.apply(value, grad, state.slots, None if updated is None else
                                         lambda start, stop, key=key, value=value: updated(key, value, start, stop))
            state.version += 1
            state.updated = step + 1

    def evict(self, step: int) -> dict[str, int]:
        """Evicts the dynamic tables' rows untouched for longer than their evict_after_steps; {table: rows evicted}."""
        out = {}
        for name, table in self.dynamic.items():
            count = table.evict(step)
            if count:
                out[name] = count
        return out

    def restore(self, shard_map: ShardMap | None, parts: dict[PartKey, PartState],
                dynamic: dict[str, DynamicRows] | None = None) -> None:
        """Replaces the whole store with checked checkpoint contents (ps_server/checkpoints/state.py)."""
        self.shard_map, self.parts, self.dynamic = shard_map, parts, dict(dynamic or {})

    def clear(self) -> None:
        """Drops the parameter list, values and optimizer state (Admin.ResetParameters)."""
        self.shard_map, self.parts, self.dynamic = None, {}, {}

    def trainable_keys(self) -> set[PartKey]:
        """The owned parts that train: floating point, and each dynamic table as (name, 0). Others (integer
        ids, vocabularies) are state that is initialized and pulled but never pushed (docs/protocol.md,
        "Non-trainable tensors")."""
        keys = {key for key, state in self.parts.items() if state.value.dtype.kind == "f"}
        return keys | {dynamic_key(name) for name in self.dynamic}

    @property
    def nbytes(self) -> int:
        """Bytes of parameter values held (dense parts and the dynamic tables' live rows). Safe to read without the
        shard's lock (a request's bound): both dicts are snapshotted before they are summed."""
        parts, tables = list(self.parts.values()), list(self.dynamic.values())
        return sum(state.value.nbytes for state in parts) + sum(table.nbytes for table in tables)


def dynamic_key(name: str) -> PartKey:
    """The key of a dynamic table's gradient in a push (and in the sync accumulator): (name, 0)."""
    return (name, 0)
