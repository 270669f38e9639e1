"""Transposes, reductions and broadcasts over size-1 axes, rewritten onto fast kernels."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import (
    Emitter,
    constants,
    opset_of,
    rebuild,
    reduction_axes,
    shapes_and_types,
    static_shapes,
    subgraph_reads,
)

__all__ = ["canonicalize_layout_ops", "drop_no_op_layout_ops", "space_to_depth_transposes"]

#: Reductions whose result over merged axes equals the result over the axes one by one.
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"})
#: Elementwise ops whose broadcasting loop onnxruntime runs slowly over size-1 axes.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Greater",
                           "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or"})
#: Outputs smaller than this keep their broadcasting op as it is.
_BROADCAST_MIN_ELEMENTS = 1024
#: First opset in which each reduction takes its axes as an input rather than an attribute.
_AXES_AS_INPUT = {"ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18}


def _squeezed(shape: Sequence[int]) -> list[int]:
    """Axes of `shape` that are not of size 1."""
    return [axis for axis, size in enumerate(shape) if size != 1]


def _canonical_transpose(shape: Sequence[int], perm: Sequence[int]
                         ) -> tuple[list[int], list[int]]:
    """The smallest (input shape, perm) doing the same data movement as `perm` on `shape`:
    size-1 axes dropped, and axes that stay adjacent and in order merged."""
    kept = _squeezed(shape)
    position = {axis: index for index, axis in enumerate(kept)}
    order = [position[axis] for axis in perm if axis in position]  # squeezed axes, out order
    groups: list[list[int]] = []
    for axis in order:
        if groups and groups[-1][-1] + 1 == axis:
            groups[-1].append(axis)
        else:
            groups.append([axis])
    by_input = sorted(range(len(groups)), key=lambda g: groups[g][0])
    merged_shape = [int(np.prod([shape[kept[a]] for a in groups[g]])) for g in by_input]
    rank_of = {g: index for index, g in enumerate(by_input)}
    return merged_shape, [rank_of[g] for g in range(len(groups))]


def _canonical_reduction(shape: Sequence[int], axes: set[int]
                         ) -> tuple[list[int], list[int]]:
    """(merged shape, reduced axes of it) for reducing `axes` of `shape`, size-1 axes dropped
    and neighbouring axes of the same kind (reduced / kept) merged."""
    merged: list[int] = []
    kinds: list[bool] = []
    for axis in _squeezed(shape):
        reduced = axis in axes
        if kinds and kinds[-1] == reduced:
            merged[-1] *= shape[axis]
        else:
            merged.append(shape[axis])
            kinds.append(reduced)
    return merged, [axis for axis, reduced in enumerate(kinds) if reduced]


def canonicalize_layout_ops(model: onnx.ModelProto) -> int:
    """Rewrite Transposes, reductions and broadcasting ops over tensors with size-1 axes,
    in place.

    onnx-ad carries a trailing seed axis of length 1 on every derivative tensor, and
    onnxruntime's kernels only take their fast paths on shapes without size-1 axes: a
    ReduceSum over axis 1 of a [1024, 8, 1] tensor runs some 20 times slower than over the
    same data as [1024, 8], and a Mul of a [64, 8, 128, 1] tensor by a scalar some 60
    times slower than of a [64, 8, 128] one (its broadcast loop degenerates to one element
    per step). Each such op with static shapes becomes Reshape -> op on the shape without
    the size-1 axes -> Reshape (a lone Reshape where the op moves or reduces nothing), and
    chains of Reshapes are collapsed. Returns the number of ops rewritten.
    """
    shapes = static_shapes(model)
    known = constants(model)
    opset = opset_of(model)
    emit = Emitter(model, "canonical")
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in model.graph.node:
        replacement = None
        shape = shapes.get(node.input[0]) if node.input else None
        out_shape = shapes.get(node.output[0]) if node.output else None
        if shape is not None and out_shape is not None and 1 in shape:
            if node.op_type == "Transpose":
                replacement = _transpose(node, shape, out_shape, emit)
            elif node.op_type in _REDUCTIONS:
                replacement = _reduction(node, shape, out_shape, known, opset, emit)
        if out_shape is not None and 1 in out_shape and node.op_type in _BROADCASTING:
            if all(name in shapes for name in node.input):
                operands = [shapes[name] for name in node.input]
                replacement = _broadcasting(node, operands, out_shape, emit)
        if replacement is None:
            nodes.append(node)
        else:
            nodes.extend(replacement)
            rewritten += 1
    if rewritten:
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(emit.initializers)
        _collapse_reshape_chains(model)
    return rewritten


def _broadcasting(node: onnx.NodeProto, operands: Sequence[tuple[int, ...]],
                  out_shape: tuple[int, ...], emit: Emitter) -> list[onnx.NodeProto] | None:
    """The op on operands with the output's size-1 axes removed; single-element operands
    are left alone (they broadcast against anything)."""
    if int(np.prod(out_shape)) < _BROADCAST_MIN_ELEMENTS:
        return None  # the two Reshapes would cost more than the slow path saves
    keep = [axis for axis, size in enumerate(out_shape) if size != 1]
    result: list[onnx.NodeProto] = []
    inputs = []
    for name, shape in zip(node.input, operands):
        aligned = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
        target = [aligned[axis] for axis in keep]
        if int(np.prod(shape)) == 1 or list(shape) == target:
            inputs.append(name)
            continue
        reshape, reshaped = emit.reshape(name, target)
        result.append(reshape)
        inputs.append(reshaped)
    computed = emit.name()
    op = onnx.NodeProto()
    op.CopyFrom(node)
    del op.input[:]
    op.input.extend(inputs)
    op.output[0] = computed
    op.name = computed
    return result + [op, emit.reshape(computed, out_shape, out=node.output[0])[0]]


def _collapse_reshape_chains(model: onnx.ModelProto) -> None:
    """Point every Reshape whose input comes from another Reshape at that one's input, in
    place (the inner one is left to dead-node pruning if nothing else reads it)."""
    produced_by = {node.output[0]: node for node in model.graph.node
                   if node.op_type == "Reshape"}
    for node in model.graph.node:
        if node.op_type != "Reshape":
            continue
        source = node.input[0]
        while source in produced_by:
            source = produced_by[source].input[0]
        node.input[0] = source


def _transpose(node: onnx.NodeProto, shape: tuple[int, ...], out_shape: tuple[int, ...],
               emit: Emitter) -> list[onnx.NodeProto] | None:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"),
                list(reversed(range(len(shape)))))
    merged, merged_perm = _canonical_transpose(shape, perm)
    if merged_perm == sorted(merged_perm):  # moves only size-1 axes: a reshape
        return [emit.reshape(node.input[0], out_shape, out=node.output[0])[0]]
    if len(merged) >= len(shape):
        return None
    to_merged, merged_in = emit.reshape(node.input[0], merged)
    moved = emit.name()
    return [to_merged,
            helper.make_node("Transpose", [merged_in], [moved], name=moved, perm=merged_perm),
            emit.reshape(moved, out_shape, out=node.output[0])[0]]


def _reduction(node: onnx.NodeProto, shape: tuple[int, ...], out_shape: tuple[int, ...],
               known: dict[str, np.ndarray], opset: int,
               emit: Emitter) -> list[onnx.NodeProto] | None:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axes = reduction_axes(node, known)
    if axes is None:
        return None  # axes computed at run time
    if not axes:
        if attributes.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(len(shape)))
    merged, merged_axes = _canonical_reduction(shape, {a % len(shape) for a in axes})
    if not merged_axes:  # only size-1 axes are reduced: the data is unchanged
        return [emit.reshape(node.input[0], out_shape, out=node.output[0])[0]]
    if len(merged) >= len(shape):
        return None
    to_merged, merged_in = emit.reshape(node.input[0], merged)
    reduced = emit.name()
    if opset >= _AXES_AS_INPUT[node.op_type]:
        op = helper.make_node(node.op_type, [merged_in, emit.ints(merged_axes)], [reduced],
                              name=reduced, keepdims=1)
    else:
        op = helper.make_node(node.op_type, [merged_in], [reduced], name=reduced,
                              axes=merged_axes, keepdims=1)
    return [to_merged, op, emit.reshape(reduced, out_shape, out=node.output[0])[0]]


#: Element types onnxruntime's CPU SpaceToDepth takes.
_SPACE_TO_DEPTH_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


def space_to_depth_transposes(model: onnx.ModelProto) -> int:
    """Rewrite Transposes that gather s x s blocks of a map into channels as one SpaceToDepth, in place.

    The adjoint of a DepthToSpace in CRD mode -- torch's PixelShuffle exports as one -- has no op of its
    own, and onnx-ad writes it as a Reshape to [N, C, H, s, W, s], a Transpose to [N, C, s, s, H, W] and a
    Reshape back: onnxruntime runs that 6-D Transpose element by element, 1.3 ms on [32, 16, 32, 32] at
    one thread. With N and C folded together into the batch and one channel, the same permutation is
    SpaceToDepth's (whose channel order is then just the block position): 0.15 ms on the same tensor. Any
    Transpose whose data movement is that one (size-1 axes and axes that stay together aside, so also
    [N*C, H, s, W, s] and the like) with the same block along both axes becomes Reshape -> SpaceToDepth ->
    Reshape. Exact: both move the same elements. Returns the number rewritten.
    """
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, "space_to_depth")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "Transpose":
            return None
        shape, out_shape = shapes.get(node.input[0]), shapes.get(node.output[0])
        if shape is None or out_shape is None or types.get(node.input[0]) not in _SPACE_TO_DEPTH_TYPES:
            return None
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(len(shape)))[::-1])
        merged, order = _canonical_transpose(shape, perm)
        if order == [1, 3, 0, 2] and len(merged) == 4:    # no batch left once size-1 axes are dropped
            merged, order = [1, *merged], [0, 2, 4, 1, 3]
        if order != [0, 2, 4, 1, 3] or merged[2] != merged[4]:
            return None
        batch, height, block, width, _ = merged
        blocks = emit.name()
        to_map, source = emit.reshape(node.input[0], [batch, 1, height * block, width * block])
        return [to_map,
                helper.make_node("SpaceToDepth", [source], [blocks], name=blocks, blocksize=block),
                emit.reshape(blocks, list(out_shape), out=node.output[0])[0]]

    return rebuild(model, emit, replace)


def drop_no_op_layout_ops(model: onnx.ModelProto) -> int:
    """Expands and Identities that hand on their input unchanged bypassed, and Transposes that move only
    size-1 axes written as Reshapes; in place. Returns the number changed.

    onnx-ad writes an Expand of every adjoint to the shape it already has and an Identity onto each
    output; in the main graph onnxruntime drops most of them, but in a Scan body run once per time step
    each costs a kernel launch per step (rewrites/scans.py). An Expand or Identity is bypassed where its
    output is not a graph output (its readers read the input); a Transpose whose non-1 axes keep their
    order is a Reshape, which onnxruntime runs without a copy; an Identity onto a graph output from a
    computed value is dropped, the value's producer writing the output itself and its other readers reading
    it there."""
    graph = model.graph
    shapes = static_shapes(model)
    kept = {value.name for value in graph.output}   # and what a subgraph reads from this one
    for node in graph.node:
        kept |= subgraph_reads(node)
    emit = Emitter(model, "no_op")
    bypass: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    reshaped = 0
    for node in graph.node:
        node.input[:] = [bypass.get(name, name) for name in node.input]
        source, result = (node.input[0] if node.input else ""), node.output[0]
        before, after = shapes.get(source), shapes.get(result)
        if node.op_type in ("Expand", "Identity") and before is not None and before == after and result not in kept:
            bypass[result] = source
            continue
        if node.op_type == "Transpose" and before is not None and after is not None:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(len(before)))[::-1])
            moved = [axis for axis in perm if before[axis] != 1]
            if moved == sorted(moved):
                nodes.append(helper.make_node("Reshape", [source, emit.ints(list(after))], [result],
                                              name=node.name or result))
                reshaped += 1
                continue
        nodes.append(node)
    # an Identity onto a graph output from a computed value: the value's producer writes the output, and the
    # value's other readers read it there (a Scan body's output copied per step, the gates' adjoints the
    # reverse sweep hands out and also multiplies on)
    producers = {name: node for node in nodes for name in node.output}
    written = 0
    for node in list(nodes):
        value = node.input[0] if node.op_type == "Identity" else ""
        if value not in producers or node.output[0] not in kept or value in kept:
            continue
        producer = producers.pop(value)
        producer.output[:] = [node.output[0] if name == value else name for name in producer.output]
        producers[node.output[0]] = producer
        nodes.remove(node)
        for reader in nodes:
            reader.input[:] = [node.output[0] if name == value else name for name in reader.input]
        written += 1
    if bypass or reshaped or written:
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(emit.initializers)
    return len(bypass) + reshaped + written
