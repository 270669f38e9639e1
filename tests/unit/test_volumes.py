"""3-D Convs as 2-D Convs over the depth taps stacked as channels (rewrites/volumes.py): the same values and
gradients as the 3-D Conv, and the Convs it does not cover left as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine import GradientEngine
from worker_client.engine import rewrites
from worker_client.engine.rewrites import rewrite_forward
from worker_client.engine.rewrites.volumes import MIN_CHANNELS, planar_volume_convs


def _conv_model(x: tuple[int, ...], filters: int, kernel: tuple[int, ...] = (3, 3, 3), *, bias: bool = False,
                seed: int = 0, **attributes: object) -> onnx.ModelProto:
    """y = Conv(x, w[, b]) with the given attributes, static input shapes, weights of unit-scale outputs."""
    rng = np.random.default_rng(seed)
    group = int(attributes.get("group", 1))   # type: ignore[call-overload]
    shape = (filters, x[1] // group, *kernel)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32),
                                       "w")]
    inputs = ["x", "w"]
    if bias:
        weights.append(numpy_helper.from_array(rng.standard_normal(filters).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], kernel_shape=list(kernel), **attributes)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"y{i}" for i in range(len(x))])],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("x, filters, kernel, attributes", [
    ((4, 16, 8, 8, 8), 32, (3, 3, 3), {"pads": [1] * 6}),                              # a same-size layer
    ((2, 8, 6, 7, 5), 8, (3, 3, 3), {"pads": [0, 1, 2, 2, 0, 1]}),                    # unequal pads, odd sizes
    ((2, 8, 9, 9, 9), 16, (3, 3, 3), {"pads": [1] * 6, "strides": [2, 2, 2]}),       # strided: stepped Slices
    ((2, 8, 8, 8, 8), 8, (3, 3, 3), {"pads": [2] * 6, "dilations": [2, 2, 2]}),      # dilated taps
    ((2, 8, 5, 6, 6), 12, (1, 3, 3), {"pads": [0, 1, 1, 0, 1, 1]}),                  # (2+1)D's spatial half: no copy
    ((2, 8, 6, 6, 6), 8, (2, 2, 2), {"strides": [2, 1, 2]}),                          # no pads, strides that differ
])
@pytest.mark.parametrize("bias", [False, True])
def test_a_volume_conv_becomes_a_planar_conv_that_computes_the_same(
        x: tuple[int, ...], filters: int, kernel: tuple[int, ...], attributes: dict, bias: bool) -> None:
    model = _conv_model(x, filters, kernel, bias=bias, **attributes)
    data = np.random.default_rng(1).standard_normal(x).astype(np.float32)
    direct = _run(model, data)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert planar_volume_convs(rewritten) == 1
    convs = [n for n in rewritten.graph.node if n.op_type == "Conv"]
    assert len(convs) == 1 and len(next(a.ints for a in convs[0].attribute if a.name == "pads")) == 4   # 2-D
    assert [n.op_type for n in rewritten.graph.node].count("Slice") == (0 if kernel[0] == 1 else kernel[0])
    onnx.checker.check_model(rewritten, full_check=True)
    got = _run(rewritten, data)
    assert got.shape == direct.shape
    # float32 rounding of sums of C x 27 terms of unit scale, computed in another order
    np.testing.assert_allclose(got, direct, rtol=0, atol=2e-5 * np.abs(direct).max())


@pytest.mark.parametrize("x, filters, kernel, attributes, why", [
    ((2, 16, 8, 8), 16, (3, 3), {"pads": [1] * 4}, "a 2-D Conv"),
    ((2, 8, 8, 8, 8, 8), 8, (3, 3, 3, 3), {}, "a 4-D Conv"),
    ((2, 16, 6, 6, 6), 16, (3, 3, 3), {"pads": [1] * 6, "group": 2}, "grouped"),
    ((2, MIN_CHANNELS - 1, 6, 6, 6), 16, (3, 3, 3), {"pads": [1] * 6}, "too few input channels (a first layer)"),
    ((2, 16, 6, 6, 6), MIN_CHANNELS - 1, (3, 3, 3), {"pads": [1] * 6}, "too few filters (a last layer)"),
    ((2, 16, 6, 6, 6), 16, (3, 3, 3), {"auto_pad": "SAME_UPPER"}, "pads not yet written out"),
    ((2, 16, 7, 4, 4), 16, (3, 1, 1), {"pads": [1, 0, 0, 1, 0, 0]}, "(2+1)D's temporal half: 1 x 1 planes"),
])
def test_convs_the_rewrite_does_not_cover_are_left_alone(x: tuple[int, ...], filters: int, kernel: tuple[int, ...],
                                                         attributes: dict, why: str) -> None:
    model = _conv_model(x, filters, kernel, **attributes)
    before = model.SerializeToString()
    assert planar_volume_convs(model) == 0, why
    assert model.SerializeToString() == before, why


def test_the_channel_threshold_is_the_fewer_of_inputs_and_filters() -> None:
    assert planar_volume_convs(_conv_model((2, MIN_CHANNELS, 4, 4, 4), MIN_CHANNELS, pads=[1] * 6)) == 1
    assert planar_volume_convs(_conv_model((2, MIN_CHANNELS - 1, 4, 4, 4), 64, pads=[1] * 6)) == 0
    assert planar_volume_convs(_conv_model((2, 64, 4, 4, 4), MIN_CHANNELS - 1, pads=[1] * 6)) == 0


def test_a_conv_with_a_dynamic_batch_or_a_double_input_is_left_alone() -> None:
    model = _conv_model((2, 16, 6, 6, 6), 16, pads=[1] * 6)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    assert planar_volume_convs(model) == 0
    model = _conv_model((2, 16, 6, 6, 6), 16, pads=[1] * 6)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(
        numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64), "w"))
    assert planar_volume_convs(model) == 0


def _volume_layers(path: Path) -> Path:
    """Conv3d(8 -> 16, bias, stride 2) - ReLU - Conv3d(16 -> 8) over 6^3 volumes, written to `path`."""
    rng = np.random.default_rng(3)
    weights = {"w1": rng.standard_normal((16, 8, 3, 3, 3)) / 15, "b1": rng.standard_normal(16) * 0.1,
               "w2": rng.standard_normal((8, 16, 3, 3, 3)) / 21}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], kernel_shape=[3, 3, 3], pads=[1] * 6,
                              strides=[2, 2, 2]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], kernel_shape=[3, 3, 3], pads=[1] * 6)]
    graph = helper.make_graph(nodes, "layers",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8, 6, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8, 3, 3, 3])],
                              [numpy_helper.from_array(w.astype(np.float32), k) for k, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _volume_convs(engine: GradientEngine) -> int:
    return sum(1 for n in engine._graph.model.graph.node if n.op_type in ("Conv", "ConvTranspose") and
               len(next((a.ints for a in n.attribute if a.name == "pads"), [])) == 6)


def test_the_engine_s_gradients_through_planar_convs_are_the_volume_convs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _volume_layers(tmp_path / "layers.onnx")
    planar = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "planar")
    assert _volume_convs(planar) == 0   # both layers and their adjoints run on 2-D kernels
    monkeypatch.setattr(rewrites, "planar_volume_convs", lambda model: 0)
    direct = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "direct")
    assert _volume_convs(direct) >= 2
    rng = np.random.default_rng(4)
    batch = {"x": rng.standard_normal((4, 8, 6, 6, 6)).astype(np.float32),
             "labels": rng.standard_normal((4, 8, 3, 3, 3)).astype(np.float32)}
    parameters = direct.parameters()
    loss, expected = direct.gradients(parameters, batch)
    got_loss, got = planar.gradients(parameters, batch)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert set(got) == set(expected) == {"w1", "b1", "w2"}
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5 * np.abs(value).max(), err_msg=name)


def test_a_cuda_target_keeps_its_volume_convs() -> None:
    model = _conv_model((2, 16, 6, 6, 6), 16, pads=[1] * 6)
    cuda = rewrite_forward(onnx.ModelProto.FromString(model.SerializeToString()), "cuda")
    assert [len(next(a.ints for a in n.attribute if a.name == "pads")) for n in cuda.graph.node
            if n.op_type == "Conv"] == [6]
    cpu = rewrite_forward(model, "cpu")
    assert [len(next(a.ints for a in n.attribute if a.name == "pads")) for n in cpu.graph.node
            if n.op_type == "Conv"] == [4]
