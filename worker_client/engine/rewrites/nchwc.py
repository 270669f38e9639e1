"""Convolutions on onnxruntime's channel-blocked (NCHWc) CPU kernels, for weights that are fed every step.

onnxruntime's CPU build has direct convolution kernels over a channel-blocked layout (the
`com.microsoft.nchwc` ops; blocks of 16 channels with AVX-512, 8 with AVX2) that run a 3 x 3
convolution 1.3-1.5 times as fast as its im2col + GEMM Conv on 16 x 16 and larger feature maps.
Its optimizer moves a Conv onto them only when the weight is a constant initializer, since it
reorders the filter once, at load. A gradient graph feeds every weight as an input, so none of
its Convs got there. Here each Conv that gains is rewritten to the blocked ops itself, with the
filter reordered in the graph (each step: ReorderInput blocks its input channels, a Transpose of three
axes its output channels; a depthwise filter is one ReorderInput) and the activations reordered in
and out around it, since the training-mode BatchNorm arithmetic around
each Conv reads them in NCHW.

The rewrite is applied when a CPU session is opened, never to the cached gradient graph: the
layout depends on the CPU (`nchwc_block_size` asks onnxruntime which block it uses here), and a
CUDA session has no such kernels.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.toolkit import Emitter, constants, shapes_and_types

__all__ = ["MIN_BATCH_POSITIONS", "MIN_POSITIONS", "MIN_SMALL_POSITIONS", "NCHWC_DOMAIN", "SMALL_FILTER_BYTES",
           "block_convs", "blocked_shape", "nchwc_block_size", "small_map_gains"]

log = logging.getLogger(__name__)

#: onnxruntime's domain of the channel-blocked ops.
NCHWC_DOMAIN = "com.microsoft.nchwc"
#: Output positions (height x width) from which a blocked Conv is faster, weight reorder included. One thread,
#: batch 32, 3 x 3 kernels (median ms, im2col against blocked): 32 x 32 x 64 19.9 / 13.1, 16 x 16 x 128
#: 17.1 / 13.1, 8 x 8 x 256 14.4 / 14.7, 4 x 4 x 512 17.9 / 26.3; a 1 x 1 kernel (a strided projection)
#: 1.1 / 1.8, so kernels of one tap keep the plain Conv too.
MIN_POSITIONS = 16 * 16
#: Below MIN_POSITIONS a Conv gains as well where its filter's reorder, which every step pays and which scales
#: with the filter alone, is small against the products, which scale with the batch's output positions too:
#: from maps of MIN_SMALL_POSITIONS positions (2 x 2) on, a filter of at most SMALL_FILTER_BYTES and at least
#: MIN_BATCH_POSITIONS output positions over the batch. The figures above predate the filter's reorder without
#: six-axis Transposes (2026-11-29); with it, one thread, AVX-512 (block 16), median ms plain / blocked with every
#: reorder, [N, C, H, H] by [M, C, k, k], N 32 unless said: 32 -> 64, k 4, stride 2, 16 -> 8: 1.87 / 1.32 (N 4:
#: 0.24 / 0.18); 64 -> 128, k 3, stride 2, 16 -> 8: 3.43 / 2.94; 128 -> 128, 8 x 8: 6.66 / 5.28 (N 4: 0.82 /
#: 0.68); 16 -> 16, 8 x 8: 0.24 / 0.11. Larger filters win less, or lose: 128 -> 256 (1.2 MB), stride 2, 16 -> 8
#: (a ResNet-18's): 12.6 / 12.8; 256 -> 512 (4.7 MB), stride 2, 8 -> 4: 12.0 / 12.5; 512 -> 512 (9.4 MB), 4 x 4:
#: 23.6 / 22.0, N 16 12.1 / 16.4; 256 -> 512, k 4, 4 -> 1 x 1: 4.48 / 4.99.
MIN_SMALL_POSITIONS = 2 * 2
SMALL_FILTER_BYTES = 1 << 20
MIN_BATCH_POSITIONS = 256
#: The filter's order in the blocked layout: [O/B, B, I/B, B, kh, kw] -> [O/B, I/B, kh, kw, B (in), B (out)].
_FILTER_ORDER = [0, 2, 4, 5, 3, 1]
_BIAS = 2
#: onnxruntime's ReorderInput takes channels in multiples of 4, padding them to the block with zeros.
_INPUT_CHANNEL_STEP = 4
#: The most multiply-adds a Conv padded to whole blocks may do, against its own: 32 -> 12 channels at 32 x 32
#: (16 computed, 4/3 the work) took 1.81 ms where the plain Conv took 2.65; 12 -> 32, 1.41 against 1.53.
_MAX_PADDED_WORK = 4 / 3


def _blocked_filter(weight: np.ndarray, block: int) -> np.ndarray:
    out, inp, kh, kw = weight.shape
    return weight.reshape(out // block, block, inp // block, block, kh, kw).transpose(_FILTER_ORDER).reshape(weight.shape)


@functools.cache
def nchwc_block_size() -> int:
    """The channel block of onnxruntime's NCHWc kernels on this CPU, 0 when this build or CPU has none.

    Asked of onnxruntime itself: its optimizer blocks a Conv with a constant filter, and the filter it
    writes says the block (the layout is MLAS's OIHWBiBo reorder)."""
    channels = 32
    weight = np.random.default_rng(0).standard_normal((channels, channels, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, channels, 4, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    try:
        with tempfile.TemporaryDirectory(prefix="onnx-ps-nchwc-") as scratch:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.log_severity_level = 3   # its warning that an optimized model is hardware-specific
            options.optimized_model_filepath = str(Path(scratch) / "probe.onnx")
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
    except Exception as exc:  # onnxruntime's own error types; no blocked kernels is the safe answer
        log.info("onnxruntime's NCHWc probe failed (%s): convolutions keep onnxruntime's own kernels", exc)
        return 0
    blocked = [n for n in optimized.graph.node if n.domain == NCHWC_DOMAIN and n.op_type == "Conv"]
    if not blocked:
        return 0
    written = constants(optimized).get(blocked[0].input[1])
    for block in (16, 8, 4):
        if written is not None and np.array_equal(written, _blocked_filter(weight, block)):
            return block
    log.info("onnxruntime's NCHWc filter layout is not one this engine knows: convolutions keep its own kernels")
    return 0


def block_convs(model: onnx.ModelProto, block: int) -> int:
    """Rewrite in place each Conv that runs faster on the blocked kernels of `block` channels; returns the count.

    Matches 2-D Convs with static shapes whose filter is not a constant (onnxruntime blocks those itself)
    and whose kernel has more than one tap: ungrouped ones whose output has at least MIN_POSITIONS positions
    (or fewer, where `small_map_gains` says the filter's reorder is cheap enough)
    and whose input channels are a multiple of 4 -- channels that are not a multiple of `block` are padded
    to it with zero filters (the activation's by ReorderInput, the output cut back by ReorderOutput), where
    that adds at most a third to the work (_MAX_PADDED_WORK) --, and depthwise ones (one filter per
    channel) whose channels are a multiple of `block`, at any size -- on [32, C, H, H] at one thread the
    blocked depthwise kernel took 1.05 / 1.19 / 0.59 / 0.32 ms where the plain Conv took 3.97 / 5.76 /
    4.96 / 5.31 (C, H = 32, 32 / 128, 16 / 256, 8 / 512, 4). A 1-D Conv is the same Conv over a map of
    height 1, with the same conditions: on [32, C, L] (C -> M channels, kernel k) 4.5 -> 3.8 ms (16 -> 32,
    L 2,000, k 5), 6.5 -> 4.4 (32 -> 16), 5.8 -> 3.9 (64 -> 64, L 1,000, stride 2), 7.1 -> 6.4 (128 -> 128,
    L 256).
    """
    if block <= 0 or not any(n.op_type == "Conv" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return 0
    shapes, types = shapes_and_types(model)
    # the blocked kernels are float32's alone: a float64 or float16 Conv keeps its op
    shapes = {name: shape for name, shape in shapes.items() if types.get(name) == onnx.TensorProto.FLOAT}
    fixed = {t.name for t in model.graph.initializer}
    emit = Emitter(model, "nchwc")
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        replacement = _blocked(node, shapes, fixed, block, emit)
        nodes.extend(replacement or [node])
        count += replacement is not None
    if count:
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(emit.initializers)
        if not any(o.domain == NCHWC_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(NCHWC_DOMAIN, 1))
    return count


def _padded(channels: int, block: int) -> int:
    """`channels` rounded up to whole blocks."""
    return -(-channels // block) * block


def blocked_shape(inputs: int, outputs: int, positions: int, block: int) -> bool:
    """Whether an ungrouped Conv of `inputs` to `outputs` channels over `positions` output positions (and a kernel
    of more than one tap) gains on the blocked kernels with channel blocks of `block` (`block_convs`): input
    channels in ReorderInput's steps of 4, at least MIN_POSITIONS positions, and channels padded to whole
    blocks adding at most a third to the work."""
    return positions >= MIN_POSITIONS and _channels_fit(inputs, outputs, block)


def _channels_fit(inputs: int, outputs: int, block: int) -> bool:
    """Input channels in ReorderInput's steps of 4, and channels padded to whole blocks adding at most a third to
    the work."""
    return inputs % _INPUT_CHANNEL_STEP == 0 and \
        _padded(outputs, block) * _padded(inputs, block) <= _MAX_PADDED_WORK * outputs * inputs


def small_map_gains(inputs: int, outputs: int, positions: int, batch: int, filter_bytes: int, block: int) -> bool:
    """Whether an ungrouped Conv over a map of fewer than MIN_POSITIONS output `positions` gains on the blocked
    kernels all the same, its filter of `filter_bytes` reordered every step: `blocked_shape`'s channels, at least
    MIN_SMALL_POSITIONS positions, a filter of at most SMALL_FILTER_BYTES and `batch` x `positions` at least
    MIN_BATCH_POSITIONS."""
    return positions >= MIN_SMALL_POSITIONS and filter_bytes <= SMALL_FILTER_BYTES and \
        batch * positions >= MIN_BATCH_POSITIONS and _channels_fit(inputs, outputs, block)


def _blocked(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]], fixed: set[str], block: int,
             emit: Emitter) -> list[onnx.NodeProto] | None:
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or node.input[1] in fixed:
        return None
    x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1], node.output[0]))
    if x is None or w is None or y is None or not len(x) == len(w) == len(y) in (3, 4):
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    line = len(x) == 3   # a 1-D Conv runs as a 2-D one of height 1
    if line:
        x, w, y = (*x[:2], 1, x[2]), (*w[:2], 1, w[2]), (*y[:2], 1, y[2])
        attributes = _as_two_dimensional(attributes)
    out, inp, kh, kw = w
    group = attributes.get("group", 1)
    depthwise = group > 1 and inp == 1 and out == group == x[1]
    if (group != 1 and not depthwise) or attributes.get("auto_pad", b"NOTSET") != b"NOTSET" or kh * kw < 2:
        return None
    if depthwise and out % block:
        return None
    # channels padded up to whole blocks with zero filters (ReorderInput pads the activation's, in fours)
    out_p, inp_p = (_padded(out, block), inp if depthwise else _padded(inp, block))
    positions, filter_bytes = y[2] * y[3], out * inp * kh * kw * 4   # float32 alone reaches here (block_convs)
    if not depthwise and (x[1] != inp or not (blocked_shape(inp, out, positions, block) or small_map_gains(
            inp, out, positions, y[0], filter_bytes, block))):
        return None
    unblocked, filter_, blocked_x, blocked_y = emit.name(), emit.name(), emit.name(), emit.name()
    ordered = emit.name()
    weight, bias = node.input[1], node.input[_BIAS] if len(node.input) > _BIAS and node.input[_BIAS] else None
    nodes = []
    if (out_p, inp_p) != (out, inp):
        weight, padded_bias = emit.name(), emit.name()
        nodes.append(helper.make_node("Pad", [node.input[1], emit.ints([0, 0, 0, 0, out_p - out, inp_p - inp, 0, 0])],
                                      [weight], name=weight))
        if bias is not None:
            nodes.append(helper.make_node("Pad", [bias, emit.ints([0, out_p - out])], [padded_bias], name=padded_bias))
            bias = padded_bias
    back, _ = emit.reshape(ordered, [out_p, inp_p, kh, kw], out=filter_)
    if depthwise:
        # [C/B, B, kh * kw] -> [C/B, kh * kw, B] (MLAS's OIHWBo with one input channel) is the blocked layout of
        # the filters as one image of C channels, which ReorderInput writes: a depthwise weight adjoint's filter
        # (the output adjoint, [32 * 128, 1, 16, 16]) took 0.086 ms where the Transpose took 0.107 at one thread,
        # 0.049 against 0.37 at two (onnxruntime's Transpose of [256, 16, 256] slows down on two threads)
        as_image, _ = emit.reshape(weight, [1, out, kh, kw], out=unblocked)
        nodes += [as_image, helper.make_node("ReorderInput", [unblocked], [ordered], name=ordered, domain=NCHWC_DOMAIN,
                                           channels_last=0), back]
    else:
        # [O/B, B, I/B, B, kh, kw] -> [O/B, I/B, kh, kw, B (in), B (out)] in two moves: ReorderInput blocks each
        # filter's input channels ([O, I/B, kh, kw, B], the filters as O images), then one Transpose brings each
        # block of filters innermost; onnxruntime's 6-axis Transpose went element by element: [128, 128, 3, 3]
        # took 0.35 ms that way and 0.050 this one at one thread (0.34 and 0.043 at two), [256, 256, 3, 3] 1.56
        # and 0.21
        as_images, _ = emit.reshape(weight, [out_p, inp_p, kh, kw], out=unblocked)
        filters, rows = emit.name(), emit.name()
        nodes += [as_images,
                  helper.make_node("ReorderInput", [unblocked], [filters], name=filters, domain=NCHWC_DOMAIN, channels_last=0),
                  emit.reshape(filters, [out_p // block, block, inp_p * kh * kw], out=rows)[0],
                  helper.make_node("Transpose", [rows], [ordered], name=ordered, perm=[0, 2, 1]), back]
    kept = {name: value for name, value in attributes.items() if name in ("pads", "strides", "dilations", "kernel_shape")}
    inputs = [blocked_x, filter_] + ([bias] if bias is not None else [])
    source, result = node.input[0], node.output[0]
    if line:
        lifted, source = emit.reshape(source, list(x))
        result = emit.name()
        nodes.append(lifted)
    nodes += [
        helper.make_node("ReorderInput", [source], [blocked_x], name=blocked_x, domain=NCHWC_DOMAIN, channels_last=0),
        helper.make_node("Conv", inputs, [blocked_y], name=blocked_y, domain=NCHWC_DOMAIN, group=group, **kept),
        helper.make_node("ReorderOutput", [blocked_y], [result], name=node.name or result,
                         domain=NCHWC_DOMAIN, channels=out, channels_last=0),
    ]
    if line:
        nodes.append(helper.make_node("Reshape", [result, emit.ints([y[0], y[1], y[3]])], [node.output[0]],
                                      name=emit.name()))
    return nodes


def _as_two_dimensional(attributes: dict) -> dict:
    """A 1-D Conv's attributes for the same Conv over a map of height 1."""
    lifted = dict(attributes)
    for name, fill in (("strides", 1), ("dilations", 1), ("kernel_shape", 1)):
        if name in attributes:
            lifted[name] = [fill, *attributes[name]]
    if "pads" in attributes:
        begin, end = attributes["pads"]
        lifted["pads"] = [0, begin, 0, end]
    return lifted
