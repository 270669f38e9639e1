"""User inputs that ended in a traceback, a late failure or a silently wrong answer (a probe of hostile inputs):
each now gets a clear error up front, or the behaviour the user meant."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from ps_common.shard_map import ParamSpec
from ps_tools import ctl, health
from worker_client import GradientEngine

OPSET = 18


def _save(path: Path, nodes, inputs, outputs, initializers, *, ir_version: int = 9) -> Path:
    graph = helper.make_graph(nodes, "edge", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = ir_version
    onnx.save(model, path)
    return path


def _linear(path: Path, *, outputs: bool = True, weight=None) -> Path:
    weight = np.ones((4, 3), np.float32) if weight is None else weight
    return _save(path, [helper.make_node("MatMul", ["x", "W"], ["y"], name="dense")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])] if outputs else [],
                 [numpy_helper.from_array(weight, "W")])


def test_a_model_with_no_outputs_is_refused_naming_the_problem(tmp_path: Path) -> None:
    """It was an IndexError traceback from the loss (ps-check, ps-launch and ps-worker alike)."""
    with pytest.raises(UnsupportedModelError, match="the graph has no outputs; the cross_entropy loss reads"):
        GradientEngine(_linear(tmp_path / "none.onnx", outputs=False), batch_size=2, cache_dir=tmp_path)


def test_a_bfloat16_parameter_is_refused_when_the_engine_is_built(tmp_path: Path) -> None:
    """onnxruntime's Python API takes no ml_dtypes array: the first step failed with 'Numpy_type 256 can't be
    converted to MLDataType', and under ps-launch only after the shards had started."""
    weight = np.ones((4, 3), ml_dtypes.bfloat16)
    graph_path = tmp_path / "bf16.onnx"
    _save(graph_path, [helper.make_node("Cast", ["x"], ["xb"], name="narrow", to=TensorProto.BFLOAT16),
                       helper.make_node("MatMul", ["xb", "W"], ["yb"], name="dense"),
                       helper.make_node("Cast", ["yb"], ["y"], name="widen", to=TensorProto.FLOAT)],
          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
          [numpy_helper.from_array(weight, "W")])
    with pytest.raises(UnsupportedModelError, match=r"parameter\(s\) \['W'\] are bfloat16.*float32 or float16"):
        GradientEngine(graph_path, batch_size=2, cache_dir=tmp_path)


def test_a_model_declaring_a_newer_ir_version_exports_at_the_one_the_job_ran(tmp_path: Path) -> None:
    """A file saying IR 99 trained (the engine lowers it), then failed onnx's checker at export."""
    from ps_tools.export import TrainedState, apply_state, write_model
    from worker_client.engine.load import max_ir_version

    path = _linear(tmp_path / "ir99.onnx")
    model = onnx.load(path)
    model.ir_version = 99
    state = TrainedState(specs={"W": ParamSpec("W", "float32", (4, 3))}, dense={"W": np.full((4, 3), 2.0, np.float32)},
                         dynamic={}, steps=[3], mode="sync", source="test")
    apply_state(model, state, where="test")
    assert model.ir_version == max_ir_version()
    written = write_model(model, tmp_path / "out.onnx")
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(written).graph.initializer[0]), 2.0)


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0", "notanaddr", "host:"])
def test_ps_health_and_ps_ctl_refuse_an_address_without_a_valid_port(address: str, capsys) -> None:
    """gRPC wraps a port past 65535 round (99999 reached 34463, and ps-health said SERVING)."""
    assert health.main([address, "--timeout", "1"]) == 2
    assert ctl.main(["status", address, "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count(f"address {address!r} is not host:port with a port in 1..65535") == 2


def test_a_custom_domain_op_is_named_instead_of_the_engines_own_loss_node(tmp_path: Path) -> None:
    """onnx infers no shape through an op it does not know; the refusal named the loss's 'ce_total'."""
    path = _save(tmp_path / "custom.onnx",
                 [helper.make_node("MatMul", ["x", "W"], ["h"], name="dense"),
                  helper.make_node("MyRelu", ["h"], ["y"], name="mine", domain="com.example")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                 [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    model = onnx.load(path)
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(model, path)
    with pytest.raises(UnsupportedModelError, match=r"1 node\(s\) of a custom domain -- 'mine' \(com.example:MyRelu\)"):
        GradientEngine(path, batch_size=2, cache_dir=tmp_path)
