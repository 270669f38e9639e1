"""3 x 3 convolutions over small maps as Winograd's minimal filtering F(2 x 2, 3 x 3), on the forward graph.

onnxruntime runs a Conv as im2col and one GEMM of 9 x C columns (or, from 16 x 16 maps on, on its
channel-blocked kernels: rewrites/nchwc.py); over small maps neither reaches the speed of its GEMM on
well-shaped operands, and the Conv's input and weight adjoints cost as much again each. Winograd's
algorithm computes each 2 x 2 tile of the output from the 4 x 4 tile of the input under it with 16
products instead of 36: the input tile and the filter transformed to 4 x 4 (V = B^T d B, U = G g G^T),
multiplied elementwise, and transformed back (Y = A^T (U . V) A). Over C input and M output channels the
elementwise products at each of the 16 tile positions (xi, nu) are one GEMM, V[xi, nu] [tiles, C] times
U[xi, nu] [C, M], so a Conv is 16 GEMMs of 4/9 of its multiply-adds between cheap transforms.

Written before differentiation, its adjoints come from onnx-ad's rules for the same ops, and they are
Winograd's algorithm for the other two products: each Gemm's input adjoint (dV = dY U^T, transB) is the
Conv's input adjoint at 16 GEMMs of the same size, and its weight adjoint (dU = V^T dY, transA) the weight
gradient, from the V the forward computed; the transforms' adjoints are the transposed constant products,
adds and subtracts. So one rewrite takes all three products of the layer to 4/9 of the multiply-adds.

The layout makes every transform a product or a pass over contiguous blocks, with no transpose of more than
two axes (onnxruntime's Transpose of 4 or 6 axes moves elements one by one): B's columns are applied along the
width on the map as it lies, [N x C x H, W] times a constant [W, T'] for each column, each result moved to [H
x T', N x C] by one 2-D transpose, and B^T's rows along the height as products of constant [T, H] matrices by
it; those constants hold the Conv's pads as missing entries, and the 16 V[xi, nu] come out as [T x T' x N, C]
matrices with no further copy (the width second instead, as products of [T', W] by the [W, N x C] planes of a
[T, W, N x C] tensor batched over T, the transforms' MatMuls took 29.5 ms of a profiled two-layer step at 16 x
16 x 128 where these take 23.4). The filter is moved to [9, M x C] (one 2-D transpose) and multiplied by the
[16, 9] transform kron(G, G): each position's [M, C] kernel a contiguous block, read transposed by its Gemm.
The products [T x T' x N, M] are combined by A^T's adds and subtracts into the four corners of each output
tile, and one 2-D transpose and a DepthToSpace of 2 x 2 blocks (CRD mode) lay them on the [N, M, 2T, 2T'] map
(cropped to an odd size by a Slice); a CPU session runs that DepthToSpace as a Col2Im (col2im.py), and its
adjoint is one SpaceToDepth. The transforms of F(2 x 2, 3 x 3) have coefficients 0, +-1 and +-1/2 only: the
results agree with the direct convolution's to float32 rounding (errors of a few units in the 7th digit on
unit-scale data).

Matched: a 2-D Conv of a float tensor with a 3 x 3 kernel, unit strides and dilations, one group, pads of
at most 2, static shapes, in a model of opset 11 or later (DepthToSpace's CRD mode), with an output map of at most
MAX_POSITIONS positions (from 32 x 32 on, the channel-blocked direct kernels are faster), at least
MIN_CHANNELS input and output channels (below, the input and output transforms cost more than the products
save) and at least MIN_BATCH_POSITIONS output positions over the batch (below, the filter's transform and
its adjoint, which scale with the weight alone, do). A ResNet-18 step for 32 x 32 images at batch 32 on one
thread: 1,502 / 1,385 -> 1,103 / 1,081 ms, alternated (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from worker_client.engine.rewrites.toolkit import Emitter, Writer, attribute, opset_of, rebuild, shapes_and_types

__all__ = ["MAX_POSITIONS", "MIN_BATCH_POSITIONS", "MIN_CHANNELS", "winograd_convs"]

#: Output maps (height x width) of at most this many positions are computed by Winograd's algorithm.
MAX_POSITIONS = 16 * 16
#: Input and output channels from which the products save more than the input and output transforms cost.
MIN_CHANNELS = 64
#: Output positions over the batch (batch x height x width) from which the products save more than the filter
#: transform and its adjoint cost (they scale with the weight alone).
MIN_BATCH_POSITIONS = 512
#: F(2 x 2, 3 x 3)'s filter transform G [4, 3] (its output transform A^T [2, 4] is `_transform_output`'s adds).
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
#: F(2 x 2, 3 x 3)'s input transform B^T: row k of a tile's transform reads the tile's rows where it is nonzero.
_INPUT_TRANSFORM = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float32)
#: The filter transform of a flattened 3 x 3 kernel: U[4 xi + nu] = sum over i, j of G[xi, i] G[nu, j] g[3 i + j].
_FILTER_TRANSFORM = np.kron(_G, _G)
#: The opset of DepthToSpace's CRD mode, which lays the output tiles on the map.
_MIN_OPSET = 11


def winograd_convs(model: onnx.ModelProto) -> int:
    """Each matched Conv (module docstring) replaced by its F(2 x 2, 3 x 3) form, in place; returns how many."""
    if opset_of(model) < _MIN_OPSET:
        return 0
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, "winograd")
    kernel_transform: list[str] = []   # the constant, added once

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
            return None
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        if types.get(node.input[0]) != onnx.TensorProto.FLOAT or not _matches(node, x, w):
            return None
        assert x is not None and w is not None
        if not kernel_transform:
            name = emit.name("winograd_filter_transform")
            emit.initializers.append(numpy_helper.from_array(_FILTER_TRANSFORM, name))
            kernel_transform.append(name)
        return _winograd(node, x, w, kernel_transform[0], emit)

    return rebuild(model, emit, replace)


def _pads(node: onnx.NodeProto) -> list[int]:
    return list(attribute(node, "pads", [0, 0, 0, 0]))


def _matches(node: onnx.NodeProto, x: tuple[int, ...] | None, w: tuple[int, ...] | None) -> bool:
    if x is None or w is None or len(x) != 4 or len(w) != 4 or tuple(w[2:]) != (3, 3) or w[1] != x[1]:
        return False
    if attribute(node, "group", 1) != 1 or list(attribute(node, "strides", [1, 1])) != [1, 1] or \
            list(attribute(node, "dilations", [1, 1])) != [1, 1] or \
            attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return False
    pads = _pads(node)
    if len(pads) != 4 or not all(0 <= p <= 2 for p in pads):
        return False
    rows, columns = x[2] + pads[0] + pads[2] - 2, x[3] + pads[1] + pads[3] - 2
    return rows >= 1 and columns >= 1 and rows * columns <= MAX_POSITIONS and min(x[1], w[0]) >= MIN_CHANNELS \
        and x[0] * rows * columns >= MIN_BATCH_POSITIONS


def _winograd(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], transform: str,
              emit: Emitter) -> list[onnx.NodeProto]:
    batch, channels, height, width = x
    filters = w[0]
    top, left, bottom, right = _pads(node)
    out_rows, out_columns = height + top + bottom - 2, width + left + right - 2
    tile_rows, tile_columns = -(-out_rows // 2), -(-out_columns // 2)
    write = Writer(emit)
    plane = batch * channels
    # B^T d B as products with constant matrices that hold the Conv's pads as missing entries: along the width
    # first, on the map as it lies ([N x C x H, W] times [W, T'] for each column nu of B), then each result moved
    # to [H x T', N x C] by a 2-D transpose, and along the height ([T, H] times [H, T' x N x C] for each row xi)
    # -> the [T x T' x N, C] operand of position (xi, nu), with no copy between
    flat = write.reshape(node.input[0], [plane * height, width])
    positions = tile_rows * tile_columns * batch
    down = [_spread(emit, xi, tile_rows, height, top) for xi in range(4)]   # each read by the 4 columns' products
    inputs: list[str] = [""] * 16
    for nu in range(4):
        across = write.node("MatMul", [flat, _spread(emit, nu, tile_columns, width, left, transposed=True)])
        moved = write.node("Transpose", [write.reshape(across, [plane, height * tile_columns])], perm=[1, 0])
        lying = write.reshape(moved, [height, tile_columns * plane])
        for xi in range(4):
            inputs[4 * xi + nu] = write.reshape(write.node("MatMul", [down[xi], lying]), [positions, channels])
    # G g G^T for every filter: the weight as [9, M x C] (one 2-D transpose), times the [16, 9] transform ->
    # [16, M x C], one contiguous [M, C] row block per position, read transposed by its Gemm
    taps = write.node("Transpose", [write.reshape(node.input[1], [filters * channels, 9])], perm=[1, 0])
    kernels = write.node("MatMul", [transform, taps])
    products = []
    for k, tile in enumerate(inputs):
        kernel = write.reshape(write.node("Slice", [kernels, emit.ints([k]), emit.ints([k + 1]), emit.ints([0])]),
                               [filters, channels])
        products.append(write.node("Gemm", [tile, kernel], transB=1))                  # [T x T' x N, M]
    # A^T m A: rows then columns, A^T's rows m0 + m1 + m2 and m1 - m2 - m3
    rows = [_transform_output(write, *(products[4 * xi + nu] for xi in range(4))) for nu in range(4)]
    corners = []
    for a in range(2):
        corners += _transform_output(write, *(rows[nu][a] for nu in range(4)))
    # the corners [4, T x T', N x M] moved by one 2-D transpose to [N, M x 4, T, T'] (corner fastest) and laid out
    # on the map by a DepthToSpace in CRD mode: a CPU session runs it as a Col2Im of 2 x 2 blocks (col2im.py),
    # and its adjoint, onnx-ad's six-axis Transpose, becomes one SpaceToDepth (layout.space_to_depth_transposes)
    # where a Col2Im's would be a grouped Conv of one-hot kernels
    stacked = write.node("Concat", [write.reshape(c, [1, tile_rows * tile_columns, batch * filters]) for c in corners],
                         axis=0)
    columns = write.node("Transpose", [write.reshape(stacked, [4 * tile_rows * tile_columns, batch * filters])],
                         perm=[1, 0])
    bias = len(node.input) > 2 and node.input[2]
    cropped = 2 * tile_rows != out_rows or 2 * tile_columns != out_columns
    result = write.node("DepthToSpace", [write.reshape(columns, [batch, filters * 4, tile_rows, tile_columns])],
                        out=None if bias or cropped else node.output[0], blocksize=2, mode="CRD")
    if cropped:
        result = write.node("Slice", [result, emit.ints([0, 0]), emit.ints([out_rows, out_columns]), emit.ints([2, 3])],
                            out=None if bias else node.output[0])
    if bias:
        write.node("Add", [result, write.reshape(node.input[2], [1, filters, 1, 1])], out=node.output[0])
    return write.nodes



def _spread(emit: Emitter, row: int, tiles: int, size: int, pad: int, *, transposed: bool = False) -> str:
    """A constant [tiles, size] ([size, tiles] `transposed`): row `row` of B^T applied to the 4 entries of each tile
    (tile t starts at 2 t - pad along an axis of `size`; entries outside it are the Conv's zero padding and drop
    out)."""
    matrix = np.zeros((tiles, size), np.float32)
    for tile in range(tiles):
        for offset in range(4):
            index = 2 * tile - pad + offset
            if 0 <= index < size:
                matrix[tile, index] = _INPUT_TRANSFORM[row, offset]
    name = emit.name("winograd_input_transform")
    emit.initializers.append(numpy_helper.from_array(np.ascontiguousarray(matrix.T) if transposed else matrix, name))
    return name


def _transform_output(write: Writer, m0: str, m1: str, m2: str, m3: str) -> list[str]:
    """A^T's two rows of four values: m0 + m1 + m2 and m1 - m2 - m3."""
    return [write.node("Add", [write.node("Add", [m0, m1]), m2]),
            write.node("Sub", [write.node("Sub", [m1, m2]), m3])]
