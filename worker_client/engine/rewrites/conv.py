"""Cheaper equivalents, on onnxruntime's CPU kernels, of onnx-ad's conv and pool adjoints."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.nchwc import blocked_shape
from worker_client.engine.rewrites.toolkit import (Emitter, Writer, auto_pads, constants, rebuild, set_attribute,
                                                   shapes_and_types, static_shapes)

__all__ = ["assign_unique_scatters", "equal_transposed_conv_pads", "explicit_auto_pads",
           "explicit_transposed_conv_pads", "flip_unit_stride_transposed_convs",
           "gemm_large_kernel_convs", "narrowing_volume_transposed_conv", "phases_gain", "resize_window_spreads",
           "route_max_pool_adjoints", "split_strided_transposed_convs"]

#: The widest channel block of onnxruntime's blocked Conv kernels (AVX-512; AVX2's is 8): what pads a phase
#: Conv's channels by more than a third here keeps it on the plain kernel under any block (`phases_gain`).
_WIDEST_BLOCK = 16

#: Slice's end for a negative step that runs past index 0.
_BEFORE_START = int(np.iinfo(np.int64).min)
#: Slice's end for a step of 1 that runs to the end of the axis.
_PAST_END = int(np.iinfo(np.int64).max)

#: Input index of the optional bias of Conv and ConvTranspose.
_BIAS = 2
#: Ops that pass integer indices on without reordering or repeating them.
_INDEX_PASS_THROUGH = frozenset({"Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten",
                                 "Expand", "Cast"})


#: A Resize that repeats each element over a block (a nearest upsample by whole factors).
_NEAREST: dict[str, Any] = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _replace(model: onnx.ModelProto, replacements: dict[int, list[onnx.NodeProto]],
             emit: Emitter) -> None:
    """Swap nodes (by position) for their replacements and add the new constants."""
    nodes = []
    for index, node in enumerate(model.graph.node):
        nodes.extend(replacements.get(index, [node]))
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(emit.initializers)


def gemm_large_kernel_convs(model: onnx.ModelProto, spatial_ranks: Collection[int] | None = None) -> int:
    """Rewrite each Conv whose kernel is larger than its output as one GEMM, in place.

    onnx-ad's weight adjoint of a Conv is itself a Conv: the (transposed) input correlated
    with the output adjoint as a filter bank, so the kernel spans the whole feature map and
    the output is only the original kernel's size (3 x 3). onnxruntime runs that as one
    im2col + skinny GEMM per input channel. Here the input window under each of the few
    output positions (i, j; a 1-D or 3-D Conv's as well) is sliced out and one well-shaped
    GEMM per window with the flattened filters computes that position's outputs -- the same
    multiply-adds. The small results are stacked, not the windows: stacking the windows first
    (one GEMM for all) copied the activations nine more times, and on a ResNet-18 layer at
    32 x 32 took 38 ms where the GEMMs per window take 24 (16 x 16: 25 and 18.5; 4 x 4: 20.7
    and 19.1). 1-D Convs too: a three-layer Conv1d network over 2,000 samples (kernels 9, 5
    dilated, 3) took 125 ms a step at one thread with its two weight adjoints left to
    onnxruntime's Conv (34 ms), 81 ms with them as GEMMs. Matches ungrouped, unpadded,
    bias-free Convs with static shapes, of any spatial rank, or only of those in `spatial_ranks`
    (for onnxruntime's CUDA provider 1-D ones alone: on an H200 cuDNN ran the Conv1d network's weight
    adjoints, kernels of hundreds to thousands of taps, in 7.72 ms a step against 2.48 as GEMMs, where
    2-D models went either way by 15% at most: ResNet-18 26.3 / 25.9, VGG 2.00 / 2.34, MobileNet
    5.51 / 6.13). Returns the number rewritten.
    """
    shapes = static_shapes(model)
    fixed = constants(model)
    emit = Emitter(model, "conv_gemm")
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(model.graph.node):
        for name in node.input:
            readers.setdefault(name, []).append(index)
    outputs = {value.name for value in model.graph.output}
    replacements: dict[int, list[onnx.NodeProto]] = {}
    rewritten = 0
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Conv" or (len(node.input) > _BIAS and node.input[_BIAS]):
            continue
        x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1],
                                                  node.output[0]))
        attributes = _attributes(node)
        if x is None or w is None or y is None or len(x) < 3 or len(w) != len(x) or len(y) != len(x) or \
                attributes.get("group", 1) != 1 or any(attributes.get("pads", [0])) or \
                attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID") or \
                (spatial_ranks is not None and len(x) - 2 not in spatial_ranks):
            continue
        written = node.output[0]   # the value the GEMMs write: the Conv's, or that of the readers they replace
        crop = _leading_crop(written, y, readers, outputs, model.graph.node, fixed)
        if crop is not None:   # onnx-ad keeps only the kernel's extent: compute just those positions
            cropper, kept = crop
            y = (*y[:2], *kept)
            written = model.graph.node[cropper].output[0]
        if math.prod(w[2:]) <= math.prod(y[2:]):
            continue  # an ordinary convolution: onnxruntime's own kernel is the right one
        spatial = len(x) - 2
        strides = list(attributes.get("strides", [1] * spatial))
        dilations = list(attributes.get("dilations", [1] * spatial))
        swap = _swapping_reader(written, y, readers, outputs, model.graph.node, shapes)
        if swap is not None:   # written straight in the layout onnx-ad moves it to: [filters, batch, ...]
            reshape, transpose = swap
            written = model.graph.node[transpose].output[0]
            replacements[reshape] = replacements[transpose] = []
        target = node
        if written != node.output[0]:
            target = onnx.NodeProto()
            target.CopyFrom(node)
            target.output[0] = written
        replacements[index] = _conv_as_gemm(target, x, w, y, strides, dilations, emit,
                                            swapped=None if swap is None else shapes[written])
        rewritten += 1
        if crop is not None:
            replacements[crop[0]] = []
    if replacements:
        _replace(model, replacements, emit)
    return rewritten


def _sole_reader(name: str, readers: dict[str, list[int]], outputs: set[str]) -> int | None:
    """The index of the one node that reads `name`, where nothing else does (a graph output neither)."""
    return readers[name][0] if name not in outputs and len(readers.get(name, [])) == 1 else None


def _leading_crop(name: str, shape: tuple[int, ...], readers: dict[str, list[int]], outputs: set[str],
                  nodes: Sequence[onnx.NodeProto], fixed: dict[str, np.ndarray]
                  ) -> tuple[int, list[int]] | None:
    """(the index of the Slice that alone reads `name` and keeps the first positions of its spatial axes, the
    sizes kept), or None. onnx-ad crops a Conv weight adjoint's overhang that way (a strided Conv's weight
    adjoint reaches past the kernel: a 3 x 3 kernel at stride 2 gives 4 x 4 positions, 9 of them kept)."""
    index = _sole_reader(name, readers, outputs)
    if index is None:
        return None
    node = nodes[index]
    if node.op_type != "Slice" or node.input[0] != name or len(node.input) < 3:
        return None
    values = [fixed.get(value) if value else None for value in list(node.input[1:]) + [""] * (4 - len(node.input[1:]))]
    starts, ends, axes, steps = values
    spatial = list(range(2, len(shape)))
    if starts is None or ends is None or (len(node.input) > 3 and axes is None) or \
            (len(node.input) > 4 and (steps is None or any(steps != 1))):
        return None
    axes = [int(a) % len(shape) for a in (axes if axes is not None else range(len(starts)))]
    if sorted(axes) != spatial or any(int(begin) != 0 for begin in starts):
        return None
    kept = {axis: min(int(end), shape[axis]) for axis, end in zip(axes, ends)}
    if any(size <= 0 for size in kept.values()):
        return None
    return index, [kept[axis] for axis in spatial]


def _swapping_reader(name: str, shape: tuple[int, ...], readers: dict[str, list[int]], outputs: set[str],
                     nodes: Sequence[onnx.NodeProto], shapes: dict[str, tuple[int, ...]]) -> tuple[int, int] | None:
    """(index of the Reshape, of the Transpose) where `name` ([batch, filters, k...]) is read only by a Reshape
    adding size-1 axes (onnx-ad's seed axis) read only by a Transpose that swaps the first two axes and keeps
    the rest in order -- onnx-ad's move of a Conv weight adjoint into the weight's layout -- else None."""
    reshape = _sole_reader(name, readers, outputs)
    if reshape is None or 1 in shape:
        return None
    node = nodes[reshape]
    reshaped = shapes.get(node.output[0])
    transpose = _sole_reader(node.output[0], readers, outputs)
    if node.op_type != "Reshape" or node.input[0] != name or reshaped is None or transpose is None \
            or [d for d in reshaped if d != 1] != list(shape):
        return None
    moved = nodes[transpose]
    if moved.op_type != "Transpose" or moved.output[0] not in shapes:
        return None
    perm = next((list(a.ints) for a in moved.attribute if a.name == "perm"), list(range(len(reshaped)))[::-1])
    order = [axis for axis in perm if reshaped[axis] != 1]      # the non-1 axes, as the Transpose writes them
    kept = [axis for axis in range(len(reshaped)) if reshaped[axis] != 1]
    if order != [kept[1], kept[0], *kept[2:]]:
        return None
    return reshape, transpose


def _conv_as_gemm(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...],
                  y: tuple[int, ...], strides: list[int], dilations: list[int],
                  emit: Emitter, swapped: tuple[int, ...] | None = None) -> list[onnx.NodeProto]:
    """The Conv as one GEMM per output position, into node.output[0]; with `swapped` (that output's shape), in
    the [filters, batch, positions] order instead: each product computed as [filters, batch] and the stack of
    them moved by one 2-D transpose ([positions, filters * batch] -> [filters * batch, positions]), where
    onnxruntime's Transposes of three axes or more go element by element (2.1 ms for a 512 x 512 x 3 x 3
    weight gradient moved to [out, in, 9] against 0.8). With at most _MAX_STACKED_BATCH rows a window (the
    weight adjoint of a Conv over few channels: an RGB image's first layer), the windows are stacked and
    multiplied by one GEMM instead (`_stacked_windows_gemm`)."""
    batch, filters = x[0], w[0]
    window = math.prod(w[1:])
    spatial = len(x) - 2
    axes = emit.ints(list(range(2, 2 + spatial)))
    steps = emit.ints(dilations)
    if batch > _MAX_STACKED_BATCH and strides == [1] * spatial and dilations == [1] * spatial and \
            filters * math.prod(x[2:]) * _SLIDING_FILTERS_GAIN <= batch * math.prod(w[2:]):
        return _sliding_filters_gemms(node, x, w, y, emit, swapped)
    flat_filters, filters_2d = emit.reshape(node.input[1], [filters, window])
    nodes = [flat_filters]
    patches = []
    phases = _phase_planes(node.input[0], x, dilations, math.prod(y[2:]), emit)
    nodes += phases[:1]
    for position in itertools.product(*(range(size) for size in y[2:])):
        start = [p * s for p, s in zip(position, strides)]
        end = [b + (k - 1) * d + 1 for b, k, d in zip(start, w[2:], dilations)]
        if start == [0] * spatial and end == list(x[2:]) and dilations == [1] * spatial:
            patches.append(node.input[0])   # the window is the whole input (a 1 x 1 Conv's weight adjoint)
            continue
        patch = emit.name()
        if phases:   # the window is one phase plane, cut with unit steps
            block = dilations[0]
            plane = (start[0] % block) * block + start[1] % block
            first = [plane * x[1], start[0] // block, start[1] // block]
            nodes.append(helper.make_node(
                "Slice", [phases[1], emit.ints(first), emit.ints([first[0] + x[1], first[1] + w[2], first[2] + w[3]]),
                          emit.ints([1, 2, 3])], [patch], name=patch))
        else:
            nodes.append(helper.make_node("Slice", [node.input[0], emit.ints(start), emit.ints(end), axes, steps],
                                          [patch], name=patch))
        patches.append(patch)
    if batch <= _MAX_STACKED_BATCH:
        return nodes + _stacked_windows_gemm(node, patches, filters_2d, batch, filters, window, y, emit, swapped)
    pairs = []
    for patch in patches:
        to_rows, rows = emit.reshape(patch, [batch, window])
        nodes.append(to_rows)
        pairs.append((rows, filters_2d))
    return nodes + _window_products(node, pairs, batch, filters, y, emit, swapped)


def _window_products(node: onnx.NodeProto, pairs: list[tuple[str, str]], batch: int, filters: int,
                     y: tuple[int, ...], emit: Emitter, swapped: tuple[int, ...] | None) -> list[onnx.NodeProto]:
    """One GEMM per output position of its (rows [batch, K], filters [filters, K]) pair, stacked into node.output[0]
    ([batch, filters, *positions], or `swapped`: [filters, batch, ...] by one 2-D transpose)."""
    nodes, products = [], []
    for rows, filters_2d in pairs:
        product = emit.name()
        operands = [rows, filters_2d] if swapped is None else [filters_2d, rows]
        nodes.append(helper.make_node("Gemm", operands, [product], name=product, transB=1))
        products.append(product)
    stacked = emit.name()
    nodes.append(helper.make_node("Concat", products, [stacked], name=stacked, axis=0))
    if swapped is not None:
        flat, moved = emit.name(), emit.name()
        return nodes + [emit.reshape(stacked, [len(products), filters * batch], out=flat)[0],
                        helper.make_node("Transpose", [flat], [moved], name=moved, perm=[1, 0]),
                        emit.reshape(moved, list(swapped), out=node.output[0])[0]]
    return nodes + _positions_last(node, stacked, y, batch, filters, emit)


#: Feature maps (height x width) from which the strided windows are cut from phase planes (`_phase_planes`).
_MIN_PHASE_PLANE_AREA = 16 * 16


def _phase_planes(source: str, x: tuple[int, ...], dilations: list[int], windows: int, emit: Emitter) -> tuple:
    """(the SpaceToDepth node, its output) that splits a 2-D `source` into the planes of its s x s phases, where
    the windows step s > 1 along both axes over maps that divide by s, of at least _MIN_PHASE_PLANE_AREA, and there
    are at least s * s of them (a strided 1 x 1 Conv's one window reads a quarter of the map); else ().
    The weight adjoint of a stride-s Conv reads each window at step s, and onnxruntime's Slice with steps copies
    element by element: nine such windows of [16, 32, 34, 34] took 0.99 ms, the SpaceToDepth and nine unit-step
    Slices of its planes 0.39 ([64, 32, 34, 34]: 3.97 and 2.19; [128, 32, 18, 18]: 2.06 and 1.34; at 10 x 10
    the two are even). SpaceToDepth puts phase (a, b) of channel c at a * s * C + b * C + c."""
    if len(x) != 4 or len(set(dilations)) != 1 or dilations[0] < 2 or x[2] % dilations[0] or x[3] % dilations[0] \
            or x[2] * x[3] < _MIN_PHASE_PLANE_AREA or windows < dilations[0] ** 2:
        return ()
    planes = emit.name()
    return helper.make_node("SpaceToDepth", [source], [planes], name=planes, blocksize=dilations[0]), planes


#: The filters slide instead of the input's windows where their copies are at most this fraction of the windows'.
_SLIDING_FILTERS_GAIN = 2


def _sliding_filters_gemms(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...],
                           emit: Emitter, swapped: tuple[int, ...] | None) -> list[onnx.NodeProto]:
    """The Conv (unit strides and dilations) as one GEMM per output position with the input whole and the filters
    shifted instead: out[b, f, k] = sum over c, j of x[b, c, j] * F[f, c, j - k], F zero-padded by P - 1 on each
    side of each axis (P positions along it) and cut at P - 1 - k to the input's extent. Each position copies
    filters x C x the map where the input's windows copied batch x C x the kernel: in a weight adjoint the
    filters are the output adjoint and the batch the input channels, so a layer with fewer outputs than inputs
    copies less: a decoder's last Convs (32 -> 12 before a PixelShuffle, a 1 x 1 head 32 -> 3, which copies
    nothing now) took the zoo pixelshuffle's step 9.15 -> 8.70 ms and the unet's 6.81 -> 6.58 at one thread."""
    batch, filters, spatial = x[0], w[0], len(x) - 2
    reach = [p - 1 for p in y[2:]]
    whole = math.prod(x[1:])
    to_rows, rows_name = emit.reshape(node.input[0], [batch, whole])
    if not any(reach):   # one position: the filters span the input (a 1 x 1 Conv's weight adjoint)
        flat, flat_name = emit.reshape(node.input[1], [filters, whole])
        return [to_rows, flat, *_window_products(node, [(rows_name, flat_name)], batch, filters, y, emit, swapped)]
    padded = emit.name()
    nodes = [to_rows, helper.make_node("Pad", [node.input[1], emit.ints([0, 0, *reach, 0, 0, *reach])], [padded],
                                       name=padded)]
    axes = emit.ints(list(range(2, 2 + spatial)))
    pairs = []
    for position in itertools.product(*(range(size) for size in y[2:])):
        start = [r - k for r, k in zip(reach, position)]
        shifted = emit.name()
        flat, flat_name = emit.reshape(shifted, [filters, whole])
        nodes += [helper.make_node("Slice", [padded, emit.ints(start), emit.ints([b + n for b, n in zip(start, x[2:])]),
                                             axes], [shifted], name=shifted), flat]
        pairs.append((rows_name, flat_name))
    return nodes + _window_products(node, pairs, batch, filters, y, emit, swapped)


#: Windows of at most this many rows (a Conv weight adjoint's input channels) are stacked into one GEMM.
_MAX_STACKED_BATCH = 8


def _stacked_windows_gemm(node: onnx.NodeProto, patches: list[str], filters_2d: str, batch: int, filters: int,
                          window: int, y: tuple[int, ...], emit: Emitter,
                          swapped: tuple[int, ...] | None) -> list[onnx.NodeProto]:
    """The windows stacked ([batch * positions, window], position fastest) and multiplied by the filters in one
    GEMM. A GEMM per window of so few rows reads the whole filter bank (the output adjoint, [filters, window])
    once for a thin result: on a first layer's weight adjoint (3 input channels, 64 filters, 32 x 32 maps,
    batch 32, one thread) the nine GEMMs took 3.4 ms, the stack and one GEMM 0.8; from 16 rows a window on,
    the copy into the stack costs more than the reads it saves. Swapped, the product [filters, batch *
    positions] is already in the layout wanted."""
    stacked, rows, product = emit.name(), emit.name(), emit.name()
    nodes, pieces = [], []
    for patch in patches:
        lift, piece = emit.reshape(patch, [batch, 1, window])
        nodes.append(lift)
        pieces.append(piece)
    nodes += [helper.make_node("Concat", pieces, [stacked], name=stacked, axis=1),
              emit.reshape(stacked, [batch * len(patches), window], out=rows)[0]]
    if swapped is not None:
        return nodes + [helper.make_node("Gemm", [filters_2d, rows], [product], name=product, transB=1),
                        emit.reshape(product, list(swapped), out=node.output[0])[0]]
    grid, moved = emit.name(), emit.name()    # [batch, positions, filters] -> [batch, filters, positions]
    return nodes + [helper.make_node("Gemm", [rows, filters_2d], [product], name=product, transB=1),
                    emit.reshape(product, [batch, len(patches), filters], out=grid)[0],
                    helper.make_node("Transpose", [grid], [moved], name=moved, perm=[0, 2, 1]),
                    emit.reshape(moved, list(y), out=node.output[0])[0]]


def _positions_last(node: onnx.NodeProto, products: str, y: tuple[int, ...], batch: int, filters: int,
                    emit: Emitter) -> list[onnx.NodeProto]:
    """Products stacked as [positions * batch, filters] moved to the Conv's output [batch, filters, *positions]."""
    spatial = len(y) - 2
    grid = emit.name()
    return [emit.reshape(products, [*y[2:], batch, filters], out=grid)[0],
            helper.make_node("Transpose", [grid], [node.output[0]], name=node.name or node.output[0],
                             perm=[spatial, spatial + 1, *range(spatial)])]


def explicit_auto_pads(model: onnx.ModelProto) -> int:
    """Give each Conv and pool with auto_pad SAME_UPPER, SAME_LOWER or VALID the explicit pads it means, in place.

    onnx-ad refuses a Conv or pool with auto_pad SAME ("re-export with explicit pads"), and torch
    exports every `padding="same"` Conv that way, even with an odd kernel. With a static input the
    pads are known: SAME's output is ceil(size / stride), its total padding split with the odd one
    at the end (UPPER) or the beginning (LOWER); VALID pads nothing. The same windows, so the same
    values. Returns the number rewritten.
    """
    shapes = static_shapes(model)
    rewritten = 0
    for node in model.graph.node:
        if node.op_type not in ("Conv", "AveragePool", "MaxPool", "LpPool"):
            continue
        attributes = _attributes(node)
        mode = attributes.get("auto_pad", b"NOTSET")
        mode = mode.encode() if isinstance(mode, str) else mode
        x = shapes.get(node.input[0])
        if mode == b"NOTSET" or x is None or len(x) < 3:
            continue
        spatial = len(x) - 2
        if node.op_type == "Conv":
            w = shapes.get(node.input[1])
            kernel = list(attributes.get("kernel_shape", w[2:] if w is not None else []))
        else:
            kernel = list(attributes.get("kernel_shape", []))
        strides = list(attributes.get("strides", [1] * spatial))
        dilations = list(attributes.get("dilations", [1] * spatial))
        if len(kernel) != spatial or len(strides) != spatial or len(dilations) != spatial or \
                mode not in (b"SAME_UPPER", b"SAME_LOWER", b"VALID"):
            continue
        if mode == b"VALID":
            pads = [0] * (2 * spatial)
        else:
            out = [-(-size // stride) for size, stride in zip(x[2:], strides)]
            pads = auto_pads(mode, x[2:], kernel, strides, dilations, out)
        kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        node.ClearField("attribute")
        node.attribute.extend(kept)
        node.attribute.append(helper.make_attribute("pads", pads))
        rewritten += 1
    return rewritten


def explicit_transposed_conv_pads(model: onnx.ModelProto, *, adjoints: bool) -> int:
    """Give each ConvTranspose that states its output_shape the pads that shape implies instead, in place.

    onnx's shape inference (1.23) gives some such nodes an output of rank 2 -- [N, C], no
    spatial axes; a 9x9 input, a 2x2 kernel and output_shape 8x8, for one -- and onnxruntime,
    which runs the node correctly, refuses to load a graph in which a Reshape then meets that
    rank-2 shape ("Dimension could not be inferred:
    incompatible shapes"). And given an output_shape, onnxruntime ignores the node's pads: it
    splits the total padding the shape implies with the larger half at the head (`_head_pads`).

    onnx-ad writes output_shape, with the pads it means, on a Conv's input adjoint: the adjoint
    of a Conv padded (b, e) drops b at the head. Where the forward padding was heavier at the
    end (the phase convolutions of a strided ConvTranspose, `split_strided_transposed_convs`,
    pad (0, 1)), onnxruntime's split dropped one row too many at the head, and the gradient
    flowing back through the Conv was shifted. So on a differentiated graph (`adjoints`) the
    head is the node's own pads' head where it has pads; on the forward graph, and where a node
    has no pads, it is onnxruntime's split, which is what the model computes there. The tail
    takes the rest of the total. A shape that needs more output than the kernel gives (a
    negative total) is left as it is. Needs the input and weight shapes static, and no
    auto_pad. In sweeps: the rank-2 shape of one such node hides the shapes after it, so the
    input of the next is static only once the one before is rewritten. Returns the number
    rewritten.
    """
    rewritten = 0
    for _ in range(sum(node.op_type == "ConvTranspose" for node in model.graph.node)):
        done = _explicit_transposed_conv_pads_once(model, adjoints)
        rewritten += done
        if not done:
            break
    return rewritten


def equal_transposed_conv_pads(model: onnx.ModelProto) -> int:
    """Give each ConvTranspose padded more at one end of an axis than at the other equal pads, the smaller
    of each axis's two, and a Slice after it that cuts the rest away, in place.

    onnxruntime's CUDA provider has no ConvTranspose kernel for unequal pads (1.31: "Dropping the
    ConvTranspose node ... to CPU because it requires asymmetric padding which the CUDA EP currently does
    not support"): it runs such a node on the CPU, its input and output copied across the bus every step.
    onnx-ad writes them as the input adjoints of strided Convs padded at both ends (a ResNet's downsampling
    3x3 Conv, pads (1, 1), has an adjoint padded (1, 0)). Padding less only widens the output, and the
    node's output is a window of the wider one, so the Slice gives the same values. Only nodes with explicit
    pads (no output_shape: `explicit_transposed_conv_pads` ran) and no auto_pad. Returns the number rewritten.
    """
    emit = Emitter(model, "equal_pads")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "ConvTranspose":
            return None
        attributes = _attributes(node)
        pads = attributes.get("pads")
        if not pads or "output_shape" in attributes or \
                attributes.get("auto_pad", b"NOTSET") != b"NOTSET":
            return None
        axes = len(pads) // 2
        head, tail = list(pads[:axes]), list(pads[axes:])
        if head == tail:
            return None
        equal = [min(h, t) for h, t in zip(head, tail)]
        wide = onnx.NodeProto()
        wide.CopyFrom(node)
        set_attribute(wide, "pads", equal + equal)
        wide.output[0] = emit.name()
        starts = [h - e for h, e in zip(head, equal)]
        ends = [e - t if t > e else _PAST_END for t, e in zip(tail, equal)]
        cut = helper.make_node("Slice", [wide.output[0], emit.ints(starts), emit.ints(ends),
                                         emit.ints(list(range(2, 2 + axes)))], [node.output[0]], name=emit.name())
        return [wide, cut]

    return rebuild(model, emit, replace)


def _explicit_transposed_conv_pads_once(model: onnx.ModelProto, adjoints: bool) -> int:
    shapes = static_shapes(model)
    rewritten = 0
    for node in model.graph.node:
        if node.op_type != "ConvTranspose":
            continue
        attributes = _attributes(node)
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        if "output_shape" not in attributes or x is None or w is None or len(x) != len(w) or \
                attributes.get("auto_pad", b"NOTSET") != b"NOTSET":
            continue
        spatial = len(x) - 2
        wanted = list(attributes["output_shape"])[-spatial:]
        strides = list(attributes.get("strides", [1] * spatial))
        extra = list(attributes.get("output_padding", [0] * spatial))
        dilations = list(attributes.get("dilations", [1] * spatial))
        if len(wanted) != spatial or len(strides) != spatial or len(extra) != spatial or len(dilations) != spatial:
            continue
        totals = [strides[a] * (x[a + 2] - 1) + extra[a] + (w[a + 2] - 1) * dilations[a] + 1 - wanted[a]
                  for a in range(spatial)]
        if any(t < 0 for t in totals):
            continue
        given = list(attributes.get("pads", []))
        heads = given[:spatial] if adjoints and len(given) == 2 * spatial else [t - t // 2 for t in totals]
        if any(h > t for h, t in zip(heads, totals)):
            continue
        kept = [a for a in node.attribute if a.name not in ("output_shape", "pads")]
        node.ClearField("attribute")
        node.attribute.extend(kept)
        node.attribute.append(helper.make_attribute("pads", heads + [t - h for t, h in zip(totals, heads)]))
        rewritten += 1
    return rewritten


def narrowing_volume_transposed_conv(model: onnx.ModelProto) -> Callable[[onnx.NodeProto], bool]:
    """Which of the model's ConvTransposes stay ConvTransposes rather than flipped Convs: 3-D ones, ungrouped, of
    static shape, that make fewer channels than they take -- the input adjoint of a volume Conv that widens
    its channels, as an encoder's do.

    onnxruntime has no channel-blocked kernels for 3-D Convs (rewrites/nchwc.py is 2-D): a flipped Conv is an
    im2col and a GEMM per image whose rows are its output channels, few here, so the big operand is packed for
    few uses; its ConvTranspose's GEMM has the kernel's channels times taps for rows. One thread, a batch of 32,
    ms as a flipped Conv / as a ConvTranspose: [32, 16, 8^3] from 16 to 32 channels' adjoint (an encoder's
    second Conv) 27.3 / 21.3, from 1 to 16 at 16^3 37.7 / 7.1, from 4 to 8 at 16^3 28.6 / 19.8; where the
    channels do not narrow the flip wins: 16 to 16 at 16^3 61.9 / 84.4, 32 to 32 at 8^3 23.0 / 39.5, 64 to 64 at
    4^3 14.2 / 20.6, 32 to 1 at 16^3 7.1 / 128."""
    shapes, _ = shapes_and_types(model)

    def narrowing(node: onnx.NodeProto) -> bool:
        if node.op_type != "ConvTranspose" or _attributes(node).get("group", 1) != 1:
            return False
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        return x is not None and w is not None and len(x) == 5 and len(w) == 5 and w[1] < w[0]

    return narrowing


def flip_unit_stride_transposed_convs(model: onnx.ModelProto,
                                      only: Callable[[onnx.NodeProto], bool] | None = None) -> int:
    """Rewrite each unit-stride ConvTranspose as a Conv with the flipped kernel, in place.

    onnx-ad's input adjoint of a Conv is a ConvTranspose of the output adjoint with the
    conv's weight. onnxruntime's CPU ConvTranspose runs one GEMM per image with the kernel
    transposed and folds the columns back (col2im); on a ResNet's small late feature maps
    (4x4, 8x8) it reaches a third or less of the speed of its Conv, and the ConvTransposes
    were a third of a ResNet-18 step. With stride 1 a transposed convolution is exactly a
    convolution with the kernel's two channel axes swapped and its spatial axes reversed,
    padded by (k - 1) * dilation - pad on each side: the same multiply-adds, on the Conv
    kernel. The kernel is swapped and reversed in the graph (it is a parameter, fed every
    step): a Transpose and a MatMul by the reversal matrix (`_reverse_taps`). A grouped one (the input
    adjoint of a depthwise Conv) is the grouped Conv, its channel axes swapped within each group:
    3.9 ms as a ConvTranspose on [32, 128, 16, 16] at one thread, 1.2 as the depthwise Conv on the
    blocked kernels (rewrites/nchwc.py). Matches bias-free
    ConvTransposes with stride 1, no output padding, no auto_pad, pads no larger
    than (k - 1) * dilation, and an output whose static shape is the one those pads give;
    with `only`, those it accepts. Returns the number rewritten.
    """
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, "flipped_conv")
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type != "ConvTranspose" or (len(node.input) > _BIAS and node.input[_BIAS]) or \
                (only is not None and not only(node)):
            continue
        x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1], node.output[0]))
        if x is None or w is None or y is None or len(x) < 3 or len(w) != len(x) or len(y) != len(x):
            continue
        attributes = _attributes(node)
        spatial = len(x) - 2
        kernel = list(w[2:])
        dilations = list(attributes.get("dilations", [1] * spatial))
        pads = list(attributes.get("pads", [0] * 2 * spatial))
        reach = [(k - 1) * d for k, d in zip(kernel, dilations)]
        group = attributes.get("group", 1)
        plain = (x[1] % group == 0
                 and list(attributes.get("strides", [1] * spatial)) == [1] * spatial
                 and not any(attributes.get("output_padding", [0]))
                 and attributes.get("auto_pad", b"NOTSET") == b"NOTSET"
                 and len(pads) == 2 * spatial and len(dilations) == spatial
                 and all(0 <= p <= r for p, r in zip(pads, reach + reach)))
        if not plain:
            continue
        expected = [x[0], w[1] * group] + [size + r - pads[axis] - pads[axis + spatial]
                                   for axis, (size, r) in enumerate(zip(x[2:], reach))]
        if list(y) != expected:
            continue
        if "output_shape" in attributes and (list(attributes["output_shape"]) != expected[2:] or
                                             pads[:spatial] != pads[spatial:]):
            continue   # onnxruntime splits the padding an output_shape implies its own way
        swapping, swapped = _swap_channel_axes(node.input[1], w, group, emit)
        reversing, flipped = _reverse_taps(swapped, [w[1] * group, w[0] // group, *kernel],
                                           types.get(node.input[1]), emit)
        replacements[index] = [
            *swapping,
            *reversing,
            helper.make_node("Conv", [node.input[0], flipped], [node.output[0]],
                             name=node.name or node.output[0], dilations=dilations,
                             pads=[r - p for p, r in zip(pads, reach + reach)],
                             **({"group": group} if group != 1 else {})),
        ]
    if replacements:
        _replace(model, replacements, emit)
    return len(replacements)


#: Kernels of up to this many taps are reversed by a MatMul with the reversal matrix, larger ones by a Slice.
_MAX_MATMUL_TAPS = 64


def _reverse_taps(weight: str, w: list[int], element: int | None, emit: Emitter) -> tuple[list[onnx.NodeProto], str]:
    """`weight` [A, B, *kernel] with every spatial axis reversed: the nodes and the result.

    Reversing each spatial axis reverses the row-major order of the K taps, so the flattened kernel
    [A, B, K] times the K x K reversal matrix is the flipped kernel, exactly where the weights are finite
    (each output is one weight times 1 plus zeros). onnxruntime runs that at memory speed, where its Slice
    with step -1 goes element by element: on a 512 x 512 x 3 x 3 weight the swap and flip took 8.1 ms
    with the Slice, 3.3 with the MatMul (the Transpose alone 2.8). A kernel of one tap needs nothing;
    one of more than _MAX_MATMUL_TAPS taps, or of a type the MatMul cannot hold, keeps the Slice."""
    kernel = w[2:]
    taps = math.prod(kernel)
    if taps == 1:
        return [], weight
    flipped = emit.name()
    floating = element in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    if not floating or taps > _MAX_MATMUL_TAPS:
        spatial = len(kernel)
        return [helper.make_node("Slice", [weight, emit.ints([-1] * spatial), emit.ints([_BEFORE_START] * spatial),
                                           emit.ints(list(range(2, 2 + spatial))), emit.ints([-1] * spatial)],
                                 [flipped], name=flipped)], flipped
    rows, rows_name = emit.reshape(weight, [w[0], w[1], taps])
    reversal, product = emit.name(), emit.name()
    emit.initializers.append(numpy_helper.from_array(
        np.eye(taps, dtype=helper.tensor_dtype_to_np_dtype(element))[::-1].copy(), reversal))
    back, _ = emit.reshape(product, w, out=flipped)
    return [rows, helper.make_node("MatMul", [rows_name, reversal], [product], name=product), back], flipped


def _swap_channel_axes(weight: str, w: tuple[int, ...], group: int,
                       emit: Emitter) -> tuple[list[onnx.NodeProto], str]:
    """A ConvTranspose's weight [C, M/G, *k] as a Conv's [M, C/G, *k] (G groups): the nodes and the result.

    Per group the two channel axes swap: Conv filter g * M/G + m, channel c is the ConvTranspose's
    channel g * C/G + c, filter m. Where either axis holds one channel (a depthwise weight) that is a
    Reshape, otherwise a Transpose within each group."""
    channels, per_group_out, kernel = w[0], w[1], list(w[2:])
    per_group_in = channels // group
    if group == 1:
        swapped = emit.name()
        return [helper.make_node("Transpose", [weight], [swapped], name=swapped,
                                 perm=[1, 0, *range(2, 2 + len(kernel))])], swapped
    if min(per_group_in, per_group_out) == 1:
        node, swapped = emit.reshape(weight, [group * per_group_out, per_group_in, *kernel])
        return [node], swapped
    split, split_name = emit.reshape(weight, [group, per_group_in, per_group_out, *kernel])
    transposed = emit.name()
    merged, swapped = emit.reshape(transposed, [group * per_group_out, per_group_in, *kernel])
    return [split, helper.make_node("Transpose", [split_name], [transposed], name=transposed,
                                    perm=[0, 2, 1, *range(3, 3 + len(kernel))]), merged], swapped


def _head_pads(attributes: dict[str, Any], x: tuple[int, ...], kernel: list[int],
               y: tuple[int, ...]) -> list[int]:
    """The padding a ConvTranspose drops before each spatial axis. Given output_shape, the pads
    attribute is ignored and the total padding the shape implies is split with the odd one at the
    head (the ONNX rule for auto_pad NOTSET, and onnxruntime's)."""
    spatial = len(x) - 2
    pads = list(attributes.get("pads", [0] * 2 * spatial))
    if "output_shape" not in attributes:
        return pads[:spatial]
    strides = list(attributes.get("strides", [1] * spatial))
    extra = list(attributes.get("output_padding", [0] * spatial))
    dilations = list(attributes.get("dilations", [1] * spatial))
    heads = []
    for axis in range(spatial):
        total = max(0, strides[axis] * (x[axis + 2] - 1) + extra[axis]
                    + (kernel[axis] - 1) * dilations[axis] + 1 - y[axis + 2])
        heads.append(total - total // 2)
    return heads


def phases_gain(model: onnx.ModelProto) -> Callable[[onnx.NodeProto], bool]:
    """Which of the model's strided ConvTransposes -- strided Convs' input adjoints -- run faster as phase Convs
    (`split_strided_transposed_convs`) than as onnxruntime's own ConvTranspose (one GEMM of the kernel by each
    image and a col2im), for `rewrite_adjoints` to split; the others are left as they are.

    The phases gain where their Convs run on onnxruntime's channel-blocked kernels (rewrites/nchwc.py: a map of
    at least MIN_POSITIONS positions, input channels a multiple of 4, output channels that a block of 16 pads by
    a third at most), and where the ConvTranspose has more output channels than input ones; elsewhere each
    phase is an im2col and a GEMM of a few taps per image, and the ConvTranspose's one GEMM per image is the
    better shape. One thread, batch 32, median ms (ConvTranspose / phases): [32, 512, 4, 4] by [512, 256, 3, 3]
    12.2 / 12.7 (two threads 6.4 / 9.4), [32, 256, 8, 8] by [256, 128, 3, 3] 7.3 / 8.2, [32, 64, 8, 8] by [64,
    32, 4, 4] 1.07 / 1.48, [32, 128, 16, 16] by [128, 3, 4, 4] 0.72 / 4.90 (3 output channels: no block);
    blocked, [32, 128, 16, 16] by [128, 64, 3, 3] 7.6 / 7.6 (two threads 4.6 / 4.0), [32, 32, 16, 16] by [32,
    16, 3, 3] 0.79 / 0.65; more output channels, [32, 64, 8, 8] by [64, 128, 3, 3] 2.5 / 2.2. A kernel that is
    its stride (one 1 x 1 Conv, `_block_conv`) and maps of one or three axes are always split, as before."""
    if not any(node.op_type == "ConvTranspose" for node in model.graph.node):
        return lambda node: True     # nothing to choose for: no shape inference
    shapes = static_shapes(model)

    def gain(node: onnx.NodeProto) -> bool:
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        if x is None or w is None or len(x) != 4 or len(w) != 4:
            return True
        attributes = _attributes(node)
        if list(attributes.get("strides", [1, 1])) == list(w[2:]) and not any(attributes.get("pads", [0])):
            return True
        inputs, outputs = w[0], w[1]   # the phase Convs': the ConvTranspose's, over about its input's positions
        return blocked_shape(inputs, outputs, x[2] * x[3], _WIDEST_BLOCK) or outputs > inputs

    return gain


def split_strided_transposed_convs(model: onnx.ModelProto,
                                   only: Callable[[onnx.NodeProto], bool] | None = None) -> int:
    """Rewrite each ungrouped strided ConvTranspose as one Conv per output phase, in place.

    The input adjoint of a strided Conv (a ResNet's downsampling convs) is a strided
    ConvTranspose, which onnxruntime runs as one GEMM per image and a col2im: slower than these
    phase Convs where they run on its channel-blocked kernels (`phases_gain` says where;
    `rewrite_adjoints` splits only those). Along an axis of stride s, output s*m + a only ever
    meets the kernel taps k = (a + head) mod s (+ s, + 2s ...), so each phase (one a per axis)
    is a unit-stride convolution of the input with that sub-kernel, swapped and reversed; the
    phases are stacked and interleaved -- by DepthToSpace for a 2-D map of equal strides, for a 3-D
    one whose in-plane strides are equal by two 4-D Transposes and a DepthToSpace (`_interleaved_3d`),
    by a Reshape and Transpose otherwise (1-D maps, strides that differ between axes). The
    same multiply-adds, on the Conv kernel. An output whose size along an axis does not divide
    by its stride is computed to the next multiple (the transposed convolution goes on past the
    end, as more output padding would make it) and cut back. A 2-D one whose kernel is its stride, unpadded
    (a UNet's 2 x 2 upsampling), is one 1 x 1 Conv and the DepthToSpace (`_block_conv`): the zoo unet's step
    7.9 -> 6.7 ms at one thread. Matches bias-free ConvTransposes
    with group 1, dilation 1, some stride above 1, a kernel of at least the stride along each
    axis, no auto_pad, and a static output; with `only`, those it accepts. Returns the number
    rewritten.
    """
    shapes = static_shapes(model)
    emit = Emitter(model, "phase_conv")
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type != "ConvTranspose" or (len(node.input) > _BIAS and node.input[_BIAS]) or \
                (only is not None and not only(node)):
            continue
        x, w, y = (shapes.get(name) for name in (node.input[0], node.input[1], node.output[0]))
        if x is None or w is None or y is None or len(x) < 3 or len(w) != len(x) or len(y) != len(x):
            continue
        spatial = len(x) - 2
        attributes = _attributes(node)
        strides = list(attributes.get("strides", [1] * spatial))
        plain = (attributes.get("group", 1) == 1 and len(strides) == spatial and max(strides) > 1
                 and list(attributes.get("dilations", [1] * spatial)) == [1] * spatial
                 and attributes.get("auto_pad", b"NOTSET") == b"NOTSET"
                 and all(k >= s for k, s in zip(w[2:], strides))
                 and tuple(y[:2]) == (x[0], w[1]))
        if not plain:
            continue
        heads = _head_pads(attributes, x, list(w[2:]), y)
        whole = tuple(y[:2]) + tuple(-(-size // s) * s for size, s in zip(y[2:], strides))
        target = node
        if whole != tuple(y):
            target = onnx.NodeProto()
            target.CopyFrom(node)
            target.output[0] = emit.name()
        if spatial == 2 and strides[0] == strides[1] == w[2] == w[3] and not any(heads) and \
                tuple(y[2:]) == (x[2] * strides[0], x[3] * strides[0]):
            nodes = _block_conv(node, w, strides[0], emit)
        elif spatial == 2 and strides[0] == strides[1]:
            nodes = _phase_convs(target, x, w, whole, strides[0], heads, emit)
        else:
            nodes = _phase_convs_interleaved(target, x, w, whole, strides, heads, emit)
        if target is not node:
            axes = list(range(2, len(y)))
            nodes.append(helper.make_node("Slice", [target.output[0], emit.ints([0] * spatial),
                                                    emit.ints(list(y[2:])), emit.ints(axes)],
                                          [node.output[0]], name=emit.name()))
        replacements[index] = nodes
    if replacements:
        _replace(model, replacements, emit)
    return len(replacements)


def _block_conv(node: onnx.NodeProto, w: tuple[int, ...], stride: int, emit: Emitter) -> list[onnx.NodeProto]:
    """A ConvTranspose whose kernel is its stride (s x s, no padding: a UNet's 2 x 2 upsampling, each input pixel
    spread over its own s x s output block) as one 1 x 1 Conv to C_out * s * s channels and a DepthToSpace
    (CRD: channel o * s * s + a * s + b holds phase (a, b) of output channel o). The phase Convs would be s * s
    Convs of 1 x 1, a Concat and the same DepthToSpace. The weight [C_in, C_out, s, s] is moved to [C_out, s, s,
    C_in] in the graph (it may be a trained parameter: onnx-ad differentiates the Transpose)."""
    moved, flat, blocks = emit.name(), emit.name(), emit.name()
    return [helper.make_node("Transpose", [node.input[1]], [moved], name=moved, perm=[1, 2, 3, 0]),
            emit.reshape(moved, [w[1] * stride * stride, w[0], 1, 1], out=flat)[0],
            helper.make_node("Conv", [node.input[0], flat], [blocks], name=blocks),
            helper.make_node("DepthToSpace", [blocks], [node.output[0]], name=node.name or node.output[0],
                             blocksize=stride, mode="CRD")]


def _phase_convs(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...],
                 stride: int, heads: list[int], emit: Emitter) -> list[onnx.NodeProto]:
    swapped = emit.name()
    nodes = [helper.make_node("Transpose", [node.input[1]], [swapped], name=swapped, perm=[1, 0, 2, 3])]
    phases = []
    for a in range(stride):
        for b in range(stride):
            # per axis: (first tap, taps, input cut at the start and the end, pads before and after)
            plans = [_phase_axis(phase, heads[axis], w[axis + 2], x[axis + 2], y[axis + 2] // stride,
                                 stride) for axis, phase in enumerate((a, b))]
            nodes += _phase_conv(node, swapped, x, plans, [stride, stride], emit)
            phases.append(nodes[-1].output[0])
    # channel-major (CRD): on the CPU that DepthToSpace is one Col2Im (rewrites/col2im.py), and its adjoint, where
    # onnx-ad differentiates one (a trainable ConvTranspose), one SpaceToDepth (layout.space_to_depth_transposes)
    stacked = emit.name()
    to_channels, channels = emit.reshape(stacked, [y[0], y[1] * stride * stride, y[2] // stride,
                                                   y[3] // stride])
    nodes += [helper.make_node("Concat", phases, [stacked], name=stacked, axis=2), to_channels,
              helper.make_node("DepthToSpace", [channels], [node.output[0]],
                               name=node.name or node.output[0], blocksize=stride, mode="CRD")]
    return nodes


def _phase_convs_interleaved(node: onnx.NodeProto, x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...],
                             strides: list[int], heads: list[int], emit: Emitter) -> list[onnx.NodeProto]:
    """The phase convolutions of any rank and per-axis strides, interleaved by a Reshape and a Transpose:
    phases [N, C, s1, ..., sn, o1, ..., on] -> [N, C, o1, s1, ..., on, sn] -> [N, C, o1*s1, ..., on*sn]."""
    spatial = len(x) - 2
    swapped = emit.name()
    nodes = [helper.make_node("Transpose", [node.input[1]], [swapped], name=swapped,
                              perm=[1, 0] + list(range(2, len(x))))]
    outputs = [size // s for size, s in zip(y[2:], strides)]
    phases = []
    for phase in itertools.product(*(range(s) for s in strides)):
        plans = [_phase_axis(p, heads[axis], w[axis + 2], x[axis + 2], outputs[axis], strides[axis])
                 for axis, p in enumerate(phase)]
        nodes += _phase_conv(node, swapped, x, plans, strides, emit)
        phases.append(nodes[-1].output[0])
    stacked = emit.name()
    nodes.append(helper.make_node("Concat", phases, [stacked], name=stacked, axis=2))
    if spatial == 3 and strides[1] == strides[2]:
        return nodes + _interleaved_3d(stacked, y, strides, outputs, node.output[0], emit)
    grid, grid_name = emit.reshape(stacked, [y[0], y[1]] + strides + outputs)
    interleaved = emit.name()
    perm = [0, 1] + [axis for pair in zip(range(2 + spatial, 2 + 2 * spatial), range(2, 2 + spatial))
                     for axis in pair]
    nodes += [grid, helper.make_node("Transpose", [grid_name], [interleaved], name=interleaved, perm=perm),
              emit.reshape(interleaved, list(y), out=node.output[0])[0]]
    return nodes


def _interleaved_3d(stacked: str, y: tuple[int, ...], strides: list[int], outputs: list[int], out: str,
                    emit: Emitter) -> list[onnx.NodeProto]:
    """3-D phases [N, C, s1, s2, s3, o1, o2, o3] (s2 = s3 = s) interleaved into [N, C, o1 s1, o2 s, o3 s] on
    4-D views, where onnxruntime's Transpose is fast (one 8-D Transpose of [32, 16, 2, 2, 2, 8, 8, 8] took 8.1 ms
    at one thread): o1 moved before the (s2, s3) phases, a DepthToSpace interleaving those with (o2, o3), then
    o1 moved before s1."""
    (n, c), (s1, s, _), (o1, o2, o3) = y[:2], strides, outputs
    phases, spread, moved = emit.name(), emit.name(), emit.name()
    first, first_name = emit.reshape(stacked, [n * c * s1, s * s, o1, o2 * o3])
    blocks, blocks_name = emit.reshape(phases, [n * c * s1 * o1, s * s, o2, o3])
    rows, rows_name = emit.reshape(spread, [n * c, s1, o1, o2 * s * o3 * s])
    return [first, helper.make_node("Transpose", [first_name], [phases], name=phases, perm=[0, 2, 1, 3]),
            blocks, helper.make_node("DepthToSpace", [blocks_name], [spread], name=spread, blocksize=s, mode="CRD"),
            rows, helper.make_node("Transpose", [rows_name], [moved], name=moved, perm=[0, 2, 1, 3]),
            emit.reshape(moved, list(y), out=out)[0]]


def _phase_conv(node: onnx.NodeProto, swapped: str, x: tuple[int, ...], plans: list[tuple[int, ...]],
                strides: list[int], emit: Emitter) -> list[onnx.NodeProto]:
    """One phase: its sub-kernel (taken reversed from the swapped kernel), the input cut where the phase starts
    or ends inside it, the unit-stride Conv, and an axis for the stack (the last node's output)."""
    axes = list(range(2, len(x)))
    kernel, phase_out, lifted = emit.name(), emit.name(), emit.name()
    starts = [first + stride * (taps - 1) for (first, taps, *_), stride in zip(plans, strides)]
    ends = [start - stride * taps for start, (_, taps, *_), stride in zip(starts, plans, strides)]
    nodes = [helper.make_node(
        "Slice", [swapped, emit.ints(starts), emit.ints([e if e >= 0 else _BEFORE_START for e in ends]),
                  emit.ints(axes), emit.ints([-s for s in strides])], [kernel], name=kernel)]
    source = node.input[0]
    if any(cut_start or cut_end for _, _, cut_start, cut_end, *_ in plans):
        source = emit.name()
        nodes.append(helper.make_node(
            "Slice", [node.input[0], emit.ints([p[2] for p in plans]),
                      emit.ints([x[axis + 2] - p[3] for axis, p in enumerate(plans)]),
                      emit.ints(axes)], [source], name=source))
    pads = [p[4] for p in plans] + [p[5] for p in plans]
    nodes += [helper.make_node("Conv", [source, kernel], [phase_out], name=phase_out, pads=pads),
              helper.make_node("Unsqueeze", [phase_out, emit.ints([2])], [lifted], name=lifted)]
    return nodes


def _phase_axis(phase: int, head: int, kernel: int, size: int, outputs: int,
                stride: int) -> tuple[int, int, int, int, int, int]:
    """One axis of one output phase: output s*m + phase (m < outputs) takes input i = m + c - j
    with tap first + s*j (j < taps); as a unit-stride Conv over the input with the reversed taps,
    the input cut at its start and end and padded before and after."""
    first = (phase + head) % stride
    taps = -(-(kernel - first) // stride)
    offset = (phase + head - first) // stride
    before = taps - 1 - offset
    after = outputs - size - before + taps - 1
    return first, taps, max(0, -before), max(0, -after), max(0, before), max(0, after)


def resize_window_spreads(model: onnx.ModelProto) -> int:
    """Rewrite grouped all-ones ConvTransposes with stride == kernel as a nearest Resize.

    onnx-ad's adjoint of a k x k AveragePool spreads each window's value back with a
    per-channel ConvTranspose over a kernel of ones. When the stride equals the kernel and
    nothing is padded, that is exactly a nearest-neighbour upsample by k, which
    onnxruntime's Resize does in a fraction of the time. Returns the number rewritten.
    """
    shapes = static_shapes(model)
    values = constants(model)
    emit = Emitter(model, "spread")
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type != "ConvTranspose" or (len(node.input) > _BIAS and node.input[_BIAS]):
            continue
        x, y = shapes.get(node.input[0]), shapes.get(node.output[0])
        kernel = values.get(node.input[1])
        attributes = _attributes(node)
        if x is None or y is None or kernel is None or len(x) != 4 or \
                kernel.shape != (x[1], 1) + kernel.shape[2:] or not np.all(kernel == 1):
            continue
        size = list(kernel.shape[2:])
        plain = (attributes.get("group", 1) == x[1]
                 and list(attributes.get("strides", [1, 1])) == size
                 and not any(attributes.get("pads", [0]))
                 and not any(attributes.get("output_padding", [0]))
                 and list(attributes.get("dilations", [1, 1])) == [1, 1]
                 and list(y) == [x[0], x[1], x[2] * size[0], x[3] * size[1]])
        if not plain:
            continue
        scales = emit.name()
        emit.initializers.append(onnx.numpy_helper.from_array(
            np.array([1, 1] + size, np.float32), scales))
        replacements[index] = [helper.make_node(
            "Resize", [node.input[0], "", scales], [node.output[0]],
            name=node.name or node.output[0], **_NEAREST)]
    if replacements:
        _replace(model, replacements, emit)
    return len(replacements)


def _indices_source(name: str, producers: dict[str, onnx.NodeProto],
                    shapes: dict[str, tuple[int, ...]]) -> onnx.NodeProto | None:
    """The MaxPool whose Indices output `name` carries, passed on by ops that neither
    reorder nor repeat indices; None when it comes from anywhere else."""
    while name in producers:
        node = producers[name]
        if node.op_type == "MaxPool":
            return node if len(node.output) > 1 and node.output[1] == name else None
        if node.op_type not in _INDEX_PASS_THROUGH:
            return None
        if node.op_type == "Expand":  # an Expand that adds elements repeats indices
            source, target = shapes.get(node.input[0]), shapes.get(node.output[0])
            if source is None or target is None or np.prod(source) != np.prod(target):
                return None
        name = node.input[0]
    return None


def _disjoint_windows(pool: onnx.NodeProto) -> bool:
    """Whether no two of a MaxPool's windows overlap (so no argmax index repeats)."""
    attributes = _attributes(pool)
    kernel = list(attributes.get("kernel_shape", []))
    strides = list(attributes.get("strides", [1] * len(kernel)))
    dilations = list(attributes.get("dilations", [1] * len(kernel)))
    return all(s >= k for s, k in zip(strides, kernel)) and all(d == 1 for d in dilations)


def _tiling_window(pool: onnx.NodeProto, shape: tuple[int, ...] | None) -> list[int] | None:
    """The kernel of a MaxPool (1-D, 2-D or 3-D) whose windows tile its input exactly (stride =
    kernel, no padding, dilation or ceil mode, sizes divisible), else None."""
    attributes = _attributes(pool)
    kernel = list(attributes.get("kernel_shape", []))
    if shape is None or len(shape) < 3 or len(kernel) != len(shape) - 2:
        return None
    spatial = len(kernel)
    tiles = (list(attributes.get("strides", [1] * spatial)) == kernel
             and not any(attributes.get("pads", [0]))
             and list(attributes.get("dilations", [1] * spatial)) == [1] * spatial
             and attributes.get("auto_pad", b"NOTSET") in (b"NOTSET", b"VALID")
             and not attributes.get("ceil_mode", 0)
             and all(size % k == 0 for size, k in zip(shape[2:], kernel)))
    return kernel if tiles else None


def _is_zeros(name: str, producers: dict[str, onnx.NodeProto],
              values: dict[str, np.ndarray]) -> bool:
    """Whether `name` is a constant, or a ConstantOfShape, that is all zeros."""
    if name in values:
        return not np.any(values[name])
    node = producers.get(name)
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    return value is None or not np.any(onnx.numpy_helper.to_array(value))  # default: 0


def route_max_pool_adjoints(model: onnx.ModelProto) -> int:
    """Replace the argmax scatter of a tiling MaxPool's adjoint by masks, in place.

    onnx-ad's MaxPool adjoint is a second MaxPool that also returns argmax Indices and a
    ScatterND(add) of the output adjoint into zeros at those indices; onnxruntime runs
    both single-threaded, the MaxPool-with-indices some 15 times slower than a plain one,
    and together they were half the CNN fixture's step (and 20 of a 1-D audio CNN's 70 ms).
    Where the windows tile the input (a 1-D, 2-D or 3-D kernel k, stride k, no padding) the same adjoint is built from cheap, parallel ops:
    the elements equal to their window's maximum (a plain MaxPool, a nearest Resize back,
    Equal); among those, the first in row-major window order -- the one torch's and
    onnxruntime's argmax pick -- found by a second MaxPool over `mask * (k*k - position)`;
    and the output adjoint spread back (Resize) onto that one element. Returns the number
    replaced.
    """
    shapes = static_shapes(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    values = constants(model)
    emit = Emitter(model, "max_adjoint")
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type != "ScatterND" or _attributes(node).get("reduction") != b"add" or \
                not _is_zeros(node.input[0], producers, values):
            continue
        pool = _indices_source(node.input[1], producers, shapes)
        x = shapes.get(pool.input[0]) if pool is not None else None
        kernel = _tiling_window(pool, x) if pool is not None else None
        if pool is None or x is None or kernel is None:
            continue
        y = (x[0], x[1], *(size // k for size, k in zip(x[2:], kernel)))
        numel = int(np.prod(x))
        if shapes.get(node.input[2]) != y + (1,) or shapes.get(node.output[0]) != (numel, 1):
            continue  # more than one seed direction: leave the scatter as it is
        # the forward's own pool of x over the same tiles, where there is one: its maxima, not computed again
        forward = next((n.output[0] for n in model.graph.node if n.op_type == "MaxPool" and n is not pool
                        and n.input[0] == pool.input[0] and shapes.get(n.output[0]) == y
                        and _tiling_window(n, x) == kernel), None)
        replacements[index] = _routed_spread(node, pool.input[0], kernel, y, numel, emit, forward)
    if replacements:
        _replace(model, replacements, emit)
    return len(replacements)


def _routed_spread(scatter: onnx.NodeProto, x: str, kernel: list[int], y: tuple[int, ...],
                   numel: int, emit: Emitter, pooled: str | None = None) -> list[onnx.NodeProto]:
    """The routed adjoint's nodes (route_max_pool_adjoints); `pooled`: the forward's MaxPool of x over the same
    windows, whose output is the windows' maxima (0.6 ms on [32, 32, 2000] not spent again)."""
    if len(kernel) == 3:
        return _routed_spread_3d(scatter, x, kernel, y, numel, emit, pooled)
    area = math.prod(kernel)
    rank = emit.name()
    # k*k - (row-major position in the window): larger for earlier elements, never 0
    emit.initializers.append(onnx.numpy_helper.from_array(
        (area - np.arange(area, dtype=np.float32)).reshape([1, 1] + kernel), rank))
    window: dict[str, Any] = {"kernel_shape": kernel, "strides": kernel}
    (peak, peak_up, maxima, mask, tiled, typed_rank, candidates, best, best_up, first,
     route, spread, gradient) = (emit.name() for _ in range(13))
    to_grid, grid = emit.reshape(scatter.input[2], list(y))
    maxima_nodes = [] if pooled is not None else [helper.make_node("MaxPool", [x], [peak], name=peak, **window)]
    peak = pooled or peak
    return [
        *maxima_nodes,
        *_nearest_upsample(peak, kernel, peak_up, emit),
        helper.make_node("Equal", [x, peak_up], [maxima], name=maxima),
        helper.make_node("CastLike", [maxima, x], [mask], name=mask),
        helper.make_node("Tile", [rank, emit.ints([1, 1, *y[2:]])], [tiled], name=tiled),
        helper.make_node("CastLike", [tiled, x], [typed_rank], name=typed_rank),
        helper.make_node("Mul", [mask, typed_rank], [candidates], name=candidates),
        helper.make_node("MaxPool", [candidates], [best], name=best, **window),
        *_nearest_upsample(best, kernel, best_up, emit),
        helper.make_node("Equal", [candidates, best_up], [first], name=first),
        helper.make_node("CastLike", [first, x], [route], name=route),
        to_grid,
        *_nearest_upsample(grid, kernel, spread, emit),
        helper.make_node("Mul", [spread, route], [gradient], name=gradient),
        emit.reshape(gradient, [numel, 1], out=scatter.output[0])[0],
    ]


def _routed_spread_3d(scatter: onnx.NodeProto, x: str, kernel: list[int], y: tuple[int, ...],
                      numel: int, emit: Emitter, pooled: str | None) -> list[onnx.NodeProto]:
    """_routed_spread for a 3-D window (kd, kh, kw), on x viewed as [N C D/kd, kd, H, W]: the windows' values
    (maxima, first ranks, the output adjoint) spread over h and w by onnxruntime's fast 4-D Resize and over the
    depth axis by the broadcast of the Equal or Mul that reads them ([M, 1, H, W] against [M, kd, H, W]).
    onnxruntime's Resize has a fast path for 4-D tensors only ([32, 16, 8, 8, 8] by 2 x 2 x 2: 15.7 ms as one
    5-D Resize, 1.2 as two 4-D ones); a second 4-D Resize over depth still wrote each value's full-size copy,
    three of them in each adjoint."""
    (n, c, depth, height, width), (kd, kh, kw) = y, kernel
    rows, full_h, full_w = n * c * depth, height * kh, width * kw
    window: dict[str, Any] = {"kernel_shape": kernel, "strides": kernel}
    write = Writer(emit)
    factors = emit.name()
    emit.initializers.append(onnx.numpy_helper.from_array(np.array([1, 1, kh, kw], np.float32), factors))
    # area - (row-major position in the window), larger for earlier elements, never 0, laid over [kd, H, W]
    area = kd * kh * kw
    rank = emit.name()
    within = (area - np.arange(area, dtype=np.float32)).reshape(kd, kh, kw)
    emit.initializers.append(onnx.numpy_helper.from_array(np.tile(within, (1, height, width))[None], rank))

    def spread(value: str) -> str:   # [N, C, D/kd, H/kh, W/kw] -> [M, 1, H, W]
        return write.node("Resize", [write.reshape(value, [rows, 1, height, width]), "", factors], **_NEAREST)

    peak = pooled or write.node("MaxPool", [x], **window)
    view = write.reshape(x, [rows, kd, full_h, full_w])
    maxima = write.node("CastLike", [write.node("Equal", [view, spread(peak)]), x])
    candidates = write.node("Mul", [maxima, write.node("CastLike", [rank, x])])
    best = write.node("MaxPool", [write.reshape(candidates, [n, c, depth * kd, full_h, full_w])], **window)
    route = write.node("CastLike", [write.node("Equal", [candidates, spread(best)]), x])
    gradient = write.node("Mul", [spread(write.reshape(scatter.input[2], list(y))), route])
    write.reshape(gradient, [numel, 1], out=scatter.output[0])
    return write.nodes


def _nearest_upsample(value: str, kernel: list[int], out: str, emit: Emitter) -> list[onnx.NodeProto]:
    """`value` [N, C, *spatial] with each element repeated over a `kernel` block (a nearest upsample by the
    kernel) for 1 or 2 spatial axes: one Resize."""
    factors = emit.name()
    emit.initializers.append(onnx.numpy_helper.from_array(np.array([1, 1] + kernel, np.float32), factors))
    return [helper.make_node("Resize", [value, "", factors], [out], name=out, **_NEAREST)]


def assign_unique_scatters(model: onnx.ModelProto) -> int:
    """Turn ScatterND(reduction="add") into zeros at unique indices into a plain ScatterND.

    The MaxPool adjoints `route_max_pool_adjoints` leaves alone (padded windows, say)
    still scatter-add into zeros at the argmax indices. Where the windows do not overlap
    no index repeats, so adding into zeros is assigning -- and onnxruntime's plain
    ScatterND runs about twice as fast as its accumulating one. Returns the number
    rewritten.
    """
    shapes = static_shapes(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    values = constants(model)
    rewritten = 0
    for node in model.graph.node:
        if node.op_type != "ScatterND" or _attributes(node).get("reduction") != b"add" or \
                not _is_zeros(node.input[0], producers, values):
            continue
        pool = _indices_source(node.input[1], producers, shapes)
        if pool is not None and _disjoint_windows(pool):
            for attribute in node.attribute:
                if attribute.name == "reduction":
                    attribute.s = b"none"
            rewritten += 1
    return rewritten
