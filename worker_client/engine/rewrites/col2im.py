"""DepthToSpace as Col2Im on the CPU.

onnxruntime's CPU DepthToSpace moves its elements one by one through a 6-D transpose: 0.55 ms for a
[32, 64, 16, 16] -> [32, 16, 32, 32] interleave at one thread, in the step of every model with a
PixelShuffle, a strided ConvTranspose (which the engine computes as phase Convs interleaved this way,
rewrites/conv.py) or a strided Conv's input adjoint (the same). The same permutation is a Col2Im (opset
18) whose blocks do not overlap -- block s x s at stride s, C * s * s columns per position -- which
onnxruntime runs as a scatter of contiguous rows: 0.07 ms on the same tensor. CRD's channel order is
Col2Im's (channel, then block row, then block column); DCR's (block first) is brought there by a
Transpose of whole [H * W] planes first.

Exact: every output element is one input element (added to zero). The rewrite is applied to a CPU
session's copy of a graph when it is opened, as the channel-blocked Convs are (rewrites/nchwc.py): the
cached gradient graph keeps DepthToSpace, which every execution provider has, and is only differentiated
in that form.
"""

from __future__ import annotations

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, opset_of, rebuild, shapes_and_types

__all__ = ["depth_to_space_as_col2im"]

#: The first opset with Col2Im.
COL2IM_OPSET = 18


def depth_to_space_as_col2im(model: onnx.ModelProto) -> int:
    """Rewrite each DepthToSpace of static 4-D shape as Col2Im (module docstring), in place; nothing below
    opset 18. Returns the number rewritten."""
    if opset_of(model) < COL2IM_OPSET:
        return 0
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, "col2im")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "DepthToSpace" or node.domain not in ("", "ai.onnx"):
            return None
        source, result = shapes.get(node.input[0]), shapes.get(node.output[0])
        if source is None or result is None or len(source) != 4 or types.get(node.input[0]) != onnx.TensorProto.FLOAT:
            return None     # onnxruntime's CPU Col2Im is float32 only
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        block = int(attributes["blocksize"])
        mode = attributes.get("mode", b"DCR")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        batch, depth, height, width = source
        channels = depth // (block * block)
        nodes: list[onnx.NodeProto] = []
        if mode == "CRD":
            reshape, columns = emit.reshape(node.input[0], [batch, depth, height * width])
            nodes.append(reshape)
        else:   # DCR: [N, s*s, C, H*W] -> [N, C, s*s, H*W], whole planes moved
            reshape, planes = emit.reshape(node.input[0], [batch, block * block, channels, height * width])
            moved = emit.name()
            reshape_back, columns = emit.reshape(moved, [batch, depth, height * width])
            nodes += [reshape, helper.make_node("Transpose", [planes], [moved], name=moved, perm=[0, 2, 1, 3]),
                      reshape_back]
        nodes.append(helper.make_node(
            "Col2Im", [columns, emit.ints([height * block, width * block]), emit.ints([block, block])],
            list(node.output), name=node.name or node.output[0], strides=[block, block]))
        return nodes

    return rebuild(model, emit, replace)
