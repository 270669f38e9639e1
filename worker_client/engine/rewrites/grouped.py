"""Grouped and depthwise convolutions, and strided transposed ones, whose weight trains: onnx-ad has no
weight adjoint for them.

A Conv with group > 1 (depthwise and grouped convolutions: MobileNet, ResNeXt) keeps its own
kernel in the forward graph; the engine writes the weight adjoint itself, and onnx-ad the rest.
So does a strided 2-D ConvTranspose (a decoder's or a GAN generator's upsampling): written as
phase Convs for onnx-ad (transposed.py), its weight's gradient came through a Pad, windows, GEMMs
and Transposes per phase; here it is one GEMM of the input by the output adjoint's windows
(`_transposed_weight_adjoint`).

1. `detach_grouped_weights`, on the forward graph before differentiation: the Conv reads its
   weight from a stand-in graph input (DETACHED_PREFIX + weight) that is not differentiated, and
   its output gains a probe: y = Conv(...) + P, P a graph input (PROBE_PREFIX + y) that is
   differentiated. onnx-ad then writes the input's adjoint (a grouped ConvTranspose) and the
   bias's, and the probe's gradient is the Conv output's adjoint dY.
2. `attach_grouped_weight_adjoints`, on the differentiated graph: the stand-ins and probes
   removed (the Conv reads its weight again, the Add is gone), and the weight's gradient written
   from x and dY: with G groups of C/G input and M/G output channels, for each kernel offset k,
   dW[g, m, c, k] = sum over images n and output positions p of dY[n, g, m, p] * X[n, g, c, p*s + k*d]
   (X padded): one batched MatMul per offset over the window the offset reads, [G, M/G, N*P] times
   [G, N*P, C/G]. These are the grouped Conv's own multiply-adds; the input is transposed once to
   [G, C/G, N, ...] and each window is one strided Slice of it.

On a MobileNet-style model (depthwise 3 x 3 over 128 channels at 16 x 16, batch 32, one thread)
the gradient step took 275 ms when the grouped Convs were written out as batched MatMuls over
stacked windows (`expand_grouped_convs`, below): onnx-ad's adjoints of those Slices and Concats
are a Pad per window and a Sum of them. That rewrite remains for a grouped Conv whose weight is
computed in the graph rather than fed (a weight-normalized one): a stand-in input cannot replace
a computed value. Output channel m of group g = m // (M/G) sums input channels
g*C/G ... (g+1)*C/G - 1 over the kernel window, exactly the Conv's definition:

1. the input padded (Pad) and, for each of the K kernel offsets, the strided window the
   offset reads (Slice): K tensors [N, C, *out];
2. stacked into columns [N, C, K, *out] and regrouped as [G, C/G * K, N * P] (P output
   positions per image);
3. one MatMul per group, batched: weight [G, M/G, C/G * K] @ columns -> [G, M/G, N * P];
4. back to [N, M, *out], plus the bias.

Convs with a constant weight keep their kernel and are left alone: only the input's adjoint is
needed there, which onnx-ad writes itself.
"""

from __future__ import annotations

import itertools
import math

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import (SAME_DATA_OPS, Emitter, auto_pads, constants, drop_values,
                                                   opset_of, rebuild, static_shapes)

__all__ = ["DETACHED_PREFIX", "PROBE_PREFIX", "attach_grouped_weight_adjoints", "detach_grouped_weights",
           "expand_grouped_convs", "probe_inputs"]

#: Name prefix of the stand-in input a detached grouped Conv reads its weight from.
DETACHED_PREFIX = "grouped_conv_weight__"
#: Name prefix of the zero probe added to a detached grouped Conv's output (its gradient is dY).
PROBE_PREFIX = "grouped_conv_probe__"

#: Input index of the Conv's optional bias.
_BIAS = 2
#: The opset from which Pad takes its pads as an input (the spelling written here).
_PAD_AS_INPUT = 11
#: The channel blocks of onnxruntime's blocked kernels divide this (16 with AVX-512, 8 with AVX2): a
#: depthwise weight adjoint over N x C planes is written as a Conv only where they divide N x C.
_BLOCKED_CHANNELS = 16
#: The opset from which ReduceSum takes its axes as an input.
_REDUCE_AXES_AS_INPUT = 13


