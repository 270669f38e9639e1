"""torch's detach() kept out of the gradient (rewrites/detaches.py), and the warning when the dynamo exporter's
optimizer removed one. The graphs are written by hand with the records torch 2.13's dynamo exporter writes."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client.check import check_model, format_report
from worker_client.engine import GradientEngine
from worker_client.engine.exporters import dropped_torch_detaches

DETACH = ("%detach : [num_users=1] = call_function[target=torch.ops.aten.detach.default](args = (%sub,), "
          "kwargs = {})")
ADD = "%add : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%linear, %detach), kwargs = {})"


def _recorded(node: onnx.NodeProto, record: str) -> onnx.NodeProto:
    node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=record)
    return node


def _straight_through(*, detach_record: bool = True, optimized: bool = False) -> onnx.ModelProto:
    """y = (h + detach(round(h) - h)) @ V with h = x @ W: quantization by a straight-through estimator. Without
    `detach_record`, no record on the Identity and the Add; with `optimized`, the Identity is gone, as the
    exporter's optimizer leaves it, and the Add's record still reads it."""
    rng = np.random.default_rng(0)
    nodes = [_recorded(helper.make_node("MatMul", ["x", "W"], ["linear"]), "%linear : (args = (%x, %p_W), ...)"),
             helper.make_node("Round", ["linear"], ["round_1"]),
             helper.make_node("Sub", ["round_1", "linear"], ["sub"])]
    if optimized:
        nodes.append(_recorded(helper.make_node("Add", ["linear", "sub"], ["add"], name="node_add"), ADD))
    else:
        identity, add = (helper.make_node("Identity", ["sub"], ["detach"]),
                         helper.make_node("Add", ["linear", "detach"], ["add"], name="node_add"))
        nodes += [_recorded(identity, DETACH), _recorded(add, ADD)] if detach_record else [identity, add]
    nodes.append(helper.make_node("MatMul", ["add", "V"], ["y"]))
    graph = helper.make_graph(nodes, "main_graph",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
                              [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "W"),
                               numpy_helper.from_array(rng.normal(size=(3, 2)).astype(np.float32), "V")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="pytorch",
                             ir_version=9)


def _step(model: onnx.ModelProto, tmp_path: Path, x: np.ndarray, target: np.ndarray):
    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=len(x), loss="mse", cache_dir=tmp_path / "cache")
    return engine.step(engine.parameters(), {"x": x, "labels": target}), engine.parameters()


def test_a_straight_through_estimator_gets_torch_s_gradient(tmp_path: Path) -> None:
    """d(h + detach(round(h) - h))/dh is 1 in torch; differentiated through the detach it would be 1 + 0 - 1."""
    rng = np.random.default_rng(1)
    x, target = rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(5, 2)).astype(np.float32)
    result, parameters = _step(_straight_through(), tmp_path, x, target)
    w, v = parameters["W"].astype(np.float64), parameters["V"].astype(np.float64)
    q = np.round(x @ w)                                   # the forward value: the rounded h
    dy = 2 * (q @ v - target) / target.size               # mean squared error over every element
    assert result.loss == pytest.approx(float(np.mean((q @ v - target) ** 2)), rel=1e-5)
    np.testing.assert_allclose(result.gradients["V"], q.T @ dy, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(result.gradients["W"], x.T @ (dy @ v.T), rtol=1e-4, atol=1e-6)
    assert np.abs(result.gradients["W"]).max() > 1e-2
    # the same graph without the exporter's record (as the legacy exporter writes it, minus even the Identity):
    # nothing says a detach was there, and the gradient through round(h) - h cancels h's own
    plain, _ = _step(_straight_through(detach_record=False), tmp_path, x, target)
    np.testing.assert_allclose(plain.gradients["W"], 0.0, atol=1e-6)
    np.testing.assert_allclose(plain.gradients["V"], result.gradients["V"], rtol=1e-5)


def test_a_detach_the_optimizer_removed_is_named_in_a_warning(tmp_path: Path) -> None:
    optimized = _straight_through(optimized=True)
    assert [n.name for n in dropped_torch_detaches(optimized)] == ["node_add"]
    assert dropped_torch_detaches(_straight_through()) == []                       # kept: the engine stops it
    path = tmp_path / "optimized.onnx"
    onnx.save(optimized, path)
    with pytest.warns(UserWarning, match=r"optimized\.onnx: the optimizer of torch\.onnx\.export's dynamo exporter "
                                         r"\(optimize=True, the default\) removed the detach\(\) read by node_add "
                                         r"\(Add\): the gradient flows through it"):
        GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnx.save(_straight_through(), tmp_path / "kept.onnx")
        GradientEngine(tmp_path / "kept.onnx", batch_size=2, loss="mse", cache_dir=tmp_path / "cache")


def test_ps_check_does_not_difference_a_parameter_before_a_detach(tmp_path: Path) -> None:
    """Differences of the loss see round()'s zero slope where torch's gradient (and the engine's) passes the
    identity: ps-check names the parameter as not checked, checks the others, and passes the model."""
    path = tmp_path / "ste.onnx"
    onnx.save(_straight_through(), path)
    report = check_model(path, loss="mse", batch_size=4, cache_dir=tmp_path / "cache")
    assert report.detached == ["W"]
    assert [g.name for g in report.gradients] == ["V"] and report.ok
    assert "gradient W: not checked (a torch detach() reads a value computed from it" in format_report(report)
