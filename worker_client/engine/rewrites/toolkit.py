"""What every rewrite pass uses: the opset, static shapes, constant values, fresh names."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["SAME_DATA_OPS", "Emitter", "auto_pads", "constants", "opset_of", "reader_counts",
           "rebuild", "shapes_and_types", "static_shapes", "subgraph_reads"]

#: Ops that hand their input's elements on unchanged when input and output hold as many (onnx-ad's
#: seed-axis Reshapes, its Expands of a tensor to its own shape, Identities).
SAME_DATA_OPS = frozenset({"Reshape", "Expand", "Identity", "Squeeze", "Unsqueeze"})


def opset_of(model: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    return max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [1])


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every value whose shape is fully static, as inferred by onnx."""
    return shapes_and_types(model)[0]


def shapes_and_types(model: onnx.ModelProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """(every value whose shape is fully static; the element type, onnx.TensorProto's enum, of every value
    whose type onnx infers), from one run of onnx's shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except onnx.shape_inference.InferenceError:
        inferred = model
    graph = inferred.graph
    shapes: dict[str, tuple[int, ...]] = {t.name: tuple(t.dims) for t in graph.initializer}
    types = {t.name: t.data_type for t in graph.initializer}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        if tensor_type.elem_type:
            types[value.name] = tensor_type.elem_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    return shapes, types


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Every name the subgraphs of `node`'s attributes read (a Scan's or If's body), nested ones included --
    by their nodes or as their outputs: among them the outer values they capture."""
    names: set[str] = set()
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            names.update(value.name for value in graph.output)
            for inner in graph.node:
                names.update(name for name in inner.input if name)
                names |= subgraph_reads(inner)
    return names


def reader_counts(graph: onnx.GraphProto) -> Counter[str]:
    """How many times each value is read: by the graph's nodes, and once more for being a graph output."""
    readers = Counter(name for node in graph.node for name in node.input)
    readers.update(value.name for value in graph.output)
    return readers


def constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values by name."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
    return values


class Emitter:
    """New nodes and int64 shape constants with names that collide with nothing."""

    def __init__(self, model: onnx.ModelProto, stem: str) -> None:
        graph = model.graph
        self.taken = {v.name for v in list(graph.input) + list(graph.output)}
        self.taken.update(t.name for t in graph.initializer)
        self.taken.update(out for node in graph.node for out in node.output)
        self.stem = stem
        self.counter = 0
        self.initializers: list[onnx.TensorProto] = []

    def name(self) -> str:
        """A fresh tensor (and node) name."""
        while True:
            self.counter += 1
            candidate = f"{self.stem}_{self.counter}"
            if candidate not in self.taken:
                self.taken.add(candidate)
                return candidate

    def ints(self, values: Sequence[int]) -> str:
        """A new int64 initializer holding `values`; returns its name."""
        name = self.name()
        self.initializers.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def reshape(self, value: str, shape: Sequence[int], out: str | None = None
                ) -> tuple[onnx.NodeProto, str]:
        """A Reshape of `value` to the static `shape`, and its output name."""
        out = out or self.name()
        return helper.make_node("Reshape", [value, self.ints(shape)], [out], name=out), out


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
