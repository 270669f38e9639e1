"""3-D Convs as 2-D Convs over the depth taps stacked as channels (on the forward graph of a CPU target).

onnxruntime's CPU Conv runs a 3-D convolution as an im2col of every kernel tap (27 copies of the input for a
3 x 3 x 3 kernel) and one GEMM per image, and has no channel-blocked (NCHWc) kernels for it; onnx-ad's adjoints
of it are a 3-D ConvTranspose (a GEMM and a 3-D Col2Im) and a 3-D weight correlation, no faster. A Conv over
[N, C, D, H, W] by [M, C, kd, kh, kw] is the same sum as a 2-D Conv over the N x D' output slices, each the kd
input slices it reads side by side as kd x C channels:

    x  -> Transpose [N, D, C, H, W] -> Pad the depth -> kd Slices of D' slices (tap t from t * dilation, at the
          depth stride) -> Concat on the channels [N, D', kd x C, H, W] -> Reshape [N x D', kd x C, H, W]
    w  -> Transpose [M, kd, C, kh, kw] -> Reshape [M, kd x C, kh, kw]
    y  =  Conv2d (the height's and width's pads, strides and dilations; the bias) -> Reshape [N, D', M, H', W']
          -> Transpose [N, M, D', H', W']

The 2-D Conv and its adjoints then take the paths every 2-D Conv takes (channel-blocked kernels, the weight
adjoint's GEMMs, the input adjoint as a flipped Conv), and the copies it adds -- the Transposes, the Concat of
kd slices instead of the im2col's kd x kh x kw -- are small against the products. It is exact: the same
products summed in another order, equal to float32 rounding.

Measured on the AVX-512 machine of docs/benchmarks.md, one thread, batch 32, 3 x 3 x 3 kernels, forward
Conv alone, plain / stacked ms: 16 -> 32 channels over 8^3 7.98 / 5.59, 32 -> 32 over 8^3 15.75 / 10.10, 32 ->
32 over 16^3 110 / 97, 8 -> 16 over 8^3 4.32 / 2.06; and with few input channels it loses, the stacked
channels too few for the blocked kernels: 1 -> 16 over 16^3 2.49 / 4.26, 4 -> 16 9.35 / 12.73. So a Conv
needs MIN_CHANNELS input channels and filters (a last layer's one filter kept its 50 ms Conv and gained
copies). A kernel of one tap across the plane (an R(2+1)D's (3, 1, 1) temporal Conv) would be a 1 x 1 planar
Conv, which the blocked kernels leave alone: the Transposes for nothing (that network's step lost 8% with
them). Whole steps, old / new, the same graph with and without, interleaved, one thread: the zoo conv3d (batch
32) 62.9 / 55.7 ms, unet3d 254 / 220; a C3D-style net over 8 x 32 x 32 clips (batch 8) 134 / 114, an
R(2+1)D-style one 162 / 148. cuDNN has 3-D kernels of its own: a CUDA target keeps its Convs.
"""

from __future__ import annotations

import onnx

from worker_client.engine.rewrites.toolkit import Emitter, Writer, attribute, rebuild, shapes_and_types

__all__ = ["MIN_CHANNELS", "planar_volume_convs"]

#: The fewest input channels a 3-D Conv needs to gain (module docstring).
MIN_CHANNELS = 8
#: [N, C, D, H, W] <-> [N, D, C, H, W]; the filter's [M, C, kd, kh, kw] -> [M, kd, C, kh, kw] likewise.
_DEPTH_FIRST = [0, 2, 1, 3, 4]


def planar_volume_convs(model: onnx.ModelProto) -> int:
    """Each float 3-D Conv of one group and static shapes, with at least MIN_CHANNELS input channels and filters and
    a kernel of more than one tap across the plane, replaced by its 2-D form (module docstring), in place; returns
    how many."""
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, "volume")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
            return None
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        y = shapes.get(node.output[0])
        if types.get(node.input[0]) != onnx.TensorProto.FLOAT or not _matches(node, x, w, y):
            return None
        assert x is not None and w is not None and y is not None
        return _planar(node, x, w, y, emit)

    return rebuild(model, emit, replace)


def _matches(node: onnx.NodeProto, x: tuple[int, ...] | None, w: tuple[int, ...] | None,
             y: tuple[int, ...] | None) -> bool:
    if x is None or w is None or y is None or len(x) != 5 or len(w) != 5 or len(y) != 5:
        return False
    if attribute(node, "group", 1) != 1 or w[1] != x[1] or min(x[1], w[0]) < MIN_CHANNELS:
        return False
    if w[3] * w[4] == 1:   # a 1 x 1 planar Conv: no blocked kernel for it (`nchwc`), the Transposes for nothing
        return False
    # explicit pads only (`conv.explicit_auto_pads` writes them first), and every pad within the kernel's reach
    return attribute(node, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET") and len(_pads(node)) == 6


def _pads(node: onnx.NodeProto) -> list[int]:
    return list(attribute(node, "pads", [0] * 6))


def _planar(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...],
            emit: Emitter) -> list[onnx.NodeProto]:
    batch, channels = x[0], x[1]
    filters, taps = w[0], w[2]
    depth_out = y[2]
    front, top, left, back, bottom, right = _pads(node)
    stride = list(attribute(node, "strides", [1, 1, 1]))
    dilation = list(attribute(node, "dilations", [1, 1, 1]))
    write = Writer(emit)
    stacked = write.node("Transpose", [node.input[0]], perm=_DEPTH_FIRST)              # [N, D, C, H, W]
    if front or back:
        stacked = write.node("Pad", [stacked, emit.ints([0, front, 0, 0, 0, 0, back, 0, 0, 0])])
    padded_depth = x[2] + front + back
    span = (depth_out - 1) * stride[0] + 1
    pieces = []
    for tap in range(taps):
        start = tap * dilation[0]
        if start == 0 and span == padded_depth and stride[0] == 1:
            pieces.append(stacked)   # a tap that reads every slice as it lies (kd 1, no depth pads): no copy
            continue
        pieces.append(write.node("Slice", [stacked, emit.ints([start]), emit.ints([start + span]), emit.ints([1]),
                                           emit.ints([stride[0]])]))
    joined = pieces[0] if taps == 1 else write.node("Concat", pieces, axis=2)       # [N, D', kd x C, H, W]
    planes = write.reshape(joined, [batch * depth_out, taps * channels, x[3], x[4]])
    kernel = write.reshape(write.node("Transpose", [node.input[1]], perm=_DEPTH_FIRST),
                           [filters, taps * channels, w[3], w[4]])
    conv = write.node("Conv", [planes, kernel, *node.input[2:]], pads=[top, left, bottom, right],
                      strides=stride[1:], dilations=dilation[1:])                      # [N x D', M, H', W']
    slices = write.reshape(conv, [batch, depth_out, filters, y[3], y[4]])
    write.node("Transpose", [slices], node.output[0], perm=_DEPTH_FIRST)
    return write.nodes
