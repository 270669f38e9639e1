"""ps-serve --follow: the served weights follow a running job's shards, a whole step at a time.

A `Follower` keeps a copy of the job's trained state and refreshes it with ReadState
(docs/protocol.md): the first read of each shard takes everything; every later one only what
changed after the step it holds -- dense parts whole, the rows of sparse and dynamic tables
that changed (a table of 10^7 rows costs only its new rows). Each read is a long poll: it asks
for a step past the one held, so it returns as soon as the shard takes a push, or after
POLL_SECONDS with nothing new.

When every shard has answered (in a sync job: at one step, else it reads the laggers again),
the follower builds a new model from its copy -- the served file's graph with the values put
in by ps_tools.export.apply_state, dynamic tables re-keyed -- opens a session on it and swaps
it in whole (ps_serve.model.ServedModel.swap): a request runs on one state, never a mix of two
steps. Swaps are at least `interval` seconds apart; what changes meanwhile is gathered into the
next one.

What it survives: a shard that restarts or is restored (a new state id) is read whole again; a
dynamic table whose live rows on a shard differ from the copy's (rows were evicted) is read
whole from that shard; a shard that cannot be reached leaves the last good state served and is
asked again every RETRY_SECONDS, the failures counted and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import onnx

from ps_common.errors import ExportError, PSError, ServerError
from ps_common.shard_map import ShardMap
from ps_serve.model import ModelState, ServedModel
from ps_tools.export import TrainedState, apply_state

log = logging.getLogger(__name__)

#: The longest single wait of a read for a new step (seconds): the follower notices `stop` this often.
POLL_SECONDS = 1.0
#: After a failed read, ask again this long later (seconds).
RETRY_SECONDS = 1.0


class FollowError(ValueError):
    """The job cannot be followed: unreachable, not initialized, or its tensors are not the served model's."""


@dataclass
class _ShardCopy:
    """What the follower holds of one shard: its state id, the step, and its dynamic tables' rows (sorted keys)."""

    state_id: str = ""
    step: int = -1
    dynamic: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    reread: set[str] = field(default_factory=set)   # dynamic tables to read whole next time (evictions)


def merge_rows(ids: np.ndarray, rows: np.ndarray, new_ids: np.ndarray, new_rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """`ids` (sorted) and their rows with `new_ids`' rows put in: replaced where known, added where not; sorted."""
    if not len(new_ids):
        return ids, rows
    if not len(ids):
        order = np.argsort(new_ids, kind="stable")
        return new_ids[order], new_rows[order]
    at = np.searchsorted(ids, new_ids)
    known = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == new_ids)
    rows = rows.copy()
    rows[at[known]] = new_rows[known]
    if known.all():
        return ids, rows
    ids = np.concatenate([ids, new_ids[~known]])
    rows = np.concatenate([rows, new_rows[~known]])
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[order]


