"""Rewrite of the forward graph, before differentiation: grouped convolutions as a batched MatMul.

onnx-ad has no weight adjoint for a Conv with group > 1 (depthwise and grouped
convolutions: MobileNet, ResNeXt). Such a Conv whose weight trains is written out as what
it computes, in ops every one of which onnx-ad differentiates:

1. the input padded (Pad) and, for each of the K kernel offsets, the strided window the
   offset reads (Slice): K tensors [N, C, *out];
2. stacked into columns [N, C, K, *out] and regrouped as [G, C/G * K, N * P] (P output
   positions per image);
3. one MatMul per group, batched: weight [G, M/G, C/G * K] @ columns -> [G, M/G, N * P];
4. back to [N, M, *out], plus the bias.

Output channel m of group g = m // (M/G) sums input channels g*C/G ... (g+1)*C/G - 1 over
the kernel window, exactly the Conv's definition; the multiply-adds are the grouped Conv's
own, the columns cost K copies of the input. Convs with a constant weight keep their fast
kernel: only the input's adjoint is needed there, which onnx-ad writes itself.
"""

from __future__ import annotations

import itertools
import math

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, auto_pads, constants, opset_of, rebuild, static_shapes

__all__ = ["expand_grouped_convs"]

#: Input index of the Conv's optional bias.
_BIAS = 2
#: The opset from which Pad takes its pads as an input (the spelling written here).
_PAD_AS_INPUT = 11


def expand_grouped_convs(model: onnx.ModelProto) -> int:
    """Rewrite every grouped Conv with a non-constant weight and static shapes, in place
    (module docstring). Returns the number rewritten."""
    if opset_of(model) < _PAD_AS_INPUT:
        return 0
    shapes = static_shapes(model)
    fixed = constants(model)
    emit = Emitter(model, "grouped_conv")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if node.op_type != "Conv" or group == 1 or node.input[1] in fixed:
            return None
        x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1], node.output[0]))
        if x is None or w is None or y is None:
            return None
        return _as_matmul(node, group, x, w, y, emit)

    return rebuild(model, emit, replace)


def _as_matmul(node: onnx.NodeProto, group: int, x: tuple[int, ...], w: tuple[int, ...],
               y: tuple[int, ...], emit: Emitter) -> list[onnx.NodeProto]:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    spatial = len(x) - 2
    kernel, out = list(w[2:]), list(y[2:])
    strides = list(attributes.get("strides", [1] * spatial))
    dilations = list(attributes.get("dilations", [1] * spatial))
    pads = list(attributes.get("pads", [0] * (2 * spatial)))
    if attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
        pads = auto_pads(attributes["auto_pad"], x[2:], kernel, strides, dilations, out)
    batch, channels, filters = x[0], x[1], w[0]
    per_group_in, per_group_out = channels // group, filters // group
    offsets, positions = math.prod(kernel), math.prod(out)
    nodes: list[onnx.NodeProto] = []
    source = node.input[0]
    if any(pads):
        padded = emit.name()
        nodes.append(helper.make_node(
            "Pad", [source, emit.ints([0, 0] + pads[:spatial] + [0, 0] + pads[spatial:])],
            [padded], name=padded))
        source = padded
    axes = list(range(2, 2 + spatial))
    windows = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        starts = [o * d for o, d in zip(offset, dilations)]
        ends = [s + (n - 1) * stride + 1 for s, n, stride in zip(starts, out, strides)]
        window, column = emit.name(), emit.name()
        nodes += [helper.make_node("Slice", [source, emit.ints(starts), emit.ints(ends),
                                             emit.ints(axes), emit.ints(strides)],
                                   [window], name=window),
                  helper.make_node("Unsqueeze", [window, emit.ints([2])], [column],
                                   name=column)]
        windows.append(column)
    stacked, by_group, regrouped, product, per_image = (emit.name() for _ in range(5))
    nodes.append(helper.make_node("Concat", windows, [stacked], name=stacked, axis=2))
    grouped, grouped_name = emit.reshape(
        stacked, [batch, group, per_group_in * offsets, positions])
    columns, columns_name = emit.reshape(
        regrouped, [group, per_group_in * offsets, batch * positions])
    weights, weights_name = emit.reshape(node.input[1],
                                         [group, per_group_out, per_group_in * offsets])
    split, split_name = emit.reshape(product, [group, per_group_out, batch, positions])
    result = node.output[0]
    has_bias = len(node.input) > _BIAS and bool(node.input[_BIAS])
    unbiased = emit.name() if has_bias else result
    nodes += [grouped,
              helper.make_node("Transpose", [grouped_name], [regrouped], name=regrouped,
                               perm=[1, 2, 0, 3]),
              columns, weights,
              helper.make_node("MatMul", [weights_name, columns_name], [product],
                               name=node.name or product),
              split,
              helper.make_node("Transpose", [split_name], [per_image], name=per_image,
                               perm=[2, 0, 1, 3]),
              emit.reshape(per_image, [batch, filters] + out, out=unbiased)[0]]
    if has_bias:
        bias, bias_name = emit.reshape(node.input[_BIAS], [1, filters] + [1] * spatial)
        nodes += [bias, helper.make_node("Add", [unbiased, bias_name], [result],
                                         name=emit.name())]
    return nodes
