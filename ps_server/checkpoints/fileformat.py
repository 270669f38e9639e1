"""The checkpoint file format: a ShardState as safetensors tensors plus JSON metadata, with a checksum."""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ps_common.errors import CheckpointMismatchError, CorruptCheckpointError
from ps_common.dynamic_ids import DynamicTable
from ps_common.shard_map import ParamSpec
from ps_server.checkpoints.state import OutcomeSnapshot, PartSnapshot, ShardState, WorkerSnapshot, check_ranges
from ps_server.dynamic import DynamicSnapshot

FORMAT = "onnx-ps-shard-checkpoint"
#: 2 added dynamic tables ("dynamic" in the state, `dyn/` tensors); a file without any is still
#: written as version 1, so an older server reads it. Every version up to this one is read.
FORMAT_VERSION = 2


def _param_key(name: str, row_start: int) -> str:
    return f"param/{name}@{row_start}"


def _slot_key(name: str, row_start: int, slot: str) -> str:
    return f"slot/{name}@{row_start}/{slot}"


def _acc_key(name: str, row_start: int) -> str:
    return f"acc/{name}@{row_start}"


def _dyn_key(name: str, what: str) -> str:
    return f"dyn/{name}@{what}"


def _spec_doc(s: ParamSpec) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), **({"state": True} if s.state else {})}
    if s.dynamic is not None:
        doc["dynamic"] = {"initializer": s.dynamic.initializer, "evict_after_steps": s.dynamic.evict_after_steps,
                          "seed": s.dynamic.seed}
    return doc


def _spec_of(doc: dict[str, Any]) -> ParamSpec:
    d = doc.get("dynamic")
    dynamic = None if d is None else DynamicTable(str(d["initializer"]), int(d["evict_after_steps"]), int(d["seed"]))
    return ParamSpec(doc["name"], doc["dtype"], tuple(doc["shape"]), bool(doc.get("state", False)), dynamic)


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
    dynamic = []
    for d in state.dynamic:
        entry = {"name": d.name, "ids": _dyn_key(d.name, "ids"), "values": _dyn_key(d.name, "values"),
                 "touched": _dyn_key(d.name, "touched"), "slots": {}, "accumulator": None}
        tensors[entry["ids"]], tensors[entry["values"]], tensors[entry["touched"]] = d.ids, d.values, d.touched
        for slot, array in sorted(d.slots.items()):
            entry["slots"][slot] = key = _dyn_key(d.name, f"slot/{slot}")
            tensors[key] = array
        if d.accumulator_ids is not None:
            entry["accumulator"] = [_dyn_key(d.name, "acc_ids"), _dyn_key(d.name, "acc_values")]
            tensors[entry["accumulator"][0]], tensors[entry["accumulator"][1]] = d.accumulator_ids, d.accumulator_values
        dynamic.append(entry)
    doc = {
        "shard_index": state.shard_index, "num_shards": state.num_shards, "mode": state.mode,
        "partition_min_bytes": state.partition_min_bytes,
        "optimizer": {"name": state.optimizer, "hyperparameters": state.optimizer_params},
        "consistency": state.consistency, "step": state.step, "dropped": state.dropped,
        "applied_gradients": state.applied_gradients,
        "parameters": [_spec_doc(s) for s in state.parameters],
        "parts": parts,
        "workers": [{"worker_id": w.worker_id, "clock": w.clock, "live": w.live,
                     "outcomes": [vars(o) for o in w.outcomes]} for w in state.workers],
        "contributors": state.contributors, "created_unix": state.created_unix,
        **({"dynamic": dynamic} if dynamic else {}),
    }
    state_json = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    version = FORMAT_VERSION if dynamic or any(s.dynamic for s in state.parameters) else 1
    metadata = {"format": FORMAT, "format_version": str(version), "state": state_json,
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
        state = _state_of(json.loads(state_json), tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{source}: malformed state: {type(exc).__name__}: {exc}") from exc
    try:
        check_ranges(state)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{source}: {exc}") from None
    return state


def _state_of(doc: dict, tensors: Mapping[str, np.ndarray]) -> ShardState:
    """The ShardState a decoded state JSON describes (KeyError, TypeError or ValueError when malformed)."""
    parts = []
    for e in doc["parts"]:
        parts.append(PartSnapshot(
            name=e["name"], row_start=int(e["row_start"]), row_end=int(e["row_end"]), value=tensors[e["value"]],
            slots={slot: tensors[key] for slot, key in e["slots"].items()},
            accumulator=None if e["accumulator"] is None else tensors[e["accumulator"]]))
    dynamic = []
    for e in doc.get("dynamic", []):
        acc = e["accumulator"]
        dynamic.append(DynamicSnapshot(
            name=e["name"], ids=tensors[e["ids"]], values=tensors[e["values"]], touched=tensors[e["touched"]],
            slots={slot: tensors[key] for slot, key in e["slots"].items()},
            accumulator_ids=None if acc is None else tensors[acc[0]],
            accumulator_values=None if acc is None else tensors[acc[1]]))
    workers = [WorkerSnapshot(w["worker_id"], int(w["clock"]), bool(w["live"]),
                              [OutcomeSnapshot(**o) for o in w["outcomes"]]) for w in doc["workers"]]
    return ShardState(
        shard_index=int(doc["shard_index"]), num_shards=int(doc["num_shards"]), mode=doc["mode"],
        partition_min_bytes=int(doc["partition_min_bytes"]), optimizer=doc["optimizer"]["name"],
        optimizer_params=dict(doc["optimizer"]["hyperparameters"]), consistency=dict(doc["consistency"]),
        step=int(doc["step"]), dropped=int(doc["dropped"]), applied_gradients=int(doc["applied_gradients"]),
        parameters=[_spec_of(s) for s in doc["parameters"]],
        parts=parts, workers=workers, contributors=doc["contributors"], created_unix=float(doc["created_unix"]),
        dynamic=dynamic)
