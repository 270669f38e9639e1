"""Shape-preserving rewrites that steer the gradient graph off onnxruntime's slow paths."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

__all__ = ["Emitter", "canonicalize_layout_ops", "constants", "flatten_weight_matmuls",
           "fold_shape_queries", "opset_of", "static_shapes"]

#: Reductions whose result over merged axes equals the result over the axes one by one.
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"})
#: Elementwise ops whose broadcasting loop onnxruntime runs slowly over size-1 axes.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Greater",
                           "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or"})
#: Outputs smaller than this keep their broadcasting op as it is.
_BROADCAST_MIN_ELEMENTS = 1024
#: Largest integer tensor (elements) that shape folding turns into a constant.
_FOLD_LIMIT = 64
#: First opset in which each reduction takes its axes as an input rather than an attribute.
_AXES_AS_INPUT = {"ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18}


def opset_of(model: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    return max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [1])


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every value whose shape is fully static, as inferred by onnx."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except onnx.shape_inference.InferenceError:
        inferred = model
    graph = inferred.graph
    shapes: dict[str, tuple[int, ...]] = {t.name: tuple(t.dims) for t in graph.initializer}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    return shapes


def constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values by name."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
    return values


class Emitter:
    """New nodes and int64 shape constants with names that collide with nothing."""

    def __init__(self, model: onnx.ModelProto, stem: str) -> None:
        graph = model.graph
        self.taken = {v.name for v in list(graph.input) + list(graph.output)}
        self.taken.update(t.name for t in graph.initializer)
        self.taken.update(out for node in graph.node for out in node.output)
        self.stem = stem
        self.counter = 0
        self.initializers: list[onnx.TensorProto] = []

    def name(self) -> str:
        """A fresh tensor (and node) name."""
        while True:
            self.counter += 1
            candidate = f"{self.stem}_{self.counter}"
            if candidate not in self.taken:
                self.taken.add(candidate)
                return candidate

    def ints(self, values: Sequence[int]) -> str:
        """A new int64 initializer holding `values`; returns its name."""
        name = self.name()
        self.initializers.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def reshape(self, value: str, shape: Sequence[int], out: str | None = None
                ) -> tuple[onnx.NodeProto, str]:
        """A Reshape of `value` to the static `shape`, and its output name."""
        out = out or self.name()
        return helper.make_node("Reshape", [value, self.ints(shape)], [out], name=out), out


def flatten_weight_matmuls(model: onnx.ModelProto) -> int:
    """Rewrite `MatMul(A[b..., K], W[K, N])` as a 2-D MatMul between two Reshapes, in place.

    onnx-ad differentiates a broadcast MatMul per batch element: the weight's gradient is a
    batched product `A[b]^T @ G[b]` followed by a ReduceSum over the batch -- `b` times the
    memory of the single `A2^T @ G2` GEMM that the flattened form gets. Only MatMuls whose
    left operand has a static shape of rank > 2 and whose right operand is a matrix (a
    weight, or a Transpose of one) are rewritten. Returns the number rewritten.
    """
    shapes = static_shapes(model)
    emit = Emitter(model, "flat_matmul")
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in model.graph.node:
        left = shapes.get(node.input[0]) if node.op_type == "MatMul" else None
        right = shapes.get(node.input[1]) if node.op_type == "MatMul" else None
        if left is None or right is None or len(left) <= 2 or len(right) != 2:
            nodes.append(node)
            continue
        to_flat, flat = emit.reshape(node.input[0], [int(np.prod(left[:-1])), left[-1]])
        product = emit.name()
        nodes += [to_flat,
                  helper.make_node("MatMul", [flat, node.input[1]], [product],
                                   name=node.name or product),
                  emit.reshape(product, list(left[:-1]) + [right[1]], out=node.output[0])[0]]
        rewritten += 1
    if rewritten:
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(emit.initializers)
    return rewritten


def _evaluate(node: onnx.NodeProto, values: dict[str, np.ndarray],
              opset: int) -> list[np.ndarray] | None:
    """The outputs of one node on constant operands, by onnx's reference evaluator."""
    try:
        evaluator = ReferenceEvaluator(node, opsets={"": opset})
        return list(evaluator.run(None, {name: values[name] for name in node.input if name}))
    except Exception:  # noqa: BLE001 -- an op the evaluator lacks is simply left alone
        return None


def fold_shape_queries(model: onnx.ModelProto) -> int:
    """Fold shape arithmetic on statically shaped tensors into constants, in place.

    onnx-ad builds some zero tensors from run-time queries (MaxPool's adjoint scatters into
    `ConstantOfShape(Concat(Size(x), nseed))`), and onnx's shape inference does not see
    through Size, so everything downstream loses its static shape and escapes
    `canonicalize_layout_ops`. Shape and Size of a static tensor become constants, and so
    does every integer node whose operands are all constant. Returns the number folded.
    """
    opset = opset_of(model)
    folded = 0
    for _ in range(16):  # a fold can make the next query static
        shapes = static_shapes(model)
        values = {name: value for name, value in constants(model).items()
                  if value.dtype.kind in "iub" and value.size <= _FOLD_LIMIT}
        nodes: list[onnx.NodeProto] = []
        changed = 0
        for node in model.graph.node:
            shape = shapes.get(node.input[0]) if node.input else None
            results: list[np.ndarray] | None = None
            if shape is not None and node.op_type == "Shape":
                attributes = {a.name: a.i for a in node.attribute}
                start = attributes.get("start", 0)
                end = attributes.get("end", len(shape))
                results = [np.array(shape[start:end], np.int64)]
            elif shape is not None and node.op_type == "Size":
                results = [np.array(int(np.prod(shape, dtype=np.int64)), np.int64)]
            elif node.op_type != "Constant" and node.input and not _subgraphs(node) and all(
                    not name or name in values for name in node.input):
                results = _evaluate(node, values, opset)
                if results is not None and not all(
                        r.dtype.kind in "iub" and r.size <= _FOLD_LIMIT for r in results):
                    results = None
            if results is None:
                nodes.append(node)
                continue
            for out, result in zip(node.output, results):
                if out:
                    nodes.append(helper.make_node(
                        "Constant", [], [out], name=out,
                        value=numpy_helper.from_array(np.asarray(result), out)))
            changed += 1
        if not changed:
            break
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        folded += changed
    return folded


def _subgraphs(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute)


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
               constants: dict[str, np.ndarray], opset: int,
               emit: Emitter) -> list[onnx.NodeProto] | None:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            return None  # axes computed at run time
        axes = [int(a) for a in constants[node.input[1]].reshape(-1)]
    else:
        axes = list(attributes.get("axes", []))
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
