"""Shard checkpoints: the whole state of one shard in one safetensors file, written atomically, restored on start.

What a checkpoint holds, per shard (one file `ckpt-<step:012d>.safetensors`, in a
directory of its own per shard; `SHARD.json` there names the shard index and count that
own it, and another shard pointed at that directory refuses to start):

- tensors: every owned part's value `param/<name>@<row_start>`, every optimizer slot
  (including the int64 "step" counter) `slot/<name>@<row_start>/<slot>`, and in sync
  mode the step's accumulator `acc/<name>@<row_start>`. Keys are identifiers only: the
  state JSON below maps each part to its keys, so tensor names may hold any character.
- metadata (the safetensors header's `__metadata__`): `format`, `format_version`,
  `state` (JSON: shard index, num shards, mode and consistency settings,
  partition_min_bytes, the full parameter list so the shard map can be rebuilt, the
  optimizer's name and hyperparameters, the global step, dropped and applied counts, every
  worker's clock, liveness and its window of recent push outcomes, and in sync mode the
  step's contributors) and `checksum`, a CRC-32 over the state JSON and every tensor's
  key, dtype, shape and bytes.

Writing: the state is copied under the shard's lock (one consistent cut: no push is half
in it), then written outside the lock to a hidden temporary file in the same directory,
fsynced, renamed to its final name and the directory fsynced. A crash at any point leaves
either the complete file or no file under the final name (a leftover temporary file is
removed at the next start). The newest `keep` checkpoints are kept.

Restoring: the newest checkpoint that reads back whole (header parses, every tensor is
there, checksum matches) wins; one that does not is skipped with a warning naming the
file and the reason, renamed to `<name>.corrupt` (kept, never deleted), and the previous
one is tried. A checkpoint of another shard index, shard count, mode, partition size or
optimizer, or of a newer format version, is refused with CheckpointMismatchError; the
server does not start. Changed hyperparameters or sync/ssp/async bounds are taken from
the new configuration, with a warning.

Why a push is still applied at most once across a restart. A shard that restarts from
a checkpoint taken at time T is exactly the shard as it was at T: the parameters and
every worker's clock are from the same cut. For any worker, the pushes it made before T
are in both the parameters and its clock (so a retry of one of them, clock < the
restored clock, is acknowledged as a duplicate with its remembered outcome and not
applied again); the pushes it made after T are in neither (so their retries, and the
worker's next pushes, clock >= the restored clock, are applied to the restored
parameters once). What the shard did after T is lost, as with any checkpoint; it is
never counted twice.

Sync mode: the in-flight partial step is checkpointed, not discarded. Discarding it is
not safe: a worker whose gradient sat in the lost accumulator has its clock advanced in
the checkpoint (the clock moves in the same critical section as the accumulation), so
its retry would be answered "duplicate" and never re-added, and the step would wait for a
gradient that no one will send again (until every wait timed out). Rolling those clocks
back instead would not help a worker that already got its "accepted" answer: it only
pulls for step t+1 and does not push again. Keeping the accumulator and the
contributors makes the cut consistent: contributors' retries are duplicates, everyone
else's push for step t is added, and the step completes with the same mean it would
have had without the crash. The price is one more copy of the shard's size in the file
while a step is partly in.

After a restore the shard's step may be lower than the step a worker last saw (the
steps after T were lost). A worker must pull again (min_step 0, or the shard's step)
before it pushes: a push whose read_step is ahead of the shard's step is dropped
(DROP_STEP_AHEAD), and a pull waiting for a lost step, or for an SSP bound over clocks the
shard lost, would wait until its timeout. The training loop waits in slices of a few
seconds and, between them, asks every shard for its step and its clock for the worker
(worker_client.client.PSClient.lost_progress), then pulls a shard that went back as it is.

Leases are monotonic times and do not survive a process: a worker that was live at T
gets a fresh lease on restore (so a sync step or an SSP bound does not move on without
it at once; a dead one expires after one lease), a worker that had left stays gone.
Barriers are not checkpointed: a barrier's waiters see UNAVAILABLE and call again.

Admin.ResetParameters (Shard.reset) drops the parameters; the Checkpointer then writes
the reset state at once and deletes every older checkpoint, since their higher steps
would otherwise win at the next start and bring the dropped parameters back.

Costs: the copy under the lock takes about a memcpy of the shard (and of the sync
accumulator), and the process holds that second copy while the file is written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ps_common.shard_map import ParamSpec, build_shard_map
from ps_server.config import ServerConfig
from ps_server.consistency import SyncPolicy
from ps_server.membership import WorkerRecord
from ps_server.optimizers import make_optimizer
from ps_server.shard import PushResult, Shard
from ps_server.store import PartState

log = logging.getLogger(__name__)

FORMAT = "onnx-ps-shard-checkpoint"
FORMAT_VERSION = 1

_FINAL = re.compile(r"^ckpt-(\d{12})\.safetensors$")
_TEMPORARY = re.compile(r"^\.ckpt-\d{12}\.safetensors\.tmp-\d+-\d+$")
_CORRUPT_SUFFIX = ".corrupt"
#: The file that ties a directory to one shard of one job, so two shards never share one by mistake.
OWNER_FILE = "SHARD.json"


class CheckpointError(Exception):
    """Base of the checkpoint errors."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file that does not read back whole: truncated, bad header, missing tensor, checksum mismatch."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A valid checkpoint that does not fit this shard's configuration (shard index, shards, mode, ...)."""