class Follower:
    """Keeps `served` at the newest whole step of the job whose shards are at `addresses` (module docstring)."""

    def __init__(self, served: ServedModel, model: onnx.ModelProto, addresses: Sequence[str], *,
                 channel_credentials: grpc.ChannelCredentials | None = None, call_metadata: Sequence = (),
                 server_name: str | None = None, interval: float = 0.25, threads: int = 1,
                 connect_timeout: float = 30.0, on_swap=None) -> None:
        from worker_client.client import PSClient, RetryPolicy

        if interval < 0:
            raise ValueError(f"Invalid follow interval: {interval} (must be >= 0)")
        self.served = served
        self.base = model
        self.addresses = list(addresses)
        self.interval = interval
        self.threads = threads
        self.connect_timeout = connect_timeout
        self.on_swap = on_swap
        self.stop_event = threading.Event()
        self.client = PSClient(self.addresses, worker_id=f"ps-serve-{id(self):x}", shared_memory=False,
                               channel_credentials=channel_credentials, call_metadata=call_metadata,
                               rpc_timeout=30.0, wait_timeout=POLL_SECONDS, stop=self.stop_event,
                               retry=RetryPolicy(attempts=2, initial_backoff=0.2, max_backoff=1.0),
                               channel_options=[("grpc.ssl_target_name_override", server_name)] if server_name
                               else ())
        self.shards = [_ShardCopy() for _ in self.addresses]
        self.dense: dict[str, np.ndarray] = {}
        self.shard_map: ShardMap | None = None
        self.mode = ""
        self.swaps = 0
        self.failures = 0
        self.last_error = ""
        self.served_steps: list[int] = []
        self._dirty = False   # the copy holds changes not served yet
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.addresses)), thread_name_prefix="follow")
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ start and stop

    def start(self) -> "Follower":
        """Reads every shard whole and serves that step, then follows in a thread. FollowError when the job cannot
        be reached in connect_timeout, is not initialized, or does not match the served model."""
        from ps_common import codec

        try:
            self.client.wait_ready(self.connect_timeout)
            info = self.client.cluster_info(0)
            self.shard_map = self.client.fetch_shard_map()
        except (TimeoutError, PSError, ValueError) as exc:
            raise FollowError(f"cannot follow the job at {','.join(self.addresses)}: {exc}") from None
        self.mode = codec.mode_from_wire(info.mode).value
        self.dense = {}
        for name, spec in self.shard_map.specs.items():
            if spec.dynamic is None:
                self.dense[name] = np.zeros(spec.shape, np.dtype(spec.dtype))
        try:
            self._round(first=True)
        except ExportError as exc:
            raise FollowError(str(exc)) from None
        except PSError as exc:
            raise FollowError(f"cannot read the job at {','.join(self.addresses)}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="ps-serve-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                self._round()
            except (PSError, ValueError, OSError) as exc:
                self.failures += 1
                self.last_error = str(exc)
                log.warning("following %s: %s; still serving step %s, asking again in %.0f s",
                            ",".join(self.addresses), exc, self.served.current().step, RETRY_SECONDS)
                self.stop_event.wait(RETRY_SECONDS)
                continue
            rest = self.interval - (time.monotonic() - started)
            if rest > 0:
                self.stop_event.wait(rest)

    def _read(self, index: int, min_step: int, *, first: bool):
        """(since, tables read whole, ShardState): one shard's changes after the step held (everything on a first
        read or after its state was replaced); None when no new step came in POLL_SECONDS."""
        copy = self.shards[index]
        since = -1 if first or copy.step < 0 else copy.step
        whole = sorted(copy.reread) if since >= 0 else []
        try:
            read = self.client.read_state(index, since, whole=whole, min_step=min_step,
                                          timeout=self.connect_timeout if first else POLL_SECONDS)
        except ServerError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and not first:
                return None   # no new step in POLL_SECONDS
            raise
        if since >= 0 and read.state_id != copy.state_id:
            log.info("shard %d's state was replaced (restart or restore): reading it whole", index)
            read = self.client.read_state(index, -1, timeout=self.connect_timeout)
            since, whole = -1, []
        return since, whole, read

    def _round(self, *, first: bool = False) -> None:
        """Reads every shard (a long poll past the step held), puts what changed in, and serves it when whole."""
        targets = [max(0, c.step + (0 if first else 1)) for c in self.shards]
        results = list(self._pool.map(lambda i: self._read(i, targets[i], first=first), range(len(self.shards))))
        for index, result in enumerate(results):
            if result is not None:
                self._apply(index, *result)
        # a dynamic table that lost rows on a shard (evictions) is read whole from it now, before serving
        for _ in range(3):
            again = [i for i, c in enumerate(self.shards) if c.reread]
            if not again:
                break
            for index, result in zip(again, self._pool.map(
                    lambda i: self._read(i, self.shards[i].step, first=False), again)):
                if result is not None:
                    self._apply(index, *result)
        # a sync job is served at one step on every shard: read the laggers up to the leader's step
        deadline = time.monotonic() + POLL_SECONDS * 5
        while self.mode == "sync" and len({c.step for c in self.shards}) > 1 and not self.stop_event.is_set():
            top = max(c.step for c in self.shards)
            laggers = [i for i, c in enumerate(self.shards) if c.step < top]
            for index, result in zip(laggers, self._pool.map(lambda i: self._read(i, top, first=False), laggers)):
                if result is not None:
                    self._apply(index, *result)
            if time.monotonic() > deadline:
                return   # the next round tries again; the served step stays whole
        if self._dirty:
            self._serve()

    def _apply(self, index: int, since: int, whole: Sequence[str], read) -> None:
        """Puts one shard's read into the copy: parts, rows by id, dynamic rows merged (replaced when read whole)."""
        assert self.shard_map is not None
        copy = self.shards[index]
        self._dirty = True
        if since < 0:
            copy.dynamic = {}
        copy.state_id, copy.step = read.state_id, read.step
        for (name, row_start), value in read.parts.items():
            target = self.dense[name]
            if self.shard_map.parts_of(name)[0].whole:
                target[...] = value
            else:
                target[row_start:row_start + len(value)] = value
        copy.reread = set()
        for name, (ids, rows) in read.rows.items():
            spec = self.shard_map.specs[name]
            if spec.dynamic is None:
                self.dense[name][ids] = rows
                continue
            empty = (np.zeros(0, np.int64), np.zeros((0, *spec.shape), np.dtype(spec.dtype)))
            held = empty if name in whole else copy.dynamic.get(name, empty)
            copy.dynamic[name] = merge_rows(*held, ids, rows)
        for name, live in read.live_rows.items():
            held = copy.dynamic.get(name)
            if held is not None and len(held[0]) != live:
                copy.reread.add(name)   # rows were evicted on the shard: read the table whole next time

    def _state(self) -> TrainedState:
        assert self.shard_map is not None
        dynamic = {}
        for name, spec in self.shard_map.specs.items():
            if spec.dynamic is None:
                continue
            held = [c.dynamic[name] for c in self.shards if name in c.dynamic]
            ids = np.concatenate([i for i, _ in held]) if held else np.zeros(0, np.int64)
            rows = (np.concatenate([r for _, r in held]) if held else
                    np.zeros((0, *spec.shape), np.dtype(spec.dtype)))
            order = np.argsort(ids, kind="stable")
            dynamic[name] = (ids[order], rows[order])
        return TrainedState(dict(self.shard_map.specs), self.dense, dynamic, [c.step for c in self.shards],
                            self.mode, "follow " + ",".join(self.addresses))

    def _serve(self) -> None:
        """Builds the model of the copy's step and swaps it in whole."""
        state = self._state()
        model = onnx.ModelProto()
        model.CopyFrom(self.base)
        apply_state(model, state, where=f"served model {self.served.current().source}")
        new = ModelState.from_model(model, threads=self.threads, step=state.step,
                                    source=self.served.current().source)
        self.served.swap(new)
        self._dirty = False
        self.swaps += 1
        self.served_steps = list(state.steps)
        if self.on_swap is not None:
            self.on_swap(state.step)

