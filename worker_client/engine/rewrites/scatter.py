"""Gather adjoints that rebuild a whole tensor from its pieces, as one Concat."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, constants, static_shapes

__all__ = ["concat_piecewise_scatters"]


def _zeros(name: str, producers: dict[str, onnx.NodeProto], values: dict[str, np.ndarray]) -> bool:
    """Whether `name` is a constant, or a ConstantOfShape, that is all zeros."""
    if name in values:
        return not np.any(values[name])
    node = producers.get(name)
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    return value is None or not np.any(onnx.numpy_helper.to_array(value))


def concat_piecewise_scatters(model: onnx.ModelProto) -> int:
    """Rewrite a Sum of ScatterNDs into zeros, one per index of axis 0, as one Concat, in place.

    Torch's multi-head attention computes the query, key and value projections as one GEMM and
    takes the three apart with Gather(axis 0) at the constant indices 0, 1 and 2. onnx-ad's
    adjoint of each Gather scatters its gradient into a zero tensor of the whole stacked shape
    (a ConstantOfShape, then a ScatterND), and the three are summed: per attention layer three
    zero fills, three scatters and a three-way sum, each over the whole tensor. When the Sum's
    every input is such a scatter, each of a single constant index of axis 0, and together
    they cover every index exactly once, the sum is the three pieces stacked in index order: one
    Concat, writing the tensor once. Returns the number rewritten.
    """
    shapes = static_shapes(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    values = constants(model)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    emit = Emitter(model, "stacked")
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Sum" or len(node.input) < 2:
            continue
        shape = shapes.get(node.output[0])
        pieces = _pieces(node, shape, producers, values, shapes, readers)
        if shape is None or pieces is None:
            continue
        nodes, parts = [], []
        for update in pieces:
            part, out = emit.reshape(update, [1, *shape[1:]])
            nodes.append(part)
            parts.append(out)
        nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=node.name or node.output[0],
                                      axis=0))
        replacements[index] = nodes
    if replacements:
        kept = []
        for index, node in enumerate(model.graph.node):
            kept.extend(replacements.get(index, [node]))
        model.graph.ClearField("node")
        model.graph.node.extend(kept)
        model.graph.initializer.extend(emit.initializers)
    return len(replacements)


def _pieces(node: onnx.NodeProto, shape: tuple[int, ...] | None, producers: dict[str, onnx.NodeProto],
            values: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]],
            readers: dict[str, int]) -> list[str] | None:
    """The updates of the Sum's scatters in the order of their index along axis 0, when they
    rebuild the whole tensor; else None."""
    if shape is None or not shape:
        return None
    by_index: dict[int, str] = {}
    for name in node.input:
        scatter = producers.get(name)
        if scatter is None or scatter.op_type != "ScatterND" or readers.get(name) != 1 or \
                shapes.get(scatter.input[0]) != shape or \
                not _zeros(scatter.input[0], producers, values):
            return None
        indices = values.get(scatter.input[1])
        update = scatter.input[2]
        if indices is None or indices.shape not in ((1,), (1, 1)):
            return None
        if shapes.get(update) not in (tuple(shape[1:]), (1, *shape[1:])):
            return None
        position = int(indices.reshape(-1)[0]) % shape[0]
        if position in by_index:
            return None
        by_index[position] = update
    if sorted(by_index) != list(range(shape[0])):
        return None
    return [by_index[position] for position in range(shape[0])]