# ---------------------------------------------------------------------- the state


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

    @property
    def initialized(self) -> bool:
        return bool(self.parameters)

    @property
    def nbytes(self) -> int:
        total = 0
        for p in self.parts:
            total += p.value.nbytes + sum(s.nbytes for s in p.slots.values())
            total += 0 if p.accumulator is None else p.accumulator.nbytes
        return total


def capture(shard: Shard) -> ShardState:
    """A copy of the shard's whole state. The caller holds the shard's lock (Shard.snapshot does)."""
    c = shard.config
    store = shard.store
    accumulator = shard.policy.accumulator if isinstance(shard.policy, SyncPolicy) else {}
    parts = []
    for (name, row_start), state in sorted(store.parts.items()):
        acc = accumulator.get((name, row_start))
        parts.append(PartSnapshot(
            name=name, row_start=row_start, row_end=state.part.row_end, value=np.array(state.value, copy=True, order="C"),
            slots={k: np.array(v, copy=True, order="C") for k, v in state.slots.items()},
            accumulator=None if acc is None else np.array(acc, copy=True, order="C")))
    workers = []
    for record in sorted(shard.membership.workers.values(), key=lambda r: r.worker_id):
        outcomes = [OutcomeSnapshot(clock=k, accepted=bool(r.accepted), drop_reason=int(r.drop_reason), message=r.message,
                                    step=int(r.step), clock_after=int(r.clock), aggregated=int(r.aggregated))
                    for k, r in record.outcomes.items()]
        workers.append(WorkerSnapshot(record.worker_id, record.clock, shard.membership.is_live(record), outcomes))
    specs = [] if store.shard_map is None else sorted(store.shard_map.specs.values(), key=lambda s: s.name)
    return ShardState(
        shard_index=c.shard_index, num_shards=c.num_shards, mode=c.mode, partition_min_bytes=c.partition_min_bytes,
        optimizer=shard.optimizer.name, optimizer_params=dict(shard.optimizer.hyperparameters),
        consistency=_consistency_of(c), step=shard.step, dropped=shard.dropped,
        applied_gradients=shard.applied_gradients,
        parameters=[ParamSpec(s.name, s.dtype, tuple(s.shape)) for s in specs], parts=parts, workers=workers,
        contributors=list(shard.policy.contributors) if isinstance(shard.policy, SyncPolicy) else None,
        created_unix=time.time())


