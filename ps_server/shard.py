"""One shard's domain: where a push goes, when a pull is answered, who is live.

The shard owns the store (values and optimizer state), the membership (leases, clocks and
recent push outcomes), the consistency policy and the barriers, and coordinates them under
one condition variable; every change that could release a waiter notifies it. It takes
and returns domain values (arrays, dataclasses): decoding requests and building responses
is the service boundary's job (ps_server/service.py). Requests are checked before the
lock is taken, so a rejected request changes nothing.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ps_common.errors import (
    CheckpointMismatchError,
    InitMismatchError,
    InvalidRequestError,
    InvalidTensorError,
    NotInitializedError,
    NotPrimaryError,
    ReplayMismatchError,
    ResourceExhaustedError,
    ShuttingDownError,
    UnknownTensorError,
    WaitTimeoutError,
    shorten,
)
from ps_common.codec import CHUNK_BYTES
from ps_common.shard_map import ParamSpec, ShardMap, build_shard_map
from ps_server.barrier import Barriers
from ps_server.checkpoints.state import (OutcomeSnapshot, PartSnapshot, ShardState, WorkerSnapshot,
                                         check_compatible, check_ranges, consistency_of)
from ps_server.config import MAX_COUNTER, ServerConfig
from ps_common.modes import DropReason, step_to_wait_for
from ps_server.consistency import ConsistencyPolicy, Decision, PolicyInfo, PolicySnapshot, make_policy
from ps_server.dynamic import DynamicRows
from ps_server.events import Events
from ps_server.membership import Membership, PushResult, WorkerRecord
from ps_server.operations import Op, Push, PushPullResult, Read, ReplicationLog, StateRead, Values
from ps_server.optimizers import make_optimizer
from ps_server.rows import (RowGrad, all_finite, check_table_name, checked_ids, dynamic_gradient, owned_parts,
                            split_gradient)
from ps_server.store import ParameterStore, PartKey, PartState, dynamic_key

log = logging.getLogger(__name__)

#: The optimizer slot of per-row update counts (lazy sparse updates, ps_server/optimizers.py apply_rows).
ROW_STEP = "row_step"
#: The most row bytes one PullRows or PushPull answers: a chunk's worth, so the answer fits gRPC's
#: message limit with room for the rest; checked before the rows are allocated.
ROWS_ANSWER_BYTES = CHUNK_BYTES

#: Longest single sleep of a wait: waiters re-check stop, resets and their deadline at least this often (s).
WAIT_SLICE_SECONDS = 1.0


@dataclass(frozen=True)
class WorkerView:
    """One worker as cluster info shows it."""

    worker_id: str
    clock: int
    live: bool
    lease_remaining: float


@dataclass(frozen=True)
class DynamicView:
    """One dynamic table on this shard, as cluster info and metrics show it."""

    name: str
    rows: int       # live rows
    created: int    # rows created since the shard started or was restored
    evicted: int    # rows evicted since then


@dataclass(frozen=True)
class ShardView:
    """A consistent read of the shard's state, for cluster info and metrics."""

    step: int
    initialized: bool
    dropped: int
    shard_map: ShardMap | None
    parts_held: int
    bytes_held: int
    workers: tuple[WorkerView, ...]
    policy: PolicyInfo
    optimizer: str
    dynamic: tuple[DynamicView, ...] = ()


@dataclass(frozen=True)
class _ReadPlan:
    """A checked Read: the tensors (None: all), the rows as (name, ids, owning parts or None for a dynamic
    table), and the bytes it answers."""

    names: list[str] | None
    rows: list[tuple[str, np.ndarray, list | None]]
    nbytes: int


