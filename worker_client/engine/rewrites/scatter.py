"""Gather and Slice adjoints that rebuild a whole tensor from its pieces, as one Concat."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, constants, reader_counts, static_shapes

__all__ = ["concat_padded_pieces", "concat_piecewise_scatters"]


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


def concat_padded_pieces(model: onnx.ModelProto) -> int:
    """Rewrite a Sum of zero-padded pieces that tile one axis as one Concat of the pieces, in place.

    onnx-ad's adjoint of a Slice pads the slice's gradient with zeros back to the whole tensor, and the
    adjoints of slices that take a tensor apart are summed: an LSTM's gates, cut from its stacked weights,
    biases and input projection, come back as four (eight for the biases) Pads of the whole
    [4H, ...] tensor and a Sum over them -- 56 Pads in ps_bench.zoo_models' 2-layer LSTM, the largest
    four of [40, 32, 512] a step. Where every input of a Sum (or Add) is such a Pad (constant mode, zero
    value), read by nothing else, all padding one axis, and the pieces cover that axis exactly once, the
    sum is the pieces side by side in order: one Concat. Exact: each element of the sum is one piece's
    element plus zeros. Returns the number rewritten.
    """
    shapes = static_shapes(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    values = constants(model)
    readers = reader_counts(model.graph)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for node in model.graph.node:
        if node.op_type not in ("Sum", "Add") or len(node.input) < 2 or node.output[0] not in shapes:
            continue
        full = shapes[node.output[0]]
        pieces = [_padded_piece(name, full, producers, values, readers, shapes) for name in node.input]
        if any(piece is None for piece in pieces):
            continue
        axes = {axis for axis, _, _, _ in pieces}       # type: ignore[misc]
        if len(axes) != 1:
            continue
        axis = axes.pop()
        ordered = sorted(pieces, key=lambda piece: piece[1])   # type: ignore[index,return-value]
        edge = 0
        for _, begin, size, _ in ordered:                # type: ignore[misc]
            if begin != edge:                            # a gap or an overlap: not a tiling
                break
            edge += size
        if edge != full[axis]:
            continue
        replaced[id(node)] = helper.make_node("Concat", [piece[3].input[0] for piece in ordered],  # type: ignore[index]
                                              list(node.output), name=node.name or node.output[0], axis=axis)
        dropped.update(id(piece[3]) for piece in pieces)  # type: ignore[index]
    if not replaced:
        return 0
    nodes = [replaced.get(id(node), node) for node in model.graph.node if id(node) not in dropped]
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    return len(replaced)


def _padded_piece(name: str, full: tuple[int, ...], producers: dict[str, onnx.NodeProto],
                  values: dict[str, np.ndarray], readers, shapes: dict[str, tuple[int, ...]]
                  ) -> tuple[int, int, int, onnx.NodeProto] | None:
    """(the padded axis, where the piece begins on it, its size there, the Pad) for `name`, a zero Pad of a
    piece along one axis to the shape `full`, read only once; else None."""
    pad = producers.get(name)
    if pad is None or pad.op_type != "Pad" or readers[name] != 1 or pad.input[0] not in shapes:
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in pad.attribute}
    mode = attributes.get("mode", b"constant")
    if mode not in (b"constant", "constant") or len(pad.input) < 2 or pad.input[1] not in values \
            or (len(pad.input) > 3 and pad.input[3]):      # explicit axes (opset 18): not worth reading
        return None
    if len(pad.input) > 2 and pad.input[2] and (pad.input[2] not in values or np.any(values[pad.input[2]])):
        return None
    piece = shapes[pad.input[0]]
    amounts = [int(v) for v in values[pad.input[1]].reshape(-1)]
    rank = len(piece)
    if len(amounts) != 2 * rank or len(full) != rank or any(v < 0 for v in amounts):
        return None
    padded = [axis for axis in range(rank) if amounts[axis] or amounts[axis + rank]]
    if len(padded) != 1 or any(piece[axis] != full[axis] for axis in range(rank) if axis != padded[0]):
        return None
    axis = padded[0]
    if amounts[axis] + piece[axis] + amounts[axis + rank] != full[axis]:
        return None
    return axis, amounts[axis], piece[axis], pad
