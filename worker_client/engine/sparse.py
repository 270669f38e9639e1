"""Stage "sparse": embedding tables used only through Gather(axis 0) train on the rows a batch touches.

`find_sparse_tables` picks the float initializers whose every use is the data input of a
Gather on axis 0 whose indices are a graph input, with at least `min_rows` rows, or named by
the caller. `rewrite_sparse` replaces each such table T of shape (R, *row) by an initializer
"T.rows" of shape (P, *row), P the number of index elements of one batch (the most unique
rows a batch can touch), and each Gather's indices by a new graph input "IDX@T.positions":
positions in the batch's list of unique ids. The engine then differentiates with respect to
"T.rows" as with any parameter: the gradient of the rows, never of the whole table.

At run time (`SparsePlan`): `unique_ids(inputs)` gives each table's unique ids of a batch
(what the worker pulls), `feeds(inputs, ids)` the positions inputs, `rows_parameter` pads the
pulled rows to P, and `row_gradients` cuts the rows' gradient back to the unique ids (what
the worker pushes). Scattering the row gradient into a zero table gives the original model's
dense gradient (tests/unit/test_sparse_engine.py).

A *dynamic* table (`rewrite_sparse(..., dynamic=...)`) is held by the shards as a dynamic table
(docs/protocol.md, "Dynamic tables"): its ids are keys (any int64), not row indices, so they
are neither range-checked nor wrapped, and its capacity P is the batch's index elements even
when the model's table has fewer rows (the model's table only gives the row shape and dtype).
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.external_data import map_external
from worker_client.engine.feeds import declared_dims

__all__ = ["ROWS_SUFFIX", "SparsePlan", "SparseTable", "find_sparse_tables", "rewrite_sparse"]

#: The name of a table's rows parameter: "<table>.rows".
ROWS_SUFFIX = ".rows"
#: The name of a Gather's positions input: "<indices input>@<table>.positions".
POSITIONS_SUFFIX = ".positions"


@dataclass
class SparseTable:
    """One table trained sparsely: its full shape and initial value, the rows parameter, and its Gathers' inputs."""

    name: str
    shape: tuple[int, ...]
    initial: np.ndarray
    capacity: int                                       # P: index elements per batch
    positions: dict[str, str] = field(default_factory=dict)   # indices input -> positions input
    dynamic: bool = False                               # ids are int64 keys of a dynamic table, not row indices

    @property
    def rows_name(self) -> str:
        return self.name + ROWS_SUFFIX