class _CopyOut:
    """A read into arrays (Read.into), each part copied once: from the update's blocks while they are still in the
    cache (`updated`, where the read follows the push at once) or afterwards (`copy`); with `written`, each
    block's bytes told as they land (Read.written)."""

    #: Bytes a copy made after the update tells at a time.
    BLOCK_BYTES = 1 << 20

    def __init__(self, into: Mapping[PartKey, np.ndarray], written: Callable[[PartKey, int], None] | None,
                 keys: Collection[PartKey]) -> None:
        self.into, self.written, self.keys = into, written, keys
        self.done: set[PartKey] = set()

    def updated(self, key: PartKey, value: np.ndarray, start: int, stop: int) -> None:
        """The store's update finished `value`'s flat elements [start, stop) of part `key`."""
        target = self.into.get(key)
        if key not in self.keys or target is None:
            return   # not read, or no place for it: _read_locked copies or refuses it
        # (Never raises into the update, which must finish. A part updated twice before its read would tell fewer
        # bytes than it told: the data channel then drops the answer and the connection, and the worker asks again.)
        np.copyto(target.reshape(-1)[start:stop], value.reshape(-1)[start:stop], casting="no")
        if self.written is not None:
            self.written(key, stop * value.itemsize)
        if stop == value.size:
            self.done.add(key)

    def copy(self, key: PartKey, value: np.ndarray, target: np.ndarray) -> None:
        """Part `key` read into `target` (unless the update copied it already)."""
        if key in self.done:
            return
        self.done.add(key)
        if self.written is None:
            np.copyto(target, value, casting="no")
            return
        flat_value, flat_target = value.reshape(-1), target.reshape(-1)
        block = max(1, self.BLOCK_BYTES // max(1, value.itemsize))
        for start in range(0, value.size, block):
            stop = min(start + block, value.size)
            np.copyto(flat_target[start:stop], flat_value[start:stop], casting="no")
            self.written(key, stop * value.itemsize)
        if not value.size:
            self.written(key, 0)


class _Host:
    """The PolicyHost a policy sees: the step, live workers and clocks, the owned parts, and apply."""

    def __init__(self, shard: "Shard") -> None:
        self.shard_index = shard.config.shard_index
        self._shard = shard
        self.live_clocks = shard.membership.live_clocks
        self.not_live = shard.membership.not_live
        # touches dynamic rows at t; a PushPull whose read follows at once copies each block out as it is updated
        self.apply = lambda grads: shard.store.apply(grads, step=shard.step, updated=shard._copy_as_updated)

    @property
    def step(self) -> int:
        return self._shard.step

    def live_count(self) -> int:
        """The live workers; while a backup replays an operation, the count its primary decided with."""
        dictated = self._shard._dictated_live
        return self._shard.membership.live_count() if dictated is None else dictated

    def parts(self) -> set[PartKey]:
        return self._shard.store.trainable_keys()


class Shard:
    """The domain object behind one shard process. Thread-safe; pull and barrier block.

    `policy` replaces the consistency policy of `config.mode` (the way a server's update
    rule is replaced); `events` receives the shard's domain events (metrics, checkpoints).
    """

    def __init__(self, config: ServerConfig, *, policy: ConsistencyPolicy | None = None,
                 events: Events | None = None, now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.optimizer = make_optimizer(config.optimizer, **config.optimizer_params)
        self.store = ParameterStore(shard_index=config.shard_index, num_shards=config.num_shards,
                                    partition_min_bytes=config.partition_min_bytes, optimizer=self.optimizer)
        self.membership = Membership(config.lease_seconds, clock=now)
        self.policy: ConsistencyPolicy = policy or self._default_policy()
        self.barriers = Barriers(max_barriers=config.max_barriers)
        self.events = events or Events()
        self.step = 0
        self.dropped = 0
        self.applied_gradients = 0
        #: "PATH (step N)" of the checkpoint this shard started from (checkpoints/writer.py), else None
        self.restored_from: str | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._resets = 0            # bumped by reset(): a waiter that sees it change fails with UNAVAILABLE
        #: Bumped whenever the parts change shape (initialize, reset, restore): what a shared-memory layout
        #: was made for (the boundary compares; an int read is atomic).
        self.generation = 0
        #: this shard process's random id: with `generation`, the state id a reader of changes compares
        self.incarnation = secrets.token_hex(6)
        #: replicated shards (ps_server/replication): told every state change under the lock, in order
        self.replication: ReplicationLog | None = None
        #: ... raises NotPrimaryError when this replica may not take calls now (a backup); None: always may
        self.role_check: Callable[[], None] | None = None
        #: ... True on a backup: its state changes only by replay (no policy decisions of its own on ticks)
        self.following = False
        self._dictated_live: int | None = None   # a backup's replay: the primary's live-worker count
        #: set (lock held) by a PushPull whose read into arrays follows its push at once: the store's
        #: update calls it with each block it finishes (_CopyOut.updated)
        self._copy_as_updated: Callable[[PartKey, np.ndarray, int, int], None] | None = None
        self.policy_host = _Host(self)   # the narrow view every policy call gets

    def _default_policy(self) -> ConsistencyPolicy:
        c = self.config
        return make_policy(c.mode, replicas_to_aggregate=c.replicas_to_aggregate, total_replicas=c.total_replicas,
                           staleness=c.staleness, max_staleness=c.max_staleness)

    # ------------------------------------------------------------------ helpers

    def _carry_out(self, decision: Decision) -> None:
        """What a policy decided (lock held): one step per applied update; its events are emitted."""
        if decision.applied:
            self.step += 1
            self.applied_gradients += decision.applied
            self.store.evict(self.step)   # dynamic rows untouched for longer than evict_after_steps
            self.events.emit("step", step=self.step)
        for event in decision.events:
            self.events.emit(event.name, **event.fields)

    def check_id(self, what: str, value: str) -> None:
        """An id (worker, barrier, participant) must be non-empty and at most max_id_bytes of UTF-8."""
        if not value:
            raise InvalidRequestError(f"{what} must not be empty")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > self.config.max_id_bytes:
            raise InvalidRequestError(f"{what} is {size} bytes long, over max_id_bytes={self.config.max_id_bytes}: "
                                      f"{shorten(value, 64)!r}")

    def holds_lease(self, worker_id: str) -> bool:
        """Whether `worker_id` is registered and its lease runs (admission tells such callers apart).

        Read without the lock: one dict lookup and one float compare, atomic under the GIL; a
        lease that ends during the call changes nothing the answer is used for.
        """
        record = self.membership.workers.get(worker_id)
        return record is not None and self.membership.is_live(record)

    def atomically(self, fn: Callable[[], object]) -> object:
        """fn() under the shard's lock (a replica's snapshot taken at one operation of its log)."""
        with self._cond:
            return fn()

    def renew_leases(self) -> None:
        """A fresh lease for every worker still registered (a backup becoming primary: their heartbeats went to the
        old primary)."""
        with self._cond:
            for worker_id, record in self.membership.workers.items():
                if record.gone_since is None:
                    self.membership.renew(worker_id)

    def check_role(self) -> None:
        """NotPrimaryError when this replica of a replicated shard may not take calls now."""
        if self.role_check is not None:
            self.role_check()

    def _check_running(self) -> None:
        if self._stopping:
            raise ShuttingDownError(f"shard {self.config.shard_index} is shutting down")

    def _wait(self, blocker: Callable[[], str | None], timeout: float, what: str) -> None:
        """Waits (lock held) until blocker() returns None, or raises WaitTimeoutError after timeout s.

        Real time (time.monotonic), like the condition's wait: the injected `now` clock
        drives leases only, so a frozen test clock cannot make a wait endless. A stop or a
        reset ends the wait with ShuttingDownError.
        """
        deadline = time.monotonic() + timeout
        resets = self._resets
        reason = blocker()
        while reason is not None:
            self._check_running()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(f"{what} waited {timeout:.1f} s for {reason}")
            self._cond.wait(min(left, WAIT_SLICE_SECONDS))
            if self._resets != resets:
                raise ShuttingDownError(f"{what}: the parameters of shard {self.config.shard_index} were reset "
                                        "while it waited")
            reason = blocker()

    def wait_timeout(self, requested_ms: int, rpc_remaining: float | None) -> float:
        """The wait bound: the request's (or the default), the shard's maximum and the rpc deadline."""
        if requested_ms < 0:
            raise InvalidRequestError(f"wait_timeout_ms must be >= 0, got {requested_ms}")
        limit = self.config.wait_timeout_seconds
        timeout = limit if requested_ms == 0 else min(requested_ms / 1000, limit)
        if rpc_remaining is not None:
            timeout = min(timeout, max(0.0, rpc_remaining))
        return timeout

    # ------------------------------------------------------------------ init

    def init_layout(self, specs: Sequence[ParamSpec]) -> Callable[[str, int], tuple[np.dtype, tuple[int, ...]]]:
        """The parts this shard owns under `specs`, as a lookup (name, row_start) -> (dtype, shape) for decoding.

        Raises InvalidTensorError for an invalid list, InitMismatchError when another list is in place.
        """
        self.check_role()
        self._check_running()
        self._check_specs(specs)
        with self._cond:
            try:
                shard_map, _ = self.store.plan(specs)
            except InitMismatchError as exc:
                if self.restored_from is None:
                    raise
                raise InitMismatchError(
                    f"{exc}: shard {self.config.shard_index} restored the checkpoint {self.restored_from}, which "
                    f"holds another model's parameters; give the job the model it was trained with, or another "
                    f"checkpoint folder") from None
        owned = sum(p.nbytes for p in shard_map.parts_on(self.config.shard_index))
        limit = self.config.shard_bytes_limit
        if owned > limit:
            raise ResourceExhaustedError(
                f"the parameter list puts {owned} bytes on shard {self.config.shard_index}, over its limit of "
                f"{limit} bytes (max_shard_bytes; default: the machine's memory): use more shards")
        return ParameterStore.expected_from(shard_map, self.config.shard_index)

    def _check_specs(self, specs: Sequence[ParamSpec]) -> None:
        """A parameter list within the limits: count, name length, shapes (before anything is planned or allocated)."""
        c = self.config
        if not specs:
            raise InvalidRequestError("InitParameters: the parameter list is empty")
        if len(specs) > c.max_tensors:
            raise InvalidRequestError(f"InitParameters: {len(specs)} tensors, over max_tensors={c.max_tensors}")
        for spec in specs:
            size = len(spec.name.encode("utf-8", "surrogatepass"))
            if not spec.name or size > c.max_name_bytes:
                raise InvalidRequestError(f"InitParameters: tensor name of {size} bytes {shorten(spec.name, 64)!r}: "
                                          f"names must have 1 to max_name_bytes={c.max_name_bytes} bytes")
            if any(d < 0 for d in spec.shape):
                raise InvalidTensorError(f"tensor {spec.name!r}: negative dimension in shape {list(spec.shape)}")
            if spec.nbytes >= MAX_COUNTER:
                raise InvalidTensorError(f"tensor {spec.name!r}: shape {list(spec.shape)} of {spec.dtype} is "
                                         f"{spec.nbytes} bytes, more than any machine holds")

    def initialize(self, specs: Sequence[ParamSpec], values: Mapping[PartKey, np.ndarray],
                   worker_id: str = "") -> tuple[bool, int, int]:
        """Installs the initial values of this shard's parts; returns (already_initialized, step, parts owned)."""
        self.check_role()
        self._check_running()
        with self._cond:
            shard_map, already = self.store.plan(specs)   # again: another init may have won the race
            if already:
                step, seq = self.step, self._last_seq()
            else:
                replicated = None if self.replication is None else {k: np.array(v, copy=True)
                                                                    for k, v in values.items()}
                self.store.install(shard_map, values)
                self.generation += 1
                self._cond.notify_all()
                seq = self._record(Op("init", specs=tuple(specs), values=replicated))
        self._confirmed(seq)   # already initialized: the step it reports is one the backups hold too
        if already:
            return True, step, len(self.store.parts)
        log.info("shard %d initialized by %r: %d tensors, %d parts here (%d bytes)", self.config.shard_index,
                 worker_id, len(specs), len(self.store.parts), self.store.nbytes)
        self.events.emit("init")
        return False, self.step, len(self.store.parts)

    # ------------------------------------------------------------------ push

    def push_layout(self) -> Callable[[str, int], tuple[np.dtype, tuple[int, ...]]]:
        """The lookup (name, row_start) -> (dtype, shape) a push's gradients are decoded against."""
        if not self.store.initialized:
            raise NotInitializedError(
                f"shard {self.config.shard_index} has no parameters yet: push before InitParameters")
        return self.store.expected

    def part_layout(self, names: Collection[str] | None = None,
                    ) -> tuple[int, list[tuple[PartKey, np.dtype, tuple[int, ...]]]]:
        """(generation, every owned part's (key, dtype, shape) in shard-map order, of the tensors `names` only when
        given): one consistent read, e.g. for a shared-memory layout. UnknownTensorError for a name the model
        lacks."""
        if not self.store.initialized:
            raise NotInitializedError(f"shard {self.config.shard_index} has no parameters yet")
        if names is not None:
            self.store.check_names(names)
        with self._cond:
            return self.generation, [(key, state.value.dtype, state.value.shape) for key, state in self.store.parts.items()
                                     if names is None or key[0] in names]

    def parameter_bytes(self) -> int:
        """Bytes of the parameter values this shard holds now (ParameterStore.nbytes), read without the lock: a
        bound for what one request may bring, not an exact figure."""
        return self.store.nbytes

    def table_spec(self, name: str, where: str) -> ParamSpec:
        """The spec of a tensor pushed or pulled by rows (NotInitializedError, UnknownTensorError, bad name)."""
        check_table_name(name, where)
        shard_map = self.store.shard_map
        if shard_map is None:
            raise NotInitializedError(f"shard {self.config.shard_index} has no parameters yet: {where} before "
                                      "InitParameters")
        spec = shard_map.specs.get(name)
        if spec is None:
            raise UnknownTensorError(f"{where}: tensor {name!r} is not a parameter of this model")
        return spec

    def push(self, push: Push) -> PushResult:
        """Applies, accumulates or drops one push; answers a retry (a clock below the worker's) with its first
        outcome, never applying it again. Checked whole before the lock: a rejected push changes nothing."""
        self.check_role()
        grads = self._checked(push)
        replicated = push.copied() if self.replication is not None else None
        with self._cond:
            result, seq = self._push_locked(push, grads, replicated)
        self._confirmed(seq)
        self._emit_push(push, result, grads)
        return result

    def pull(self, read: Read) -> Values:
        """Waits as `read` says (at most its timeout: WaitTimeoutError), then reads its parts and rows, all at one
        step. The read runs under the lock, so no update lands half-way through it."""
        self.check_role()
        plan = self._read_plan(read, f"pull by {read.worker_id or 'a client'!r}")
        with self._cond:
            self._check_running()
            if read.worker_id and read.worker_id in self.membership.workers:
                self.membership.renew(read.worker_id)
            self._wait_for(read.min_step, read.worker_id if read.ssp else "", read.clock, read.timeout,
                           f"pull by {read.worker_id or 'a client'!r} on shard {self.config.shard_index}")
            values = self._read_locked(read, plan)
            seq = self._last_seq()
        self._confirmed(seq)   # read committed: never a step the backups lack
        self.events.emit("pull", nbytes=plan.nbytes)
        return values

    def push_pull(self, push: Push, read: Read) -> PushPullResult:
        """A push, then the read the worker needs next, in one locked section (the training loop's step).

        Both are checked before anything changes. The read waits for the step the push
        belongs to (`read.wait_for_step`: ps_common.modes.step_to_wait_for) or the SSP bound
        at the worker's clock after the push (`read.ssp`), at most `read.timeout`; a wait that
        runs out, or new dynamic rows that would pass max_shard_bytes, leave the push applied
        and return no values.
        """
        self.check_role()
        grads = self._checked(push)
        plan = self._read_plan(read, f"PushPull rows by {push.worker_id!r}")
        replicated = push.copied() if self.replication is not None else None
        copy_out = self._copy_out(read, plan)
        with self._cond:
            # A read that follows the push without letting go of the lock reads what the update writes: each block
            # is copied out (and may be sent) as the update finishes it, while it is still in the cache.
            if copy_out is not None and not (read.wait_for_step or read.ssp):
                self._copy_as_updated = copy_out.updated
            try:
                result, seq = self._push_locked(push, grads, replicated)
            finally:
                self._copy_as_updated = None
            min_step = step_to_wait_for(result.accepted, result.drop_reason, push.read_step, result.step) \
                if read.wait_for_step else 0
            try:
                self._wait_for(min_step, push.worker_id if read.ssp else "", result.clock, read.timeout,
                               f"PushPull by {push.worker_id!r} on shard {self.config.shard_index}")
                values, why = self._read_locked(read, plan, copy_out), ""
                seq = max(seq, self._last_seq())   # read committed: the step read, not only the push
            except WaitTimeoutError as exc:
                values, why = None, str(exc)
            except ResourceExhaustedError as exc:   # new dynamic rows would pass max_shard_bytes
                values, why = None, str(exc)
                log.warning("PushPull by %r: its rows were not read: %s", push.worker_id, exc)
        self._confirmed(seq)
        self._emit_push(push, result, grads)
        if values is not None:
            self.events.emit("pull", nbytes=plan.nbytes)
        return PushPullResult(result, values, why)

    def read_state(self, since: int, *, whole: Sequence[str] = (), min_step: int = 0, timeout: float = 0.0
                   ) -> StateRead:
        """The trained state (since < 0), or what changed of it after step `since`: dense parts updated since
        (whole), rows of tables trained by rows updated or created since; tensors named in `whole` whole. Waits
        for `min_step` first (WaitTimeoutError after timeout s). One locked section: one step's values."""
        self.check_role()
        shard_map = self.store.shard_map
        if shard_map is None:
            raise NotInitializedError(f"shard {self.config.shard_index} has no parameters yet: ReadState before "
                                      "InitParameters")
        unknown = [n for n in whole if n not in shard_map.specs]
        if unknown:
            raise UnknownTensorError(f"ReadState: tensor(s) {unknown[:5]} are not parameters of this model")
        whole_set = set(whole)
        with self._cond:
            self._check_running()
            self._wait_for(min_step, "", 0, timeout, f"ReadState on shard {self.config.shard_index}")
            read = StateRead(self.step, f"{self.incarnation}:{self.generation}")
            for key, state in self.store.parts.items():
                name, row_start = key
                if since >= 0 and name not in whole_set and state.updated <= since:
                    continue
                if since >= 0 and name not in whole_set and state.row_updated is not None:
                    changed = np.flatnonzero(state.row_updated > since)
                    read.rows.append((name, changed + row_start, state.value[changed].copy()))
                else:
                    read.parts[key] = state.value.copy()
            for name, table in self.store.dynamic.items():
                ids, rows = table.rows_since(-1 if name in whole_set else since)
                read.rows.append((name, ids, rows))
                read.live_rows[name] = table.rows
        self.events.emit("pull", nbytes=sum(v.nbytes for v in read.parts.values()) +
                         sum(r.nbytes for _, _, r in read.rows))
        return read

    def _checked(self, push: Push) -> Mapping[PartKey, np.ndarray | RowGrad]:
        """The push's gradients, row gradients cut per part, all checked (before the lock)."""
        worker_id, clock = push.worker_id, push.clock
        self.check_id("push header: worker_id", worker_id)
        if not 0 <= clock < MAX_COUNTER or not 0 <= push.read_step < MAX_COUNTER:
            raise InvalidRequestError(f"push from {worker_id!r}: clock {clock} and read_step {push.read_step} must be "
                                      f"in [0, {MAX_COUNTER})")
        grads = self._with_rows(worker_id, clock, push.grads, push.row_grads) if push.row_grads else push.grads
        for (name, row_start), grad in grads.items():
            if isinstance(grad, RowGrad):
                continue   # checked by split_gradient
            if grad.dtype.kind != "f":
                raise InvalidTensorError(
                    f"push from {worker_id!r} at clock {clock}: {name!r} rows from {row_start} is {grad.dtype.name}: "
                    "only floating-point parameters train; push no gradient for it")
            if (name, row_start) not in push.finite and not all_finite(grad):
                raise InvalidRequestError(
                    f"push from {worker_id!r} at clock {clock}: gradient of {name!r} rows from {row_start} holds NaN or inf")
        return grads

    def _push_locked(self, push: Push, grads: Mapping[PartKey, np.ndarray | RowGrad],
                     replicated: Push | None = None) -> tuple[PushResult, int]:
        """The push under the lock: the worker's record, the read step, the policy's decision carried out; with the
        sequence number its answer waits for (`_confirmed`): its replicated operation's, for a retry the last one
        recorded (0: an unreplicated shard)."""
        self._check_running()
        worker_id, clock, read_step = push.worker_id, push.clock, push.read_step
        record = self.membership.get(worker_id)
        if clock < record.clock:
            # answered once the backups hold what this replica holds: the first push among it, which may still be
            # on its way to them (the retry came while the first waited for their confirmation)
            return self._duplicate(record, clock), self._last_seq()
        if clock > record.clock + self.config.max_clock_ahead:
            raise InvalidRequestError(
                f"push from {worker_id!r}: clock {clock} is more than max_clock_ahead={self.config.max_clock_ahead} "
                f"ahead of the shard's clock {record.clock} for it")
        self._check_room([(key[0], g.rows) for key, g in grads.items()
                          if isinstance(g, RowGrad) and g.part_rows is None])
        live = self.policy_host.live_count()   # what the policy decides with: a backup replays with the same
        if read_step > self.step:
            # Only a shard restored from an older checkpoint can be behind a worker's read.
            decision = Decision.drop(DropReason.STEP_AHEAD, (
                f"gradient read at step {read_step}, but shard {self.config.shard_index} is at step {self.step} "
                f"(restored from an older checkpoint?): dropped; pull again"))
        else:
            decision = self.policy.on_push(self.policy_host, worker_id, read_step, grads)
        staleness = self.step - read_step   # on arrival, before this push can advance the step
        self._carry_out(decision)
        record.clock = clock + 1
        self.membership.renew(worker_id)
        if not decision.accepted:
            self.dropped += 1
        result = PushResult(decision.accepted, decision.drop_reason, decision.message, self.step, record.clock,
                            aggregated=self.policy.aggregated(), staleness=staleness)
        self.membership.remember(record, clock, result)
        self._cond.notify_all()
        seq = self._record(Op("push", push=replicated or push, live_count=live,
                              result=(result.accepted, result.step, result.clock)))
        return result, seq

    # ------------------------------------------------------------------ replication (ps_server/replication)

    def _record(self, op: Op) -> int:
        """Tells the replication log a change (under the lock, in order); its sequence number, 0 when unreplicated."""
        return 0 if self.replication is None else self.replication.record(op)

    def _last_seq(self) -> int:
        """(Lock held) The last change told to the replication log: everything a read or an answer now reflects;
        0 when unreplicated."""
        return 0 if self.replication is None else self.replication.seq

    def _confirmed(self, seq: int) -> None:
        """Waits (outside the lock) until every in-sync backup has operation `seq`, and this replica may still
        acknowledge: NotPrimaryError otherwise (the change stays here; the client retries on the new primary)."""
        if not seq:
            return
        log_ = self.replication
        if log_ is None:
            raise NotPrimaryError(f"shard {self.config.shard_index}: this replica stepped down before its backups "
                                  "confirmed the change; ask the new primary")
        log_.wait(seq)

    def replay(self, op: Op) -> None:
        """A backup applies its primary's operation exactly as the primary did: the same code under the lock, the
        live-worker count the primary decided with. ReplayMismatchError when a push's outcome differs from the
        primary's (the backup then takes a whole state again)."""
        grads = self._checked(op.push) if op.kind == "push" and op.push is not None else None
        with self._cond:
            self._dictated_live = op.live_count
            try:
                self._replay_locked(op, grads)
            finally:
                self._dictated_live = None
                self._cond.notify_all()

    def _replay_locked(self, op: Op, grads: Mapping[PartKey, np.ndarray | RowGrad] | None) -> None:
        if op.kind == "push":
            assert op.push is not None and op.result is not None and grads is not None
            result, _ = self._push_locked(op.push, grads)
            if (result.accepted, result.step, result.clock) != tuple(op.result):
                raise ReplayMismatchError(
                    f"shard {self.config.shard_index}: replaying the push of {op.push.worker_id!r} at clock "
                    f"{op.push.clock} gave (accepted, step, clock) {(result.accepted, result.step, result.clock)}, "
                    f"the primary {tuple(op.result)}")
        elif op.kind == "register":
            self.membership.register(op.worker_id).clock = op.clock
        elif op.kind == "deregister":
            self.membership.deregister(op.worker_id)
            self._membership_changed(record=False)
        elif op.kind == "membership":
            self._membership_changed(record=False)
        elif op.kind == "init":
            shard_map, already = self.store.plan(op.specs)
            if not already:
                self.store.install(shard_map, op.values or {})
                self.generation += 1
        elif op.kind == "reset":
            self._reset_locked()
        else:
            raise ValueError(f"unknown replicated operation {op.kind!r}")

    def _emit_push(self, push: Push, result: PushResult, grads: Mapping[PartKey, np.ndarray | RowGrad]) -> None:
        if result.duplicate:
            return   # counted as "duplicate" under the lock
        self.events.emit("push", worker_id=push.worker_id, accepted=result.accepted, reason=result.drop_reason,
                         staleness=result.staleness, nbytes=sum(g.nbytes for g in grads.values()),
                         rows=sum(len(g.rows) for g in grads.values() if isinstance(g, RowGrad)))

    def _with_rows(self, worker_id: str, clock: int, grads: Mapping[PartKey, np.ndarray],
                   row_grads: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> dict[PartKey, np.ndarray | RowGrad]:
        """`grads` plus the checked row gradients (before the lock: a bad one changes nothing)."""
        shard_map = self.store.shard_map
        if shard_map is None:
            raise NotInitializedError(f"shard {self.config.shard_index} has no parameters yet: push before InitParameters")
        where = f"push from {worker_id!r} at clock {clock}"
        merged: dict[PartKey, np.ndarray | RowGrad] = dict(grads)
        named: set[str] = set()
        for name, ids, values in row_grads:
            check_table_name(name, where)
            if name in named:
                raise InvalidTensorError(f"{where}: tensor {name!r} has two row gradients; send one (ids may repeat)")
            named.add(name)
            spec = shard_map.specs.get(name)
            if spec is not None and spec.dynamic is not None:   # a dynamic table: by id (its own key, no chunks)
                merged[dynamic_key(name)] = dynamic_gradient(spec, ids, values, self.config.shard_index,
                                                             self.config.num_shards, where)
                continue
            for key, grad in split_gradient(shard_map, self.config.shard_index, name, ids, values, where).items():
                if key in merged:
                    raise InvalidTensorError(f"{where}: tensor {name!r} rows from {key[1]} has both a dense gradient "
                                             "and a row gradient")
                merged[key] = grad
        return merged

    def _check_room(self, tables: Sequence[tuple[str, np.ndarray]]) -> None:
        """ResourceExhaustedError (lock held) when creating the missing rows of `tables` (dynamic table name,
        ids) would take this shard past its parameter bytes limit (max_shard_bytes) with their optimizer state."""
        if not tables:
            return
        extra = sum(self.store.dynamic[name].missing(ids) * self.store.dynamic[name].row_state_bytes
                    for name, ids in tables)
        tables_held = self.store.dynamic.values()
        held = self.store.nbytes - sum(t.nbytes for t in tables_held) + sum(t.rows * t.row_state_bytes for t in tables_held)
        if extra and held + extra > self.config.shard_bytes_limit:
            raise ResourceExhaustedError(
                f"shard {self.config.shard_index}: creating dynamic rows of {[n for n, _ in tables][:5]} "
                f"({extra} bytes with optimizer state) would pass its limit of {self.config.shard_bytes_limit} "
                "bytes (max_shard_bytes): evict sooner (evict_after_steps) or use more shards")

    def _duplicate(self, record: WorkerRecord, clock: int) -> PushResult:
        first = record.outcomes.get(clock)
        self.events.emit("duplicate", worker_id=record.worker_id)
        if first is not None:
            return PushResult(first.accepted, first.drop_reason, first.message, self.step, record.clock,
                              duplicate=True, aggregated=first.aggregated)
        return PushResult(True, DropReason.NONE,
                          f"clock {clock} was taken before (worker {record.worker_id!r} is at clock {record.clock}); "
                          "not applied again", self.step, record.clock, duplicate=True)

    # ------------------------------------------------------------------ reads

    def _wait_for(self, min_step: int, worker_id: str, clock: int, timeout: float, what: str) -> None:
        """Waits (lock held) until the step reaches `min_step` and the policy lets `worker_id` at `clock` read."""
        if min_step < 0:
            raise InvalidRequestError(f"min_step must be >= 0, got {min_step}")

        def blocker() -> str | None:
            if self.step < min_step:
                return (f"step >= {min_step} (shard {self.config.shard_index} is at step {self.step}"
                        f"{self.policy.step_blocker(self.policy_host)})")
            return self.policy.pull_blocker(self.policy_host, worker_id, clock)

        self._wait(blocker, timeout, what)

    def _read_plan(self, read: Read, where: str) -> _ReadPlan:
        """Checks what `read` asks for (tensors known, tables named once, ids this shard owns, the rows' bytes
        within one answer) before the lock: InvalidRequestError, UnknownTensorError, NotInitializedError,
        ResourceExhaustedError."""
        shard_map = self.store.shard_map
        if shard_map is None:
            raise NotInitializedError(f"shard {self.config.shard_index} has no parameters yet: pull before InitParameters")
        names = None if read.names is None else list(read.names)
        if names:
            self.store.check_names(names)
        if not read.rows and names == []:
            raise InvalidRequestError(f"{where}: no tables named")
        tables = [name for name, _ in read.rows]
        if len(set(tables)) != len(tables):
            raise InvalidRequestError(f"{where}: a tensor is named twice in {tables[:10]}")
        rows = []
        for name, ids in read.rows:
            check_table_name(name, where)
            spec = shard_map.specs.get(name)
            if spec is not None and spec.dynamic is not None:
                checked_ids(spec, ids, self.config.shard_index, self.config.num_shards, where)
                rows.append((name, ids, None))
            else:
                rows.append((name, ids, owned_parts(shard_map, self.config.shard_index, name, ids, where)))
        row_bytes = sum(len(ids) * shard_map.specs[name].row_bytes for name, ids in read.rows)
        if row_bytes > ROWS_ANSWER_BYTES:   # before anything is allocated: one answer carries them all
            raise ResourceExhaustedError(
                f"{where}: {sum(len(ids) for _, ids in read.rows)} rows of {tables[:5]} are {row_bytes} bytes, more "
                f"than one answer carries ({ROWS_ANSWER_BYTES} bytes): ask for fewer rows per call")
        nbytes = row_bytes + sum(p.nbytes for p in shard_map.parts_on(self.config.shard_index)
                                 if names is None or p.name in set(names))
        return _ReadPlan(names, rows, nbytes)

    def _copy_out(self, read: Read, plan: _ReadPlan) -> _CopyOut | None:
        """How a PushPull's read into arrays is copied (None: not into arrays). Read.written is told only where
        the answer does not wait after the read (a replicated shard waits for its backups) and cannot go without
        its values (a dynamic table's rows asked: creating them may pass max_shard_bytes after the dense parts
        are read; a fixed tensor's rows cannot fail)."""
        if read.into is None:
            return None
        dynamic = any(found is None for _, _, found in plan.rows)
        written = read.written if not dynamic and self.replication is None else None
        return _CopyOut(read.into, written, {state.part.key for state in self.store.select(plan.names)})

    def _read_locked(self, read: Read, plan: _ReadPlan, copy_out: _CopyOut | None = None) -> Values:
        """The parts and rows `plan` names, at the current step (lock held): copies, or into `read.into` (by
        `copy_out` when given: a part it copied as the update wrote it is not copied again)."""
        values = Values(self.step)
        for state in self.store.select(plan.names):
            value = state.value
            if read.into is not None:
                target = read.into.get(state.part.key)
                if target is None:
                    raise InvalidRequestError(f"part {state.part.label!r} has no place to be read into (a shared-"
                                              "memory layout of another parameter list?): open it again")
                if copy_out is None:
                    np.copyto(target, value, casting="no")
                else:
                    copy_out.copy(state.part.key, value, target)
            elif read.narrow is not None and value.dtype == np.float32 and read.narrow != value.dtype:
                values.parts[state.part.key] = value.astype(read.narrow)
            else:
                values.parts[state.part.key] = value.copy()
        if plan.rows:
            # dynamic rows are created (from the initializer) and touched at this step
            self._check_room([(name, ids) for name, ids, found in plan.rows if found is None])
            for name, ids, found in plan.rows:
                if found is None:
                    values.rows.append((name, self.store.dynamic[name].read(ids, self.step)))
                    continue
                spec = self.store.shard_map.specs[name]
                rows = np.empty((len(ids), *spec.shape[1:]), dtype=spec.dtype)
                for part, pos in found:
                    rows[pos] = self.store.parts[part.key].value[ids[pos] - part.row_start]
                values.rows.append((name, rows))
        return values

    # ------------------------------------------------------------------ membership

    def register(self, worker_id: str) -> tuple[int, int, float]:
        """(clock to resume at, step, lease seconds)."""
        self.check_role()
        self.check_id("RegisterWorker: worker_id", worker_id)
        with self._cond:
            self._check_running()
            if worker_id not in self.membership.workers:
                self.membership.evict(self.config.worker_retention_seconds)
                if len(self.membership.workers) >= self.config.max_registered_workers:
                    raise ResourceExhaustedError(
                        f"shard {self.config.shard_index} holds {len(self.membership.workers)} workers, "
                        f"max_registered_workers={self.config.max_registered_workers}: {worker_id!r} refused")
            record = self.membership.register(worker_id)
            self._cond.notify_all()
            seq = self._record(Op("register", worker_id=worker_id, clock=record.clock))
            log.info("worker %r registered on shard %d at clock %d (step %d)", worker_id, self.config.shard_index,
                     record.clock, self.step)
            answer = record.clock, self.step, self.membership.lease_seconds
        self._confirmed(seq)
        return answer

    def heartbeat(self, worker_id: str) -> tuple[float, int]:
        self.check_role()
        self.check_id("Heartbeat: worker_id", worker_id)
        with self._cond:
            self.membership.renew(worker_id)
            return self.membership.lease_seconds, self.step

    def deregister(self, worker_id: str) -> None:
        self.check_role()
        seq = 0
        with self._cond:
            if self.membership.deregister(worker_id):
                log.info("worker %r left shard %d", worker_id, self.config.shard_index)
                live = self.policy_host.live_count()
                self._membership_changed(record=False)
                seq = self._record(Op("deregister", worker_id=worker_id, live_count=live))
        self._confirmed(seq)

    def tick(self) -> None:
        """Periodic: lets the policy react to expired leases, forgets long-gone workers and idle barriers,
        and wakes waiters to re-check."""
        with self._cond:
            if self.following:   # a backup's state moves only by its primary's operations
                return
            for worker_id in self.membership.evict(self.config.worker_retention_seconds):
                log.info("shard %d forgot worker %r: gone for over %g s (worker_retention_seconds)",
                         self.config.shard_index, worker_id, self.config.worker_retention_seconds)
            self._membership_changed()
        self.barriers.evict(self.config.barrier_retention_seconds)

    def _membership_changed(self, *, record: bool = True) -> None:
        """Lets the policy react to the live workers (a sync step may complete); a step that completes is told to
        the replication log with the count it was decided with (unless the caller records the cause itself)."""
        live = self.policy_host.live_count()
        decision = self.policy.on_membership_change(self.policy_host)
        if decision is not None:
            self._carry_out(decision)
            if record and decision.applied:
                self._record(Op("membership", live_count=live))
        self._cond.notify_all()

    def barrier(self, name: str, participant: str, participants: int, timeout: float) -> tuple[int, int]:
        self.check_role()
        self._check_running()
        self.check_id("Barrier: name", name)
        self.check_id(f"barrier {name!r}: participant_id", participant)
        if not 1 <= participants <= self.config.max_registered_workers:
            raise InvalidRequestError(f"barrier {name!r}: participants must be in [1, max_registered_workers="
                                      f"{self.config.max_registered_workers}], got {participants}")
        return self.barriers.wait(name, participant, participants, timeout)

    def stop(self) -> None:
        """Refuses new work and wakes every waiter (pulls, sync and SSP holds, barriers) to fail fast with UNAVAILABLE."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.barriers.stop(f"shard {self.config.shard_index} is shutting down")

    def reset(self) -> int:
        """Drops the parameters, optimizer state, step, worker clocks and the policy's state (Admin.ResetParameters).

        Afterwards the shard is as if just started: the next InitParameters may set a
        different parameter list, and workers register again. Waiting pulls wake and fail
        with UNAVAILABLE. Returns the step before the reset.
        """
        self.check_role()
        with self._cond:
            self._check_running()
            before = self.step
            self._reset_locked()
            seq = self._record(Op("reset"))
        self._confirmed(seq)
        self.events.emit("reset", step=before)
        return before

    def _reset_locked(self) -> None:
        self.store.clear()
        self.generation += 1
        self.membership.clear()
        self.policy = self._default_policy()
        self.step = self.dropped = self.applied_gradients = 0
        self._resets += 1
        self._cond.notify_all()

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self) -> ShardState:
        """A copy of the whole state, one consistent cut: each component gives its own part.

        Copies under the lock (about a memcpy of the shard); see ps_server/checkpoints.
        """
        c = self.config
        with self._cond:
            policy = self.policy.snapshot(_copy)
            parts = [PartSnapshot(name=name, row_start=row_start, row_end=state.part.row_end, value=_copy(state.value),
                                  slots={k: _copy(v) for k, v in state.slots.items()},
                                  accumulator=_dense(policy.accumulator.get((name, row_start))))
                     for (name, row_start), state in sorted(self.store.parts.items())]
            dynamic = []
            for name, table in sorted(self.store.dynamic.items()):
                snap = table.snapshot()
                acc = policy.accumulator.get(dynamic_key(name))
                if acc is not None:
                    snap.accumulator_ids, snap.accumulator_values = acc.rows, acc.values
                dynamic.append(snap)
            workers = [WorkerSnapshot(r.worker_id, r.clock, self.membership.is_live(r),
                                      [OutcomeSnapshot(clock=k, accepted=bool(o.accepted), drop_reason=int(o.drop_reason),
                                                       message=o.message, step=int(o.step), clock_after=int(o.clock),
                                                       aggregated=int(o.aggregated))
                                       for k, o in r.outcomes.items()])
                       for r in sorted(self.membership.workers.values(), key=lambda r: r.worker_id)]
            shard_map = self.store.shard_map
            specs = [] if shard_map is None else sorted(shard_map.specs.values(), key=lambda s: s.name)
            return ShardState(
                shard_index=c.shard_index, num_shards=c.num_shards, mode=c.mode,
                partition_min_bytes=c.partition_min_bytes, optimizer=self.optimizer.name,
                optimizer_params=dict(self.optimizer.hyperparameters), consistency=consistency_of(c), step=self.step,
                dropped=self.dropped, applied_gradients=self.applied_gradients,
                parameters=[ParamSpec(s.name, s.dtype, tuple(s.shape), s.state, s.dynamic) for s in specs], parts=parts,
                workers=workers,
                contributors=policy.contributors, created_unix=time.time(), dynamic=dynamic)

    def restore(self, state: ShardState) -> None:
        """Replaces the whole state with a checkpoint's (before serving); checked first, so a bad one changes nothing."""
        check_compatible(state, self.config, warn=False)
        check_ranges(state)
        shard_map, parts, accumulator = self._checked_parts(state)
        dynamic = self._checked_dynamic(state, shard_map, accumulator)
        workers: dict[str, WorkerRecord] = {}
        for w in state.workers:
            record = WorkerRecord(w.worker_id, clock=w.clock)
            for o in w.outcomes:
                record.outcomes[o.clock] = PushResult(o.accepted, DropReason(o.drop_reason), o.message, o.step,
                                                      o.clock_after, aggregated=o.aggregated)
            workers[w.worker_id] = record
        contributors = list(state.contributors or [])
        unknown = [w for w in contributors if w not in workers]
        if unknown:
            raise CheckpointMismatchError(f"checkpoint of shard {state.shard_index} at step {state.step}: sync "
                                          f"contributors {unknown} are not among its workers")
        with self._cond:
            self.store.restore(shard_map, parts, dynamic)
            self.generation += 1
            self.membership.replace(workers, [w.worker_id for w in state.workers if w.live])
            self.policy.restore(PolicySnapshot(contributors if state.contributors is not None else None, accumulator))
            self.step, self.dropped, self.applied_gradients = state.step, state.dropped, state.applied_gradients
            self._cond.notify_all()

    def _checked_parts(self, state: ShardState) -> tuple[ShardMap | None, dict[PartKey, PartState],
                                                         dict[PartKey, np.ndarray]]:
        """The store's parts and the sync accumulator rebuilt from a checkpoint, each checked against the shard map."""
        where = f"checkpoint of shard {state.shard_index} at step {state.step}"
        if not state.parameters:
            if state.parts:
                raise CheckpointMismatchError(f"{where}: holds {len(state.parts)} parts but no parameter list")
            return None, {}, {}
        try:
            shard_map = build_shard_map(state.parameters, self.config.num_shards,
                                        partition_min_bytes=self.config.partition_min_bytes)
        except ValueError as exc:
            raise CheckpointMismatchError(f"{where}: its parameter list is not valid: {exc}") from exc
        own = {p.key: p for p in shard_map.parts_on(self.config.shard_index)}
        have = {(p.name, p.row_start): p for p in state.parts}
        if set(own) != set(have):
            extra, missing = sorted(set(have) - set(own)), sorted(set(own) - set(have))
            raise CheckpointMismatchError(
                f"{where}: its parts do not match the shard map rebuilt from its parameter list "
                f"(not in the map: {extra[:5]}, missing: {missing[:5]})")
        fresh_slots = self.optimizer.init_state(np.zeros((1,), np.float32))
        parts: dict[PartKey, PartState] = {}
        accumulator: dict[PartKey, np.ndarray] = {}
        for key, part in own.items():
            snap = have[key]
            dtype, shape = np.dtype(part.dtype), tuple(part.shape)
            if snap.row_end != part.row_end or snap.value.dtype != dtype or tuple(snap.value.shape) != shape:
                raise CheckpointMismatchError(
                    f"{where}: part {part.name!r} rows from {part.row_start} is {snap.value.dtype}{list(snap.value.shape)} "
                    f"rows to {snap.row_end}, the shard map says {dtype}{list(shape)} rows to {part.row_end}")
            if set(snap.slots) - {ROW_STEP} != set(fresh_slots):
                raise CheckpointMismatchError(
                    f"{where}: part {part.name!r} has optimizer slots {sorted(snap.slots)}, "
                    f"optimizer {self.optimizer.name!r} needs {sorted(fresh_slots)}")
            for slot, array in snap.slots.items():
                if slot == ROW_STEP:   # per-row update counts of a table trained sparsely
                    want = shape[:1]
                else:
                    want = fresh_slots[slot].shape if fresh_slots[slot].ndim == 0 else shape
                if tuple(array.shape) != tuple(want):
                    raise CheckpointMismatchError(
                        f"{where}: slot {slot!r} of {part.name!r} rows from {part.row_start} has shape "
                        f"{list(array.shape)}, expected {list(want)}")
            parts[key] = PartState(part=part, value=_writable(snap.value),
                                   slots={k: _writable(v) for k, v in snap.slots.items()})
            if snap.accumulator is not None:
                if snap.accumulator.shape != snap.value.shape:
                    raise CheckpointMismatchError(f"{where}: accumulator of {part.name!r} has shape "
                                                  f"{list(snap.accumulator.shape)}, the part {list(shape)}")
                accumulator[key] = _writable(snap.accumulator)
                if ROW_STEP in snap.slots:   # a table trained sparsely: its written-dense accumulator is rows again
                    touched = np.flatnonzero(accumulator[key].reshape(len(accumulator[key]), -1).any(axis=1))
                    accumulator[key] = RowGrad(touched.astype(np.int64), accumulator[key][touched], shape[0])
        return shard_map, parts, accumulator

    def _checked_dynamic(self, state: ShardState, shard_map: ShardMap | None,
                         accumulator: dict[PartKey, np.ndarray | RowGrad]) -> dict[str, DynamicRows]:
        """The dynamic tables rebuilt from a checkpoint (checked against its parameter list; ids against this
        shard's hash); their sync accumulators go into `accumulator` as rows by id."""
        where = f"checkpoint of shard {state.shard_index} at step {state.step}"
        specs = {} if shard_map is None else {n: s for n, s in shard_map.specs.items() if s.dynamic is not None}
        have = {d.name: d for d in state.dynamic}
        if set(have) - set(specs):
            raise CheckpointMismatchError(f"{where}: rows of dynamic tables {sorted(set(have) - set(specs))[:5]} "
                                          "that its parameter list lacks")
        fresh_slots = set(self.optimizer.init_state(np.zeros((1,), np.float32))) - {"step"} | {ROW_STEP}
        tables: dict[str, DynamicRows] = {}
        for name, spec in specs.items():
            table = tables[name] = DynamicRows(spec, self.optimizer)
            snap = have.get(name)
            if snap is None:   # a table that held no rows
                continue
            k = len(snap.ids)
            rows = (k, *spec.row_shape)
            shapes_ok = (snap.ids.dtype == np.int64 and snap.ids.shape == (k,) and snap.touched.shape == (k,)
                         and snap.values.shape == rows and snap.values.dtype == np.dtype(spec.dtype)
                         and set(snap.slots) == fresh_slots
                         and all(a.shape == (rows if n != ROW_STEP else (k,)) for n, a in snap.slots.items()))
            if not shapes_ok or len(np.unique(snap.ids)) != k:
                raise CheckpointMismatchError(
                    f"{where}: dynamic table {name!r} holds {k} ids with values {snap.values.dtype}"
                    f"{list(snap.values.shape)} and slots {sorted(snap.slots)}; the table needs unique int64 ids, "
                    f"rows of {spec.dtype}{list(spec.row_shape)} and slots {sorted(fresh_slots)}")
            try:
                checked_ids(spec, snap.ids, self.config.shard_index, self.config.num_shards, where)
            except InvalidTensorError as exc:
                raise CheckpointMismatchError(str(exc)) from None
            table.restore(snap)
            if snap.accumulator_ids is not None:
                ids, values = snap.accumulator_ids, snap.accumulator_values
                if ids.dtype != np.int64 or ids.ndim != 1 or values.shape != (len(ids), *spec.row_shape):
                    raise CheckpointMismatchError(f"{where}: accumulator of dynamic table {name!r} has ids "
                                                  f"{ids.dtype}{list(ids.shape)} and rows {list(values.shape)}")
                accumulator[dynamic_key(name)] = RowGrad(_writable(snap.accumulator_ids),
                                                         _writable(snap.accumulator_values), None)
        return tables

    # ------------------------------------------------------------------ info

    def view(self) -> ShardView:
        """The shard's state for cluster info and metrics (one consistent read; does not block on waits)."""
        with self._cond:
            workers = tuple(WorkerView(r.worker_id, r.clock, self.membership.is_live(r), self.membership.remaining(r))
                            for r in sorted(self.membership.workers.values(), key=lambda r: r.worker_id))
            return ShardView(step=self.step, initialized=self.store.initialized, dropped=self.dropped,
                             shard_map=self.store.shard_map, parts_held=len(self.store.parts),
                             bytes_held=self.store.nbytes, workers=workers, policy=self.policy.info(self.policy_host),
                             optimizer=self.optimizer.name,
                             dynamic=tuple(DynamicView(name, t.rows, t.created, t.evicted)
                                           for name, t in sorted(self.store.dynamic.items())))


def _dense(acc: np.ndarray | RowGrad | None) -> np.ndarray | None:
    """A dense part's accumulator as an array: a row accumulator is written dense (it applies the same after a
    restore, where its non-zero rows become rows again)."""
    return acc.dense() if isinstance(acc, RowGrad) else acc


def _copy(array: np.ndarray) -> np.ndarray:
    return np.array(array, copy=True, order="C")


def _writable(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable and array.flags.c_contiguous and array.flags.owndata:
        return array
    return _copy(array)
