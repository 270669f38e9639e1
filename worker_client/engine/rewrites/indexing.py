"""Rewrite of the forward graph, before differentiation: stepped Slices and edge, reflect and wrap Pads in ops
onnx-ad differentiates.

onnx-ad refuses a Slice with a step other than 1 ("not differentiated in reverse mode") and
a Pad in any mode but constant. Both come from ordinary models: a strided slice `h[:, ::2]`,
a Conv with `padding_mode="replicate"` or `"reflect"` (torch exports the padding as a Pad
in mode edge or reflect), and this engine's own rewrites, which take a strided conv's
windows and a flipped kernel as stepped Slices (grouped.py, and the transposed convolutions
of transposed.py). With static shapes each is exactly a selection of indices along its axes:

- a positive step s along an axis of size D, from `start`, keeping n elements: the
  step-1 window [start, start + n*s) (zero-padded at its end where it passes D), reshaped
  to [n, s] on that axis, of which the first column is kept. Every op here (Slice, Pad,
  Reshape) has an adjoint that is a copy, not a scatter;
- a negative step (a reversal): a Gather of the constant indices Python's `slice` gives;
- a Pad in mode edge, reflect or wrap: a Gather of the constant source index of every output
  position along each padded axis (edge repeats the border, reflect mirrors it without
  repeating it, wrap goes round). Its adjoint scatter-adds, so a border element gets the
  gradients of all its copies.

A constant-mode Pad with negative pads (cropping, as `F.pad(x, (-1, -1))` exports) is split
into a step-1 Slice for the crop and a Pad of the rest (`slice_cropping_pads`): onnx-ad's
adjoint of such a Pad slices the gradient but never pads it back, so the graph either failed
to load (an Expand of mismatched shapes) or, where the cropped axis ended at length 1,
broadcast it: a silently wrong gradient.

The values are the original op's, copied: nothing is computed. Slices and Pads whose data
has no static shape, or whose bounds are not constants, are left to onnx-ad (which then
refuses them only if a gradient must flow through them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.fold import evaluate_node
from worker_client.engine.rewrites.toolkit import Emitter, constants, opset_of, rebuild, static_shapes

__all__ = ["gather_copying_pads", "index_without_steps_or_copying_pads", "slice_cropping_pads", "unstep_slices"]

#: The opset from which Slice takes its bounds, and Pad its pads, as inputs.
_BOUNDS_AS_INPUTS = {"Slice": 10, "Pad": 11}


#: Most nodes evaluated to find one bound (an exporter's Unsqueeze / Cast / Concat of constants).
_BOUND_NODES = 32


class _Bounds:
    """Integer operands that are constants, or computed from constants and the shapes of static tensors only
    (torch exports a Slice's bounds as Unsqueezes of Constants, and a Pad's pads as arithmetic on its input's
    Shape, when it does not fold constants): evaluated node by node with onnx's reference evaluator, never
    written into the graph."""

    def __init__(self, model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.values = {k: v for k, v in constants(model).items() if v.dtype.kind in "iu"}
        self.producers = {out: node for node in model.graph.node for out in node.output}
        self.opset = opset_of(model)

    def ints(self, node: onnx.NodeProto, index: int) -> list[int] | None:
        """The integer list at input `index`; [] when the input is absent; None when it is not constant."""
        if len(node.input) <= index or not node.input[index]:
            return []
        value = self._value(node.input[index], [_BOUND_NODES])
        if value is None or value.dtype.kind not in "iu":
            return None
        return [int(v) for v in np.asarray(value).reshape(-1)]

    def _value(self, name: str, budget: list[int]) -> np.ndarray | None:
        if name in self.values:
            return self.values[name]
        node = self.producers.get(name)
        if node is None or budget[0] <= 0 or node.op_type in ("RandomNormal", "RandomUniform", "RandomNormalLike",
                                                               "RandomUniformLike", "Multinomial"):
            return None
        budget[0] -= 1
        if node.op_type in ("Shape", "Size"):
            shape = self.shapes.get(node.input[0])
            if shape is None:
                return None
            if node.op_type == "Size":
                self.values[name] = np.array(int(np.prod(shape, dtype=np.int64)), np.int64)
            else:
                attributes = {a.name: a.i for a in node.attribute}
                picked = shape[attributes.get("start", 0):attributes.get("end", len(shape))]
                self.values[name] = np.array(picked, np.int64)
            return self.values[name]
        operands = {}
        for operand in node.input:
            if operand:
                value = self._value(operand, budget)
                if value is None:
                    return None
                operands[operand] = value
        results = evaluate_node(node, operands, self.opset)
        if results is None:
            return None
        for out, result in zip(node.output, results):
            self.values[out] = np.asarray(result)
        return self.values.get(name)


def unstep_slices(model: onnx.ModelProto) -> int:
    """Rewrite every Slice with a step other than 1, constant bounds and static data, in place (module
    docstring). Returns the number rewritten."""
    if opset_of(model) < _BOUNDS_AS_INPUTS["Slice"]:
        return 0
    shapes = static_shapes(model)
    bounds = _Bounds(model, shapes)
    emit = Emitter(model, "unstepped")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        plan = _slice_plan(node, shapes, bounds) if node.op_type == "Slice" else None
        return None if plan is None else _unstepped(node, shapes[node.input[0]], plan, emit)

    return rebuild(model, emit, replace)


def _slice_plan(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]],
                bounds: _Bounds) -> list[tuple[int, int, int, int]] | None:
    """(axis, start, step, count) for each sliced axis, normalized as onnx defines it (and as Python's `slice`
    does); None unless some step is not 1 and everything is static."""
    shape = shapes.get(node.input[0])
    starts, ends, axes, steps = (bounds.ints(node, i) for i in range(1, 5))
    if shape is None or starts is None or ends is None or axes is None or steps is None or \
            not steps or all(s == 1 for s in steps) or len(starts) != len(ends):
        return None
    rank = len(shape)
    axes = axes or list(range(len(starts)))
    if len(axes) != len(starts) or len(steps) != len(starts) or 0 in steps:
        return None
    plan = []
    for axis, start, end, step in zip(axes, starts, ends, steps):
        if not -rank <= axis < rank:
            return None
        axis %= rank
        first, stop, step = slice(start, end, step).indices(shape[axis])
        plan.append((axis, first, step, len(range(first, stop, step))))
    return plan


def _unstepped(node: onnx.NodeProto, shape: tuple[int, ...], plan: list[tuple[int, int, int, int]],
               emit: Emitter) -> list[onnx.NodeProto]:
    nodes: list[onnx.NodeProto] = []
    source, dims = node.input[0], list(shape)
    plain = [(axis, first, count) for axis, first, step, count in plan if step == 1]
    if plain:
        out = emit.name()
        nodes.append(helper.make_node("Slice", [source, emit.ints([f for _, f, _ in plain]),
                                                emit.ints([f + c for _, f, c in plain]),
                                                emit.ints([a for a, _, _ in plain])], [out], name=out))
        source = out
        for axis, _, count in plain:
            dims[axis] = count
    stepped = [(axis, first, step, count) for axis, first, step, count in plan if step != 1]
    for position, (axis, first, step, count) in enumerate(stepped):
        out = node.output[0] if position == len(stepped) - 1 else emit.name()
        if step < 0 or count == 0:
            indices = np.arange(first, first + step * count, step, dtype=np.int64)
            nodes.append(helper.make_node("Gather", [source, emit.ints(indices.tolist())], [out],
                                          name=out, axis=axis))
        else:
            nodes += _every_nth(source, out, dims, axis, first, step, count, emit)
        dims[axis] = count
        source = out
    return nodes


def _every_nth(source: str, out: str, dims: list[int], axis: int, first: int, step: int, count: int,
               emit: Emitter) -> list[onnx.NodeProto]:
    """Elements first, first + step, ... (count of them) along `axis`, by a step-1 window reshaped to
    [count, step] of which column 0 is kept."""
    nodes: list[onnx.NodeProto] = []
    end = first + count * step
    window = emit.name()
    nodes.append(helper.make_node("Slice", [source, emit.ints([first]), emit.ints([min(end, dims[axis])]),
                                            emit.ints([axis])], [window], name=window))
    if end > dims[axis]:   # the last window passes the end: zeros, which column 0 never keeps
        padded = emit.name()
        pads = [0] * (2 * len(dims))
        pads[len(dims) + axis] = end - dims[axis]
        nodes.append(helper.make_node("Pad", [window, emit.ints(pads)], [padded], name=padded))
        window = padded
    split, split_name = emit.reshape(window, dims[:axis] + [count, step] + dims[axis + 1:])
    column = emit.name()
    nodes += [split,
              helper.make_node("Slice", [split_name, emit.ints([0]), emit.ints([1]), emit.ints([axis + 1])],
                               [column], name=column),
              emit.reshape(column, dims[:axis] + [count] + dims[axis + 1:], out=out)[0]]
    return nodes


def index_without_steps_or_copying_pads(model: onnx.ModelProto) -> int:
    """`unstep_slices` and `gather_copying_pads` in sweeps until neither finds more, in place. onnx's shape
    inference stops at a Pad whose pads are computed (as torch exports them, with constant folding off), so
    what follows one has a static shape only once it is rewritten. Returns the number rewritten."""
    total = 0
    for _ in range(1 + sum(node.op_type in ("Slice", "Pad") for node in model.graph.node)):
        done = unstep_slices(model) + gather_copying_pads(model) + slice_cropping_pads(model)
        total += done
        if not done:
            break
    return total


def gather_copying_pads(model: onnx.ModelProto) -> int:
    """Rewrite every Pad in mode edge, reflect or wrap with constant pads and static data as Gathers, in place
    (module docstring). Returns the number rewritten."""
    return _rewrite_pads(model, "gathered_pad", _gathered)


def slice_cropping_pads(model: onnx.ModelProto) -> int:
    """Rewrite every constant-mode Pad with a negative pad, constant pads and static data as a Slice (the crop)
    and a Pad of what is left, in place (module docstring). Returns the number rewritten."""
    return _rewrite_pads(model, "cropping_pad", _cropped)


_PadOperands = tuple[str, tuple[int, ...], list[int], list[int]]


def _rewrite_pads(model: onnx.ModelProto, stem: str,
                  rewrite: Callable[[onnx.NodeProto, _PadOperands, Emitter], list[onnx.NodeProto] | None]) -> int:
    """Each Pad of static shape and pads swapped for what `rewrite` returns (None: kept)."""
    if opset_of(model) < _BOUNDS_AS_INPUTS["Pad"]:
        return 0
    shapes = static_shapes(model)
    bounds = _Bounds(model, shapes)
    emit = Emitter(model, stem)

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        found = _pad_operands(node, shapes, bounds)
        return None if found is None else rewrite(node, found, emit)

    return rebuild(model, emit, replace)


def _gathered(node: onnx.NodeProto, found: _PadOperands, emit: Emitter) -> list[onnx.NodeProto] | None:
    """An edge, reflect or wrap Pad as a Gather along each padded axis."""
    mode, shape, before, after = found
    if mode not in ("edge", "reflect", "wrap"):
        return None
    sources = [_sources(mode, size, b, a) for size, b, a in zip(shape, before, after)]
    if any(s is None for s in sources):
        return None   # reflect wider than the axis allows: onnxruntime's own error, left to it
    chain = [(axis, index) for axis, index in enumerate(sources)
             if index is not None and not np.array_equal(index, np.arange(shape[axis]))]
    nodes: list[onnx.NodeProto] = []
    source = node.input[0]
    if not chain:
        nodes.append(helper.make_node("Identity", [source], [node.output[0]], name=node.name or emit.name()))
    for position, (axis, index) in enumerate(chain):
        out = node.output[0] if position == len(chain) - 1 else emit.name()
        nodes.append(helper.make_node("Gather", [source, emit.ints(index.tolist())], [out],
                                      name=out if out != node.output[0] else (node.name or emit.name()),
                                      axis=axis))
        source = out
    return nodes


def _cropped(node: onnx.NodeProto, found: _PadOperands, emit: Emitter) -> list[onnx.NodeProto] | None:
    """A constant Pad with a negative pad as a Slice of the crop and a Pad of the rest."""
    mode, shape, before, after = found
    if mode != "constant" or not any(p < 0 for p in before + after):
        return None
    cut = [a for a in range(len(shape)) if before[a] < 0 or after[a] < 0]
    cropped = emit.name()
    nodes = [helper.make_node(
        "Slice", [node.input[0], emit.ints([max(-before[a], 0) for a in cut]),
                  emit.ints([shape[a] - max(-after[a], 0) for a in cut]), emit.ints(cut)], [cropped],
        name=cropped)]
    if any(p > 0 for p in before + after):
        value = [node.input[2]] if len(node.input) > 2 and node.input[2] else []
        nodes.append(helper.make_node(
            "Pad", [cropped, emit.ints([max(p, 0) for p in before] + [max(p, 0) for p in after])] + value,
            [node.output[0]], name=node.name or emit.name()))
    else:
        nodes.append(helper.make_node("Identity", [cropped], [node.output[0]], name=node.name or emit.name()))
    return nodes


def _pad_operands(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]], bounds: _Bounds) -> _PadOperands | None:
    """A Pad's mode, its data's static shape, and its pads before and after every axis (its `axes` input spread
    out); None for another node, or a Pad whose shape or pads are not static."""
    if node.op_type != "Pad":
        return None
    mode = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "mode"), b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    shape = shapes.get(node.input[0])
    pads = bounds.ints(node, 1) if shape is not None else None
    axes = bounds.ints(node, 3) if pads is not None else None
    if shape is None or pads is None or axes is None:
        return None
    rank = len(shape)
    if any(not -rank <= a < rank for a in axes):
        return None
    axes = [a % rank for a in axes] or list(range(rank))
    if len(pads) != 2 * len(axes):
        return None
    before, after = [0] * rank, [0] * rank
    for i, axis in enumerate(axes):
        before[axis], after[axis] = pads[i], pads[i + len(axes)]
    return mode, shape, before, after


def _sources(mode: str, size: int, before: int, after: int) -> np.ndarray | None:
    """The input index each output position along one axis copies (a negative pad crops)."""
    positions = np.arange(-before, size + after, dtype=np.int64)
    if size == 0:
        return None if len(positions) else positions
    if mode == "edge":
        return np.clip(positions, 0, size - 1)
    if mode == "wrap":
        return positions % size
    if max(before, after) >= size:   # reflect mirrors without the border: pads must be below the axis' size
        return None
    if size == 1:
        return positions
    period = 2 * (size - 1)
    folded = positions % period
    return np.where(folded < size, folded, period - folded)