def detach_grouped_weights(model: onnx.ModelProto) -> int:
    """Each grouped Conv with static shapes whose weight is a graph input, and each strided ConvTranspose
    `_transposed_geometry` takes: the weight read from a stand-in input, a probe input added to the output
    (module docstring, step 1); in place. Returns the number detached. Undone by
    `attach_grouped_weight_adjoints` once the graph is differentiated."""
    if opset_of(model) < _PAD_AS_INPUT:
        return 0
    graph = model.graph
    inputs = {value.name: value for value in graph.input}
    initialized = {tensor.name for tensor in graph.initializer}
    shapes = static_shapes(model)
    emit = Emitter(model, "grouped_conv")
    stand_ins: dict[str, onnx.ValueInfoProto] = {}
    probes: list[onnx.ValueInfoProto] = []

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if len(node.input) < 2 or node.domain not in ("", "ai.onnx"):
            return None
        weight, result = node.input[1], node.output[0]
        if weight not in inputs or weight in initialized or \
                any(shapes.get(name) is None for name in (node.input[0], weight, result)):
            return None
        if not ((node.op_type == "Conv" and group > 1) or (node.op_type == "ConvTranspose" and _transposed_geometry(
                node, shapes[node.input[0]], shapes[weight], shapes[result]) is not None)):
            return None
        element = inputs[weight].type.tensor_type.elem_type
        stand_in = DETACHED_PREFIX + weight
        stand_ins.setdefault(stand_in, helper.make_tensor_value_info(stand_in, element, list(shapes[weight])))
        probe, raw = PROBE_PREFIX + result, emit.name()
        probes.append(helper.make_tensor_value_info(probe, element, list(shapes[result])))
        conv = onnx.NodeProto()
        conv.CopyFrom(node)
        conv.input[1] = stand_in
        conv.output[0] = raw
        return [conv, helper.make_node("Add", [raw, probe], [result], name=emit.name())]

    detached = rebuild(model, emit, replace)
    graph.input.extend(list(stand_ins.values()) + probes)
    return detached


def probe_inputs(model: onnx.ModelProto) -> list[str]:
    """The probe inputs `detach_grouped_weights` added: differentiated beside the parameters."""
    return [value.name for value in model.graph.input if value.name.startswith(PROBE_PREFIX)]


