"""Stage "sparse": embedding tables used only through Gather(axis 0) train on the rows a batch touches.

`find_sparse_tables` picks the float initializers whose every use is the data input of a
Gather on axis 0 whose indices are a graph input, or are computed from graph inputs alone
(a column of a (batch, fields) ids input taken by Gather on axis 1 or Slice, a reshape, a
cast, an offset, a hash by Mod: any nodes that read no trainable parameter), and that are
at least `min_bytes` large (or `min_rows` rows), or named by the caller; `exclude` keeps
tables dense. Computed indices are evaluated on each batch before the step by a small model
cut from the graph (`SparsePlan.index_values`), so the training graph reads positions
instead. `rewrite_sparse` replaces each such table T of shape (R, *row) by an initializer
"T.rows" of shape (P, *row), P the number of index elements of one batch (the most unique
rows a batch can touch), and each Gather's indices by a new graph input "IDX@T.positions":
positions in the batch's list of unique ids. The engine then differentiates with respect to
"T.rows" as with any parameter: the gradient of the rows, never of the whole table.

At run time (`SparsePlan`): `unique_ids(inputs)` gives each table's unique ids of a batch
(what the worker pulls), `feeds(inputs, ids)` the positions inputs, `rows_parameter` pads the
pulled rows to P, and `row_gradients` cuts the rows' gradient back to the unique ids (what
the worker pushes), the padding row of a torch Embedding with padding_idx at zero. Scattering
the row gradient into a zero table gives the original model's dense gradient
(tests/unit/test_sparse_engine.py).

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
from worker_client.engine.load import max_ir_version
from worker_client.engine.rewrites.toolkit import RANDOM_OPS

__all__ = ["DYNAMIC_TABLES_KEY", "ROWS_SUFFIX", "SparsePlan", "SparseTable", "declared_dynamic_tables",
           "find_sparse_tables", "rewrite_sparse"]

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
    #: torch's padding_idx (read from a dynamo export's record): the row whose gradient torch keeps at zero
    padding_row: int | None = None

    @property
    def rows_name(self) -> str:
        return self.name + ROWS_SUFFIX


@dataclass
class SparsePlan:
    """The tables of a rewritten model and how a batch's feeds, rows and gradients map to them."""

    tables: dict[str, SparseTable]
    dropped_inputs: list[str]          # index inputs only the rewritten Gathers used: not fed to the session
    #: a model computing the index tensors that are not graph inputs, from the graph inputs (None: there are none)
    ids_model: onnx.ModelProto | None = None
    _ids_session: object = field(default=None, repr=False)

    def index_values(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every Gather's indices for a batch: graph inputs as given, computed ones by the ids model."""
        out = {i: np.asarray(inputs[i]) for t in self.tables.values() for i in t.positions if i in inputs}
        if self.ids_model is not None:
            if self._ids_session is None:
                import onnxruntime as ort
                options = ort.SessionOptions()
                options.intra_op_num_threads = 1
                self._ids_session = ort.InferenceSession(self.ids_model.SerializeToString(), options,
                                                         providers=["CPUExecutionProvider"])
            session = self._ids_session
            feeds = {v.name: np.asarray(inputs[v.name]) for v in session.get_inputs()}
            out.update(zip((o.name for o in session.get_outputs()), session.run(None, feeds)))
        return out

    def unique_ids(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each table's sorted unique row ids of a batch (negative indices counted from the end, as Gather does;
        a dynamic table's ids are keys, taken as they are)."""
        indices = self.index_values(inputs)
        out = {}
        for name, table in self.tables.items():
            rows = table.shape[0]
            parts = []
            for index in table.positions:
                ids = np.asarray(indices[index]).astype(np.int64).reshape(-1)
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
        indices = self.index_values(inputs)
        out = {k: v for k, v in inputs.items() if k not in self.dropped_inputs}
        for name, table in self.tables.items():
            rows = table.shape[0]
            for index, positions in table.positions.items():
                raw = np.asarray(indices[index])
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
        """{table: (unique ids, their gradient rows)} from the engine's gradients of the rows parameters; a
        table's padding row, when the batch touched it, with a zero gradient (in place), as torch keeps it."""
        out = {}
        for name, table in self.tables.items():
            unique, rows = ids[name], gradients[table.rows_name][:len(ids[name])]
            if table.padding_row is not None:
                at = int(np.searchsorted(unique, table.padding_row))
                if at < len(unique) and unique[at] == table.padding_row:
                    rows[at] = 0
            out[name] = (unique, rows)
        return out


def _input_only(graph: onnx.GraphProto) -> set[str]:
    """The tensors computed from graph inputs alone: graph inputs, non-float constants (shapes, offsets, hash
    moduli), and the outputs of nodes (without subgraphs) that read only those. A float initializer may be a
    parameter, so what reads one is not in the set."""
    inputs = {v.name for v in graph.input}
    initializers = {t.name: t for t in graph.initializer}
    known = set(inputs) - set(initializers)
    known |= {n for n, t in initializers.items()
              if helper.tensor_dtype_to_np_dtype(t.data_type).kind != "f"}
    for node in graph.node:   # topological order
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        if node.op_type in RANDOM_OPS:
            continue
        if all(i == "" or i in known for i in node.input):
            known.update(o for o in node.output if o)
    return known


def _gathers_only(graph: onnx.GraphProto, name: str, indices_ok: set[str]) -> list[onnx.NodeProto] | None:
    """The Gathers that read `name` as data on axis 0 with indices in `indices_ok` (graph inputs, or tensors computed
    from them alone); None if any use is another."""
    uses = [n for n in graph.node if name in n.input]
    if not uses:
        return None
    for node in uses:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] != name or name in node.input[1:] or axis != 0 \
                or node.input[1] not in indices_ok:
            return None
    if name in {o.name for o in graph.output}:
        return None
    return uses


#: The model metadata key by which an exporter declares dynamic tables (comma-separated names): tables whose ids are
#: hashed int64 keys, their initializer only giving the row shape (docs/models.md, "Dynamic tables").
DYNAMIC_TABLES_KEY = "onnx_ps.dynamic_tables"


def declared_dynamic_tables(model: onnx.ModelProto) -> list[str]:
    """The tables the model's metadata declares dynamic (DYNAMIC_TABLES_KEY)."""
    value = next((p.value for p in model.metadata_props if p.key == DYNAMIC_TABLES_KEY), "")
    return [n.strip() for n in value.split(",") if n.strip()]


#: A table at least this large (rows x row bytes) trains sparsely by default, when it qualifies (docs/models.md).
DEFAULT_SPARSE_MIN_BYTES = 1 << 20


def find_sparse_tables(model: onnx.ModelProto, *, min_rows: int | None = None, min_bytes: int | None = None,
                       named: Sequence[str] = (), exclude: Collection[str] = (),
                       dynamic: Collection[str] = ()) -> list[str]:
    """The float initializers to train sparsely: used only through Gather(axis 0) with indices that are graph inputs
    or computed from graph inputs alone, with >= min_rows rows or >= min_bytes bytes (None: none by that size), or
    named; never one in `exclude`. A named table that does not qualify is a ValueError saying why (`dynamic`: the
    named ones asked for as dynamic tables, so that the error names what was asked)."""
    graph = model.graph
    indices_ok = _input_only(graph)
    found = []
    initializers = {t.name: t for t in graph.initializer}
    for name in [*named, *exclude]:
        if name not in initializers:
            kind = "dynamic" if name in dynamic else "sparse" if name in named else "dense"
            tables = [t for t in initializers if _gathers_only(graph, t, indices_ok) is not None]
            raise ValueError(f"{kind} table {name!r} is not an initializer of the model; the tables it gathers rows "
                             f"of are {tables}" if tables else
                             f"{kind} table {name!r} is not an initializer of the model, which gathers rows of no "
                             "table")
    for name in named:
        if name in exclude:
            raise ValueError(f"table {name!r} is named both sparse and dense")
        if _gathers_only(graph, name, indices_ok) is None:
            raise ValueError(f"sparse table {name!r} is used other than as the data of Gather(axis=0) with indices "
                             "computed from the graph's inputs alone: it cannot train sparsely")
    for name, tensor in initializers.items():
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        if dtype.kind != "f" or name in exclude or len(tensor.dims) < 1:
            continue
        nbytes = math.prod(tensor.dims) * np.dtype(dtype).itemsize
        big = (min_rows is not None and tensor.dims[0] >= min_rows) or (min_bytes is not None and nbytes >= min_bytes)
        if (name in named or big) and _gathers_only(graph, name, indices_ok) is not None:
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
    Index tensors computed from the inputs are cut out into the plan's ids model; nodes and
    inputs that only fed them leave the training graph.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inputs = {v.name: v for v in graph.input}
    initializers = {t.name: t for t in graph.initializer}
    indices_ok = _input_only(graph)
    typed = _value_infos(model)
    plan = SparsePlan({}, [])
    computed: list[str] = []
    for name in tables:
        tensor = initializers[name]
        value = table_value(tensor, base_dir)
        gathers = _gathers_only(graph, name, indices_ok)
        if gathers is None:
            raise ValueError(f"table {name!r} cannot train sparsely (see find_sparse_tables)")
        indices = sorted({g.input[1] for g in gathers})
        capacity = 0
        for index in indices:
            info = inputs.get(index) or typed.get(index)
            dims = None if info is None else declared_dims(info)
            if dims is None or not dims or any(not isinstance(d, int) for d in dims[1:]):
                raise ValueError(f"indices {index!r} of table {name!r} need a static shape besides the batch axis "
                                 f"(axis 0), got {dims}")
            capacity += batch_size * math.prod(dims[1:])
            if index not in inputs and index not in computed:
                computed.append(index)
        dynamic_ = name in dynamic
        table = SparseTable(name, tuple(value.shape), value, capacity if dynamic_ else min(capacity, value.shape[0]),
                            dynamic=dynamic_)
        for index in indices:
            positions = f"{index}@{name}{POSITIONS_SUFFIX}"
            table.positions[index] = positions
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(inputs.get(index) or typed[index])
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
    if computed:
        plan.ids_model = _ids_model(model, computed, typed)
    _prune(graph)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    plan.dropped_inputs = sorted(v.name for v in graph.input if v.name not in used and v.name not in initializers
                                 and not v.name.endswith(POSITIONS_SUFFIX))
    kept = [v for v in graph.input if v.name not in plan.dropped_inputs]
    graph.ClearField("input")
    graph.input.extend(kept)
    return out, plan


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every tensor's type as shape inference finds it (graph inputs, outputs and intermediate values)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 -- a model onnx cannot infer: computed indices then need declared shapes
        inferred = model
    graph = inferred.graph
    return {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}


def _ids_model(model: onnx.ModelProto, outputs: Sequence[str], typed: Mapping[str, onnx.ValueInfoProto]
               ) -> onnx.ModelProto:
    """The part of `model` computing `outputs` (index tensors) from its graph inputs: a model of its own."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    needed_nodes, needed, stack = [], set(), list(outputs)
    while stack:
        tensor = stack.pop()
        if tensor in needed or tensor == "":
            continue
        needed.add(tensor)
        node = producers.get(tensor)
        if node is not None:
            stack.extend(node.input)
    for node in graph.node:   # in the graph's (topological) order
        if any(o in needed for o in node.output):
            needed_nodes.append(node)
    initializers = [t for t in graph.initializer if t.name in needed]
    init_names = {t.name for t in initializers}
    inputs = [v for v in graph.input if v.name in needed and v.name not in init_names]
    ids = helper.make_graph(needed_nodes, "sparse_ids", inputs, [typed[o] for o in outputs], initializers)
    result = helper.make_model(ids, opset_imports=model.opset_import)
    result.ir_version = min(model.ir_version, max_ir_version())
    return result


def _prune(graph: onnx.GraphProto) -> None:
    """Removes the nodes whose outputs nothing reads (in place), until none is left."""
    while True:
        wanted = {o.name for o in graph.output} | {i for n in graph.node for i in n.input}
        dead = [n for n in graph.node if not any(o in wanted for o in n.output if o)]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)
