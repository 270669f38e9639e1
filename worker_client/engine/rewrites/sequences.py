"""A SplitToSequence read only at constant positions, as the Split it stands for.

torch.onnx's dynamo exporter with optimize=False writes `torch.chunk` and `torch.split` as a
SplitToSequence whose pieces SequenceAt then reads, one constant position each. onnx-ad
differentiates no sequence op, so such a model was refused. The same pieces come from one
Split (with the piece sizes the SplitToSequence implies, and a Squeeze per piece when it splits
into single slices without keeping the axis): exact, and differentiated as Split. Needs the
split axis's length static and every position a constant; other sequences are left alone.
"""

from __future__ import annotations

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, attribute, constants, opset_of, rebuild, static_shapes
from worker_client.engine.selection import consumers

__all__ = ["split_constant_sequences"]

#: Rounds of the rewrite: a piece that is split again has a static length only once the first split is a Split.
_ROUNDS = 8


def split_constant_sequences(model: onnx.ModelProto) -> int:
    """Each SplitToSequence read only by SequenceAt at constant positions, as a Split (in place); returns how many."""
    total = 0
    for _ in range(_ROUNDS):
        done = _split_once(model)
        total += done
        if not done:
            break
    return total


def _split_once(model: onnx.ModelProto) -> int:
    graph = model.graph
    if not any(node.op_type == "SplitToSequence" for node in graph.node):
        return 0
    shapes, values = static_shapes(model), constants(model)
    uses = consumers(graph)
    outputs = {value.name for value in graph.output}
    sizes_as_input = opset_of(model) >= 13   # Split's sizes and Squeeze's axes: inputs from opset 13, attributes before
    emit = Emitter(model, "sequence_split")
    plans: dict[int, list[onnx.NodeProto]] = {}
    splits = 0
    for node in graph.node:
        if node.op_type != "SplitToSequence" or node.output[0] in outputs:
            continue
        users = uses.get(node.output[0], [])
        sizes = _piece_sizes(node, shapes, values)
        if not users or sizes is None or any(u.op_type != "SequenceAt" or index != 0 or values.get(u.input[1]) is None
                                             or values[u.input[1]].size != 1 for u, index in users):
            continue
        positions = [int(values[u.input[1]].reshape(-1)[0]) for u, _ in users]
        if any(not -len(sizes) <= p < len(sizes) for p in positions):
            continue   # onnxruntime's error to give, unchanged
        axis = attribute(node, "axis", 0) % len(shapes[node.input[0]])
        pieces = [emit.name() for _ in sizes]
        split_inputs, split_attributes = [node.input[0]], {"axis": axis}
        if sizes_as_input:
            split_inputs.append(emit.ints(sizes))
        else:
            split_attributes["split"] = sizes
        plans[id(node)] = [helper.make_node("Split", split_inputs, pieces, name=node.name or emit.name(),
                                            **split_attributes)]
        splits += 1
        squeeze = (len(node.input) < 2 or not node.input[1]) and not attribute(node, "keepdims", 1)
        for (user, _), position in zip(users, positions):
            piece, name = pieces[position], user.name or emit.name()
            if squeeze and sizes_as_input:
                plans[id(user)] = [helper.make_node("Squeeze", [piece, emit.ints([axis])], [user.output[0]], name=name)]
            elif squeeze:
                plans[id(user)] = [helper.make_node("Squeeze", [piece], [user.output[0]], axes=[axis], name=name)]
            else:
                plans[id(user)] = [helper.make_node("Identity", [piece], [user.output[0]], name=name)]
    rebuild(model, emit, lambda node: plans.get(id(node)))
    return splits


def _piece_sizes(node: onnx.NodeProto, shapes, values) -> list[int] | None:
    """The pieces' lengths along the axis, from the input's static length and the `split` input; None when either
    is unknown or they disagree."""
    shape = shapes.get(node.input[0])
    if not shape:
        return None
    length = shape[attribute(node, "axis", 0) % len(shape)]
    if len(node.input) < 2 or not node.input[1]:
        return [1] * length
    split = values.get(node.input[1])
    if split is None or split.ndim > 1:
        return None
    if split.ndim == 0:   # pieces of this length, the last one shorter
        step = int(split)
        if step < 1:
            return None
        return [step] * (length // step) + ([length % step] if length % step else [])
    sizes = [int(s) for s in split]
    return sizes if sum(sizes) == length and all(s >= 0 for s in sizes) else None
