"""Rewrite of the forward graph, before differentiation: pools with ceil_mode=1 in forms onnx-ad differentiates.

onnx-ad refuses an AveragePool with ceil_mode=1 in reverse mode, since a window can then
overhang the input ("which no convolution reproduces"). torch exports `ceil_mode=True`
pools that way (ResNet-D's average-pool shortcut, Inception-style stems).

- Where rounding the output size up and down gives the same size -- a 2x2 pool of stride 2 on
  an even map -- no window overhangs, the windows are the same in both modes, and the flag is
  dropped (`drop_idle_ceil_modes`, for every pool kind).
- Where a window does overhang, an AveragePool is the sum over each window of what lies in it,
  divided by a count that depends on the window only. It is written as the input zero-padded
  far enough that every window fits, an AveragePool with ceil_mode 0 and its padding counted
  (the sum over the window, divided by its area), and a constant per output position: the area
  over the count (`pad_overhanging_average_pools`). Which cells the count takes -- the input's
  only (count_include_pad=0), or the explicit padding's too -- is onnxruntime's choice; the
  rewrite computes both counts and keeps the one under which its output equals onnxruntime's
  own on a random input (run once, when the graph is built), or leaves the node alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.toolkit import Emitter, opset_of, rebuild, static_shapes

__all__ = ["drop_idle_ceil_modes", "pad_overhanging_average_pools"]

#: The opset from which Pad takes its pads as an input (the spelling written here).
_PAD_AS_INPUT = 11
#: The largest map (elements of one channel) whose counts are written as a constant.
_MAX_COUNT_ELEMENTS = 1 << 20


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _geometry(node: onnx.NodeProto, x: tuple[int, ...] | None) -> tuple[list[int], ...] | None:
    """(kernel, strides, pads, dilations) of a ceil-mode pool of static input and explicit pads; else None."""
    attributes = _attributes(node)
    if node.op_type not in ("AveragePool", "MaxPool", "LpPool") or not attributes.get("ceil_mode", 0) or \
            x is None or attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    kernel = list(attributes.get("kernel_shape", []))
    spatial = len(kernel)
    strides = list(attributes.get("strides", [1] * spatial))
    pads = list(attributes.get("pads", [0] * 2 * spatial))
    dilations = list(attributes.get("dilations", [1] * spatial))
    if not spatial or len(x) != spatial + 2 or len(strides) != spatial or len(pads) != 2 * spatial or \
            len(dilations) != spatial:
        return None
    return kernel, strides, pads, dilations


def drop_idle_ceil_modes(model: onnx.ModelProto) -> int:
    """Set ceil_mode to 0 on each pool whose windows all fit the (padded) input anyway, in place (module
    docstring). Returns the number rewritten."""
    shapes = static_shapes(model)
    rewritten = 0
    for node in model.graph.node:
        geometry = _geometry(node, shapes.get(node.input[0]) if node.input else None)
        if geometry is None:
            continue
        kernel, strides, pads, dilations = geometry
        x, spatial = shapes[node.input[0]], len(kernel)
        spans = [x[a + 2] + pads[a] + pads[a + spatial] - ((kernel[a] - 1) * dilations[a] + 1)
                 for a in range(spatial)]
        if any(span < 0 or span % stride for span, stride in zip(spans, strides)):
            continue   # a window would overhang: ceil_mode matters there
        kept = [a for a in node.attribute if a.name != "ceil_mode"]
        node.ClearField("attribute")
        node.attribute.extend(kept)
        rewritten += 1
    return rewritten


def pad_overhanging_average_pools(model: onnx.ModelProto) -> int:
    """Rewrite each ceil-mode AveragePool whose windows overhang, of static shapes and no dilation, in place
    (module docstring). Returns the number rewritten."""
    opset = opset_of(model)
    if opset < _PAD_AS_INPUT:
        return 0
    shapes = static_shapes(model)
    emit = Emitter(model, "ceil_pool")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        x = shapes.get(node.input[0]) if node.op_type == "AveragePool" else None
        y = shapes.get(node.output[0]) if x is not None else None
        geometry = _geometry(node, x) if y is not None and len(y) == len(x) else None
        return _padded_pool(node, x, y, geometry, opset, emit) if geometry is not None else None

    return rebuild(model, emit, replace)


def _padded_pool(node: onnx.NodeProto, x: tuple[int, ...], y: tuple[int, ...], geometry: tuple[list[int], ...],
                 opset: int, emit: Emitter) -> list[onnx.NodeProto] | None:
    kernel, strides, pads, dilations = geometry
    spatial = len(kernel)
    if any(d != 1 for d in dilations) or int(np.prod(x[2:])) > _MAX_COUNT_ELEMENTS:
        return None
    heads, tails = pads[:spatial], pads[spatial:]
    # the end padding that lets every one of the y windows fit: (y - 1) * s + k - (x + head)
    ends = [(o - 1) * s + k - (size + h) for o, s, k, size, h in zip(y[2:], strides, kernel, x[2:], heads)]
    if any(e < t for e, t in zip(ends, tails)):
        return None
    area = float(np.prod(kernel))
    counts = {}
    for counted in ("input", "padded"):
        # in the padded map's coordinates: the input is [head, head + size), its explicit padding [0, head) and
        # [head + size, head + size + tail); the rest up to `ends` is the overhang, never counted
        mask = np.zeros([1, 1] + [h + size + e for h, size, e in zip(heads, x[2:], ends)], np.float32)
        if counted == "input":
            inside = [slice(h, h + size) for h, size in zip(heads, x[2:])]
        else:
            inside = [slice(0, h + size + t) for h, size, t in zip(heads, x[2:], tails)]
        mask[tuple([0, 0] + inside)] = 1.0
        window_sums = _window_sums(mask, kernel, strides)
        if window_sums.shape[2:] != tuple(y[2:]) or np.any(window_sums <= 0):
            return None
        counts[counted] = window_sums
    feeds = np.random.default_rng(0).standard_normal((1, 1) + tuple(x[2:])).astype(np.float32)
    wanted = _run_alone(node, feeds, opset)
    for counted, window_sums in counts.items():
        scale = (area / window_sums).astype(np.float32)
        got = _window_sums(np.pad(feeds, [(0, 0), (0, 0)] + list(zip(heads, ends))), kernel, strides) * \
            (scale / area)
        if wanted is not None and wanted.shape == got.shape and np.allclose(got, wanted, rtol=1e-5, atol=1e-6):
            return _nodes(node, spatial, heads, ends, kernel, strides, scale, emit)
    return None


def _window_sums(values: np.ndarray, kernel: list[int], strides: list[int]) -> np.ndarray:
    """The sum over every window of a [1, 1, ...] map that the windows fit exactly (float64)."""
    windows = np.lib.stride_tricks.sliding_window_view(values.astype(np.float64), kernel, axis=tuple(
        range(2, 2 + len(kernel))))
    windows = windows[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
    return windows.sum(axis=tuple(range(-len(kernel), 0)))


def _run_alone(node: onnx.NodeProto, x: np.ndarray, opset: int) -> np.ndarray | None:
    """What onnxruntime makes of this pool on one channel of `x`."""
    single = helper.make_node("AveragePool", ["x"], ["y"], **_attributes(node))
    graph = helper.make_graph([single], "pool", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                               list(x.shape))],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x})[0]
    except Exception:  # noqa: BLE001 -- a pool onnxruntime will not run alone is left as it is
        return None


def _nodes(node: onnx.NodeProto, spatial: int, heads: list[int], ends: list[int], kernel: list[int],
           strides: list[int], scale: np.ndarray, emit: Emitter) -> list[onnx.NodeProto]:
    padded, pooled, factor = emit.name(), emit.name(), emit.name()
    emit.initializers.append(numpy_helper.from_array(scale, factor))
    return [helper.make_node("Pad", [node.input[0], emit.ints([0, 0] + heads + [0, 0] + ends)], [padded],
                             name=padded),
            helper.make_node("AveragePool", [padded], [pooled], name=pooled, kernel_shape=kernel, strides=strides,
                             count_include_pad=1),
            helper.make_node("Mul", [pooled, factor], [node.output[0]], name=node.name or emit.name())]
