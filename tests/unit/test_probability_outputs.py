"""A model whose first output is probabilities -- a Keras classifier's Dense(activation="softmax"), a torch model
ending in nn.Softmax(dim=1) or a Sigmoid -- trains on the loss of its logits, and is evaluated so.

Applied to the probabilities themselves, cross-entropy would take a second softmax: a different loss, which
trained the model silently (1.085 where the true cross-entropy was 1.241 on the model below)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine import GradientEngine
from worker_client.engine.loss import probability_output
from worker_client.training.evaluate import metrics_of

BATCH = 5


def classifier(path: Path, activation: str, *, opset: int = 13, axis: int | None = None, classes: int = 3,
               rank: int = 2) -> Path:
    """x [N, 4] -> MatMul W [4, classes] -> (reshaped to [N, classes, 1] when rank 3) -> activation."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, classes)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"])]
    logits = "z"
    if rank == 3:
        nodes.append(helper.make_node("Unsqueeze", ["z", "last"], ["z3"]))
        logits = "z3"
    attributes = {} if axis is None else {"axis": axis}
    nodes.append(helper.make_node(activation, [logits], ["p"], **attributes))
    shape = ["N", classes] + ([1] if rank == 3 else [])
    initializers = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([2], np.int64), "last")]
    graph = helper.make_graph(nodes, "classifier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, shape)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def batch(classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((BATCH, 4)).astype(np.float32), rng.integers(0, classes, BATCH)


@pytest.mark.parametrize("opset, axis", [(13, None), (13, -1), (13, 1), (11, None), (11, 1)])
def test_cross_entropy_of_a_softmax_output_is_that_of_its_logits(tmp_path, opset, axis):
    path = classifier(tmp_path / "m.onnx", "Softmax", opset=opset, axis=axis)
    engine = GradientEngine(path, batch_size=BATCH, loss="cross_entropy", intra_op_threads=1)
    assert engine.output_activation == "softmax"
    x, y = batch()
    result = engine.step({**engine.parameters(), **engine.state()}, {"x": x, "labels": y})
    w = engine.parameters()["W"].astype(np.float64)
    p = softmax(x @ w)
    np.testing.assert_allclose(result.loss, -np.log(p[np.arange(BATCH), y]).mean(), rtol=1e-5)
    expected = x.T @ ((p - np.eye(3)[y]) / BATCH)
    np.testing.assert_allclose(result.gradients["W"], expected, rtol=1e-4, atol=1e-6)


def test_binary_cross_entropy_of_a_sigmoid_output_is_that_of_its_logit(tmp_path):
    path = classifier(tmp_path / "m.onnx", "Sigmoid", classes=1)
    engine = GradientEngine(path, batch_size=BATCH, loss="bce", intra_op_threads=1)
    assert engine.output_activation == "sigmoid"
    x, _ = batch()
    y = np.array([1, 0, 1, 1, 0], np.float32)
    result = engine.step({**engine.parameters(), **engine.state()}, {"x": x, "labels": y})
    z = (x @ engine.parameters()["W"].astype(np.float64)).ravel()
    p = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(result.loss, -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)), rtol=1e-5)
    np.testing.assert_allclose(result.gradients["W"].ravel(), x.T @ ((p - y) / BATCH), rtol=1e-4, atol=1e-6)


def test_other_outputs_and_losses_keep_the_output_as_it_is(tmp_path):
    # mean squared error of probabilities is what it says; a Softmax over another axis than the classes' (or one
    # that flattens more than (batch, classes) below opset 13) is not a classifier's; a plain output has no logits
    softmax_out = classifier(tmp_path / "a.onnx", "Softmax")
    engine = GradientEngine(softmax_out, batch_size=BATCH, loss="mse", intra_op_threads=1)
    assert engine.output_activation is None
    x, _ = batch()
    labels = np.zeros((BATCH, 3), np.float32)
    result = engine.step({**engine.parameters(), **engine.state()}, {"x": x, "labels": labels})
    p = softmax(x @ engine.parameters()["W"].astype(np.float64))
    np.testing.assert_allclose(result.loss, np.mean(p ** 2), rtol=1e-5)
    assert probability_output(onnx.load(classifier(tmp_path / "b.onnx", "Softmax", axis=2, rank=3))) is None
    assert probability_output(onnx.load(classifier(tmp_path / "c.onnx", "Softmax", opset=11, axis=1,
                                                   rank=3))) is None
    assert probability_output(onnx.load(classifier(tmp_path / "d.onnx", "Softmax", axis=1, rank=3))) == "softmax"
    assert probability_output(onnx.load(classifier(tmp_path / "e.onnx", "Relu"))) is None


def test_metrics_of_probabilities_are_those_of_their_logits():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((50, 4))
    y = rng.integers(0, 4, 50)
    from_logits = metrics_of(z, y, 4)
    from_probabilities = metrics_of(softmax(z), y, 4, activation="softmax")
    assert from_probabilities["test_accuracy"] == from_logits["test_accuracy"]
    assert from_probabilities["test_loss"] == pytest.approx(from_logits["test_loss"], rel=1e-9)
    assert metrics_of(softmax(z), y, 4)["test_loss"] != pytest.approx(from_logits["test_loss"], rel=1e-3)
    logit = rng.standard_normal(50)
    labels = (rng.random(50) < 0.5).astype(np.int64)
    binary = metrics_of(logit, labels, 2, kind="binary")
    sigmoid = metrics_of(1 / (1 + np.exp(-logit)), labels, 2, kind="binary", activation="sigmoid")
    assert sigmoid["test_accuracy"] == binary["test_accuracy"]
    assert sigmoid["test_loss"] == pytest.approx(binary["test_loss"], rel=1e-9)
    assert sigmoid["test_auc"] == pytest.approx(binary["test_auc"])
    saturated = metrics_of(np.array([0.0, 1.0]), np.array([0, 1]), 2, kind="binary", activation="sigmoid")
    assert saturated["test_accuracy"] == 1.0 and saturated["test_loss"] is not None


def test_a_predict_only_engine_says_its_output_is_probabilities_and_metrics_read_them_for_their_kind(tmp_path):
    # the pipeline's evaluation builds an engine without a loss: the output's activation is what it is
    assert GradientEngine(classifier(tmp_path / "a.onnx", "Softmax"), batch_size=1, loss=None).output_activation \
        == "softmax"
    assert GradientEngine(classifier(tmp_path / "b.onnx", "Relu"), batch_size=1, loss=None).output_activation is None
    rng = np.random.default_rng(5)
    p = softmax(rng.standard_normal((20, 3)))
    targets = rng.standard_normal((20, 3))
    # regression targets: a softmax's probabilities are what is compared, not logits
    assert metrics_of(p, targets, 0, activation="softmax")["test_loss"] == pytest.approx(np.mean((p - targets) ** 2))