def install(shard: Shard, state: ShardState) -> None:
    """Replaces the shard's whole state with `state` (checked first: nothing changes on an error).

    The caller holds the shard's lock (Shard.restore does) and has checked the state
    against the configuration (check_compatible). Workers live at the cut get a fresh lease.
    """
    check_compatible(state, shard.config, warn=False)
    where = f"checkpoint of shard {state.shard_index} at step {state.step}"
    shard_map = None
    parts: dict[tuple[str, int], PartState] = {}
    accumulator: dict[tuple[str, int], np.ndarray] = {}
    if state.parameters:
        try:
            shard_map = build_shard_map(state.parameters, shard.config.num_shards,
                                        partition_min_bytes=shard.config.partition_min_bytes)
        except ValueError as exc:
            raise CheckpointMismatchError(f"{where}: its parameter list is not valid: {exc}") from exc
        own = {(p.name, p.row_start): p for p in shard_map.parts_on(shard.config.shard_index)}
        have = {(p.name, p.row_start): p for p in state.parts}
        if set(own) != set(have):
            extra, missing = sorted(set(have) - set(own)), sorted(set(own) - set(have))
            raise CheckpointMismatchError(
                f"{where}: its parts do not match the shard map rebuilt from its parameter list "
                f"(not in the map: {extra[:5]}, missing: {missing[:5]})")
        fresh_slots = shard.optimizer.init_state(np.zeros((1,), np.float32))
        for key, part in own.items():
            snap = have[key]
            dtype, shape = np.dtype(part.dtype), tuple(part.shape)
            if snap.row_end != part.row_end or snap.value.dtype != dtype or tuple(snap.value.shape) != shape:
                raise CheckpointMismatchError(
                    f"{where}: part {part.name!r} rows from {part.row_start} is {snap.value.dtype}{list(snap.value.shape)} "
                    f"rows to {snap.row_end}, the shard map says {dtype}{list(shape)} rows to {part.row_end}")
            if set(snap.slots) != set(fresh_slots):
                raise CheckpointMismatchError(
                    f"{where}: part {part.name!r} has optimizer slots {sorted(snap.slots)}, "
                    f"optimizer {shard.optimizer.name!r} needs {sorted(fresh_slots)}")
            for slot, array in snap.slots.items():
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
    elif state.parts:
        raise CheckpointMismatchError(f"{where}: holds {len(state.parts)} parts but no parameter list")

    membership = shard.membership
    workers: dict[str, WorkerRecord] = {}
    for w in state.workers:
        record = WorkerRecord(w.worker_id, clock=w.clock)
        for o in w.outcomes:
            record.outcomes[o.clock] = PushResult(o.accepted, o.drop_reason, o.message, o.step, o.clock_after,
                                                  aggregated=o.aggregated)
        workers[w.worker_id] = record
    contributors = list(state.contributors or [])
    unknown = [w for w in contributors if w not in workers]
    if unknown:
        raise CheckpointMismatchError(f"{where}: sync contributors {unknown} are not among its workers")

    # Checked: now replace.
    shard.store.shard_map = shard_map
    shard.store.parts = parts
    membership.workers = workers
    for w in state.workers:
        if w.live:
            membership.renew(w.worker_id)
    shard.step = state.step
    shard.dropped = state.dropped
    shard.applied_gradients = state.applied_gradients
    if isinstance(shard.policy, SyncPolicy):
        shard.policy.contributors = contributors
        shard.policy.accumulator = accumulator if contributors else {}


def _writable(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable and array.flags.c_contiguous and array.flags.owndata:
        return array
    return np.array(array, copy=True, order="C")


def _consistency_of(config: ServerConfig) -> dict[str, Any]:
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
    if _consistency_of(config) != state.consistency:
        log.warning("checkpoint at step %d used %s settings %s; continuing with the configured %s", state.step,
                    state.mode, state.consistency, _consistency_of(config))


# ---------------------------------------------------------------------- the file format


def _param_key(name: str, row_start: int) -> str:
    return f"param/{name}@{row_start}"


def _slot_key(name: str, row_start: int, slot: str) -> str:
    return f"slot/{name}@{row_start}/{slot}"


def _acc_key(name: str, row_start: int) -> str:
    return f"acc/{name}@{row_start}"


def _checksum(state_json: str, tensors: Mapping[str, np.ndarray]) -> str:
    crc = zlib.crc32(state_json.encode())
    for key in sorted(tensors):
        array = tensors[key]
        crc = zlib.crc32(f"{key}\0{array.dtype.str}\0{list(array.shape)}\0".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8), crc)
    return f"crc32:{crc:08x}"


