"""MatMul rewrites: batched weight MatMuls as one GEMM (forward graph), transposed products at their operands (adjoints)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import (
    SAME_DATA_OPS,
    Emitter,
    constants,
    reader_counts,
    rebuild,
    reduction_axes,
    static_shapes,
)

__all__ = ["flatten_weight_matmuls", "sum_batched_products", "untranspose_products"]


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


def untranspose_products(model: onnx.ModelProto) -> int:
    """Rewrite `Transpose(MatMul(P, Q))` of matrices as `MatMul(Transpose(Q), Transpose(P))`, in place.

    onnx-ad's weight adjoint of a Gemm with transB=1 -- every torch Linear the legacy exporter
    writes -- is `(X^T @ dY)^T`: a GEMM into the input-major layout, then a Transpose of the whole
    weight gradient into the weight's. onnxruntime runs that Transpose as a strided copy: 8.6 ms of
    a 2048 x 2048 layer's 29 ms gradient step at one thread, more than the GEMM. Swapping the
    operands puts the Transposes on the operands instead, where a Transpose of onnx-ad's own
    Transpose (X^T) cancels and the other (dY^T) folds into onnxruntime's FusedMatMul as transA:
    the gradient comes out of the GEMM in the weight's layout. Reshapes that only add or drop
    size-1 axes (the seed axis, a broadcast batch axis of 1), and onnx-ad's Expands of a tensor to
    its own shape (a transformer's Linear on 3-D inputs), are looked through. Only chains nothing
    else reads are rewritten. Returns the number rewritten.
    """
    shapes = static_shapes(model)
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers = reader_counts(graph)
    emit = Emitter(model, "untransposed")

    def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(size for size in shape if size != 1)

    def source(name: str, *, private: bool) -> str:
        """`name` with unit-axis Reshapes, Squeezes and Unsqueezes, Identities and Expands to the same data looked
        through (each read by nothing else when `private`)."""
        while True:
            node = producers.get(name)
            if node is None or node.op_type not in SAME_DATA_OPS or node.input[0] not in shapes or name not in shapes:
                return name
            if squeezed(shapes[node.input[0]]) != squeezed(shapes[name]) or (private and readers[name] != 1):
                return name
            name = node.input[0]

    def matrix(name: str) -> tuple[int, int] | None:
        shape = shapes.get(name)
        if shape is None or len(shape) < 2 or any(size != 1 for size in shape[:-2]):
            return None
        return shape[-2], shape[-1]

    def transposed(name: str, rows: int, cols: int, out: list[onnx.NodeProto]) -> str:
        """`name`, a [rows, cols] matrix maybe with leading unit axes, transposed: onnx-ad's own
        Transpose undone where `name` is one, else Reshape and Transpose nodes appended to `out`."""
        origin = producers.get(source(name, private=False))
        if (origin is not None and origin.op_type == "Transpose" and _perm(origin) == [1, 0]
                and shapes.get(origin.input[0]) == (cols, rows)):
            return origin.input[0]
        if shapes[name] != (rows, cols):
            reshape, name = emit.reshape(name, [rows, cols])
            out.append(reshape)
        flipped = emit.name()
        out.append(helper.make_node("Transpose", [name], [flipped], name=flipped, perm=[1, 0]))
        return flipped

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "Transpose" or _perm(node) != [1, 0] or len(shapes.get(node.input[0], ())) != 2:
            return None
        if readers[node.input[0]] != 1:
            return None
        product = producers.get(source(node.input[0], private=True))
        if product is None or product.op_type != "MatMul" or readers[product.output[0]] != 1:
            return None
        left, right = matrix(product.input[0]), matrix(product.input[1])
        if left is None or right is None or left[1] != right[0]:
            return None
        (rows, inner), (_, cols) = left, right
        if shapes[node.input[0]] != (rows, cols):
            return None
        nodes: list[onnx.NodeProto] = []
        right_t = transposed(product.input[1], inner, cols, nodes)
        left_t = transposed(product.input[0], rows, inner, nodes)
        nodes.append(helper.make_node("MatMul", [right_t, left_t], [node.output[0]], name=emit.name()))
        return nodes

    return rebuild(model, emit, replace)


def sum_batched_products(model: onnx.ModelProto) -> int:
    """Rewrite a ReduceSum over all the batch axes of a batched MatMul as one GEMM, in place.

    A weight read by a MatMul of a batched operand that the forward rewrites never saw -- onnx-ad writes
    an LSTM's or GRU's input projection as MatMul(X[T, B, I], W^T) itself, when it expands the layer --
    gets onnx-ad's adjoint per batch: X[t]^T @ G[t] for every t, a [T, I, 4H] stack (10 MB for
    ps_bench.zoo_models' LSTM), then a ReduceSum over t. The sum over t of X[t]^T @ G[t] is one GEMM of
    the batches side by side, X as [T*B, I] rows against G as [T*B, 4H]: the same products, summed in
    another order (float rounding), no stack, and a GEMM whose inner dimension is T*B rather than B. The
    left operand is written as the Transpose of its rows, which `untranspose_products` and onnxruntime's
    FusedMatMul fold away. Only a ReduceSum (through at most one Reshape) of exactly the batch axes, of
    a MatMul whose two operands both carry the whole batch and that nothing else reads, is rewritten.
    Returns the number rewritten.
    """
    shapes = static_shapes(model)
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers = reader_counts(graph)
    values = constants(model)
    emit = Emitter(model, "batch_summed")

    def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(size for size in shape if size != 1)

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "ReduceSum" or node.input[0] not in shapes or node.output[0] not in shapes:
            return None
        data = node.input[0]
        named = reduction_axes(node, values)
        axes = sorted(a % len(shapes[data]) for a in named) if named else None
        source = data
        reshape = producers.get(data)
        if reshape is not None and reshape.op_type == "Reshape" and readers[data] == 1:
            source = reshape.input[0]
        product = producers.get(source)
        if axes is None or product is None or product.op_type != "MatMul" or readers[source] != 1 \
                or source not in shapes or any(name not in shapes for name in product.input):
            return None
        left, right, result = shapes[product.input[0]], shapes[product.input[1]], shapes[source]
        if len(left) < 3 or len(right) < 3 or len(result) < 3:
            return None
        batch = squeezed(result[:-2])
        if not batch or squeezed(left[:-2]) != batch or squeezed(right[:-2]) != batch:
            return None
        reduced = shapes[data]
        count = len(axes)
        if axes != list(range(count)) or int(np.prod(reduced[:count])) != int(np.prod(batch)) \
                or int(np.prod(reduced[count:])) != result[-2] * result[-1]:
            return None
        rows, cols = result[-2], result[-1]
        nodes: list[onnx.NodeProto] = []
        rank = len(left)
        swap = [*range(rank - 2), rank - 1, rank - 2]
        origin = producers.get(product.input[0])
        if origin is not None and origin.op_type == "Transpose" and _perm(origin) == swap:
            left_rows = origin.input[0]              # the left operand's batches as rows already
        else:
            left_rows = emit.name()
            nodes.append(helper.make_node("Transpose", [product.input[0]], [left_rows], name=left_rows, perm=swap))
        reshape_left, left_flat = emit.reshape(left_rows, [-1, rows])
        reshape_right, right_flat = emit.reshape(product.input[1], [-1, cols])
        left_t, summed = emit.name(), emit.name()
        nodes += [reshape_left, reshape_right,
                  helper.make_node("Transpose", [left_flat], [left_t], name=left_t, perm=[1, 0]),
                  helper.make_node("MatMul", [left_t, right_flat], [summed], name=summed),
                  emit.reshape(summed, list(shapes[node.output[0]]), out=node.output[0])[0]]
        return nodes

    return rebuild(model, emit, replace)


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
