"""Shape arithmetic on statically shaped tensors folded into constants."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from worker_client.engine.rewrites.toolkit import RANDOM_OPS, constants, opset_of, static_shapes, subgraphs

__all__ = ["evaluate_node", "fold_shape_queries"]

#: Largest integer tensor (elements) that shape folding turns into a constant.
_FOLD_LIMIT = 64
#: Ops never folded: a Constant is one already; the others draw random values at every run.
_UNFOLDED = RANDOM_OPS | {"Constant"}


def evaluate_node(node: onnx.NodeProto, values: dict[str, np.ndarray],
              opset: int) -> list[np.ndarray] | None:
    """The outputs of one node on constant operands, by onnx's reference evaluator."""
    try:
        evaluator = ReferenceEvaluator(node, opsets={"": opset})
        return list(evaluator.run(None, {name: values[name] for name in node.input if name}))
    except Exception:  # noqa: BLE001 -- an op the evaluator lacks is simply left alone
        return None


def fold_shape_queries(model: onnx.ModelProto, *, floats: bool = False) -> int:
    """Fold shape arithmetic on statically shaped tensors into constants, in place.

    onnx-ad builds some zero tensors from run-time queries (MaxPool's adjoint scatters into
    `ConstantOfShape(Concat(Size(x), nseed))`), and onnx's shape inference does not see
    through Size, so everything downstream loses its static shape and escapes
    `canonicalize_layout_ops`. Shape and Size of a static tensor become constants, and so
    does every integer node whose operands are all constant; with `floats`, small float ones too
    (a Resize's scales, which torch writes as a Concat of Constants, and onnx's shape inference
    reads only from a constant). Returns the number folded.
    """
    kinds = "iubf" if floats else "iub"
    opset = opset_of(model)
    folded = 0
    # a sweep folds every chain of constant arithmetic; the next one sees the shapes it made static (a Reshape's
    # folded target: ShuffleNet's channel shuffles take one sweep each, 16 in all). Each sweep that continues has
    # folded a node, so there are at most as many as nodes.
    for _ in range(len(model.graph.node) + 1):
        shapes = static_shapes(model)
        values = {name: value for name, value in constants(model).items()
                  if value.dtype.kind in kinds and value.size <= _FOLD_LIMIT}
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
            elif node.op_type not in _UNFOLDED and node.input and not subgraphs(node) and all(
                    not name or name in values for name in node.input):
                results = evaluate_node(node, values, opset)
                if results is not None and not all(
                        r.dtype.kind in kinds and r.size <= _FOLD_LIMIT for r in results):
                    results = None
            if results is None:
                nodes.append(node)
                continue
            for out, result in zip(node.output, results):
                if out:
                    nodes.append(helper.make_node(
                        "Constant", [], [out], name=out,
                        value=numpy_helper.from_array(np.asarray(result), out)))
                    # the nodes after it (in topological order) fold in this same sweep: a chain of shape
                    # arithmetic (Shape, Gather, Unsqueeze, Concat, Reshape's target) folds whole, where one
                    # sweep a link ran out of sweeps on ShuffleNet's 16 channel shuffles
                    values[out] = np.asarray(result)
            changed += 1
        if not changed:
            break
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        folded += changed
    return folded

