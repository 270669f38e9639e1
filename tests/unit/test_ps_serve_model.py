"""ps-serve's served model (ps_serve/model.py): one immutable state per step, swapped whole, never mixed."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ps_models.builders import write_model
from tests.helpers.conv3d_fixture import conv3d_reference, conv3d_without_bias
from ps_serve.errors import ModelNotFound, RequestError
from ps_serve.model import ModelLoadError, ModelState, ServedModel


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    return write_model("mlp", tmp_path_factory.mktemp("model") / "mlp.onnx")


def test_a_state_built_with_new_weights_answers_with_them(mlp: Path) -> None:
    base = ModelState.load(mlp)
    shifted = ModelState.load(mlp, step=9, weights={"fc3.bias": np.full(10, 3.0, np.float32)})
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    original_bias = onnx.numpy_helper.to_array(
        next(t for t in onnx.load(str(mlp)).graph.initializer if t.name == "fc3.bias"))
    difference = shifted.infer({"x": x})["logits"] - base.infer({"x": x})["logits"]
    np.testing.assert_allclose(difference, np.broadcast_to(3.0 - original_bias, (4, 10)), rtol=1e-5, atol=1e-5)
    assert shifted.step == 9 and base.step is None
    assert not shifted.weights["fc3.bias"].flags.writeable
    with pytest.raises(TypeError):
        shifted.weights["fc3.bias"] = np.zeros(10, np.float32)   # the state's weights are read-only


def test_a_state_from_a_model_in_memory_answers_with_the_initializers_it_holds(mlp: Path) -> None:
    model = onnx.load(str(mlp))
    bias = next(t for t in model.graph.initializer if t.name == "fc3.bias")
    bias.CopyFrom(numpy_helper.from_array(np.full(10, 100.0, np.float32), "fc3.bias"))
    state = ModelState.from_model(model, step=12, source="trained mlp")
    x = np.zeros((2, 64), np.float32)
    reference = ModelState.load(mlp, weights={"fc3.bias": np.full(10, 100.0, np.float32)}).infer({"x": x})
    np.testing.assert_array_equal(state.infer({"x": x})["logits"], reference["logits"])
    assert state.step == 12 and state.source == "trained mlp"
    with pytest.raises(ModelLoadError, match=r"onnxruntime cannot load model \(broken\)"):
        ModelState.from_model(b"\x08\x07garbage", source="broken")


@pytest.mark.parametrize(("weights", "message"), [
    ({"fc9.bias": np.zeros(10, np.float32)}, "weight 'fc9.bias' is not an initializer of model"),
    ({"fc3.bias": np.zeros(11, np.float32)}, "weight 'fc3.bias' is float32 [11], but model"),
    ({"fc3.bias": np.zeros(10, np.float64)}, "weight 'fc3.bias' is float64 [10], but model"),
])
def test_weights_that_are_not_the_files_initializers_are_refused_before_onnxruntime_sees_them(
        mlp: Path, weights: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        ModelState.load(mlp, weights=weights)
    assert str(raised.value).startswith(message)


def test_a_missing_or_damaged_file_is_a_model_load_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nowhere.onnx' does not exist"):
        ModelState.load(tmp_path / "nowhere.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"\x08\x07garbage")
    with pytest.raises(ModelLoadError, match="onnxruntime cannot load model '.*bad.onnx'"):
        ModelState.load(tmp_path / "bad.onnx")


def test_infer_refuses_missing_and_unknown_inputs_and_outputs_naming_them(mlp: Path) -> None:
    state = ModelState.load(mlp)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(RequestError, match=r"missing input\(s\): x \(FP32 \[-1, 64\]\)"):
        state.infer({})
    with pytest.raises(RequestError, match="unknown input 'y'"):
        state.infer({"x": x, "y": x})
    with pytest.raises(RequestError, match="unknown output 'probs'; the model outputs logits"):
        state.infer({"x": x}, ["probs"])
    with pytest.raises(RequestError, match="the model cannot run on these inputs"):
        state.infer({"x": np.zeros((1, 64), np.float64)})


def test_served_model_names_an_unknown_model_or_version_as_not_found(mlp: Path) -> None:
    served = ServedModel("mlp", ModelState.load(mlp))
    served.check("mlp")
    served.check("mlp", "1")
    with pytest.raises(ModelNotFound, match="unknown model 'other'; this server serves 'mlp'"):
        served.check("other")
    with pytest.raises(ModelNotFound, match="model 'mlp' has no version '3'"):
        served.check("mlp", "3")


def test_swap_refuses_a_state_whose_inputs_or_outputs_differ(mlp: Path, tmp_path: Path) -> None:
    served = ServedModel("mlp", ModelState.load(mlp))
    other = ModelState.load(write_model("mlp", tmp_path / "wide.onnx", input_dim=32))
    with pytest.raises(ValueError, match="differ from the served ones"):
        served.swap(other)
    assert served.current().inputs[0].shape == (-1, 64)


def _offset_model(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"]), helper.make_node("Mul", ["y", "c"], ["z"])], "offset",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 8])],
        initializer=[numpy_helper.from_array(np.zeros(8, np.float32), "c")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_requests_racing_swaps_each_see_one_whole_state_with_its_own_step(tmp_path: Path) -> None:
    path = _offset_model(tmp_path / "offset.onnx")
    states = [ModelState.load(path, step=s, weights={"c": np.full(8, float(s), np.float32)}) for s in (1, 2, 3)]
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    expected = {state.step: state.infer({"x": x}) for state in states}
    served = ServedModel("offset", states[0])
    stop = threading.Event()
    seen: list[tuple[int, dict]] = []
    failures: list[str] = []

    def swapper() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            served.swap(states[i % 3])

    def reader() -> None:
        for _ in range(300):
            state = served.current()
            outputs = state.infer({"x": x})
            seen.append((state.step, outputs))
            if any(not np.array_equal(outputs[k], expected[state.step][k]) for k in ("y", "z")):
                failures.append(f"step {state.step} answered outputs of another state")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    swapping = threading.Thread(target=swapper)
    swapping.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stop.set()
    swapping.join(10)
    assert not failures
    assert len(seen) == 900
    assert {step for step, _ in seen} == {1, 2, 3}


def test_swap_returns_the_state_it_replaced_and_current_returns_the_new_one(mlp: Path) -> None:
    first, second = ModelState.load(mlp, step=1), ModelState.load(mlp, step=2)
    served = ServedModel("mlp", first)
    assert served.swap(second) is first
    assert served.current() is second
    assert served.metadata()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]


def test_a_file_onnxruntime_refuses_for_an_exporters_fault_is_served_as_the_workers_read_it(tmp_path: Path) -> None:
    # torch's dynamo exporter: a buffer "mean" and an op's output "mean" -- onnxruntime refuses the file as written
    graph = helper.make_graph(
        [helper.make_node("Sub", ["x", "mean"], ["centred"]),
         helper.make_node("ReduceMean", ["centred", "axes"], ["mean"], keepdims=1),
         helper.make_node("Add", ["centred", "mean"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "mean"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path = tmp_path / "dynamo.onnx"
    onnx.save(model, path)
    state = ModelState.load(path, weights={"mean": np.array([0.0, 0.0, 1.0], np.float32)})
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    centred = x - np.array([0.0, 0.0, 1.0])
    np.testing.assert_allclose(state.infer({"x": x})["y"], centred + centred.mean(axis=1, keepdims=True), rtol=1e-6)
    # a file nothing mends is still refused with onnxruntime's own reason, naming it
    bad = tmp_path / "bad.onnx"
    broken = helper.make_graph([helper.make_node("Relu", ["nowhere"], ["y"])], "g",
                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(broken, opset_imports=[helper.make_opsetid("", 18)]), bad)
    with pytest.raises(ModelLoadError, match="bad.onnx"):
        ModelState.load(bad)


def test_a_file_that_loads_but_cannot_run_as_written_is_served_as_the_workers_read_it(tmp_path: Path) -> None:
    # torch's dynamo exporter: a Conv3d without a bias gets a computed zero bias of shape [4, 2], which onnxruntime
    # loads and then refuses at the first run
    path = conv3d_without_bias(tmp_path / "conv3d.onnx")
    weight = np.full((4, 2, 3, 3, 3), 0.1, np.float32)
    state = ModelState.load(path, weights={"w": weight})
    x = np.random.default_rng(12).standard_normal((2, 2, 3, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(state.infer({"x": x})["y"], conv3d_reference(weight, x), rtol=1e-5, atol=1e-6)
