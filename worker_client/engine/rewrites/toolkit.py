"""What every rewrite pass uses: the opset, static shapes, constant values, fresh names."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["RANDOM_OPS", "SAME_DATA_OPS", "Emitter", "Writer", "attribute", "auto_pads", "constants", "drop_values",
           "opset_of", "read_stand_ins", "reader_counts", "readers_of", "rebuild", "reduction_axes", "replace_items",
           "set_attribute", "shapes_and_types", "static_shapes", "subgraph_reads", "subgraphs", "value_types"]

#: Ops that hand their input's elements on unchanged when input and output hold as many (onnx-ad's
#: seed-axis Reshapes, its Expands of a tensor to its own shape, Identities).
SAME_DATA_OPS = frozenset({"Reshape", "Expand", "Identity", "Squeeze", "Unsqueeze"})


#: Ops that draw random numbers when they run (Dropout in training mode): never computed once for many uses.
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli", "Dropout"})


def opset_of(model: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    return max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [1])


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every value whose shape is fully static, as inferred by onnx."""
    return shapes_and_types(model)[0]


def shapes_and_types(model: onnx.ModelProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """(every value whose shape is fully static; the element type, onnx.TensorProto's enum, of every value
    whose type onnx infers), from one run of onnx's shape inference."""
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, int] = {}
    for name, value in value_types(model).items():
        tensor_type = value.tensor_type
        if tensor_type.elem_type:
            types[name] = tensor_type.elem_type
        if tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in tensor_type.shape.dim):
            shapes[name] = tuple(d.dim_value for d in tensor_type.shape.dim)
    return shapes, types


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor value's type (initializers', inputs', inferred values', outputs') from one run of onnx's shape
    inference, the dims it could not fix left symbolic or unknown."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except onnx.shape_inference.InferenceError:
        inferred = model
    graph = inferred.graph
    found = {t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in graph.initializer}
    found.update({value.name: value.type for value in [*graph.input, *graph.value_info, *graph.output]
                  if value.type.HasField("tensor_type")})
    return found


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of `node`'s attribute `name`, `default` when it has none."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs `node`'s attributes hold (a Scan's or If's body)."""
    return [graph for attribute in node.attribute
            for graph in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs)]


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Every name the subgraphs of `node`'s attributes read (a Scan's or If's body), nested ones included --
    by their nodes or as their outputs: among them the outer values they capture."""
    names: set[str] = set()
    for graph in subgraphs(node):
        names.update(value.name for value in graph.output)
        for inner in graph.node:
            names.update(name for name in inner.input if name)
            names |= subgraph_reads(inner)
    return names


def reduction_axes(node: onnx.NodeProto, known: dict[str, np.ndarray]) -> list[int] | None:
    """The axes a reduction names -- its second input (ReduceSum from opset 13, the others from 18) or its
    `axes` attribute --, [] where it names none, None where they are computed at run time."""
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in known:
            return None
        return [int(a) for a in known[node.input[1]].reshape(-1)]
    return next((list(a.ints) for a in node.attribute if a.name == "axes"), [])


def reader_counts(graph: onnx.GraphProto) -> Counter[str]:
    """How many times each value is read: by the graph's nodes (once more for each node whose subgraphs read
    it: a Scan body capturing it), and once more for being a graph output."""
    readers = Counter(name for node in graph.node for name in node.input)
    for node in graph.node:
        readers.update(subgraph_reads(node))
    readers.update(value.name for value in graph.output)
    return readers