def attach_grouped_weight_adjoints(model: onnx.ModelProto, prefix: str) -> int:
    """The differentiated graph of a model `detach_grouped_weights` rewrote, put back and completed, in place
    (module docstring, step 2): every stand-in input read as its weight again, every probe and its Add
    dropped, and the gradient output `prefix` + weight of each detached weight written from the Conv's input
    and the probe's gradient (summed with onnx-ad's, where the weight is also read elsewhere). Returns the
    number of Convs whose weight adjoint was written."""
    graph = model.graph
    probes = {value.name for value in graph.input if value.name.startswith(PROBE_PREFIX)}
    if not probes:
        return 0
    shapes = static_shapes(model)
    emit = Emitter(model, "grouped_weight_adjoint")
    outputs = {value.name: value for value in graph.output}
    producers = {out: node for node in graph.node for out in node.output}
    # the probes' Adds, by probe: y = Add(raw Conv output, probe)
    adds = {node.input[1]: node for node in graph.node if node.op_type == "Add" and node.input[1] in probes}
    contributions: dict[str, list[str]] = {}
    tail: list[onnx.NodeProto] = []
    for probe, add in adds.items():
        conv = producers[add.input[0]]
        weight = conv.input[1][len(DETACHED_PREFIX):]
        if prefix + weight not in outputs:
            continue   # not trained (a frozen weight fed as an input): no adjoint asked for
        seeded = prefix + probe
        written = _transposed_weight_adjoint if conv.op_type == "ConvTranspose" else _weight_adjoint
        nodes, adjoint = written(conv, shapes[conv.input[0]], shapes[conv.input[1]], shapes[add.output[0]], seeded,
                                 opset_of(model), emit)
        seed_axis, adjoint = emit.reshape(adjoint, [*shapes[conv.input[1]], 1])   # as onnx-ad's gradients are
        tail += [*nodes, seed_axis]
        contributions.setdefault(weight, []).append(adjoint)
    # the Convs write their outputs again and read their weights; readers of a probe read the output instead
    renamed = {add.input[0]: add.output[0] for add in adds.values()}
    renamed.update({probe: add.output[0] for probe, add in adds.items()})
    stand_ins = {value.name for value in graph.input if value.name.startswith(DETACHED_PREFIX)}
    renamed.update({name: name[len(DETACHED_PREFIX):] for name in stand_ins})
    dropped = {id(add) for add in adds.values()}
    kept = [node for node in graph.node if id(node) not in dropped]
    for node in kept:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]
        for index, name in enumerate(node.output):
            if name in renamed and name not in probes:
                node.output[index] = renamed[name]
    for weight, terms in contributions.items():
        gradient = prefix + weight
        declared = list(shapes.get(gradient) or [*shapes[DETACHED_PREFIX + weight], 1])
        ad_term = emit.name()   # onnx-ad's gradient, renamed: the output is written below
        for node in kept:
            node.output[:] = [ad_term if name == gradient else name for name in node.output]
        if not _zeros(gradient, producers):   # the weight is read elsewhere too: onnx-ad's gradient is a term
            terms = [*terms, ad_term]         # (where it is zeros, its nodes are left to prune)
        total = terms[0]
        for term in terms[1:]:
            summed = emit.name()
            tail.append(helper.make_node("Add", [total, term], [summed], name=summed))
            total = summed
        tail.append(emit.reshape(total, declared, out=gradient)[0])
    graph.ClearField("node")
    graph.node.extend(kept + tail)
    graph.initializer.extend(emit.initializers)
    drop_values(graph, probes | stand_ins | {prefix + probe for probe in probes}, renamed)
    return sum(len(terms) for terms in contributions.values())


def _zeros(name: str, producers: dict[str, onnx.NodeProto]) -> bool:
    """Whether `name` is onnx-ad's gradient of an input nothing differentiated reads: a ConstantOfShape (of
    zeros) passed on through Identity, Reshape and the like."""
    node = producers.get(name)
    while node is not None and node.op_type in SAME_DATA_OPS:
        node = producers.get(node.input[0])
    return node is not None and node.op_type == "ConstantOfShape"


def _geometry(conv: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...]
              ) -> tuple[int, list[int], list[int], list[int], list[int], list[int]]:
    """A Conv's (spatial rank, kernel, output size, strides, dilations, explicit pads; auto_pad resolved)."""
    attributes = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    spatial = len(x) - 2
    kernel, out = list(w[2:]), list(y[2:])
    strides = list(attributes.get("strides", [1] * spatial))
    dilations = list(attributes.get("dilations", [1] * spatial))
    pads = list(attributes.get("pads", [0] * (2 * spatial)))
    if attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
        pads = auto_pads(attributes["auto_pad"], x[2:], kernel, strides, dilations, out)
    return spatial, kernel, out, strides, dilations, pads


def _padded(source: str, pads: list[int], emit: Emitter) -> tuple[list[onnx.NodeProto], str]:
    """`source` [N, C, *spatial] zero-padded by a Conv's `pads` (begins, then ends): the nodes (none where every
    pad is 0) and the padded value's name."""
    if not any(pads):
        return [], source
    spatial = len(pads) // 2
    padded = emit.name()
    return [helper.make_node("Pad", [source, emit.ints([0, 0] + pads[:spatial] + [0, 0] + pads[spatial:])], [padded],
                             name=padded)], padded


def _reduce(value: str, out: str, axis: int, keepdims: int, opset: int, emit: Emitter) -> onnx.NodeProto:
    """A ReduceSum of `value` over `axis`, in the spelling of `opset`."""
    if opset < _REDUCE_AXES_AS_INPUT:
        return helper.make_node("ReduceSum", [value], [out], name=out, axes=[axis], keepdims=keepdims)
    return helper.make_node("ReduceSum", [value, emit.ints([axis])], [out], name=out, keepdims=keepdims)