@dataclass
class SparsePlan:
    """The tables of a rewritten model and how a batch's feeds, rows and gradients map to them."""

    tables: dict[str, SparseTable]
    dropped_inputs: list[str]          # index inputs only the rewritten Gathers used: not fed to the session

    def unique_ids(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each table's sorted unique row ids of a batch (negative indices counted from the end, as Gather does;
        a dynamic table's ids are keys, taken as they are)."""
        out = {}
        for name, table in self.tables.items():
            rows = table.shape[0]
            parts = []
            for index in table.positions:
                ids = np.asarray(inputs[index]).astype(np.int64).reshape(-1)
                if table.dynamic:
                    parts.append(ids)
                    continue
                if len(ids) and (ids.min() < -rows or ids.max() >= rows):
                    bad = int(ids[(ids < -rows) | (ids >= rows)][0])
                    raise ValueError(f"input {index!r}: index {bad} is outside table {name!r} of {rows} rows")
                parts.append(np.where(ids < 0, ids + rows, ids))
            out[name] = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        return out

    def feeds(self, inputs: Mapping[str, np.ndarray], ids: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The session's inputs: `inputs` with each Gather's positions (and without the index inputs it dropped)."""
        out = {k: v for k, v in inputs.items() if k not in self.dropped_inputs}
        for name, table in self.tables.items():
            rows = table.shape[0]
            for index, positions in table.positions.items():
                raw = np.asarray(inputs[index])
                ids_ = raw.astype(np.int64)
                if not table.dynamic:
                    ids_ = np.where(ids_ < 0, ids_ + rows, ids_)
                out[positions] = np.searchsorted(ids[name], ids_).astype(raw.dtype)
        return out

    def rows_parameter(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The pulled rows of `name`'s unique ids, padded with zero rows to the capacity P."""
        table = self.tables[name]
        out = np.zeros((table.capacity, *table.shape[1:]), dtype=table.initial.dtype)
        out[:len(rows)] = rows
        return out

    def row_gradients(self, gradients: Mapping[str, np.ndarray], ids: Mapping[str, np.ndarray]
                      ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{table: (unique ids, their gradient rows)} from the engine's gradients of the rows parameters."""
        return {name: (ids[name], gradients[table.rows_name][:len(ids[name])]) for name, table in self.tables.items()}


def _gathers_only(graph: onnx.GraphProto, name: str, inputs: set[str]) -> list[onnx.NodeProto] | None:
    """The Gathers that read `name` as data on axis 0 with a graph input as indices; None if any use is another."""
    uses = [n for n in graph.node if name in n.input]
    if not uses:
        return None
    for node in uses:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] != name or name in node.input[1:] or axis != 0 \
                or node.input[1] not in inputs:
            return None
    if name in {o.name for o in graph.output}:
        return None
    return uses


def find_sparse_tables(model: onnx.ModelProto, *, min_rows: int | None = None,
                       named: Sequence[str] = ()) -> list[str]:
    """The float initializers to train sparsely: used only through Gather(axis 0) on a graph input's indices,
    with >= min_rows rows (None: none by size), or named. A named table that does not qualify is a ValueError
    saying why."""
    graph = model.graph
    inputs = {v.name for v in graph.input}
    found = []
    initializers = {t.name: t for t in graph.initializer}
    for name in named:
        if name not in initializers:
            raise ValueError(f"sparse table {name!r} is not an initializer of the model")
        if _gathers_only(graph, name, inputs) is None:
            raise ValueError(f"sparse table {name!r} is used other than as the data of Gather(axis=0) with a "
                             "graph input as indices: it cannot train sparsely")
    for name, tensor in initializers.items():
        float_ = helper.tensor_dtype_to_np_dtype(tensor.data_type).kind == "f"
        big = min_rows is not None and len(tensor.dims) >= 1 and tensor.dims[0] >= min_rows
        if float_ and (name in named or big) and _gathers_only(graph, name, inputs) is not None:
            found.append(name)
    return found


def table_value(tensor: onnx.TensorProto, base_dir: str | os.PathLike[str] | None) -> np.ndarray:
    """A table's value: mapped read-only from its external data file (never read whole), or from the model.

    The file is opened by the rules of engine/external_data.py (inside the model's folder,
    no symbolic link, the bytes within the file)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    where = "model" if base_dir is None else f"model in {base_dir}"
    return map_external(tensor, base_dir, where=where)


def rewrite_sparse(model: onnx.ModelProto, tables: Sequence[str], batch_size: int, *,
                   base_dir: str | os.PathLike[str] | None = None,
                   dynamic: Collection[str] = ()) -> tuple[onnx.ModelProto, SparsePlan]:
    """A copy of `model` where each table's Gathers read "T.rows" at "IDX@T.positions" (see the module's doc).

    `base_dir`: the model's folder, where a table in external data is mapped from (`table_value`).
    `dynamic`: the tables (of `tables`) whose ids are dynamic-table keys (see the module's doc).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inputs = {v.name: v for v in graph.input}
    initializers = {t.name: t for t in graph.initializer}
    plan = SparsePlan({}, [])
    for name in tables:
        tensor = initializers[name]
        value = table_value(tensor, base_dir)
        gathers = _gathers_only(graph, name, set(inputs))
        if gathers is None:
            raise ValueError(f"table {name!r} cannot train sparsely (see find_sparse_tables)")
        indices = sorted({g.input[1] for g in gathers})
        capacity = 0
        for index in indices:
            dims = declared_dims(inputs[index])
            if dims is None or any(not isinstance(d, int) for d in dims[1:]):
                raise ValueError(f"indices input {index!r} of table {name!r} needs a static shape besides the "
                                 f"batch axis, got {dims}")
            capacity += batch_size * math.prod(dims[1:])
        dynamic_ = name in dynamic
        table = SparseTable(name, tuple(value.shape), value, capacity if dynamic_ else min(capacity, value.shape[0]),
                            dynamic=dynamic_)
        for index in indices:
            positions = f"{index}@{name}{POSITIONS_SUFFIX}"
            table.positions[index] = positions
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(inputs[index])
            copy.name = positions
            graph.input.append(copy)
        for g in gathers:
            g.input[0] = table.rows_name
            g.input[1] = table.positions[g.input[1]]
        rows = numpy_helper.from_array(np.zeros((table.capacity, *value.shape[1:]), value.dtype.newbyteorder("=")),
                                       table.rows_name)
        graph.initializer.remove(tensor)
        graph.initializer.append(rows)
        plan.tables[name] = table
    used = {i for n in graph.node for i in n.input}
    plan.dropped_inputs = sorted({i for t in plan.tables.values() for i in t.positions if i not in used})
    kept = [v for v in graph.input if v.name not in plan.dropped_inputs]
    graph.ClearField("input")
    graph.input.extend(kept)
    return out, plan
