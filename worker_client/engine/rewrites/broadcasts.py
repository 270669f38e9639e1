"""Rewrite of the adjoints: a broadcast left to the op that reads it, not materialized by an Expand first.

onnx-ad's adjoint of a reduction (ReduceSum, ReduceMean: a BatchNorm's or LayerNorm's statistics, a
mean loss, a softmax's normalizer) spreads the small gradient back to the input's shape with an
Expand, and a ReduceMean's then divides that full-size tensor by the count. Its readers are
elementwise ops whose other operand has the full shape anyway, so the broadcast they do themselves
gives the same values: the Expand and every elementwise op with a scalar between it and them are
passes over the full tensor for nothing. In a training-mode BatchNorm over [32, 64, 32, 32] that was
an Expand and a Div of 2 M elements for each of its two statistics, 4 of the 12 full passes of its
adjoint.

Here an Expand(a) followed by Reshapes (and Identity, Squeeze, Unsqueeze) and by elementwise ops with
a one-element operand (Mul, Div, Add, Sub; and Neg), all with one reader each, and read at the end only by
Add, Sub, Mul, Div or Sum nodes that have another operand of the full shape (their output keeps that
shape), is replaced by `a` reshaped to the broadcast shape those readers need, with the same scalar ops
applied to the small tensor. Exact: every element of the result is the same operation on the same
value. A Reshape the small tensor cannot follow (it would split a broadcast axis from a full one)
stops the rewrite.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, static_shapes, subgraph_reads

__all__ = ["broadcast_in_readers"]

#: Ops that hand their input on with another shape and the same elements.
_RESHAPING = frozenset({"Reshape", "Identity", "Squeeze", "Unsqueeze"})
#: Binary elementwise ops that a scalar constant operand keeps shape-preserving.
_WITH_SCALAR = frozenset({"Mul", "Div", "Add", "Sub"})
#: Readers that broadcast their operands themselves.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Sum"})


def broadcast_in_readers(model: onnx.ModelProto) -> int:
    """Each Expand whose readers would broadcast its input themselves, left to them (module docstring);
    in place. Returns the number of Expands bypassed (prune drops them). Counts readers: dead nodes first."""
    graph = model.graph
    shapes = static_shapes(model)
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    opaque = {value.name for value in graph.output}   # read where this pass cannot see: left alone
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
        opaque |= subgraph_reads(node)
    plans = {index: plan for index, node in enumerate(graph.node) if node.op_type == "Expand"
             and (plan := _plan(node, shapes, readers, opaque)) is not None}
    # a reader must keep a full-size operand: not one that another plan makes small too
    shrinking = {last for plan in plans.values() for _, last, _ in plan.ends}
    position = {id(node): index for index, node in enumerate(graph.node)}
    emit = Emitter(model, "broadcast")
    inserted: dict[int, list[onnx.NodeProto]] = defaultdict(list)
    changed = 0
    for index, plan in plans.items():
        if not all(any(shapes.get(name) == shapes.get(last) and name not in shrinking for name in reader.input)
                   for reader, last, _ in plan.ends):
            continue
        reshape, value = emit.reshape(graph.node[index].input[0], plan.small)
        nodes = [reshape]
        for op, source in plan.scalar_ops:
            out = emit.name()
            nodes.append(helper.make_node(op.op_type, [value if name == source else name for name in op.input],
                                          [out], name=out))
            value = out
        at: dict[tuple[int, ...], str] = {}   # a scalar op of a higher rank may have raised the value's
        for reader, last, small in plan.ends:
            if tuple(small) not in at:
                shaped, at[tuple(small)] = emit.reshape(value, small)
                nodes.append(shaped)
            reader.input[:] = [at[tuple(small)] if name == last else name for name in reader.input]
        # before the first reader: what the new nodes read (the Expand's input, the scalars) is computed by then
        inserted[min(position[id(reader)] for reader, _, _ in plan.ends)].extend(nodes)
        changed += 1
    if changed:
        nodes = []
        for index, node in enumerate(graph.node):
            nodes += inserted.get(index, [])
            nodes.append(node)
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(emit.initializers)
    return changed


class _Plan:
    """What replaces an Expand: its input reshaped to `small`, the scalar ops applied to it in order (each
    with the name it read the chain by), and each broadcasting reader with the name it reads and the small
    shape it needs there."""

    def __init__(self, small: list[int], scalar_ops: list[tuple[onnx.NodeProto, str]],
                 ends: list[tuple[onnx.NodeProto, str, list[int]]]) -> None:
        self.small, self.scalar_ops, self.ends = small, scalar_ops, ends


def _plan(expand: onnx.NodeProto, shapes: dict[str, tuple[int, ...]],
          readers: dict[str, list[onnx.NodeProto]], opaque: set[str]) -> _Plan | None:
    """How to leave an Expand to its readers, or None when it cannot be."""
    source, current = expand.input[0], expand.output[0]
    small_in, full = shapes.get(source), shapes.get(current)
    if small_in is None or full is None or len(small_in) > len(full):
        return None
    full = list(full)
    small = [1] * (len(full) - len(small_in)) + list(small_in)
    if any(s not in (1, f) for s, f in zip(small, full)) or small == full:
        return None
    # a chain of single readers: reshapes and scalar ops (which commute with the reshapes)
    scalar_ops: list[tuple[onnx.NodeProto, str]] = []
    while current not in opaque and len(readers[current]) == 1:
        node = readers[current][0]
        out_shape = shapes.get(node.output[0])
        if out_shape is None:
            return None
        if node.op_type in _RESHAPING and node.input[0] == current:
            mapped = _follow_reshape(full, small, list(out_shape))
            if mapped is None:
                break
            full, small = list(out_shape), mapped
        elif _applies_scalar(node, current, shapes, full) and list(out_shape) == full:
            scalar_ops.append((node, current))
        else:
            break
        current = node.output[0]
    ends: list[tuple[onnx.NodeProto, str, list[int]]] = []
    if not _broadcasting_readers(current, full, small, shapes, readers, opaque, ends):
        return None
    return _Plan(small, scalar_ops, ends)


def _broadcasting_readers(current: str, full: list[int], small: list[int], shapes: dict[str, tuple[int, ...]],
                          readers: dict[str, list[onnx.NodeProto]], opaque: set[str],
                          ends: list[tuple[onnx.NodeProto, str, list[int]]]) -> bool:
    """Whether every reader of `current` (of shape `full`, `small` once left to broadcasting) is a
    broadcasting op keeping that shape, or a reshape whose readers are, recursively; collects the former."""
    if current in opaque or not readers[current]:
        return False
    for node in readers[current]:
        out_shape = shapes.get(node.output[0])
        if out_shape is None:
            return False
        if node.op_type in _RESHAPING and node.input[0] == current:
            mapped = _follow_reshape(full, small, list(out_shape))
            if mapped is None or not _broadcasting_readers(node.output[0], list(out_shape), mapped, shapes,
                                                           readers, opaque, ends):
                return False
        elif node.op_type in _BROADCASTING and list(out_shape) == full and list(node.input).count(current) == 1:
            ends.append((node, current, small))
        else:
            return False
    return True


def _applies_scalar(node: onnx.NodeProto, value: str, shapes: dict[str, tuple[int, ...]], full: Sequence[int]) -> bool:
    """Whether `node` is Neg of `value`, or a Mul, Div, Add or Sub of `value` and a value of one element
    (a constant, or a count onnx-ad computes) whose rank does not exceed the value's."""
    if node.op_type == "Neg":
        return True
    if node.op_type not in _WITH_SCALAR or len(node.input) != 2 or list(node.input).count(value) != 1:
        return False
    other = shapes.get(node.input[1] if node.input[0] == value else node.input[0])
    return other is not None and int(np.prod(other)) == 1 and len(other) <= len(full)


def _follow_reshape(full: list[int], small: list[int], target: list[int]) -> list[int] | None:
    """The broadcast shape of `small` (each axis 1 or the full size) after `full` is reshaped to `target`, or
    None where a group of axes the reshape merges or splits mixes broadcast and full axes."""
    from_axes = [axis for axis, size in enumerate(full) if size != 1]
    to_axes = [axis for axis, size in enumerate(target) if size != 1]
    result = [1] * len(target)
    i = j = 0
    while i < len(from_axes):
        group_from, group_to = [from_axes[i]], []
        product_from, product_to = full[from_axes[i]], 1
        i += 1
        while product_to != product_from:
            if product_to < product_from:
                if j == len(to_axes):
                    return None
                group_to.append(to_axes[j])
                product_to *= target[to_axes[j]]
                j += 1
            else:
                if i == len(from_axes):
                    return None
                group_from.append(from_axes[i])
                product_from *= full[from_axes[i]]
                i += 1
        kinds = {small[axis] == full[axis] for axis in group_from}
        if len(kinds) != 1:
            return None
        if kinds.pop():
            for axis in group_to:
                result[axis] = target[axis]
    return result if j == len(to_axes) else None

