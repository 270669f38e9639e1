"""A transposed matrix times a vector (rewrites/vector_products.py): onnxruntime's MatmulTransposeFusion turns it
into a FusedMatMul with transA that miscomputes a 1-D operand; every engine session gets the one-column form."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from worker_client.engine.rewrites.vector_products import vector_products_as_columns
from worker_client.engine.session import open_session, placement


def _transposed_times(vector_shape: list[int], opset: int = 18) -> onnx.ModelProto:
    nodes = [helper.make_node("Transpose", ["A"], ["At"]), helper.make_node("MatMul", ["At", "v"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [16, 24]),
                                           helper.make_tensor_value_info("v", TensorProto.FLOAT, vector_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run_all_optimizations(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]


@pytest.mark.parametrize("opset", [11, 18])   # Unsqueeze's axes an attribute before opset 13, an input after
def test_a_transposed_matrix_times_a_vector_is_computed_right(opset: int) -> None:
    rng = np.random.default_rng(0)
    feeds = {"A": rng.normal(size=(16, 24)).astype(np.float32), "v": rng.normal(size=16).astype(np.float32)}
    expected = feeds["A"].T @ feeds["v"]
    model = _transposed_times([16], opset)
    rewritten = vector_products_as_columns(model)
    assert rewritten is not model and [n.op_type for n in model.graph.node] == ["Transpose", "MatMul"]
    assert [n.op_type for n in rewritten.graph.node] == ["Transpose", "Unsqueeze", "MatMul", "Squeeze"]
    np.testing.assert_allclose(_run_all_optimizations(rewritten, feeds), expected, rtol=1e-5, atol=1e-5)
    session = open_session(model, placement("cpu"), threads=(1, None), source="m.onnx")
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-5, atol=1e-5)


def test_a_matrix_operand_or_no_transpose_is_left_alone() -> None:
    model = _transposed_times([16, 3])
    assert vector_products_as_columns(model) is model
    plain = _transposed_times([24])
    plain.graph.node[0].op_type = "Relu"   # A @ v, nothing transposed: what the fusion does not touch
    plain.graph.node[1].input[0] = "At"
    assert vector_products_as_columns(plain) is plain