def _depthwise_weight_adjoint(source: str, pads: list[int], seeded: str, batch: int, channels: int,
                              size: list[int], kernel: list[int], out: list[int], strides: list[int],
                              dilations: list[int], opset: int, emit: Emitter) -> tuple[list[onnx.NodeProto], str]:
    """A depthwise Conv's weight gradient [C, 1, *kernel] as one depthwise correlation: each of the N * C
    input planes (of `size`, padded by the Conv's `pads` -- in the correlation itself, which pads as it reads:
    a Pad before it was a pass over the activation, 0.57 ms on [32, 128, 16, 16]) correlated with its own
    plane of the output adjoint (the filter), strided by the Conv's dilations and dilated by its strides, then
    summed over the images. onnxruntime's blocked depthwise kernel runs it (rewrites/nchwc.py): 2.2 ms on
    [32, 128, 16, 16] at one thread, where the window-by-window products took 10.4 and the same Conv on the
    plain kernel 20."""
    spatial = len(size)
    padded_size = [n + pads[i] + pads[spatial + i] for i, n in enumerate(size)]
    planes, planes_name = emit.reshape(source, [1, batch * channels, *size])
    filters, filters_name = emit.reshape(seeded, [batch * channels, 1, *out])
    correlated, summed = emit.name(), emit.name()
    reach = [(extent - stride * (n - 1) - 1) // dilation + 1
             for extent, n, stride, dilation in zip(padded_size, out, strides, dilations)]
    nodes = [planes, filters,
             helper.make_node("Conv", [planes_name, filters_name], [correlated], name=correlated,
                              group=batch * channels, strides=dilations, dilations=strides, pads=pads)]
    if reach != kernel:   # the padded input reaches past the last kernel offset: crop
        cropped = emit.name()
        nodes.append(helper.make_node("Slice", [correlated, emit.ints([0, 0]), emit.ints(kernel),
                                                emit.ints([2, 3])], [cropped], name=cropped))
        correlated = cropped
    split, split_name = emit.reshape(correlated, [batch, channels, math.prod(kernel)])
    shaped, result = emit.reshape(summed, [channels, 1, *kernel])
    nodes += [split, _reduce(split_name, summed, 0, 0, opset, emit), shaped]
    return nodes, result


