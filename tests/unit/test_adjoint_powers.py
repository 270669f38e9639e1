"""Pows by a constant exponent become products, roots and reciprocals (rewrites/powers.py): the same values,
without onnxruntime's per-element pow; a square's adjoint, Pow(x, 1) once folded, among them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine.rewrites.powers import powers_as_products

EXPONENTS = [1.0, 2.0, 3.0, 4.0, 0.5, 1.5, -0.5, -1.0, -2.0]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _pow_model(exponent: np.ndarray, element: int = TensorProto.FLOAT, shape: list[int] | None = None,
               as_constant: bool = False) -> onnx.ModelProto:
    nodes = [helper.make_node("Pow", ["x", "e"], ["y"])]
    initializers = [numpy_helper.from_array(exponent, "e")]
    if as_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["e"], value=initializers.pop()))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", element, shape or [4, 5])],
                              [helper.make_tensor_value_info("y", element, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_each_exponent_gives_pows_values_without_a_pow(exponent: float) -> None:
    x = np.concatenate([np.linspace(0.05, 30.0, 17), [0.0, np.inf, np.nan]]).astype(np.float32).reshape(4, 5)
    model = _pow_model(np.array(exponent, np.float32))
    expected, = _run(model, {"x": x})
    assert powers_as_products(model) == 1
    assert "Pow" not in [n.op_type for n in model.graph.node]
    got, = _run(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=0, equal_nan=True)
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.array_equal(np.isinf(got), np.isinf(expected))


def test_negative_bases_give_nan_for_roots_and_signed_values_for_integer_exponents() -> None:
    x = np.array([[-2.0, -0.5, 3.0, -7.0, 1.0]], np.float32)
    for exponent in EXPONENTS:
        model = _pow_model(np.array(exponent, np.float32), shape=[1, 5])
        expected, = _run(model, {"x": x})
        powers_as_products(model)
        got, = _run(model, {"x": x})
        np.testing.assert_allclose(got, expected, rtol=2e-7, equal_nan=True, err_msg=f"exponent {exponent}")


def test_what_stays_a_pow() -> None:
    # an exponent without a cheaper form, one of two elements, one computed at run time, and a root of integers
    assert powers_as_products(_pow_model(np.array(2.5, np.float32))) == 0
    assert powers_as_products(_pow_model(np.array([2.0, 2.0], np.float32), shape=[4, 2])) == 0
    computed = _pow_model(np.array(2.0, np.float32))
    computed.graph.node.insert(0, helper.make_node("Identity", ["e0"], ["e"]))
    computed.graph.initializer[0].name = "e0"
    assert powers_as_products(computed) == 0
    assert powers_as_products(_pow_model(np.array(0.5, np.float32), element=TensorProto.INT64)) == 0
    # an exponent of higher rank than x broadcasts x to more axes: left as it is
    wide = _pow_model(np.array([[[2.0]]], np.float32), shape=[4, 5])
    assert powers_as_products(wide) == 0


def test_integer_bases_square_and_constant_nodes_and_same_rank_exponents_are_rewritten() -> None:
    squared = _pow_model(np.array(2, np.int64), element=TensorProto.INT64)
    x = np.arange(-3, 17, dtype=np.int64).reshape(4, 5)
    expected, = _run(squared, {"x": x})
    assert powers_as_products(squared) == 1
    np.testing.assert_array_equal(_run(squared, {"x": x})[0], expected)
    constant = _pow_model(np.array([[-1.0]], np.float32), as_constant=True)
    assert powers_as_products(constant) == 1
    np.testing.assert_allclose(_run(constant, {"x": np.full((4, 5), 4.0, np.float32)})[0], 0.25)


def test_an_rms_norms_gradient_graph_has_no_pow_and_matches_numpy(tmp_path) -> None:
    """An RMSNorm as torch exports it (Pow(x, 2), ReduceMean, Add eps, Sqrt, Div) before a weight: the adjoint
    onnx-ad writes for the square is Pow(x, 2 - 1); the engine's graph has neither Pow, and its gradient is
    numpy's."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Pow", ["h", "two"], ["squares"]),
             helper.make_node("ReduceMean", ["squares"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["shifted"]),
             helper.make_node("Sqrt", ["shifted"], ["rms"]),
             helper.make_node("Div", ["h", "rms"], ["y"])]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              [numpy_helper.from_array(w, "w"),
                               numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                               numpy_helper.from_array(np.array(1e-6, np.float32), "eps")])
    path = tmp_path / "rms.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    x = rng.standard_normal((2, 3)).astype(np.float32)
    target = rng.standard_normal((2, 4)).astype(np.float32)
    _, grads = engine.gradients(engine.parameters(), {"x": x, "labels": target})
    cached, = (tmp_path / "cache").glob("*.onnx")
    assert "Pow" not in [n.op_type for n in onnx.load(cached, load_external_data=False).graph.node]
    # by hand, in float64: y = h / r, r = sqrt(mean(h^2) + eps), dL/dy = 2 (y - t) / n
    h = x.astype(np.float64) @ w
    r = np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-6)
    dy = 2 * (h / r - target) / target.size
    dh = dy / r - h * (dy * h).sum(-1, keepdims=True) / (r ** 3 * h.shape[-1])
    np.testing.assert_allclose(grads["w"], x.T.astype(np.float64) @ dh, rtol=1e-4, atol=1e-6)
