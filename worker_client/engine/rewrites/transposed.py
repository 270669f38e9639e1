"""Rewrite of the forward graph, before differentiation: transposed convolutions whose weight trains, as Convs.

onnx-ad differentiates a ConvTranspose with respect to its input only ("not differentiated
with respect to its weight"), so a decoder, an autoencoder or a GAN generator exported from
torch's `ConvTranspose2d` could not train. A transposed convolution is a convolution of its
input with its kernel's two channel axes swapped and its spatial axes reversed: with stride 1
one Conv (`conv.flip_unit_stride_transposed_convs`), with stride s one Conv per output phase,
interleaved (`conv.split_strided_transposed_convs`); the passes that make onnx-ad's own
adjoints fast, here applied to the model's ConvTransposes whose weight is not a constant.
The kernel is swapped and reversed in the graph (a Transpose and Slices with negative steps,
which `indexing.unstep_slices` then writes as Gathers), so the weight's gradient flows back
through ops onnx-ad differentiates; a bias becomes an Add after the Conv.

A grouped one (up to MAX_GROUPS groups) is first split into one ConvTranspose per group on
its slices of the input's channels and of the weight, concatenated. Matches the conditions of
those two passes and static shapes; a ConvTranspose they do not match (strided and dilated;
strided with a kernel smaller than its stride; more than MAX_GROUPS groups) is left as it is,
and onnx-ad refuses its weight, naming the node.
"""

from __future__ import annotations

import onnx
from onnx import helper

from worker_client.engine.rewrites.conv import flip_unit_stride_transposed_convs, split_strided_transposed_convs
from worker_client.engine.rewrites.toolkit import Emitter, constants, opset_of, rebuild, static_shapes

__all__ = ["convolve_trained_transposed_convs"]

#: Input index of the ConvTranspose's optional bias.
_BIAS = 2
#: The opset from which Split takes its sizes as an input (the spelling written here).
_SPLIT_AS_INPUT = 13
#: The most groups a grouped ConvTranspose is split into (one set of Convs each).
MAX_GROUPS = 64


def convolve_trained_transposed_convs(model: onnx.ModelProto) -> int:
    """Rewrite every ConvTranspose whose weight is not a constant as Convs, in place (module docstring).
    Returns the number rewritten."""
    fixed = constants(model)
    trained = {node.output[0] for node in model.graph.node
               if node.op_type == "ConvTranspose" and node.input[1] not in fixed}
    if not trained:
        return 0
    _split_biases(model, trained)
    _split_groups(model, trained)

    def only(node: onnx.NodeProto) -> bool:
        return node.output[0] in trained

    # the strided pass first: the unit-stride one would not take a strided node anyway
    return split_strided_transposed_convs(model, only) + flip_unit_stride_transposed_convs(model, only)


def _split_groups(model: onnx.ModelProto, outputs: set[str]) -> None:
    """Each of these (bias-free) ConvTransposes with group G > 1 (up to MAX_GROUPS): G ConvTransposes of group 1
    on the input's and the weight's G channel slices, concatenated (their outputs join `outputs`)."""
    if opset_of(model) < _SPLIT_AS_INPUT:
        return
    shapes = static_shapes(model)
    emit = Emitter(model, "transposed_group")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        group = next((a.i for a in node.attribute if a.name == "group"), 1) if node.op_type == "ConvTranspose" \
            else 1
        x, w = (shapes.get(node.input[0]), shapes.get(node.input[1])) if group > 1 else (None, None)
        if group == 1 or group > MAX_GROUPS or node.output[0] not in outputs or x is None or w is None or \
                x[1] % group or w[0] != x[1]:
            return None
        pieces, kernels = [emit.name() for _ in range(group)], [emit.name() for _ in range(group)]
        parts = [emit.name() for _ in range(group)]
        nodes = [helper.make_node("Split", [node.input[0], emit.ints([x[1] // group] * group)], pieces,
                                  name=emit.name(), axis=1),
                 helper.make_node("Split", [node.input[1], emit.ints([w[0] // group] * group)], kernels,
                                  name=emit.name(), axis=0)]
        kept = [a for a in node.attribute if a.name != "group"]
        for piece, kernel, part in zip(pieces, kernels, parts):
            one = helper.make_node("ConvTranspose", [piece, kernel], [part], name=part)
            one.attribute.extend(kept)
            nodes.append(one)
            outputs.add(part)
        nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=node.name or emit.name(), axis=1))
        outputs.discard(node.output[0])
        return nodes

    rebuild(model, emit, replace)


def _split_biases(model: onnx.ModelProto, outputs: set[str]) -> None:
    """Each of these ConvTransposes with a bias: the bias added after it instead (its output is renamed in `outputs`
    to the unbiased one)."""
    shapes = static_shapes(model)
    emit = Emitter(model, "transposed_bias")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        weight = shapes.get(node.input[1]) if node.op_type == "ConvTranspose" else None
        if node.op_type != "ConvTranspose" or node.output[0] not in outputs or len(node.input) <= _BIAS or \
                not node.input[_BIAS] or weight is None:
            return None
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        result, unbiased = node.output[0], emit.name()
        plain = onnx.NodeProto()
        plain.CopyFrom(node)
        del plain.input[_BIAS:]
        plain.output[0] = unbiased
        bias, bias_name = emit.reshape(node.input[_BIAS], [1, weight[1] * group] + [1] * (len(weight) - 2))
        outputs.discard(result)
        outputs.add(unbiased)
        return [plain, bias, helper.make_node("Add", [unbiased, bias_name], [result], name=emit.name())]

    rebuild(model, emit, replace)
