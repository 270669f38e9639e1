"""Col2Im on the CPU: DepthToSpace, and transposed convolutions over small maps.

onnxruntime's CPU DepthToSpace moves its elements one by one through a 6-D transpose: 0.55 ms for a
[32, 64, 16, 16] -> [32, 16, 32, 32] interleave at one thread, in the step of every model with a
PixelShuffle, a strided ConvTranspose (which the engine computes as phase Convs interleaved this way,
rewrites/conv.py) or a strided Conv's input adjoint (the same). The same permutation is a Col2Im (opset
18) whose blocks do not overlap -- block s x s at stride s, C * s * s columns per position -- which
onnxruntime runs as a scatter of contiguous rows: 0.07 ms on the same tensor. CRD's channel order is
Col2Im's (channel, then block row, then block column); DCR's (block first) is brought there by a
Transpose of whole [H * W] planes first. Exact: every output element is one input element (added to zero).

A unit-stride ConvTranspose -- a Conv's input adjoint -- is elsewhere a Conv with the kernel's channel
axes swapped and its taps reversed (`conv.flip_unit_stride_transposed_convs`). Over maps of at most
SMALL_MAP_POSITIONS input positions (a CIFAR ResNet's last stage: 4 x 4) that Conv runs as one im2col and
a GEMM of only that many columns per image, and the swap and reversal of its [512, 512, 3, 3] kernel,
each step, cost another 3.4 ms. There the ConvTranspose is, by its definition, one GEMM of all the
images' positions by the kernel as it is -- [N * h * w, O] @ [O, C * kh * kw] -- its columns moved to
[N, C * kh * kw, h * w] and folded back by one Col2Im: [32, 512, 4, 4] by [512, 512, 3, 3] 14.5 -> 11.9
ms at one thread ([32, 256, 8, 8], 64 positions: 11.3 -> 14.7, so not there). A kernel of one tap keeps
the flip: it has nothing to reverse, and its Conv costs no more. A strided one over such a map -- a
downsampling Conv's input adjoint, a decoder's trained upsampling, which keeps its op (grouped.py,
transposed.py) -- is the same GEMM and a Col2Im at that stride (output padding the rows no block reaches),
where onnxruntime's ConvTranspose makes one GEMM of 16 columns per image and the phase Convs one per phase:
[32, 512, 4, 4] by [512, 256, 3, 3] at stride 2, 12.2 ms as a ConvTranspose, 12.9 as phases, 6.5 so (two
threads 7.0, 13.2, 4.5); [32, 128, 4, 4] by [128, 64, 4, 4], 1.65, 1.59, 0.83. Equal to float32 rounding
(the same products, summed in another order).

Both rewrites are applied to a CPU session's copy of a graph when it is opened, as the channel-blocked
Convs are (rewrites/nchwc.py): the cached gradient graph keeps DepthToSpace, which every execution
provider has, and the small ConvTransposes (`conv.flip_unit_stride_transposed_convs` leaves the ones
`small_map_transposed_conv` picks), which a CUDA session runs as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, opset_of, rebuild, shapes_and_types

__all__ = ["SMALL_MAP_POSITIONS", "depth_to_space_as_col2im", "small_map_transposed_conv",
           "small_transposed_convs_as_col2im"]

#: The first opset with Col2Im.
COL2IM_OPSET = 18
#: A ConvTranspose over at most this many input positions (h x w) runs as a GEMM and a Col2Im.
SMALL_MAP_POSITIONS = 16
#: Input index of the ConvTranspose's optional bias.
_BIAS = 2


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


def small_map_transposed_conv(model: onnx.ModelProto) -> Callable[[onnx.NodeProto], bool]:
    """Which of the model's ConvTransposes a CPU session computes as a GEMM and a Col2Im (module docstring):
    2-D, float32 (a bias too, added after the Col2Im), ungrouped, unit dilations, any strides with output padding
    below them, no auto_pad, no
    output_shape, each pad below the kernel, a kernel of more than one tap, static shapes, at most
    SMALL_MAP_POSITIONS input positions; none below opset 18."""
    if opset_of(model) < COL2IM_OPSET or not any(n.op_type == "ConvTranspose" for n in model.graph.node):
        return lambda node: False
    return _picker(*shapes_and_types(model))


def _picker(shapes: dict[str, tuple[int, ...]], types: dict[str, int]) -> Callable[[onnx.NodeProto], bool]:
    def small(node: onnx.NodeProto) -> bool:
        if node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx"):
            return False
        if len(node.input) > _BIAS and node.input[_BIAS] and types.get(node.input[_BIAS]) != onnx.TensorProto.FLOAT:
            return False
        x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1], node.output[0]))
        if x is None or w is None or y is None or len(x) != 4 or len(w) != 4 or len(y) != 4 or \
                any(types.get(name) != onnx.TensorProto.FLOAT for name in node.input[:2]):
            return False
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pads = list(attributes.get("pads", [0] * 4))
        strides = list(attributes.get("strides", [1, 1]))
        extra = list(attributes.get("output_padding", [0, 0]))
        if attributes.get("group", 1) != 1 or len(strides) != 2 or min(strides) < 1 or len(extra) != 2 or \
                any(not 0 <= e < s for e, s in zip(extra, strides)) or \
                list(attributes.get("dilations", [1, 1])) != [1, 1] or \
                attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or "output_shape" in attributes or \
                len(pads) != 4 or any(p < 0 or p >= k for p, k in zip(pads, [*w[2:], *w[2:]])):
            return False
        expected = [x[0], w[1], *((size - 1) * s + k - pads[axis] - pads[axis + 2] + e
                                  for axis, (size, k, s, e) in enumerate(zip(x[2:], w[2:], strides, extra)))]
        # a kernel of one tap has nothing to reverse: its Conv (a GEMM per image) costs no more
        return x[1] == w[0] and list(y) == expected and math.prod(x[2:]) <= SMALL_MAP_POSITIONS and \
            math.prod(w[2:]) > 1

    return small


def small_transposed_convs_as_col2im(model: onnx.ModelProto) -> int:
    """Rewrite each ConvTranspose `small_map_transposed_conv` picks as a GEMM of all the images' positions by
    the kernel and a Col2Im (module docstring), in place. Returns the number rewritten."""
    if opset_of(model) < COL2IM_OPSET or not any(n.op_type == "ConvTranspose" for n in model.graph.node):
        return 0
    shapes, types = shapes_and_types(model)
    small = _picker(shapes, types)
    emit = Emitter(model, "small_convt")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if not small(node):
            return None
        (batch, inputs, height, width), (_, outputs, kh, kw) = shapes[node.input[0]], shapes[node.input[1]]
        positions, columns = height * width, outputs * kh * kw
        pads = next((list(a.ints) for a in node.attribute if a.name == "pads"), [0] * 4)
        strides = next((list(a.ints) for a in node.attribute if a.name == "strides"), [1, 1])
        flat, flat_name = emit.reshape(node.input[0], [batch, inputs, positions])
        rows, moved_rows, kernel = emit.name(), emit.name(), emit.name()
        product, folded, columns_first = emit.name(), emit.name(), emit.name()
        return [flat,
                helper.make_node("Transpose", [flat_name], [rows], name=rows, perm=[0, 2, 1]),   # [N, hw, O]
                emit.reshape(rows, [batch * positions, inputs], out=moved_rows)[0],
                emit.reshape(node.input[1], [inputs, columns], out=kernel)[0],
                helper.make_node("MatMul", [moved_rows, kernel], [product], name=product),    # [N * hw, C * k]
                emit.reshape(product, [batch, positions, columns], out=folded)[0],
                helper.make_node("Transpose", [folded], [columns_first], name=columns_first, perm=[0, 2, 1]),
                *_col2im_and_bias(node, columns_first, list(shapes[node.output[0]][2:]), [kh, kw], outputs, pads,
                                  strides, emit)]

    return rebuild(model, emit, replace)


def _col2im_and_bias(node: onnx.NodeProto, columns: str, size: list[int], kernel: list[int], channels: int,
                     pads: list[int], strides: list[int], emit: Emitter) -> list[onnx.NodeProto]:
    """The Col2Im of `columns` into the ConvTranspose's output, and its bias added per channel where it has one (a
    trained decoder's or generator's upsampling: [32, 128, 4, 4] by [128, 64, 4, 4] at stride 2 with a bias
    1.81 ms as a ConvTranspose, the GEMM, the Col2Im and the Add less than half)."""
    bias = node.input[_BIAS] if len(node.input) > _BIAS else ""
    name = node.name or node.output[0]
    if not bias:
        return [helper.make_node("Col2Im", [columns, emit.ints(size), emit.ints(kernel)], list(node.output),
                                 name=name, pads=pads, strides=strides)]
    folded = emit.name()
    col2im = helper.make_node("Col2Im", [columns, emit.ints(size), emit.ints(kernel)], [folded], name=folded,
                              pads=pads, strides=strides)
    per_channel, shaped = emit.reshape(bias, [1, channels, 1, 1])
    return [col2im, per_channel, helper.make_node("Add", [folded, shaped], [node.output[0]], name=name)]
