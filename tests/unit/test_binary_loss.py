"""--loss bce: binary cross-entropy on one logit per example, or one per label of a multi-label output, as users
write it, with AUC and accuracy in the record."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine import GradientEngine
from worker_client.training import metrics_of


def linear(path, outputs: int = 1) -> str:
    rng = np.random.default_rng(0)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"],
                                                                                              ["logit"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
                              [helper.make_tensor_value_info("logit", TensorProto.FLOAT, ["n", outputs])],
                              [numpy_helper.from_array(rng.normal(size=(5, outputs)).astype(np.float32), "w"),
                               numpy_helper.from_array(np.zeros(outputs, np.float32), "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_bce_is_the_mean_of_the_stable_binary_cross_entropy_and_its_gradient(tmp_path):
    engine = GradientEngine(linear(tmp_path / "m.onnx"), batch_size=8, loss="bce", cache_dir=tmp_path)
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 5)) * 10).astype(np.float32)   # large logits: the naive form would overflow
    y = rng.integers(0, 2, 8)
    params = engine.parameters()
    loss, grads = engine.gradients(params, {"x": x, "labels": y})
    z = (x.astype(np.float64) @ params["w"] + params["b"]).ravel()
    want = np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z))))
    assert loss == pytest.approx(want, rel=1e-5)
    p = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(grads["w"].ravel(), x.T.astype(np.float64) @ ((p - y) / 8), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["b"], [np.mean(p - y)], rtol=1e-4, atol=1e-6)


def test_bce_on_several_logits_an_example_is_the_mean_over_every_label(tmp_path):
    """A multi-label output (torch's BCEWithLogitsLoss on (batch, K) logits): a label per logit, the mean over
    all of them."""
    engine = GradientEngine(linear(tmp_path / "m.onnx", outputs=3), batch_size=4, loss="bce", cache_dir=tmp_path)
    assert tuple(engine.feed_dims()["labels"]) == (4, 3)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 5)).astype(np.float32)
    y = rng.integers(0, 2, (4, 3)).astype(np.float32)
    params = engine.parameters()
    loss, grads = engine.gradients(params, {"x": x, "labels": y})
    z = x.astype(np.float64) @ params["w"] + params["b"]
    assert loss == pytest.approx(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))), rel=1e-5)
    p = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(grads["w"], x.T.astype(np.float64) @ ((p - y) / y.size), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["b"], (p - y).sum(0) / y.size, rtol=1e-4, atol=1e-6)


def test_bce_refuses_a_scalar_output(tmp_path):
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]),
                               helper.make_node("ReduceSum", ["m"], ["logit"], keepdims=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
                              [helper.make_tensor_value_info("logit", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.ones((5, 1), np.float32), "w")])
    path = tmp_path / "scalar.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(UnsupportedModelError, match=r"bce needs logits shaped \(batch,\), \(batch, 1\) or "
                                                    r"\(batch, d1, \.\.\.\), but the first output 'logit' is a scalar"):
        GradientEngine(str(path), batch_size=4, loss="bce", cache_dir=tmp_path)


def test_binary_metrics_give_the_loss_accuracy_at_a_half_and_the_auc():
    logits = np.array([[-2.0], [-0.5], [0.3], [3.0]])
    labels = np.array([0, 1, 0, 1])
    metrics = metrics_of(logits, labels, 2, kind="binary")
    assert metrics["test_accuracy"] == 0.5          # -0.5 and 0.3 are on the wrong side
    assert metrics["test_auc"] == 0.75              # 3 of the 4 (positive, negative) pairs ordered right
    z, y = logits.ravel(), labels
    assert metrics["test_loss"] == pytest.approx(np.mean(np.log1p(np.exp(-z)) + (1 - y) * z))
