"""Rewrite of the forward graph, before differentiation: transposed convolutions whose weight trains, as Convs.

(A strided 2-D one whose weight is a graph input is detached before this pass and keeps its op:
grouped.py writes its weight adjoint. What is left here: unit strides, a computed weight, groups,
unequal strides, dilations.)

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

import base64
import json

import onnx
from onnx import helper

from worker_client.engine.rewrites.col2im import small_map_transposed_conv
from worker_client.engine.rewrites.conv import (
    flip_unit_stride_transposed_convs,
    phases_gain,
    split_strided_transposed_convs,
)
from worker_client.engine.rewrites.grouped import DETACHED_PREFIX
from worker_client.engine.rewrites.toolkit import Emitter, constants, opset_of, rebuild, static_shapes

__all__ = ["RESTORED_KEY", "convolve_trained_transposed_convs", "restore_transposed_convs"]

#: The model metadata key under which the ConvTransposes to restore after differentiation travel.
RESTORED_KEY = "onnx_ps.transposed_convs_to_restore"

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
    trained = {node.output[0] for node in model.graph.node if node.op_type == "ConvTranspose" and
               node.input[1] not in fixed and not node.input[1].startswith(DETACHED_PREFIX)}
    if not trained:
        return 0
    _split_biases(model, trained)
    _split_groups(model, trained)

    def only(node: onnx.NodeProto) -> bool:
        return node.output[0] in trained

    gain, small = phases_gain(model), small_map_transposed_conv(model)
    slower = []
    for node in model.graph.node:
        if node.op_type == "ConvTranspose" and only(node) and (small(node) or not gain(node)):
            slower.append(onnx.NodeProto())
            slower[-1].CopyFrom(node)
    # the strided pass first: the unit-stride one would not take a strided node anyway
    rewritten = split_strided_transposed_convs(model, only)
    producers = {node.output[0]: node.op_type for node in model.graph.node if node.output}
    # those the split took, for onnx-ad: their own op computes the forward value again after differentiation
    _record(model, [node for node in slower if producers.get(node.output[0], "ConvTranspose") != "ConvTranspose"])
    return rewritten + flip_unit_stride_transposed_convs(model, only)


def _record(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    """`nodes` written into the model's metadata (onnx-ad keeps it), for `restore_transposed_convs`."""
    if nodes:
        entry = next((p for p in model.metadata_props if p.key == RESTORED_KEY), None)
        if entry is None:
            entry = model.metadata_props.add()
            entry.key = RESTORED_KEY
        listed = json.loads(entry.value) if entry.value else []
        entry.value = json.dumps(listed + [base64.b64encode(node.SerializeToString()).decode() for node in nodes])


def restore_transposed_convs(model: onnx.ModelProto) -> int:
    """After differentiation: each trained ConvTranspose that `convolve_trained_transposed_convs` split into phase
    Convs only so that onnx-ad could differentiate its weight, and whose phases do not gain (`conv.phases_gain`:
    maps below 16 x 16, few output channels; or a map a CPU session computes as a GEMM and a Col2Im,
    `col2im.small_map_transposed_conv`), computes its forward value as the ConvTranspose again, in place;
    returns the number restored. The adjoint reads the input, the weight and the phases' kernels, never the
    phases' outputs, so those go with the next prune. A decoder's last layer to 3 channels, [32, 32, 16, 16] by
    [32, 3, 4, 4] at stride 2: 1.22 ms as phases, 0.27 as the ConvTranspose, at one thread."""
    entry = next((p for p in model.metadata_props if p.key == RESTORED_KEY), None)
    if entry is None:
        return 0
    nodes = []
    for encoded in json.loads(entry.value):
        node = onnx.NodeProto()
        node.ParseFromString(base64.b64decode(encoded))
        nodes.append(node)
    kept = [p for p in model.metadata_props if p.key != RESTORED_KEY]
    model.ClearField("metadata_props")
    model.metadata_props.extend(kept)
    graph = model.graph
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer} | \
        {name for node in graph.node for name in node.output}
    by_output = {node.output[0]: node for node in nodes if all(name in defined for name in node.input if name)}
    restored = 0

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        nonlocal restored
        original = by_output.get(node.output[0]) if len(node.output) == 1 else None
        if original is None:
            return None
        restored += 1
        return [original]

    rebuild(model, Emitter(model, "restored"), replace)
    return restored


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