def readers_of(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """The nodes that read each value, each node once however often it reads it (c * c is one reader; a Scan
    whose body captures the value reads it too)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in dict.fromkeys([*node.input, *sorted(subgraph_reads(node))]):
            if name:
                readers.setdefault(name, []).append(node)
    return readers


def read_stand_ins(model: onnx.ModelProto, prefix: str) -> int:
    """After differentiation: every graph input named `prefix` + V -- a stand-in a forward rewrite put where V was
    read, so that onnx-ad would not differentiate through it -- read as V itself and dropped from the inputs and
    the value_info; in place. Returns the number of stand-ins removed."""
    graph = model.graph
    stand_ins = {value.name: value.name[len(prefix):] for value in graph.input if value.name.startswith(prefix)}
    if not stand_ins:
        return 0
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in stand_ins:
                node.input[index] = stand_ins[name]
    drop_values(graph, set(stand_ins))
    return len(stand_ins)


def drop_values(graph: onnx.GraphProto, gone: set[str], stale: Collection[str] = ()) -> None:
    """The graph's inputs and outputs named in `gone` removed, and the value_info of those and of `stale` (values
    renamed or computed otherwise, whose recorded shapes no longer hold); in place."""
    for field in (graph.input, graph.output):
        values = [value for value in field if value.name not in gone]
        del field[:]
        field.extend(values)
    infos = [info for info in graph.value_info if info.name not in gone and info.name not in stale]
    graph.ClearField("value_info")
    graph.value_info.extend(infos)


#: A Constant's value given as a plain attribute (torch's dynamo exporter writes shapes, Slice bounds and
#: positions so, where the legacy exporter writes `value` tensors): its numpy type and rank.
_PLAIN_CONSTANTS = {"value_int": (np.int64, 0), "value_ints": (np.int64, 1),
                    "value_float": (np.float32, 0), "value_floats": (np.float32, 1)}


def constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values by name (a `value` tensor or a value_int(s)/value_float(s))."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
                elif attribute.name in _PLAIN_CONSTANTS:
                    dtype, rank = _PLAIN_CONSTANTS[attribute.name]
                    values[node.output[0]] = np.array(helper.get_attribute_value(attribute), dtype).reshape(
                        (-1,) * rank)
    return values


class Emitter:
    """New nodes and int64 shape constants with names that collide with nothing: no name of the main graph
    nor of any subgraph (a main-graph value must not shadow, or be shadowed by, a name a body defines)."""

    def __init__(self, model: onnx.ModelProto, stem: str) -> None:
        self.taken: set[str] = set()
        self._collect(model.graph)
        self.stem = stem
        self.counter = 0
        self.initializers: list[onnx.TensorProto] = []

    def _collect(self, graph: onnx.GraphProto) -> None:
        self.taken.update(v.name for v in list(graph.input) + list(graph.output))
        self.taken.update(t.name for t in graph.initializer)
        for node in graph.node:
            self.taken.update(node.output)
            if node.name:   # fresh names serve as node names too, which onnxruntime requires to be unique
                self.taken.add(node.name)
            for inner in subgraphs(node):
                self._collect(inner)

    def name(self, stem: str | None = None) -> str:
        """A fresh tensor (and node) name, from the Emitter's stem or `stem`."""
        while True:
            self.counter += 1
            candidate = f"{stem or self.stem}_{self.counter}"
            if candidate not in self.taken:
                self.taken.add(candidate)
                return candidate

    def ints(self, values: Sequence[int]) -> str:
        """A new int64 initializer holding `values`; returns its name."""
        name = self.name()
        self.initializers.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def scalar(self, value: float, element: int = onnx.TensorProto.FLOAT) -> str:
        """A new 0-d initializer holding `value` as the ONNX element type `element`; returns its name."""
        name = self.name()
        self.initializers.append(numpy_helper.from_array(
            np.array(value, helper.tensor_dtype_to_np_dtype(element)), name))
        return name

    def reshape(self, value: str, shape: Sequence[int], out: str | None = None
                ) -> tuple[onnx.NodeProto, str]:
        """A Reshape of `value` to the static `shape`, and its output name."""
        out = out or self.name()
        return helper.make_node("Reshape", [value, self.ints(shape)], [out], name=out), out


class Writer:
    """New nodes appended in order, each output a fresh name of `emit` unless given: a rewrite's many small nodes
    written one call each."""

    def __init__(self, emit: Emitter, nodes: list[onnx.NodeProto] | None = None) -> None:
        self.emit = emit
        self.nodes: list[onnx.NodeProto] = [] if nodes is None else nodes

    def node(self, op: str, inputs: list[str], out: str | None = None, **attributes: object) -> str:
        """An `op` node reading `inputs`; its output's name (`out`, or a fresh one), which names the node too."""
        out = out or self.emit.name()
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attributes))
        return out

    def reshape(self, value: str, shape: Sequence[int], out: str | None = None) -> str:
        """`value` reshaped to the static `shape`; the result's name."""
        made, out = self.emit.reshape(value, shape, out)
        self.nodes.append(made)
        return out


def auto_pads(mode: bytes | str, size: tuple[int, ...], kernel: list[int], strides: list[int],
              dilations: list[int], out: list[int]) -> list[int]:
    """Explicit pads (begins, then ends) for auto_pad SAME_UPPER / SAME_LOWER, given the output size `out`: the
    total padding that size needs, the odd one at the end (UPPER) or the beginning (LOWER)."""
    upper = mode in (b"SAME_UPPER", "SAME_UPPER")
    begins, ends = [], []
    for n, k, s, d, o in zip(size, kernel, strides, dilations, out):
        total = max(0, (o - 1) * s + (k - 1) * d + 1 - n)
        small, large = total // 2, total - total // 2
        begins.append(small if upper else large)
        ends.append(large if upper else small)
    return begins + ends


def rebuild(model: onnx.ModelProto, emit: Emitter,
            replace: Callable[[onnx.NodeProto], list[onnx.NodeProto] | None]) -> int:
    """Each node of the graph, in order, kept or swapped for the nodes `replace` returns (None: kept); the
    Emitter's new constants added. Returns the number replaced; the graph is untouched when none is."""
    nodes: list[onnx.NodeProto] = []
    replaced = 0
    for node in model.graph.node:
        replacement = replace(node)
        if replacement is None:
            nodes.append(node)
            continue
        nodes += replacement
        replaced += 1
    if replaced:
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(emit.initializers)
    return replaced


def replace_items(field, items: list) -> None:  # type: ignore[no-untyped-def]
    """A repeated message field's items replaced by copies of `items` (clearing the field releases the
    messages it held, `items` among them)."""
    copies = []
    for item in items:
        copy = type(item)()
        copy.CopyFrom(item)
        copies.append(copy)
    del field[:]
    field.extend(copies)


def set_attribute(node: onnx.NodeProto, name: str, value: object) -> None:
    """The attribute `name` of `node` set to `value` in place: the existing one overwritten, or one added
    (clearing the node's attribute field would release a Scan's body that a caller holds)."""
    fresh = helper.make_attribute(name, value)
    for attribute in node.attribute:
        if attribute.name == name:
            attribute.CopyFrom(fresh)
            return
    node.attribute.append(fresh)
