"""Models below the opset the gradient rules need are upgraded before differentiation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine.opset import GRADIENT_OPSET, upgrade_opset
from worker_client.engine.rewrites.toolkit import opset_of


def _embed_and_pool(opset: int) -> onnx.ModelProto:
    """Gather (an embedding) and MaxPool: both adjoints need ScatterND's reduction."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed"),
             helper.make_node("Transpose", ["embedded"], ["channels"], perm=[0, 2, 1]),
             helper.make_node("MaxPool", ["channels"], ["pooled"], name="pool",
                              kernel_shape=[2], strides=[2]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("MatMul", ["flat", "W"], ["y"], name="head")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.standard_normal((6, 2)).astype(np.float32), "table"),
         numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_an_opset_15_model_is_upgraded_and_differentiated_like_its_opset_16_twin(
        tmp_path: Path) -> None:
    old, new = tmp_path / "old.onnx", tmp_path / "new.onnx"
    onnx.save(_embed_and_pool(15), old)
    onnx.save(_embed_and_pool(GRADIENT_OPSET), new)
    inputs = {"ids": np.array([[0, 1, 1, 5], [2, 3, 4, 0], [5, 5, 5, 5]]),
              "labels": np.array([0, 2, 1])}
    results = []
    for path in (old, new):
        engine = GradientEngine(path, batch_size=3, cache_dir=tmp_path)
        results.append(engine.gradients(engine.parameters(), inputs))
    (loss_old, grads_old), (loss_new, grads_new) = results
    assert loss_old == loss_new
    assert np.abs(grads_old["table"]).sum() > 0
    for name in grads_new:
        np.testing.assert_array_equal(grads_old[name], grads_new[name])


def test_a_model_at_or_above_the_opset_is_left_alone() -> None:
    model = _embed_and_pool(GRADIENT_OPSET + 2)
    assert upgrade_opset(model, "m.onnx") is model


def test_a_model_the_converter_cannot_upgrade_warns_and_goes_on_at_its_opset() -> None:
    graph = helper.make_graph(
        [helper.make_node("ImageScaler", ["x"], ["y"], name="scale")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    with pytest.warns(UserWarning, match=r"old\.onnx: .*could not upgrade the model from opset "
                                         r"9 to 16 .*ImageScaler.*Re-export at opset 16"):
        kept = upgrade_opset(model, "old.onnx")
    assert opset_of(kept) == 9