def encode(state: ShardState) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The safetensors tensors and metadata of a state."""
    tensors: dict[str, np.ndarray] = {}
    parts = []
    for p in state.parts:
        entry: dict[str, Any] = {"name": p.name, "row_start": p.row_start, "row_end": p.row_end,
                                 "value": _param_key(p.name, p.row_start), "slots": {}, "accumulator": None}
        tensors[entry["value"]] = p.value
        for slot, array in sorted(p.slots.items()):
            entry["slots"][slot] = key = _slot_key(p.name, p.row_start, slot)
            tensors[key] = array
        if p.accumulator is not None:
            entry["accumulator"] = key = _acc_key(p.name, p.row_start)
            tensors[key] = p.accumulator
        parts.append(entry)
    doc = {
        "shard_index": state.shard_index, "num_shards": state.num_shards, "mode": state.mode,
        "partition_min_bytes": state.partition_min_bytes,
        "optimizer": {"name": state.optimizer, "hyperparameters": state.optimizer_params},
        "consistency": state.consistency, "step": state.step, "dropped": state.dropped,
        "applied_gradients": state.applied_gradients,
        "parameters": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in state.parameters],
        "parts": parts,
        "workers": [{"worker_id": w.worker_id, "clock": w.clock, "live": w.live,
                     "outcomes": [vars(o) for o in w.outcomes]} for w in state.workers],
        "contributors": state.contributors, "created_unix": state.created_unix,
    }
    state_json = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "state": state_json,
                "checksum": _checksum(state_json, tensors)}
    return tensors, metadata


def decode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], *, source: str = "checkpoint") -> ShardState:
    """The state in a file's tensors and metadata; CorruptCheckpointError or CheckpointMismatchError otherwise."""
    if metadata.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{source}: not a shard checkpoint (format {metadata.get('format')!r})")
    try:
        version = int(metadata.get("format_version", ""))
    except ValueError:
        raise CorruptCheckpointError(f"{source}: bad format_version {metadata.get('format_version')!r}") from None
    if version > FORMAT_VERSION:
        raise CheckpointMismatchError(f"{source}: format version {version} is newer than this server reads "
                                      f"({FORMAT_VERSION}); upgrade the server")
    state_json = metadata.get("state")
    if state_json is None or "checksum" not in metadata:
        raise CorruptCheckpointError(f"{source}: metadata lacks the state or the checksum")
    actual = _checksum(state_json, tensors)
    if actual != metadata["checksum"]:
        raise CorruptCheckpointError(f"{source}: checksum mismatch (recorded {metadata['checksum']}, computed {actual})")
    try:
        doc = json.loads(state_json)
        parts = []
        for e in doc["parts"]:
            parts.append(PartSnapshot(
                name=e["name"], row_start=int(e["row_start"]), row_end=int(e["row_end"]), value=tensors[e["value"]],
                slots={slot: tensors[key] for slot, key in e["slots"].items()},
                accumulator=None if e["accumulator"] is None else tensors[e["accumulator"]]))
        workers = [WorkerSnapshot(w["worker_id"], int(w["clock"]), bool(w["live"]),
                                  [OutcomeSnapshot(**o) for o in w["outcomes"]]) for w in doc["workers"]]
        return ShardState(
            shard_index=int(doc["shard_index"]), num_shards=int(doc["num_shards"]), mode=doc["mode"],
            partition_min_bytes=int(doc["partition_min_bytes"]), optimizer=doc["optimizer"]["name"],
            optimizer_params=dict(doc["optimizer"]["hyperparameters"]), consistency=dict(doc["consistency"]),
            step=int(doc["step"]), dropped=int(doc["dropped"]), applied_gradients=int(doc["applied_gradients"]),
            parameters=[ParamSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in doc["parameters"]],
            parts=parts, workers=workers, contributors=doc["contributors"], created_unix=float(doc["created_unix"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{source}: malformed state: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------- the directory


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:012d}.safetensors"


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDirectory:
    """The checkpoints of one shard in one directory. Not thread-safe: the Checkpointer serializes calls."""

    def __init__(self, path: str | os.PathLike, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"Invalid checkpoint keep: {keep} (must be >= 1)")
        self.path = Path(path)
        self.keep = keep
        self._counter = 0

    def ensure(self) -> None:
        """Creates the directory if needed; OSError naming it when it cannot be written."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise OSError(f"checkpoint directory {self.path} is not writable")

    def claim(self, shard_index: int, num_shards: int) -> None:
        """Marks the directory as shard_index's of num_shards; CheckpointMismatchError when another shard's it is."""
        self.ensure()
        owner_file = self.path / OWNER_FILE
        want = {"shard_index": shard_index, "num_shards": num_shards}
        try:
            owner = json.loads(owner_file.read_text())
        except FileNotFoundError:
            owner = None
        except (OSError, ValueError) as exc:
            log.warning("rewriting unreadable %s: %s", owner_file, exc)
            owner = None
        if owner is None:
            tmp = self.path / f".{OWNER_FILE}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(want))
            _fsync_path(tmp)
            try:
                os.link(tmp, owner_file)          # fails when another shard claimed it first
            except FileExistsError:
                owner = json.loads(owner_file.read_text())
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_path(self.path, directory=True)
        if owner is not None and {k: owner.get(k) for k in want} != want:
            raise CheckpointMismatchError(
                f"checkpoint directory {self.path} belongs to shard_index={owner.get('shard_index')} of "
                f"num_shards={owner.get('num_shards')}; this shard is shard_index={shard_index} of "
                f"num_shards={num_shards}: give every shard a directory of its own")

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete-named checkpoint, newest first."""
        if not self.path.is_dir():
            return []
        found = []
        for entry in self.path.iterdir():
            m = _FINAL.match(entry.name)
            if m and entry.is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found, reverse=True)

    def write(self, state: ShardState, *, replace_all: bool = False) -> Path:
        """Writes `state` atomically (temporary file, fsync, rename, directory fsync), then prunes to `keep`.

        With replace_all, every other checkpoint is deleted instead (after a reset).
        """
        self.ensure()
        tensors, metadata = encode(state)
        final = self.path / checkpoint_name(state.step)
        self._counter += 1
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}-{self._counter}"
        try:
            save_file(tensors, tmp, metadata=metadata)
            _fsync_path(tmp)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_path(self.path, directory=True)
        self.prune(keep_also=final, keep=1 if replace_all else self.keep)
        return final

    def prune(self, *, keep_also: Path | None = None, keep: int | None = None) -> list[Path]:
        """Keeps `keep` checkpoints (keep_also, the one just written, and the newest others), deletes the rest."""
        keep = self.keep if keep is None else keep
        removed = []
        others = [path for _, path in self.checkpoints() if path != keep_also]
        for path in others[keep - (keep_also is not None):]:
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    def remove_temporaries(self) -> list[Path]:
        """Deletes temporary files left by a write that never finished (call before writing starts)."""
        removed = []
        if self.path.is_dir():
            for entry in self.path.iterdir():
                if _TEMPORARY.match(entry.name):
                    entry.unlink(missing_ok=True)
                    removed.append(entry)
        return removed

    def read(self, path: Path) -> ShardState:
        """The state in one file; CorruptCheckpointError naming the file and the reason when it is not whole."""
        try:
            with safe_open(str(path), framework="np") as f:
                metadata = f.metadata() or {}
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except OSError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError (an Exception) for a bad or short file
            raise CorruptCheckpointError(f"{path}: unreadable: {exc}") from exc
        return decode(tensors, metadata, source=str(path))

    def latest(self) -> tuple[Path, ShardState] | None:
        """The newest checkpoint that reads back whole; a corrupt one is skipped (warning) and renamed *.corrupt."""
        for _, path in self.checkpoints():
            try:
                return path, self.read(path)
            except CorruptCheckpointError as exc:
                aside = path.with_name(path.name + _CORRUPT_SUFFIX)
                log.warning("skipping checkpoint %s: %s; moved aside to %s, trying the previous one", path, exc, aside.name)
                try:
                    os.replace(path, aside)
                except OSError as move:
                    log.warning("could not move %s aside: %s", path, move)
            except OSError as exc:
                log.warning("skipping checkpoint %s: cannot read it: %s; trying the previous one", path, exc)
        return None


