"""Routing sparse rows to shards (client side): which shard owns each id of a table, by the shard map.

A table split by the shard map has row ranges on several shards; a worker's ids go to the
shard whose range holds them (global ids on the wire), and every shard holding a part of a
table gets a RowGradient for it, empty when the batch touched none of its rows (a sync step
needs a gradient for every part: docs/protocol.md, "Sparse rows").

A dynamic table (rows keyed by any int64 id) lives on every shard: an id goes to shard
`splitmix64(id) % num_shards` (ps_common/dynamic_ids.py, the rule the shards check), and
every shard gets a RowGradient for it, empty when none of the batch's ids hash there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ps_common import codec
from ps_common.dynamic_ids import DynamicTable, shard_of_ids
from ps_common.errors import InvalidTensorError
from ps_common.shard_map import ParamSpec, ShardMap
from ps_proto.v1 import parameter_server_pb2 as pb


def dynamic_table(name: str, row_shape: tuple[int, ...] | list[int], *, dtype: str = "float32",
                  initializer: str = "zeros", evict_after_steps: int = 0, seed: int = 0) -> ParamSpec:
    """The spec of a dynamic table for PSClient.initialize(dynamic=[...]): rows of `row_shape` keyed by any
    int64 id, created from `initializer` ("zeros", "normal:STD", "uniform:A") on first use, evicted after
    `evict_after_steps` untouched steps (0: never). ValueError for a bad setting."""
    spec = ParamSpec(name, np.dtype(dtype).name, tuple(int(d) for d in row_shape),
                     dynamic=DynamicTable(initializer, int(evict_after_steps), int(seed)))
    spec.dynamic.check(name)
    return spec


def owners(shard_map: ShardMap, name: str, ids: np.ndarray) -> np.ndarray:
    """The shard of each id of table `name`; InvalidTensorError for an unknown table or an id out of range."""
    spec = shard_map.specs.get(name)
    if spec is None or not (spec.shape or spec.dynamic):
        raise InvalidTensorError(f"rows of {name!r}: not a table of this model (a tensor with rows)")
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise InvalidTensorError(f"rows of {name!r}: ids must be a 1-d integer array, got {ids.dtype}{list(ids.shape)}")
    if spec.dynamic is not None:
        if ids.dtype == np.uint64 and len(ids) and ids.max() >= 1 << 63:
            raise InvalidTensorError(f"rows of {name!r}: id {int(ids.max())} is outside the int64 range")
        return shard_of_ids(ids.astype(np.int64), shard_map.num_shards)
    if len(ids) and (ids.min() < 0 or ids.max() >= spec.shape[0]):
        bad = int(ids[(ids < 0) | (ids >= spec.shape[0])][0])
        raise InvalidTensorError(f"rows of {name!r}: id {bad} is outside [0, {spec.shape[0]})")
    parts = shard_map.parts_of(name)
    starts = np.array([p.row_start for p in parts], dtype=np.int64)
    shards = np.array([p.shard for p in parts], dtype=np.int64)
    return shards[np.searchsorted(starts, ids, side="right") - 1]


def route_rows(shard_map: ShardMap, rows: Mapping[str, np.ndarray]) -> dict[int, list[tuple[str, np.ndarray, np.ndarray]]]:
    """shard -> [(table, positions in the caller's ids, those ids)] for the shards that own some of the ids."""
    plan: dict[int, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for name, ids in rows.items():
        ids = np.asarray(ids, dtype=np.int64)
        owner = owners(shard_map, name, ids)
        for shard in np.unique(owner):
            pos = np.flatnonzero(owner == shard)
            plan.setdefault(int(shard), []).append((name, pos, ids[pos]))
    return plan


def place_rows(out: dict[str, np.ndarray], tables: Sequence[tuple[str, np.ndarray, np.ndarray]],
               answer: Iterable[pb.RowValues]) -> None:
    """Puts one shard's answered rows (PullRowsResponse.tables, PushPullResponse.rows) into `out`, at the
    positions they were asked for."""
    got = {t.name: t for t in answer}
    for name, pos, ids in tables:
        table = got.get(name)
        if table is None:
            raise InvalidTensorError(f"PullRows answer lacks table {name!r}")
        row_shape = out[name].shape[1:]
        if tuple(table.shape) != (len(ids), *row_shape):
            raise InvalidTensorError(f"PullRows answer for {name!r} has shape {list(table.shape)}, asked "
                                     f"{[len(ids), *row_shape]}")
        out[name][pos] = codec.rows_from_wire(name, table.dtype, table.data, len(ids), row_shape,
                                              want=out[name].dtype)


def split_asked(shard_map: ShardMap, asked: Sequence[tuple[str, np.ndarray, np.ndarray]], *, answer_bytes: int,
                request_bytes: int) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
    """One shard's rows asked for (route_rows' entries), cut into reads whose rows take at most `answer_bytes`
    as stored and whose ids at most `request_bytes` on the wire; a table at most once per read. A row larger
    than `answer_bytes` is a read of its own (the shard refuses it, naming the bytes)."""
    reads: list[list[tuple[str, np.ndarray, np.ndarray]]] = []
    current: list[tuple[str, np.ndarray, np.ndarray]] = []
    rows_room, ids_room = answer_bytes, request_bytes
    for name, pos, ids in asked:
        row = shard_map.specs[name].row_bytes
        start = 0
        while start < len(ids):
            fit = min(rows_room // row if row else len(ids), ids_room // codec.ID_WIRE_BYTES)
            if fit <= 0 and current:   # this read is full: the rest goes in the next one
                reads.append(current)
                current, rows_room, ids_room = [], answer_bytes, request_bytes
                continue
            end = min(len(ids), start + max(1, fit))
            current.append((name, pos[start:end], ids[start:end]))
            rows_room -= (end - start) * row
            ids_room -= (end - start) * codec.ID_WIRE_BYTES
            start = end
    if current:
        reads.append(current)
    return reads


def payload_bytes(gradients: Iterable[pb.RowGradient]) -> int:
    """The bytes row gradients hold: their rows and their ids as int64 (what the client's byte counters add)."""
    return sum(len(g.data) + 8 * len(g.ids) for g in gradients)


def asked_bytes(shard_map: ShardMap, asked: Iterable[tuple[str, np.ndarray, np.ndarray]]) -> int:
    """The bytes of the rows a read asks a shard for (route_rows' entries: table, positions, ids), as stored."""
    return sum(len(ids) * shard_map.specs[name].row_bytes for name, _, ids in asked)


def row_gradients_by_shard(shard_map: ShardMap, row_gradients: Mapping[str, tuple[np.ndarray, np.ndarray]],
                           wire_dtype: np.dtype) -> dict[int, list[pb.RowGradient]]:
    """shard -> the RowGradients it gets: for each table, one per shard holding a part of it (maybe empty).

    float32 rows travel in the job's wire dtype (the shard widens them).
    """
    out: dict[int, list[pb.RowGradient]] = {}
    for name, (ids, values) in row_gradients.items():
        ids = np.asarray(ids, dtype=np.int64)
        values = np.asarray(values)
        spec = shard_map.specs.get(name)
        if spec is not None and values.shape != (len(ids), *spec.row_shape):
            raise InvalidTensorError(f"row gradient of {name!r} is {values.dtype}{list(values.shape)}, "
                                     f"{len(ids)} rows of {spec.dtype}{list(spec.shape)} need {[len(ids), *spec.row_shape]}")
        owner = owners(shard_map, name, ids)
        if values.dtype == np.float32 and wire_dtype != values.dtype:
            values = values.astype(wire_dtype)
        holders = range(shard_map.num_shards) if spec is not None and spec.dynamic is not None else \
            sorted({p.shard for p in shard_map.parts_of(name)})
        for shard in holders:
            pos = np.flatnonzero(owner == shard)
            dtype, data = codec.rows_to_wire(values[pos])
            out.setdefault(shard, []).append(pb.RowGradient(name=name, ids=ids[pos], dtype=dtype, data=data))
    return out
