"""Rewrite of the forward graph, before differentiation: batched weight MatMuls as one GEMM."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, rebuild, static_shapes

__all__ = ["flatten_weight_matmuls"]


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

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        left = shapes.get(node.input[0]) if node.op_type == "MatMul" else None
        right = shapes.get(node.input[1]) if node.op_type == "MatMul" else None
        if left is None or right is None or len(left) <= 2 or len(right) != 2:
            return None
        to_flat, flat = emit.reshape(node.input[0], [int(np.prod(left[:-1])), left[-1]])
        product = emit.name()
        return [to_flat,
                helper.make_node("MatMul", [flat, node.input[1]], [product], name=node.name or product),
                emit.reshape(product, list(left[:-1]) + [right[1]], out=node.output[0])[0]]

    return rebuild(model, emit, replace)
