"""Matrix-vector products that onnxruntime would miscompute, written as products with a one-column matrix.

onnxruntime's MatmulTransposeFusion folds MatMul(Transpose(A), v) into its FusedMatMul(A, v, transA=1), and that
kernel computes a wrong result when v is a vector (1-D): on onnxruntime 1.32.0's CPU provider, a [16, 24] A and a
[16] v came out off by 8.8 (the same FusedMatMul with v as a [16, 1] matrix, or the graph with optimizations off,
is right). torch's spectral normalization has one in its power iteration, W^T u: where the weight was an
initializer onnxruntime folded it as a constant first, but with the weight an input, as every engine session
feeds it, the forward was off by 66 (a loss of 676 against torch's 0.035). `vector_products_as_columns` writes
each such product as MatMul(Transpose(A), Unsqueeze(v, -1)) followed by Squeeze(-1): the same values, which the
fusion's kernel computes right. Views, no copies.
"""

from __future__ import annotations

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, opset_of, value_types

__all__ = ["vector_products_as_columns"]

#: The opset from which Squeeze and Unsqueeze take their axes as an input.
_AXES_AS_INPUT = 13


def _ranks(model: onnx.ModelProto, names: set[str]) -> dict[str, int]:
    """The rank of each of `names` the model declares (initializers, inputs, value_info), onnx's shape inference
    asked only when some are not declared."""
    graph = model.graph
    ranks = {t.name: len(t.dims) for t in graph.initializer if t.name in names}
    declared = [*graph.input, *graph.value_info, *graph.output]
    ranks.update({v.name: len(v.type.tensor_type.shape.dim) for v in declared
                  if v.name in names and v.type.tensor_type.HasField("shape")})
    if names - set(ranks):
        ranks.update({name: len(value.tensor_type.shape.dim) for name, value in value_types(model).items()
                      if name in names and value.tensor_type.HasField("shape")})
    return ranks


def _last_axis(op: str, value: str, out: str, axes: str | None, emit: Emitter) -> onnx.NodeProto:
    """A Squeeze or Unsqueeze of the last axis: its axes an input (`axes`), or before opset 13 an attribute."""
    if axes is None:
        return helper.make_node(op, [value], [out], name=emit.name(), axes=[-1])
    return helper.make_node(op, [value, axes], [out], name=emit.name())


def vector_products_as_columns(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` itself when no MatMul has a first operand a Transpose computes and a vector (1-D) second one, else
    a copy with each such vector a one-column matrix (module docstring)."""
    transposed = {node.output[0] for node in model.graph.node if node.op_type == "Transpose"}
    candidates = {index: node for index, node in enumerate(model.graph.node)
                  if node.op_type == "MatMul" and node.input[0] in transposed}
    if not candidates:
        return model
    ranks = _ranks(model, {node.input[1] for node in candidates.values()})
    vectors = {index for index, node in candidates.items() if ranks.get(node.input[1]) == 1}
    if not vectors:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    emit = Emitter(result, "vector_column")
    axes = emit.ints([-1]) if opset_of(result) >= _AXES_AS_INPUT else None
    nodes = []
    for index, node in enumerate(graph.node):
        if index in vectors:
            column, product = emit.name(), emit.name()
            nodes += [_last_axis("Unsqueeze", node.input[1], column, axes, emit),
                      helper.make_node("MatMul", [node.input[0], column], [product], name=node.name or emit.name()),
                      _last_axis("Squeeze", product, node.output[0], axes, emit)]
        else:
            nodes.append(node)
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.initializer.extend(emit.initializers)
    return result