def _weight_adjoint(conv: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...],
                    seeded: str, opset: int, emit: Emitter) -> tuple[list[onnx.NodeProto], str]:
    """The nodes computing a grouped Conv's weight gradient [M, C/G, *kernel] from its input and `seeded`, the
    output's adjoint (with onnx-ad's seed axis); and the name of the result (module docstring, step 2)."""
    group = next(a.i for a in conv.attribute if a.name == "group")
    spatial, kernel, out, strides, dilations, pads = _geometry(conv, x, w, y)
    batch, channels, filters = x[0], x[1], w[0]
    per_group_in, per_group_out = channels // group, filters // group
    positions = math.prod(out)
    padded_size = [n + pads[i] + pads[spatial + i] for i, n in enumerate(x[2:])]
    if per_group_in == per_group_out == 1 and spatial == 2 and batch * channels % _BLOCKED_CHANNELS == 0:
        return _depthwise_weight_adjoint(conv.input[0], pads, seeded, batch, channels, list(x[2:]), kernel, out,
                                         strides, dilations, opset, emit)
    nodes, source = _padded(conv.input[0], pads, emit)
    # the input as [G, C/G, N, *padded], once; the adjoint as [G, M/G, N * P]
    by_group, grouped_name = emit.reshape(source, [batch, group, per_group_in, *padded_size])
    inputs_first, adjoint_first = emit.name(), emit.name()
    split, split_name = emit.reshape(seeded, [batch, group, per_group_out, positions])
    flat, flat_name = emit.reshape(adjoint_first, [group, per_group_out, batch * positions])
    nodes += [by_group,
              helper.make_node("Transpose", [grouped_name], [inputs_first], name=inputs_first,
                               perm=[1, 2, 0, *range(3, 3 + spatial)]),
              split,
              helper.make_node("Transpose", [split_name], [adjoint_first], name=adjoint_first, perm=[1, 2, 0, 3]),
              flat]
    axes = emit.ints(list(range(3, 3 + spatial)))
    steps = emit.ints(strides)
    columns = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        starts = [o * d for o, d in zip(offset, dilations)]
        ends = [s + (n - 1) * stride + 1 for s, n, stride in zip(starts, out, strides)]
        window, across, product = (emit.name() for _ in range(3))
        rows, rows_name = emit.reshape(window, [group, per_group_in, batch * positions])
        stand, column = emit.reshape(product, [group, per_group_out, per_group_in, 1])
        nodes += [helper.make_node("Slice", [inputs_first, emit.ints(starts), emit.ints(ends), axes, steps],
                                   [window], name=window),
                  rows]
        if min(per_group_in, per_group_out) == 1:
            # a depthwise Conv's (or one with a single filter per group): the products are dot products, and
            # a MatMul with one output column ran at a quarter of the speed of the elementwise product and
            # its row sums (2.1 ms against 0.5 for 128 channels of 32 x 16 x 16)
            nodes += [helper.make_node("Mul", [flat_name, rows_name], [across], name=across),
                      _reduce(across, product, 2, 1, opset, emit)]
        else:
            nodes += [helper.make_node("Transpose", [rows_name], [across], name=across, perm=[0, 2, 1]),
                      helper.make_node("MatMul", [flat_name, across], [product], name=product)]
        nodes.append(stand)
        columns.append(column)
    stacked = emit.name()
    nodes.append(helper.make_node("Concat", columns, [stacked], name=stacked, axis=3))
    shaped, result = emit.reshape(stacked, [filters, per_group_in, *kernel])
    nodes.append(shaped)
    return nodes, result


