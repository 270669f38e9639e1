"""A checkpoint's contents: one consistent cut of a shard's state, as plain dataclasses, and the
checks that decide whether a shard configured as it is now can continue from it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ps_common.errors import CheckpointMismatchError, CorruptCheckpointError
from ps_common.shard_map import ParamSpec
from ps_server.config import MAX_COUNTER, ServerConfig
from ps_server.dynamic import ROW_STEP, DynamicSnapshot
from ps_server.optimizers import make_optimizer

log = logging.getLogger(__name__)


@dataclass
class PartSnapshot:
    """One owned part: value, optimizer slots, and the sync accumulator (None when empty)."""

    name: str
    row_start: int
    row_end: int
    value: np.ndarray
    slots: dict[str, np.ndarray]
    accumulator: np.ndarray | None = None


@dataclass
class OutcomeSnapshot:
    """A remembered push outcome (PushResult's fields) for answering a retry of `clock`."""

    clock: int
    accepted: bool
    drop_reason: int
    message: str
    step: int
    clock_after: int
    aggregated: int = 0


@dataclass
class WorkerSnapshot:
    """One worker: its clock (the next push's), whether it held a lease, and its recent outcomes."""

    worker_id: str
    clock: int
    live: bool
    outcomes: list[OutcomeSnapshot] = field(default_factory=list)


@dataclass
class ShardState:
    """Everything a shard needs to continue: a consistent cut of its state."""

    shard_index: int
    num_shards: int
    mode: str
    partition_min_bytes: int
    optimizer: str
    optimizer_params: dict[str, Any]
    consistency: dict[str, Any]
    step: int
    dropped: int
    applied_gradients: int
    parameters: list[ParamSpec]
    parts: list[PartSnapshot]
    workers: list[WorkerSnapshot]
    contributors: list[str] | None = None    # sync: the workers in the step's accumulator
    created_unix: float = 0.0
    dynamic: list[DynamicSnapshot] = field(default_factory=list)   # dynamic tables' live rows (none before v2)

    @property
    def initialized(self) -> bool:
        return bool(self.parameters)

    @property
    def nbytes(self) -> int:
        total = 0
        for p in self.parts:
            total += p.value.nbytes + sum(s.nbytes for s in p.slots.values())
            total += 0 if p.accumulator is None else p.accumulator.nbytes
        return total + sum(d.nbytes for d in self.dynamic)


def consistency_of(config: ServerConfig) -> dict[str, Any]:
    return {"replicas_to_aggregate": config.replicas_to_aggregate, "total_replicas": config.total_replicas,
            "staleness": "inf" if math.isinf(config.staleness) else config.staleness,
            "max_staleness": config.max_staleness}


def check_compatible(state: ShardState, config: ServerConfig, *, warn: bool = True) -> None:
    """Raises CheckpointMismatchError when `state` cannot continue under `config`; warns on softer changes."""
    hard = [("shard_index", state.shard_index, config.shard_index), ("num_shards", state.num_shards, config.num_shards),
            ("mode", state.mode, config.mode), ("partition_min_bytes", state.partition_min_bytes, config.partition_min_bytes),
            ("optimizer", state.optimizer, config.optimizer)]
    for what, theirs, ours in hard:
        if theirs != ours:
            raise CheckpointMismatchError(
                f"checkpoint at step {state.step} was written with {what}={theirs!r}, this shard is configured with "
                f"{what}={ours!r}; start with the checkpoint's setting, or point --checkpoint-dir at another directory")
    if not warn:
        return
    ours_params = make_optimizer(config.optimizer, **config.optimizer_params).hyperparameters
    if dict(ours_params) != dict(state.optimizer_params):
        log.warning("checkpoint at step %d used %s hyperparameters %s; continuing with the configured %s", state.step,
                    state.optimizer, state.optimizer_params, dict(ours_params))
    if consistency_of(config) != state.consistency:
        log.warning("checkpoint at step %d used %s settings %s; continuing with the configured %s", state.step,
                    state.mode, state.consistency, consistency_of(config))


def check_ranges(state: ShardState, limit: int = MAX_COUNTER) -> None:
    """Refuses (CorruptCheckpointError) a state whose steps, clocks or counts are negative or at least `limit`.

    Such values cannot come from a shard that checks its input: the file was damaged or
    forged, and restoring it would make every later response fail to encode.
    """
    values = [("step", state.step), ("dropped", state.dropped), ("applied_gradients", state.applied_gradients)]
    for w in state.workers:
        values.append((f"clock of worker {w.worker_id!r}", w.clock))
        for o in w.outcomes:
            values += [(f"outcome clock of worker {w.worker_id!r}", o.clock), ("outcome step", o.step),
                       ("outcome clock_after", o.clock_after)]
    for d in state.dynamic:
        for what, array in ((f"a touch step of dynamic table {d.name!r}", d.touched),
                            (f"a row_step of dynamic table {d.name!r}", d.slots.get(ROW_STEP))):
            if array is not None and len(array):
                values += [(what, int(array.min())), (what, int(array.max()))]
    for what, value in values:
        if not 0 <= value < limit:
            raise CorruptCheckpointError(f"checkpoint at step {state.step}: {what} is {value}, outside [0, {limit})")
