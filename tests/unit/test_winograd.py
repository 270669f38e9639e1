"""3 x 3 Convs over small maps as Winograd's F(2 x 2, 3 x 3) (rewrites/winograd.py): the same values and
gradients as the direct convolution, and the Convs it does not cover left as they are."""

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
from worker_client.engine.rewrites.winograd import MAX_POSITIONS, MIN_BATCH_POSITIONS, MIN_CHANNELS, winograd_convs


def _conv_model(x: tuple[int, int, int, int], filters: int, *, kernel: int = 3, bias: bool = False,
                opset: int = 18, seed: int = 0, **attributes: object) -> onnx.ModelProto:
    """y = Conv(x, w[, b]) with the given attributes, static shapes, unit-scale weights."""
    rng = np.random.default_rng(seed)
    group = int(attributes.get("group", 1))   # type: ignore[call-overload]
    weights = [numpy_helper.from_array(
        (rng.standard_normal((filters, x[1] // group, kernel, kernel)) / kernel).astype(np.float32), "w")]
    inputs = ["x", "w"]
    if bias:
        weights.append(numpy_helper.from_array(rng.standard_normal(filters).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], kernel_shape=[kernel, kernel], **attributes)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m", "h", "w"])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("x, filters, pads, bias, opset", [
    ((8, 64, 8, 8), 64, [1, 1, 1, 1], False, 18),   # a ResNet layer's: same-size output, even tiles
    ((8, 64, 8, 8), 64, [1, 1, 1, 1], True, 13),    # an older opset: DepthToSpace's CRD mode is opset 11's
    ((16, 64, 7, 9), 96, [1, 1, 1, 1], True, 18),   # odd output sizes (the last tiles cropped), C != M, a bias
    ((32, 64, 6, 5), 64, [0, 2, 1, 0], False, 18),   # unequal pads on every side
    ((8, 80, 10, 10), 64, [0, 0, 0, 0], True, 18),   # no pads: an 8 x 8 output from a 10 x 10 map
    ((32, 64, 4, 4), 128, [2, 2, 2, 2], False, 18),   # pads of 2: a 6 x 6 output of a 4 x 4 map
    ((128, 64, 2, 2), 64, [1, 1, 1, 1], False, 18),   # a 2 x 2 map: one tile
])
def test_a_matched_conv_becomes_winograd_products_that_compute_the_same(
        x: tuple[int, int, int, int], filters: int, pads: list[int], bias: bool, opset: int) -> None:
    model = _conv_model(x, filters, pads=pads, bias=bias, opset=opset)
    data = np.random.default_rng(1).standard_normal(x).astype(np.float32)
    direct = _run(model, data)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert winograd_convs(rewritten) == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Conv" not in ops and ops.count("Gemm") == 16 and "DepthToSpace" in ops
    onnx.checker.check_model(rewritten, full_check=True)
    got = _run(rewritten, data)
    assert got.shape == direct.shape
    # float32 rounding of sums of 9 x C terms of unit scale, computed in another order
    np.testing.assert_allclose(got, direct, rtol=0, atol=2e-5 * np.abs(direct).max())


@pytest.mark.parametrize("x, filters, kernel, opset, attributes, why", [
    ((8, 64, 8, 8), 64, 3, 18, {"pads": [1, 1, 1, 1], "strides": [2, 2]}, "strided"),
    ((8, 64, 8, 8), 64, 5, 18, {"pads": [2, 2, 2, 2]}, "a 5 x 5 kernel"),
    ((8, 64, 8, 8), 64, 3, 18, {"pads": [2, 2, 2, 2], "dilations": [2, 2]}, "dilated"),
    ((8, 64, 8, 8), 64, 3, 18, {"pads": [1, 1, 1, 1], "group": 2}, "grouped"),
    ((8, 64, 8, 8), 64, 3, 18, {"pads": [3, 3, 3, 3]}, "pads beyond a tile's reach"),
    ((8, MIN_CHANNELS // 2, 8, 8), 64, 3, 18, {"pads": [1, 1, 1, 1]}, "too few input channels"),
    ((8, 64, 8, 8), MIN_CHANNELS // 2, 3, 18, {"pads": [1, 1, 1, 1]}, "too few output channels"),
    ((4, 64, 32, 32), 64, 3, 18, {"pads": [1, 1, 1, 1]}, "a map the direct kernels do better"),
    ((1, 512, 4, 4), 512, 3, 18, {"pads": [1, 1, 1, 1]}, "too few positions for the filter transform"),
])
def test_convs_the_rewrite_does_not_cover_are_left_alone(x: tuple[int, int, int, int], filters: int, kernel: int,
                                                         opset: int, attributes: dict, why: str) -> None:
    model = _conv_model(x, filters, kernel=kernel, opset=opset, **attributes)
    before = model.SerializeToString()
    assert winograd_convs(model) == 0, why
    assert model.SerializeToString() == before, why


def test_the_thresholds_bound_what_is_matched() -> None:
    """The edges of the three thresholds: each one position or channel either side."""
    side = int(MAX_POSITIONS ** 0.5)
    batch = -(-MIN_BATCH_POSITIONS // MAX_POSITIONS)
    assert winograd_convs(_conv_model((batch, MIN_CHANNELS, side, side), MIN_CHANNELS, pads=[1] * 4)) == 1
    assert winograd_convs(_conv_model((batch, MIN_CHANNELS, side + 1, side), MIN_CHANNELS, pads=[1] * 4)) == 0
    assert winograd_convs(_conv_model((batch, MIN_CHANNELS - 1, side, side), MIN_CHANNELS, pads=[1] * 4)) == 0
    small = (MIN_BATCH_POSITIONS // 64, MIN_CHANNELS, 8, 8)
    assert winograd_convs(_conv_model(small, MIN_CHANNELS, pads=[1] * 4)) == 1
    assert winograd_convs(_conv_model((small[0] - 1, *small[1:]), MIN_CHANNELS, pads=[1] * 4)) == 0


def test_a_conv_with_a_dynamic_batch_is_left_alone() -> None:
    model = _conv_model((8, 64, 8, 8), 64, pads=[1, 1, 1, 1])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    assert winograd_convs(model) == 0


def _two_layers(path: Path) -> Path:
    """Conv(64 -> 64, bias) - ReLU - Conv(64 -> 64) over 8 x 8 maps, written to `path`."""
    rng = np.random.default_rng(3)
    weights = {"w1": rng.standard_normal((64, 64, 3, 3)) / 24, "b1": rng.standard_normal(64) * 0.1,
               "w2": rng.standard_normal((64, 64, 3, 3)) / 24}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64, 8, 8])],
                              [numpy_helper.from_array(w.astype(np.float32), k) for k, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def test_the_engine_s_gradients_through_winograd_convs_are_the_direct_convs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _two_layers(tmp_path / "layers.onnx")
    winograd = GradientEngine(path, batch_size=8, loss="mse", cache_dir=tmp_path / "winograd")
    ops = {n.op_type for n in winograd._graph.model.graph.node}
    assert "Conv" not in ops and "ConvTranspose" not in ops   # both layers and their adjoints
    assert "SpaceToDepth" in ops   # the adjoint of the DepthToSpace that lays out the tiles, not a 6-axis Transpose
    monkeypatch.setattr(rewrites, "winograd_convs", lambda model: 0)
    direct = GradientEngine(path, batch_size=8, loss="mse", cache_dir=tmp_path / "direct")
    assert {"w1", "w2"} <= {n.input[1] for n in direct._graph.model.graph.node if n.op_type == "Conv"}
    rng = np.random.default_rng(4)
    batch = {"x": rng.standard_normal((8, 64, 8, 8)).astype(np.float32),
             "labels": rng.standard_normal((8, 64, 8, 8)).astype(np.float32)}
    parameters = direct.parameters()
    loss, expected = direct.gradients(parameters, batch)
    got_loss, got = winograd.gradients(parameters, batch)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert set(got) == set(expected) == {"w1", "b1", "w2"}
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5 * np.abs(value).max(), err_msg=name)


def test_a_cuda_target_keeps_its_convs_and_an_unknown_target_is_refused() -> None:
    model = _conv_model((8, 64, 8, 8), 64, pads=[1, 1, 1, 1])
    assert "Conv" in {n.op_type for n in rewrite_forward(model, "cuda").graph.node}
    assert "Conv" not in {n.op_type for n in rewrite_forward(model, "cpu").graph.node}
    with pytest.raises(ValueError, match=r"target must be one of \('cpu', 'cuda'\), got 'tpu'"):
        rewrite_forward(model, "tpu")