def _transposed_geometry(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...]
                         ) -> tuple[int, list[int], list[int]] | None:
    """(stride, begin pads, end pads of the output adjoint) of a ConvTranspose whose weight adjoint
    `_transposed_weight_adjoint` writes: 2-D, ungrouped, one stride above 1 on both axes, no dilation, no
    auto_pad or output_shape, a kernel of at least the stride; the end pads make the padded adjoint cover
    every window and divide by the stride. None for any other."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    strides = list(attributes.get("strides", [1, 1]))
    pads = list(attributes.get("pads", [0, 0, 0, 0]))
    if len(x) != 4 or len(w) != 4 or len(y) != 4 or attributes.get("group", 1) != 1 or len(strides) != 2 or \
            strides[0] != strides[1] or strides[0] < 2 or list(attributes.get("dilations", [1, 1])) != [1, 1] or \
            attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or "output_shape" in attributes or \
            len(pads) != 4 or min(pads) < 0 or min(w[2:]) < strides[0] or x[1] != w[0] or y[1] != w[1]:
        return None
    stride = strides[0]
    ends = []
    for axis in range(2):
        reach = stride * (x[2 + axis] - 1) + w[2 + axis]          # the rows the windows span, front pad included
        whole = -(-reach // stride) * stride
        ends.append(whole - y[2 + axis] - pads[axis])
    if min(ends) < 0:        # output padding past the end pad: the windows would need the adjoint cropped
        return None
    return stride, pads[:2], ends


def _transposed_weight_adjoint(conv: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...],
                               seeded: str, opset: int, emit: Emitter) -> tuple[list[onnx.NodeProto], str]:
    """A strided ConvTranspose's weight gradient [C, O, kh, kw] from its input x [N, C, H, W] and `seeded`, the
    output's adjoint dY [N, O, Hy, Wy] (with onnx-ad's seed axis):

        dW[c, o, a, b] = sum over n, i, j of x[n, c, i, j] * dY[n, o, s * i + a - pad, s * j + b - pad]

    -- for each kernel tap (a, b) the window of dY at stride s that the tap wrote, [N, O, H, W]. dY is moved
    to [O, N, Hy, Wy], zero-padded, and split into its s x s phase planes by one SpaceToDepth, from which each
    window is a unit-step Slice (onnxruntime's stepped Slice copies element by element); the windows side by
    side are the columns of one GEMM with x as [C, N * H * W]. onnx-ad has no weight adjoint for a
    ConvTranspose; its phase Convs (transposed.py) got one through windows, Pads and Transposes per phase:
    a step of [32, 128, 4, 4] by [128, 64, 4, 4] at stride 2 took 5.25 ms so, 2.54 this way (one thread)."""
    stride, begins, ends = _transposed_geometry(conv, x, w, y)
    batch, channels, height, width = x
    outputs, kernel = w[1], list(w[2:])
    taps = math.prod(kernel)
    moved, phases, columns, flat, product, split, swapped = (emit.name() for _ in range(7))
    adjoint, adjoint_name = emit.reshape(seeded, [batch, outputs, *y[2:]])
    padding, padded = _padded(moved, [*begins, *ends], emit)
    nodes = [adjoint, helper.make_node("Transpose", [adjoint_name], [moved], name=moved, perm=[1, 0, 2, 3]),
             *padding]
    nodes.append(helper.make_node("SpaceToDepth", [padded], [phases], name=phases, blocksize=stride))
    axes = emit.ints([1, 2, 3])
    windows = []
    for a, b in itertools.product(range(kernel[0]), range(kernel[1])):
        phase = (a % stride) * stride + b % stride      # SpaceToDepth's channel blocks: row phase, then column
        window = emit.name()
        nodes.append(helper.make_node(
            "Slice", [phases, emit.ints([phase * batch, a // stride, b // stride]),
                      emit.ints([(phase + 1) * batch, a // stride + height, b // stride + width]), axes],
            [window], name=window))
        windows.append(window)
    inputs_first, inputs_name = emit.name(), emit.name()
    nodes += [helper.make_node("Concat", windows, [columns], name=columns, axis=0),       # [taps * O, N, H, W]
              emit.reshape(columns, [taps * outputs, batch * height * width], out=flat)[0],
              helper.make_node("Transpose", [conv.input[0]], [inputs_first], name=inputs_first, perm=[1, 0, 2, 3]),
              emit.reshape(inputs_first, [channels, batch * height * width], out=inputs_name)[0],
              helper.make_node("Gemm", [inputs_name, flat], [product], name=product, transB=1),   # [C, taps * O]
              emit.reshape(product, [channels, taps, outputs], out=split)[0],
              helper.make_node("Transpose", [split], [swapped], name=swapped, perm=[0, 2, 1])]
    shaped, result = emit.reshape(swapped, [channels, outputs, *kernel])
    nodes.append(shaped)
    return nodes, result


def expand_grouped_convs(model: onnx.ModelProto) -> int:
    """Rewrite every grouped Conv with a weight that is neither constant nor a detached stand-in, and static
    shapes, in place (module docstring). Returns the number rewritten."""
    if opset_of(model) < _PAD_AS_INPUT:
        return 0
    shapes = static_shapes(model)
    fixed = constants(model)
    emit = Emitter(model, "grouped_conv")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if node.op_type != "Conv" or group == 1 or node.input[1] in fixed or \
                node.input[1].startswith(DETACHED_PREFIX):
            return None
        x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1], node.output[0]))
        if x is None or w is None or y is None:
            return None
        return _as_matmul(node, group, x, w, y, emit)

    return rebuild(model, emit, replace)


def _as_matmul(node: onnx.NodeProto, group: int, x: tuple[int, ...], w: tuple[int, ...],
               y: tuple[int, ...], emit: Emitter) -> list[onnx.NodeProto]:
    spatial, kernel, out, strides, dilations, pads = _geometry(node, x, w, y)
    batch, channels, filters = x[0], x[1], w[0]
    per_group_in, per_group_out = channels // group, filters // group
    offsets, positions = math.prod(kernel), math.prod(out)
    nodes, source = _padded(node.input[0], pads, emit)
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
