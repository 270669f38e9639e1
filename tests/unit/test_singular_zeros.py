"""Square roots, fractional powers and L2 norms at exactly zero (rewrites/singular.py): torch's gradient there is
0 (a ReLU's Where-masked adjoint, a norm's filled zeros), where onnx-ad's inf times a ReLU's zero mask was NaN."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine import GradientEngine
from worker_client.engine.rewrites.singular import guard_singular_zeros


def _roots_model() -> onnx.ModelProto:
    """r = relu(x @ W - 0.5); y = [sqrt(r), r ** 0.3, ||r grouped by 3||] @ V: many entries of r are exactly 0,
    and a group of three zeros is likely."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Sub", ["h", "half"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], ["r"]), helper.make_node("Sqrt", ["r"], ["root"]),
             helper.make_node("Pow", ["r", "exponent"], ["power"]),
             helper.make_node("Reshape", ["r", "groups"], ["grouped"]),
             helper.make_node("ReduceL2", ["grouped", "last"], ["norms"], keepdims=0),
             helper.make_node("Concat", ["root", "power", "norms"], ["features"], axis=1),
             helper.make_node("MatMul", ["features", "V"], ["y"])]
    initializers = [numpy_helper.from_array(rng.normal(size=(4, 6)).astype(np.float32), "W"),
                    numpy_helper.from_array(rng.normal(size=(14, 2)).astype(np.float32), "V"),
                    numpy_helper.from_array(np.array(0.5, np.float32), "half"),
                    numpy_helper.from_array(np.array(0.3, np.float32), "exponent"),
                    numpy_helper.from_array(np.array([0, 2, 3], np.int64), "groups"),
                    numpy_helper.from_array(np.array([-1], np.int64), "last")]
    graph = helper.make_graph(nodes, "roots", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _torch_convention(x: np.ndarray, target: np.ndarray, w: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """The gradients as torch computes them: each root's derivative 0 where its argument is 0."""
    h = x.astype(np.float64) @ w
    r = np.maximum(h - 0.5, 0)
    grouped = r.reshape(len(x), 2, 3)
    norms = np.sqrt((grouped ** 2).sum(-1))
    features = np.concatenate([np.sqrt(r), r ** 0.3, norms], 1)
    dy = 2 * (features @ v - target) / target.size
    df = dy @ v.T
    with np.errstate(divide="ignore", invalid="ignore"):
        dr = np.where(r > 0, df[:, :6] * 0.5 / np.sqrt(r) + df[:, 6:12] * 0.3 * r ** -0.7, 0)
        dr += np.where(norms[..., None] > 0, df[:, 12:, None] * grouped / norms[..., None], 0).reshape(len(x), 6)
    return {"W": x.T @ (dr * (h - 0.5 > 0)), "V": features.T @ dy}


def test_roots_at_zero_have_torch_s_gradient_and_their_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x, target = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)
    model = _roots_model()
    onnx.save(model, tmp_path / "roots.onnx")
    engine = GradientEngine(tmp_path / "roots.onnx", batch_size=6, loss="mse", cache_dir=tmp_path / "cache")
    parameters = engine.parameters()
    r = np.maximum(x @ parameters["W"] - 0.5, 0)
    assert (r == 0).any() and (r.reshape(6, 2, 3) == 0).all(-1).any()   # the zeros the test is about
    result = engine.step(parameters, {"x": x, "labels": target})
    expected = _torch_convention(x, target, parameters["W"], parameters["V"])
    for name in ("W", "V"):
        assert np.isfinite(result.gradients[name]).all(), name
        np.testing.assert_allclose(result.gradients[name], expected[name], rtol=1e-4, atol=1e-6, err_msg=name)
    # the rewritten forward computes what the model computes, zeros included
    guarded = onnx.ModelProto()
    guarded.CopyFrom(model)
    assert guard_singular_zeros(guarded) == 3
    feeds = {"x": x}
    np.testing.assert_array_equal(ort.InferenceSession(guarded.SerializeToString()).run(None, feeds)[0],
                                  ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0])


@pytest.mark.parametrize("exponent", [2.0, 1.0, -0.5])
def test_powers_without_an_infinite_slope_at_zero_and_stabilized_roots_are_left_alone(exponent: float) -> None:
    model = _roots_model()
    model.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.array(exponent, np.float32), "exponent"))
    model.graph.node[3].input[0] = "stable"   # sqrt(r + 1e-5): an epsilon keeps it off zero
    model.graph.node.insert(3, helper.make_node("Add", ["r", "epsilon"], ["stable"]))
    model.graph.initializer.append(numpy_helper.from_array(np.array(1e-5, np.float32), "epsilon"))
    assert guard_singular_zeros(model) == 1   # the ReduceL2 only
    assert [n.op_type for n in model.graph.node].count("ReduceL2") == 0
