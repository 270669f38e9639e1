"""onnx-ad's Sums of two adjoints become Adds (rewrites/sums.py): the same values, on onnxruntime's thread pool."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine.rewrites.sums import sums_as_adds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_a_sum_of_two_becomes_an_add_with_the_same_values_and_longer_sums_stay() -> None:
    nodes = [helper.make_node("Sum", ["a", "b"], ["two"]),                # broadcast (4, 3) + (3,)
             helper.make_node("Sum", ["a", "a", "b"], ["three"]),
             helper.make_node("Sum", ["a"], ["one"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 3]),
                                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                               for n in ("two", "three", "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    before = _run(model, feeds)
    assert sums_as_adds(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Add", "Sum", "Sum"]
    for got, expected in zip(_run(model, feeds), before):
        np.testing.assert_array_equal(got, expected)
    assert sums_as_adds(model) == 0


def test_the_gradient_graph_accumulates_a_fanned_out_tensor_with_add(tmp_path) -> None:
    """x @ w read twice (a residual): its adjoint is the sum of two, and the engine's graph adds them with Add."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Add", ["h", "r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(np.eye(3, dtype=np.float32) - 0.3, "w")])
    path = tmp_path / "fan.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    x = np.array([[1.0, -2.0, 0.5], [0.3, 0.1, -1.0]], np.float32)
    target = np.zeros((2, 3), np.float32)
    loss, grads = engine.gradients(engine.parameters(), {"x": x, "labels": target})
    # the same gradient by hand: y = h + relu(h), dL/dy = 2 (y - t) / n for the mean squared error
    h = x @ engine.parameters()["w"]
    y = h + np.maximum(h, 0)
    dh = 2 * (y - target) / y.size * (1 + (h > 0))
    np.testing.assert_allclose(grads["w"], x.T @ dh, rtol=1e-5)
    cached, = (tmp_path / "cache").glob("*.onnx")
    built = onnx.load(cached, load_external_data=False)
    assert not [n for n in built.graph.node if n.op_type == "Sum" and len(n.input) == 2]