# ---------------------------------------------------------------------- when to write


class Checkpointer:
    """Restores a shard on start, writes its checkpoints every N steps and/or T seconds, and once more on stop.

    Thread-safe. The writer thread wakes when `checkpoint_every_steps` steps passed since
    the last checkpoint (a shard listener tells it) or `checkpoint_every_seconds` passed,
    and writes only when the state changed. A failed write is logged and retried at the
    next trigger; the shard keeps serving.
    """

    def __init__(self, shard: Shard, config: ServerConfig) -> None:
        if not config.checkpoint_dir:
            raise ValueError("Checkpointer needs config.checkpoint_dir")
        self.shard = shard
        self.config = config
        self.directory = CheckpointDirectory(config.checkpoint_dir, keep=config.checkpoint_keep)
        self.every_steps = config.checkpoint_every_steps
        self.every_seconds = config.checkpoint_every_seconds
        self.last_path: Path | None = None
        self.last_seconds: float = 0.0
        self._last_step = 0
        self._dirty = False
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        shard.listeners.append(self._on_event)

    def _on_event(self, event: str, **fields: Any) -> None:
        # Called by the shard, sometimes under its lock: only flags, never I/O (but see "reset").
        if event in ("init", "push", "step", "reset"):
            self._dirty = True
        if event == "step" and self.every_steps and fields.get("step", 0) - self._last_step >= self.every_steps:
            self._wake.set()
        if event == "reset":   # emitted outside the shard's lock, by the rpc thread of Admin.ResetParameters
            self._after_reset()

    def _after_reset(self) -> None:
        """The checkpoints hold parameters that were just dropped: writes the reset state and deletes every other one.

        Otherwise a restart would bring the old parameters back (their checkpoints have
        higher steps than the reset shard's).
        """
        self._last_step = 0
        if self.checkpoint_now(force=True, replace_all=True) is None:
            log.error("shard %d: could not checkpoint the reset; until a checkpoint is written, a restart restores "
                      "the parameters from before the reset", self.config.shard_index)

    def restore(self) -> ShardState | None:
        """Restores the shard from the newest whole checkpoint (before serving); None when there is none.

        Raises CheckpointMismatchError for a checkpoint of another shard or configuration,
        OSError when the directory cannot be created or written.
        """
        self.directory.ensure()
        for stale in self.directory.remove_temporaries():
            log.info("removed %s, left by a checkpoint write that never finished", stale)
        found = self.directory.latest()
        if found is None:
            self.directory.claim(self.config.shard_index, self.config.num_shards)
            log.info("shard %d: no checkpoint in %s; starting fresh", self.config.shard_index, self.directory.path)
            return None
        path, state = found
        check_compatible(state, self.config)
        self.directory.claim(self.config.shard_index, self.config.num_shards)
        self.shard.restore(state)
        self._last_step, self._dirty, self.last_path = state.step, False, path
        log.info("shard %d restored from %s: step %d, %d parts, %d workers%s", self.config.shard_index, path, state.step,
                 len(state.parts), len(state.workers),
                 f", {len(state.contributors)} gradients in the sync step" if state.contributors else "")
        return state

    def start(self) -> "Checkpointer":
        if not self.every_steps and not self.every_seconds:
            log.warning("shard %d checkpoints to %s only when it stops: set checkpoint_every_steps or "
                        "checkpoint_every_seconds to survive a crash", self.config.shard_index, self.directory.path)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        next_due = time.monotonic() + self.every_seconds if self.every_seconds else math.inf
        while not self._stopped.is_set():
            self._wake.wait(min(1.0, max(0.0, next_due - time.monotonic())))
            self._wake.clear()
            if self._stopped.is_set():
                return
            step_due = self.every_steps and self.shard.step - self._last_step >= self.every_steps
            time_due = time.monotonic() >= next_due
            if step_due or time_due:
                self.checkpoint_now()
                if self.every_seconds:
                    next_due = time.monotonic() + self.every_seconds

    def checkpoint_now(self, *, force: bool = False, wait: float | None = None, replace_all: bool = False) -> Path | None:
        """Writes a checkpoint of the current state (unless nothing changed since the last, or force).

        Blocks while another write runs (at most `wait` s when given, then logs and gives
        up). Returns the file, or None when nothing was written (no change, or the write
        failed: logged, and the state stays marked as changed). With replace_all, every
        other checkpoint is deleted once this one is written.
        """
        if not self._write_lock.acquire(timeout=-1 if wait is None else max(0.0, wait)):
            log.error("shard %d: a checkpoint write still runs after %.1f s; not writing another",
                      self.config.shard_index, wait)
            return None
        try:
            if not (self._dirty or force):
                return None
            self._dirty = False          # a change from here on marks it again
            started = time.perf_counter()
            state = self.shard.snapshot()
            captured = time.perf_counter()
            try:
                path = self.directory.write(state, replace_all=replace_all)
            except Exception:
                self._dirty = True
                log.exception("shard %d: checkpoint at step %d to %s failed", self.config.shard_index, state.step,
                              self.directory.path)
                return None
            done = time.perf_counter()
            self._last_step, self.last_path, self.last_seconds = state.step, path, done - started
        finally:
            self._write_lock.release()
        log.info("shard %d: checkpoint at step %d written to %s (%.1f MB in %.3f s, %.3f s of it copying under the lock)",
                 self.config.shard_index, state.step, path, state.nbytes / 1e6, done - started, captured - started)
        try:
            self.shard._emit("checkpoint", step=state.step, seconds=done - started, nbytes=state.nbytes)
        except Exception:  # a listener's bug must not stop checkpoints
            log.exception("checkpoint listener failed")
        return path

    def stop(self, timeout: float = 60.0) -> Path | None:
        """Stops the writer thread (waits at most timeout s for a write in progress) and writes the final checkpoint.

        Call after the shard stopped taking pushes (Shard.stop), so the final checkpoint
        is its last state.
        """
        deadline = time.monotonic() + timeout
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        return self.checkpoint_now(wait=deadline - time.monotonic())


def iter_checkpoints(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of the complete-named checkpoints in a directory, newest first (for tools and Admin)."""
    return CheckpointDirectory(path).checkpoints()
