"""The engine's fast paths compute what they replace: adjoint rewrites onto onnxruntime's faster
kernels, and Dropout masks drawn and fed over the keep rate."""

from __future__ import annotations

import itertools
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.engines import with_and_without
from tests.helpers.lstm_fixture import assert_lstm_gradients_hold, lstm_engines
from worker_client import GradientEngine
from worker_client.engine import engine as engine_module
from worker_client.engine import rewrites
from worker_client.engine.device_masks import DeviceMasks, masks_graph
from worker_client.engine.rewrites.col2im import (
    SMALL_MAP_POSITIONS,
    depth_to_space_as_col2im,
    small_transposed_convs_as_col2im,
)
from worker_client.engine.rewrites.conv import (
    flip_unit_stride_transposed_convs,
    phases_gain,
    split_strided_transposed_convs,
)
from worker_client.engine.rewrites.layout import space_to_depth_transposes
from worker_client.engine.rewrites.nchwc import NCHWC_DOMAIN, block_convs, nchwc_block_size
from worker_client.engine.rewrites.scatter import concat_padded_pieces, concat_piecewise_scatters
from worker_client.engine.rewrites.toolkit import static_shapes
from worker_client.engine.rewrites.transposed import RESTORED_KEY
from worker_client.engine.session import placement
from worker_client.engine.training_mode import training_form

OPSET = 18


def _model(nodes: Sequence[onnx.NodeProto], inputs: dict[str, list[int]],
           outputs: Sequence[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "test",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _saved(graph: onnx.GraphProto, path: Path) -> Path:
    """`graph` as a model of OPSET written to `path`, for a GradientEngine to load."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _rewritten_agrees(model: onnx.ModelProto, rewrite: Callable[[onnx.ModelProto], int],
                      feeds: dict[str, np.ndarray]) -> tuple[int, onnx.ModelProto]:
    """Apply `rewrite` to a copy of `model`; assert the outputs are unchanged."""
    before = _run(model, feeds)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    count = rewrite(changed)
    for old, new in zip(before, _run(changed, feeds), strict=True):
        assert new.shape == old.shape
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)
    return count, changed


@pytest.mark.parametrize("kernel, pads, dilations, output_shape", [
    ([3, 3], [1, 1, 1, 1], [1, 1], None),          # a ResNet conv's input adjoint
    ([3, 3], [1, 1, 1, 1], [1, 1], [6, 7]),        # as onnx-ad writes it, with output_shape
    ([3, 2], [0, 1, 2, 0], [1, 1], None),          # uneven pads, a non-square kernel
    ([3, 3], [2, 1, 2, 3], [2, 2], None),          # dilated
    ([1, 1], [0, 0, 0, 0], [1, 1], None),          # a 1x1 projection: nothing to reverse
    ([9, 8], [4, 3, 4, 4], [1, 1], None),          # 72 taps: reversed by a Slice, not a MatMul
])
def test_a_unit_stride_transposed_conv_rewritten_as_a_flipped_conv_computes_the_same(
        kernel: list[int], pads: list[int], dilations: list[int], output_shape: list[int] | None) -> None:
    rng = np.random.default_rng(11)
    extra = {"output_shape": output_shape} if output_shape else {}
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", pads=pads,
                            dilations=dilations, strides=[1, 1], **extra)
    model = _model([node], {"g": [2, 5, 6, 7], "w": [5, 3, *kernel]}, ["y"])
    feeds = {"g": rng.standard_normal((2, 5, 6, 7)).astype(np.float32),
             "w": rng.standard_normal((5, 3, *kernel)).astype(np.float32)}
    count, changed = _rewritten_agrees(model, flip_unit_stride_transposed_convs, feeds)
    assert count == 1
    ops = [n.op_type for n in changed.graph.node]
    assert "ConvTranspose" not in ops
    taps = kernel[0] * kernel[1]
    assert ("MatMul" in ops) == (1 < taps <= 64) and ("Slice" in ops) == (taps > 64)


@pytest.mark.parametrize("group, w, dilations", [
    (5, [5, 1, 3, 3], [1, 1]),       # a depthwise Conv's input adjoint
    (5, [5, 2, 3, 2], [2, 1]),       # one input channel per group, two outputs: the axes swap by a Reshape
    (4, [8, 3, 3, 3], [1, 1]),       # two channels in, three out per group: swapped by a Transpose
])
def test_a_grouped_unit_stride_transposed_conv_is_the_grouped_flipped_conv(
        group: int, w: list[int], dilations: list[int]) -> None:
    rng = np.random.default_rng(15)
    x = [2, w[0], 6, 7]
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", pads=[1, 0, 1, 1], group=group,
                            dilations=dilations)
    model = _model([node], {"g": x, "w": w}, ["y"])
    feeds = {"g": rng.standard_normal(x).astype(np.float32), "w": rng.standard_normal(w).astype(np.float32)}
    count, changed = _rewritten_agrees(model, flip_unit_stride_transposed_convs, feeds)
    assert count == 1
    assert [next(a.i for a in n.attribute if a.name == "group") for n in changed.graph.node
            if n.op_type == "Conv"] == [group]


@pytest.mark.parametrize("attributes", [
    {"strides": [2, 2], "pads": [1, 1, 1, 1]},     # strided: left to ConvTranspose
    {"strides": [2, 2], "group": 5, "pads": [1, 1, 1, 1]},            # grouped and strided
    {"pads": [1, 1, 1, 1], "output_padding": [0, 0], "output_shape": [7, 7]},   # output_shape with another split
])
def test_transposed_convs_the_flip_does_not_cover_are_left_alone(attributes: dict) -> None:
    rng = np.random.default_rng(12)
    channels = 1 if attributes.get("group") else 3
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", **attributes)
    model = _model([node], {"g": [2, 5, 6, 6], "w": [5, channels, 3, 3]}, ["y"])
    feeds = {"g": rng.standard_normal((2, 5, 6, 6)).astype(np.float32),
             "w": rng.standard_normal((5, channels, 3, 3)).astype(np.float32)}
    count, _ = _rewritten_agrees(model, flip_unit_stride_transposed_convs, feeds)
    assert count == 0


@pytest.mark.parametrize("size, kernel, stride, attributes", [
    (4, 3, 2, {"pads": [1, 1, 1, 1], "output_shape": [8, 8]}),   # a ResNet downsampling conv's adjoint
    (4, 3, 2, {"pads": [1, 1, 1, 1], "output_padding": [1, 1]}),  # the same, by output_padding
    (5, 4, 2, {"pads": [1, 1, 1, 1]}),                            # an even kernel
    (3, 2, 2, {}),                                                # kernel = stride: no overlap
    (4, 5, 2, {"pads": [2, 2, 2, 2], "output_shape": [8, 8]}),
    (3, 3, 3, {"pads": [1, 1, 2, 2]}),                            # stride 3, uneven pads
    (4, 3, 2, {"pads": [0, 0, 0, 0], "output_shape": [8, 8]}),    # more output than the pads give
    (4, 3, 2, {"output_shape": [6, 6]}),                          # cropped: a phase cuts its input
    (4, 3, 2, {"pads": [1, 1, 1, 1]}),                            # 7 x 7: computed to 8 x 8, cut back
    (5, 4, 3, {"pads": [1, 2, 0, 1]}),                            # 14 x 13 at stride 3
])
def test_a_strided_transposed_conv_split_into_phase_convs_computes_the_same(
        size: int, kernel: int, stride: int, attributes: dict) -> None:
    rng = np.random.default_rng(13)
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", strides=[stride, stride],
                            **attributes)
    model = _model([node], {"g": [2, 5, size, size], "w": [5, 3, kernel, kernel]}, ["y"])
    feeds = {"g": rng.standard_normal((2, 5, size, size)).astype(np.float32),
             "w": rng.standard_normal((5, 3, kernel, kernel)).astype(np.float32)}
    count, changed = _rewritten_agrees(model, split_strided_transposed_convs, feeds)
    assert count == 1
    assert "ConvTranspose" not in {n.op_type for n in changed.graph.node}


@pytest.mark.parametrize("stride, attributes, blocked", [
    (2, {}, True),                                    # a UNet's 2 x 2 upsampling: one 1 x 1 Conv and a DepthToSpace
    (3, {}, True),
    (2, {"output_padding": [1, 1]}, False),           # one more row and column: phase Convs
    (2, {"pads": [1, 1, 1, 1]}, False),               # cropped: phase Convs
])
def test_a_transposed_conv_whose_kernel_is_its_stride_is_one_conv_and_a_depth_to_space(
        stride: int, attributes: dict, blocked: bool) -> None:
    rng = np.random.default_rng(17)
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="up", strides=[stride, stride], **attributes)
    model = _model([node], {"g": [2, 5, 3, 4], "w": [5, 3, stride, stride]}, ["y"])
    feeds = {"g": rng.standard_normal((2, 5, 3, 4)).astype(np.float32),
             "w": rng.standard_normal((5, 3, stride, stride)).astype(np.float32)}
    count, changed = _rewritten_agrees(model, split_strided_transposed_convs, feeds)
    assert count == 1
    ops = [n.op_type for n in changed.graph.node]
    assert (ops.count("Conv"), "DepthToSpace" in ops) == ((1, True) if blocked else (stride * stride, True))


@pytest.mark.parametrize("strides, kernel, attributes", [
    ([2, 2, 2], [2, 2, 2], {}),                              # a 3-D UNet's 2 x 2 x 2 upsampling
    ([2, 2, 2], [3, 3, 3], {"pads": [1] * 6, "output_padding": [1, 1, 1]}),   # a strided Conv3d's adjoint
    ([3, 2, 2], [3, 2, 2], {}),                              # another stride in depth
    ([2, 3, 2], [2, 3, 2], {}),                              # unequal in the plane: the one Transpose
])
def test_a_strided_3d_transposed_conv_is_interleaved_on_4d_views(strides: list[int], kernel: list[int],
                                                                  attributes: dict) -> None:
    """onnxruntime's Transpose is slow above 4-D: an 8-D one interleaving [32, 16, 2, 2, 2, 8, 8, 8] took 8.1 ms;
    with the two in-plane strides equal, two 4-D Transposes and a DepthToSpace do it."""
    rng = np.random.default_rng(19)
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="up", strides=strides, **attributes)
    model = _model([node], {"g": [2, 4, 3, 4, 2], "w": [4, 3, *kernel]}, ["y"])
    feeds = {"g": rng.standard_normal((2, 4, 3, 4, 2)).astype(np.float32),
             "w": rng.standard_normal((4, 3, *kernel)).astype(np.float32)}
    count, changed = _rewritten_agrees(model, split_strided_transposed_convs, feeds)
    assert count == 1
    shapes = static_shapes(changed)
    widest = max(len(shapes[n.input[0]]) for n in changed.graph.node if n.op_type == "Transpose"
                 and n.input[0] in shapes and n.input[0] != "w")
    assert widest == (4 if strides[1] == strides[2] else 8)


@pytest.mark.parametrize("size, kernel, stride, attributes", [
    (4, 1, 2, {"output_shape": [8, 8]}),             # a 1x1 projection: phases with no tap
    (4, 3, 2, {"pads": [1, 1, 1, 1], "output_shape": [8, 8], "group": 5}),
])
def test_strided_transposed_convs_the_split_does_not_cover_are_left_alone(
        size: int, kernel: int, stride: int, attributes: dict) -> None:
    rng = np.random.default_rng(14)
    channels = 1 if attributes.get("group") else 3
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", strides=[stride, stride],
                            **attributes)
    model = _model([node], {"g": [2, 5, size, size], "w": [5, channels, kernel, kernel]}, ["y"])
    feeds = {"g": rng.standard_normal((2, 5, size, size)).astype(np.float32),
             "w": rng.standard_normal((5, channels, kernel, kernel)).astype(np.float32)}
    count, _ = _rewritten_agrees(model, split_strided_transposed_convs, feeds)
    assert count == 0


@pytest.mark.parametrize("x, w, attributes, split", [
    ([32, 512, 4, 4], [512, 256, 3, 3], {"pads": [1] * 4, "output_padding": [1, 1]}, False),  # ResNet's last stage
    ([32, 256, 8, 8], [256, 128, 3, 3], {"pads": [1] * 4, "output_padding": [1, 1]}, False),
    ([32, 128, 16, 16], [128, 3, 4, 4], {"pads": [1] * 4}, False),      # 3 output channels: no block fits
    ([32, 30, 16, 16], [30, 16, 3, 3], {"pads": [1] * 4}, False),       # inputs not in the blocks' steps of 4
    ([32, 128, 16, 16], [128, 64, 3, 3], {"pads": [1] * 4}, True),      # the phase Convs run blocked
    ([32, 64, 8, 8], [64, 128, 3, 3], {"pads": [1] * 4}, True),         # more output channels than input ones
    ([32, 256, 4, 4], [256, 128, 2, 2], {}, True),                      # kernel = stride: one 1 x 1 Conv
    ([32, 64, 8], [64, 32, 3], {"pads": [1, 1]}, True),                 # one axis
])
def test_phases_gain_splits_only_where_the_phase_convs_beat_the_transposed_conv(
        x: list[int], w: list[int], attributes: dict, split: bool) -> None:
    spatial = len(x) - 2
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", strides=[2] * spatial,
                            **attributes)
    model = _model([node], {"g": x, "w": w}, ["y"])
    assert phases_gain(model)(node) is split
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert split_strided_transposed_convs(rewritten, phases_gain(rewritten)) == int(split)


def test_a_strided_conv_over_a_small_map_keeps_its_transposed_conv_adjoint_and_its_gradients_hold(
        tmp_path: Path, monkeypatch) -> None:
    """A stride-2 Conv that widens 16 to 32 channels to a 6 x 6 map (past a Conv whose input adjoint it needs;
    36 positions, more than a GEMM and a Col2Im take): its input adjoint stays onnxruntime's ConvTranspose
    (`phases_gain`), and the gradients are those of the engine that splits it into phase Convs."""
    rng = np.random.default_rng(22)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])]
    graph = helper.make_graph(
        nodes, "down", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32, 6, 6])],
        [numpy_helper.from_array(rng.standard_normal((16, 4, 3, 3)).astype(np.float32), "w1"),
         numpy_helper.from_array(rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1, "w2")])
    batch = {"x": rng.standard_normal((4, 4, 12, 12)).astype(np.float32),
             "labels": rng.standard_normal((4, 32, 6, 6)).astype(np.float32)}
    engine, plain = _with_and_without(graph, tmp_path, monkeypatch, rewrites, "phases_gain",
                                      lambda node: True)   # split all
    kept = [n for n in engine._graph.model.graph.node if n.op_type == "ConvTranspose"]
    assert len(kept) == 1 and next(a.ints for a in kept[0].attribute if a.name == "strides") == [2, 2]
    assert "ConvTranspose" not in {n.op_type for n in plain._graph.model.graph.node}
    loss, gradients = engine.gradients(engine.parameters(), batch)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), batch)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for name in ("w1", "w2"):
        np.testing.assert_allclose(gradients[name], plain_gradients[name], rtol=1e-4, atol=1e-5)


def _scatter_sum(indices: Sequence[int], *, index_shape: tuple[int, ...] = (1,),
                 rows: int = 3) -> onnx.ModelProto:
    """Sum over `indices` of ScatterND(zeros, [[i]], update_i): onnx-ad's adjoint of a tensor
    taken apart by Gathers at constant indices of axis 0."""
    nodes, inputs = [], {}
    for position, value in enumerate(indices):
        nodes += [
            helper.make_node("ConstantOfShape", ["shape"], [f"zeros{position}"],
                             value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])),
            helper.make_node("Constant", [], [f"index{position}"],
                             value=helper.make_tensor("i", TensorProto.INT64, index_shape, [value])),
            helper.make_node("ScatterND", [f"zeros{position}", f"index{position}", f"update{position}"],
                             [f"scattered{position}"], reduction="add"),
        ]
        inputs[f"update{position}"] = [1] * (len(index_shape) - 1) + [4, 5]
    nodes.insert(0, helper.make_node("Constant", [], ["shape"], value=helper.make_tensor(
        "s", TensorProto.INT64, [3], [rows, 4, 5])))
    nodes.append(helper.make_node("Sum", [f"scattered{p}" for p in range(len(indices))], ["y"]))
    return _model(nodes, inputs, ["y"])


@pytest.mark.parametrize("indices, index_shape", [([0, 1, 2], (1,)), ([2, 0, 1], (1,)),
                                                  ([1, -1, 0], (1, 1))])
def test_a_sum_of_scatters_rebuilding_a_tensor_becomes_one_concat(
        indices: list[int], index_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(15)
    model = _scatter_sum(indices, index_shape=index_shape)
    feeds = {f"update{p}": rng.standard_normal([1] * (len(index_shape) - 1) + [4, 5]).astype(np.float32)
             for p in range(len(indices))}
    count, changed = _rewritten_agrees(model, concat_piecewise_scatters, feeds)
    assert count == 1
    assert "Concat" in {n.op_type for n in changed.graph.node}


@pytest.mark.parametrize("indices, rows", [([0, 2], 3),       # index 1 missing: zeros there
                                           ([0, 1, 1], 3),    # a repeated index adds
                                           ([0, 1, 2], 4)])
def test_scatter_sums_that_do_not_rebuild_the_whole_tensor_are_left_alone(
        indices: list[int], rows: int) -> None:
    rng = np.random.default_rng(16)
    model = _scatter_sum(indices, rows=rows)
    feeds = {f"update{p}": rng.standard_normal((4, 5)).astype(np.float32) for p in range(len(indices))}
    count, _ = _rewritten_agrees(model, concat_piecewise_scatters, feeds)
    assert count == 0


def _padded_sum(spans: Sequence[tuple[int, int]], *, axis: int = 0, full: int = 10, value: float = 0.0,
                mode: str = "constant", also_pad_axis: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """Sum over `spans` (begin, size) of Pad(piece_i) to `full` along `axis` of a [*, 3] tensor: onnx-ad's
    adjoint of a tensor taken apart by Slices."""
    nodes, inputs = [], {}
    initializers = []
    for position, (begin, size) in enumerate(spans):
        shape = [size, 3] if axis == 0 else [3, size]
        amounts = [0, 0, 0, 0]
        amounts[axis], amounts[axis + 2] = begin, full - begin - size
        if also_pad_axis is not None:
            amounts[also_pad_axis + 2] += 1
        initializers += [numpy_helper.from_array(np.array(amounts, np.int64), f"pads{position}"),
                         numpy_helper.from_array(np.array(value, np.float32), f"value{position}")]
        nodes.append(helper.make_node("Pad", [f"piece{position}", f"pads{position}", f"value{position}"],
                                      [f"padded{position}"], mode=mode))
        inputs[f"piece{position}"] = shape
    nodes.append(helper.make_node("Sum", [f"padded{p}" for p in range(len(spans))], ["y"]))
    model = _model(nodes, inputs, ["y"])
    model.graph.initializer.extend(initializers)
    rng = np.random.default_rng(19)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in inputs.items()}
    return model, feeds


@pytest.mark.parametrize("spans, axis", [([(0, 4), (4, 6)], 0), ([(6, 4), (0, 2), (2, 4)], 0), ([(3, 7), (0, 3)], 1)])
def test_a_sum_of_padded_pieces_tiling_an_axis_becomes_one_concat(spans: list[tuple[int, int]], axis: int) -> None:
    model, feeds = _padded_sum(spans, axis=axis)
    count, changed = _rewritten_agrees(model, concat_padded_pieces, feeds)
    assert count == 1
    assert [n.op_type for n in changed.graph.node] == ["Concat"]
    ordered = [feeds[f"piece{p}"] for p, _ in sorted(enumerate(spans), key=lambda item: item[1][0])]
    np.testing.assert_array_equal(_run(changed, feeds)[0], np.concatenate(ordered, axis=axis))


@pytest.mark.parametrize("spans, options", [
    ([(0, 4), (5, 5)], {}),                        # a gap: zeros there
    ([(0, 5), (4, 6)], {}),                        # an overlap: those elements add
    ([(0, 4), (4, 6)], {"value": 1.0}),            # padded with ones
    ([(0, 4), (4, 6)], {"mode": "edge"}),          # not zeros at all
    ([(0, 4), (4, 6)], {"also_pad_axis": 1, "full": 10}),   # padded along two axes
])
def test_padded_sums_that_are_not_a_tiling_are_left_alone(spans: list[tuple[int, int]], options: dict) -> None:
    model, feeds = _padded_sum(spans, **options)
    if options.get("also_pad_axis") is not None:
        model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    count, _ = _rewritten_agrees(model, concat_padded_pieces, feeds)
    assert count == 0


def test_a_padded_piece_read_elsewhere_keeps_the_sum() -> None:
    model, feeds = _padded_sum([(0, 4), (4, 6)])
    model.graph.output.append(helper.make_tensor_value_info("padded0", TensorProto.FLOAT, None))
    count, _ = _rewritten_agrees(model, concat_padded_pieces, feeds)
    assert count == 0


def _dropout_engine(tmp_path: Path, ratio: float, *, seed: int = 0, device: str = "cpu") -> GradientEngine:
    """x (batch, 4096) -> training-mode Dropout(ratio) -> sum over the features, mse loss."""
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(np.array(ratio, np.float32))),
        helper.make_node("Constant", [], ["training"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("Mul", ["x", "w"], ["scaled"]),
        helper.make_node("Dropout", ["scaled", "ratio", "training"], ["dropped"], name="drop"),
        helper.make_node("ReduceSum", ["dropped", "axes"], ["y"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
        initializer=[numpy_helper.from_array(np.full(4096, 0.5, np.float32), "w"),
                     numpy_helper.from_array(np.array([1], np.int64), "axes")])
    path = _saved(graph, tmp_path / f"dropout_{ratio}.onnx")
    return GradientEngine(path, batch_size=8, loss="mse", seed=seed, cache_dir=tmp_path, device=device)


@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_drawn_dropout_masks_keep_one_minus_the_ratio_and_the_step_scales_them(
        tmp_path: Path, ratio: float) -> None:
    engine = _dropout_engine(tmp_path, ratio)
    (name,) = engine.mask_names
    mask = engine.draw_masks()[name]
    assert mask.shape == (8, 4096) and mask.dtype == np.float32
    assert set(np.unique(mask)) <= {0.0, 1.0}
    assert abs(mask.mean() - (1 - ratio)) < 0.02
    x = np.random.default_rng(17).standard_normal((8, 4096)).astype(np.float32)
    labels = np.zeros((8, 1), np.float32)
    result = engine.step(engine.parameters(), {"x": x, "labels": labels, name: mask})
    y = (x * 0.5 * mask / (1 - ratio)).sum(1, keepdims=True)
    assert result.loss == pytest.approx(float((y ** 2).mean()), rel=1e-5)
    np.testing.assert_allclose(result.gradients["w"], (2 * y / 8 * x * mask / (1 - ratio)).sum(0),
                               rtol=1e-4, atol=1e-4)
    # the forward pass (a pipeline stage's) takes the same 0/1 mask
    outputs, _ = engine.forward(engine.parameters(), {"x": x, name: mask})
    np.testing.assert_allclose(outputs["y"], y, rtol=1e-5, atol=1e-4)


def test_a_dropout_of_ratio_zero_is_the_identity_with_no_mask_to_draw(tmp_path: Path) -> None:
    """dropout=0.0 (common in transformer configurations): nothing to draw or feed, no Mul in the graph, the
    step and the forward pass those of the model without it."""
    engine = _dropout_engine(tmp_path, 0.0)
    assert engine.mask_names == [] and engine.draw_masks() == {}
    x = np.random.default_rng(18).standard_normal((8, 4096)).astype(np.float32)
    y = (x * 0.5).sum(1, keepdims=True)
    result = engine.step(engine.parameters(), {"x": x, "labels": np.zeros((8, 1), np.float32)})
    assert result.loss == pytest.approx(float((y ** 2).mean()), rel=1e-5)
    np.testing.assert_allclose(result.gradients["w"], (2 * y / 8 * x).sum(0), rtol=1e-4, atol=1e-4)
    outputs, _ = engine.forward(engine.parameters(), {"x": x})
    np.testing.assert_allclose(outputs["y"], y, rtol=1e-5, atol=1e-4)


def test_the_mask_output_of_a_dropout_of_ratio_zero_keeps_every_element() -> None:
    nodes = [helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(np.array(0.0, np.float32))),
             helper.make_node("Constant", [], ["training"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "kept"], name="drop")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5]),
                               helper.make_tensor_value_info("kept", TensorProto.BOOL, [3, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9   # onnx 1.23 writes IR 14 by default, past what onnxruntime 1.31 loads
    model, forms = training_form(model, [])
    assert forms.dropout_rates == {}
    x = np.random.default_rng(19).standard_normal((3, 5)).astype(np.float32)
    y, kept = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert kept.dtype == np.bool_ and kept.shape == (3, 5) and kept.all()


def test_masks_the_step_draws_follow_the_seed(tmp_path: Path) -> None:
    x = np.ones((8, 4096), np.float32)
    labels = np.zeros((8, 1), np.float32)
    losses = {}
    for label, seed in (("a", 5), ("b", 5), ("c", 6)):
        engine = _dropout_engine(tmp_path, 0.5, seed=seed)
        losses[label] = [engine.step(engine.parameters(), {"x": x, "labels": labels}).loss
                         for _ in range(2)]
    assert losses["a"] == losses["b"] and losses["a"][0] != losses["a"][1]
    assert losses["a"] != losses["c"]


def test_the_gpu_masks_graph_keeps_one_minus_the_ratio_scaled_and_draws_afresh_each_run() -> None:
    """device_masks.masks_graph, run here by onnxruntime's CPU kernels (a CUDA engine runs it on its GPU)."""
    masks = {"a": (np.dtype(np.float32), (8, 4096), 0.25), "b": (np.dtype(np.float16), (64, 512), 0.5)}

    def runs(seed: int, count: int) -> list[list[np.ndarray]]:
        session = ort.InferenceSession(masks_graph(masks, np.random.default_rng(seed)).SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        return [session.run(["a", "b"], {}) for _ in range(count)]

    (a, b), (a2, _) = runs(3, 2)
    for mask, (dtype, shape, ratio) in ((a, masks["a"]), (b, masks["b"])):
        assert mask.dtype == dtype and mask.shape == shape
        values = np.unique(mask)
        assert values[0] == 0 and len(values) == 2 and values[1] == pytest.approx(1 / (1 - ratio), rel=1e-3)
        assert abs((mask > 0).mean() - (1 - ratio)) < 0.02
    assert 0.3 < (a != a2).mean() < 0.45          # a fresh draw each run: 2 * 0.25 * 0.75 of the elements differ
    assert all(np.array_equal(x, y) for x, y in zip(runs(3, 1)[0], [a, b]))   # the generator's seeds repeat
    assert not np.array_equal(runs(4, 1)[0][0], a)


def test_device_masks_refuse_a_placement_without_a_gpu() -> None:
    with pytest.raises(ValueError, match="DeviceMasks draws on a GPU; the placement is 'cpu'"):
        DeviceMasks({"m": (np.dtype(np.float32), (2, 2), 0.5)}, placement("cpu"), np.random.default_rng(0))


@pytest.mark.cuda
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu with CUDAExecutionProvider, which this onnxruntime lacks "
                           f"(providers: {ort.get_available_providers()})")
def test_a_cuda_engine_draws_the_masks_it_is_not_given_on_the_gpu_by_its_seed(tmp_path: Path) -> None:
    x = np.ones((8, 4096), np.float32)
    labels = np.zeros((8, 1), np.float32)
    losses = {}
    for label, seed in (("a", 5), ("b", 5), ("c", 6)):
        engine = _dropout_engine(tmp_path, 0.5, seed=seed, device="cuda")
        losses[label] = [engine.step(engine.parameters(), {"x": x, "labels": labels}).loss for _ in range(2)]
        assert engine._device_masks is not None
    assert losses["a"] == losses["b"] and losses["a"][0] != losses["a"][1]
    assert losses["a"] != losses["c"]
    # y = 0.5 * (kept elements of 4096) * 2: 2048 in expectation, loss = mean(y ** 2)
    assert all(abs(loss / 2048 ** 2 - 1) < 0.05 for loss in losses["a"] + losses["c"]), losses
    # a mask the caller gives is the one the step uses
    (name,) = engine.mask_names
    mask = engine.draw_masks()[name]
    y = (0.5 * mask / 0.5).sum(1, keepdims=True)
    result = engine.step(engine.parameters(), {"x": x, "labels": labels, name: mask})
    assert result.loss == pytest.approx(float((y ** 2).mean()), rel=1e-5)


# --- convolutions on onnxruntime's channel-blocked kernels (rewrites/nchwc.py) ----------------------------------

BLOCK = nchwc_block_size()
needs_blocked_kernels = pytest.mark.skipif(not BLOCK, reason="this CPU or onnxruntime build has no NCHWc kernels")


def _cpu_flags() -> set[str]:
    try:
        return {flag for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the NCHWc block sizes are x86's")
def test_the_probe_finds_the_block_onnxruntime_uses_on_this_cpu() -> None:
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    assert BLOCK == (16 if "avx512f" in flags else 8 if "avx2" in flags else 0), (BLOCK, sorted(flags)[:20])


def _conv_model(x: list[int], w: list[int], bias: bool = False, weight_constant: bool = False,
                **attributes) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(sum(x) + sum(w))
    feeds = {"x": rng.standard_normal(x).astype(np.float32), "w": (rng.standard_normal(w) * 0.1).astype(np.float32)}
    inputs = ["x", "w"] + (["b"] if bias else [])
    if bias:
        feeds["b"] = rng.standard_normal(w[0]).astype(np.float32)
    model = _model([helper.make_node("Conv", inputs, ["y"], name="conv", **attributes)],
                   {name: list(value.shape) for name, value in feeds.items()}, ["y"])
    if weight_constant:
        model.graph.initializer.append(numpy_helper.from_array(feeds.pop("w"), "w"))
        model.graph.ClearField("input")
        model.graph.input.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[n].shape))
                                  for n in feeds])
    return model, feeds


@needs_blocked_kernels
@pytest.mark.parametrize("x, w, bias, attributes", [
    ([2, 16, 16, 16], [32, 16, 3, 3], False, {"pads": [1, 1, 1, 1]}),                 # a ResNet block's conv
    ([2, 32, 34, 33], [16, 32, 3, 3], True, {"strides": [2, 2], "pads": [1, 0, 2, 1]}),  # strided, uneven pads
    ([1, 16, 24, 20], [16, 16, 3, 2], False, {"dilations": [2, 1]}),                     # dilated, unpadded
    ([2, 32, 16, 16], [32, 1, 3, 3], False, {"group": 32, "pads": [1, 1, 1, 1]}),      # MobileNet's depthwise
    ([2, 16, 9, 8], [16, 1, 3, 3], True, {"group": 16, "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ([1, 64, 18, 18], [64, 1, 16, 16], False, {"group": 64}),   # a depthwise weight adjoint: large kernel
    ([2, 16, 300], [32, 16, 5], True, {"pads": [2, 2]}),                                # 1-D: audio, text
    ([2, 32, 600], [16, 32, 3], False, {"strides": [2], "dilations": [2], "pads": [1, 3]}),
    ([2, 16, 64], [16, 1, 3], False, {"group": 16, "pads": [1, 1]}),                  # 1-D depthwise
    ([2, 32, 16, 16], [12, 32, 3, 3], True, {"pads": [1, 1, 1, 1]}),   # 12 outputs (a PixelShuffle's 3 x 2 x 2)
    ([2, 12, 16, 16], [32, 12, 3, 3], False, {"pads": [1, 1, 1, 1]}),  # 12 inputs, padded by ReorderInput
    ([2, 24, 16, 16], [32, 24, 3, 3], True, {"pads": [1, 1, 1, 1]}),   # 24 inputs (an EfficientNet's width)
    ([4, 16, 8, 8], [16, 16, 3, 3], False, {"pads": [1, 1, 1, 1]}),     # a small map, a small filter
    ([4, 32, 16, 16], [64, 32, 4, 4], True, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),   # a GAN's downsampling
    ([3, 16, 100], [16, 16, 3], False, {"pads": [1, 1]}),               # 1-D, 100 positions
])
def test_a_conv_with_a_fed_weight_on_the_blocked_kernels_computes_the_same(x, w, bias, attributes) -> None:
    model, feeds = _conv_model(x, w, bias, **attributes)
    count, changed = _rewritten_agrees(model, lambda m: block_convs(m, BLOCK), feeds)
    assert count == 1
    # the filter's blocks and the activation's by ReorderInput, the filter's output blocks by a Transpose of
    # three axes (onnxruntime's Transposes of more go element by element)
    assert [n.op_type for n in changed.graph.node if n.domain == NCHWC_DOMAIN] == ["ReorderInput", "ReorderInput",
                                                                                    "Conv", "ReorderOutput"]
    assert all(len(next(a.ints for a in n.attribute if a.name == "perm")) <= 3
               for n in changed.graph.node if n.op_type == "Transpose")


@pytest.mark.parametrize("x, w, constant, attributes", [
    ([2, 32, 16, 16], [32, 16, 3, 3], False, {"pads": [1, 1, 1, 1], "group": 2}),   # grouped, not depthwise
    ([2, 24, 16, 16], [24, 1, 3, 3], False, {"pads": [1, 1, 1, 1], "group": 24}),   # depthwise, 24 channels
    ([2, 16, 16, 16], [32, 1, 3, 3], False, {"pads": [1, 1, 1, 1], "group": 16}),   # two filters per channel
    ([2, 3, 32, 32], [16, 3, 3, 3], False, {"pads": [1, 1, 1, 1]}),                 # 3 input channels (a stem)
    ([2, 16, 4, 4], [32, 16, 4, 4], False, {}),                                     # a 1 x 1 output: no gain
    ([2, 16, 3, 2], [16, 16, 2, 2], False, {}),                                     # 2 x 1 positions: no gain
    ([2, 16, 8, 8], [16, 16, 3, 3], False, {"pads": [1, 1, 1, 1]}),      # 128 positions over the batch
    ([32, 128, 16, 16], [256, 128, 3, 3], False, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),   # a 1.2 MB filter
    ([2, 16, 32, 32], [32, 16, 1, 1], False, {"strides": [2, 2]}),                  # one tap: no gain
    ([2, 16, 16, 16], [16, 16, 3, 3], True, {"pads": [1, 1, 1, 1]}),                # onnxruntime blocks it itself
    ([2, 16, 16, 16], [16, 16, 3, 3], False, {"auto_pad": "SAME_UPPER"}),
    ([2, 32, 16, 16], [17, 32, 3, 3], False, {"pads": [1, 1, 1, 1]}),   # 17 outputs: 32 computed, too many
    ([2, 6, 16, 16], [32, 6, 3, 3], False, {"pads": [1, 1, 1, 1]}),     # 6 inputs: ReorderInput takes fours
])
def test_convs_the_blocked_kernels_would_not_speed_up_are_left_alone(x, w, constant, attributes) -> None:
    model, _ = _conv_model(x, w, weight_constant=constant, **attributes)
    assert block_convs(model, 16) == 0 and [n.op_type for n in model.graph.node] == ["Conv"]
    assert block_convs(_conv_model([2, 16, 16, 16], [16, 16, 3, 3], pads=[1, 1, 1, 1])[0], 0) == 0   # no kernels


def test_below_16_x_16_a_conv_is_blocked_where_its_filters_reorder_is_small_against_its_products() -> None:
    from worker_client.engine.rewrites.nchwc import (MIN_BATCH_POSITIONS, MIN_SMALL_POSITIONS, SMALL_FILTER_BYTES,
                                                     small_map_gains)

    assert small_map_gains(128, 128, 8 * 8, MIN_BATCH_POSITIONS // 64, SMALL_FILTER_BYTES, 16)
    assert not small_map_gains(128, 128, 8 * 8, MIN_BATCH_POSITIONS // 64 - 1, SMALL_FILTER_BYTES, 16)   # one image
    assert not small_map_gains(128, 128, MIN_SMALL_POSITIONS - 1, 1024, 1024, 16)   # a 1 x 1 map, say
    assert not small_map_gains(128, 256, 8 * 8, 1024, SMALL_FILTER_BYTES + 1, 16)   # ResNet-18's 1.2 MB: a wash
    assert not small_map_gains(6, 32, 8 * 8, 32, 1024, 16)                          # the channel rules stand
    assert not small_map_gains(32, 17, 8 * 8, 32, 1024, 16)


def test_a_float16_cnn_keeps_its_convs_off_the_blocked_kernels_and_trains(tmp_path: Path) -> None:
    """The blocked kernels are float32's alone: a float16 Conv the shape rules would take keeps its op (ReorderInput
    of a float16 tensor made onnxruntime refuse the whole model), and the model trains in float16."""
    model, _ = _conv_model([2, 16, 16, 16], [32, 16, 3, 3], pads=[1, 1, 1, 1])   # a ResNet block's conv
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    assert block_convs(model, 16) == 0 and [n.op_type for n in model.graph.node] == ["Conv"]
    rng = np.random.default_rng(5)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "conv.w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("ReduceMean", ["c", "axes"], ["logits"], keepdims=0)],
        "half", [helper.make_tensor_value_info("image", TensorProto.FLOAT16, ["N", 16, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["N", 32])],
        [numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(np.float16), "conv.w"),
         numpy_helper.from_array(np.array([2, 3], np.int64), "axes")])
    engine = GradientEngine(_saved(graph, tmp_path / "half.onnx"), batch_size=2, intra_op_threads=1,
                            cache_dir=tmp_path)
    image = rng.standard_normal((2, 16, 16, 16))
    result = engine.step(engine.parameters(), {"image": image, "labels": np.array([1, 30])})
    # the gradient of the cross-entropy of the spatial means, in float64: softmax - one-hot, through the mean
    weight = engine.parameters()["conv.w"].astype(np.float64)
    padded = np.pad(image.astype(np.float16).astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3)).mean(axis=(2, 3))  # [N, C, 3, 3]
    logits = np.einsum("ocij,ncij->no", weight, windows)
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    seed = (probabilities - np.eye(32)[[1, 30]]) / 2
    assert result.gradients["conv.w"].dtype == np.float16
    np.testing.assert_allclose(result.gradients["conv.w"], np.einsum("no,ncij->ocij", seed, windows), atol=2e-3)


def _cnn_engine(tmp_path: Path) -> GradientEngine:
    """conv 16 -> 32 on 16 x 16, ReLU, global average, a linear head: one Conv the blocked kernels take."""
    rng = np.random.default_rng(3)
    weights = {"conv.w": (rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(np.float32),
               "head.w": (rng.standard_normal((32, 10)) * 0.1).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "conv.w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["g"]),
         helper.make_node("Flatten", ["g"], ["f"]), helper.make_node("MatMul", ["f", "head.w"], ["logits"])],
        "cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 16, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    return GradientEngine(_saved(graph, tmp_path / "cnn.onnx"), batch_size=4, intra_op_threads=1, cache_dir=tmp_path)


@needs_blocked_kernels
def test_the_cpu_sessions_run_the_blocked_convs_and_give_what_the_plain_ones_give(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    batch = {"image": rng.standard_normal((4, 16, 16, 16)).astype(np.float32), "labels": np.arange(4)}
    moved: list[int] = []

    def counted(model: onnx.ModelProto, block: int) -> int:
        moved.append(block_convs(model, block))
        return moved[-1]

    def run(engine: GradientEngine) -> tuple:
        """A training step, the forward pass a pipeline stage runs (static batch) and an evaluation."""
        return (engine.step(engine.parameters(), batch), engine.forward(engine.parameters(), {"image": batch["image"]})[0],
                engine.predict(engine.parameters(), {"image": batch["image"][:3]}))

    monkeypatch.setattr("worker_client.engine.engine.block_convs", counted)
    blocked = _cnn_engine(tmp_path)
    assert not any(n.domain == NCHWC_DOMAIN for n in blocked._graph.model.graph.node)   # the cached graph: plain
    got = run(blocked)
    assert moved[:2] == [1, 1]   # the gradient and the forward sessions' Conv; evaluation's batch is not static
    monkeypatch.setattr("worker_client.engine.engine.nchwc_block_size", lambda: 0)
    monkeypatch.setattr("worker_client.engine.engine.channel_affines", lambda model, threads: 0)
    plain = _cnn_engine(tmp_path)
    assert plain._for_placement(plain._graph.model) is plain._graph.model
    want = run(plain)
    assert got[0].loss == pytest.approx(want[0].loss, rel=1e-5)
    for name in want[0].gradients:
        np.testing.assert_allclose(got[0].gradients[name], want[0].gradients[name], rtol=1e-4, atol=1e-5, err_msg=name)
    for got_out, want_out in zip(got[1:], want[1:]):
        np.testing.assert_allclose(got_out["logits"], want_out["logits"], rtol=1e-5, atol=1e-6)


def _with_and_without(graph: onnx.GraphProto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module,
                      rewrite: str, nothing: object = 0) -> tuple[GradientEngine, GradientEngine]:
    """The engine (batch 4, mse) of `graph` as built, and built with `module.<rewrite>` doing nothing (returning
    `nothing`)."""
    return with_and_without(_saved(graph, tmp_path / "model.onnx"), tmp_path, monkeypatch, module, rewrite,
                            nothing=nothing, batch_size=4, loss="mse")


def test_the_cpu_sessions_copy_keeps_no_initializer_nothing_reads(tmp_path: Path) -> None:
    """The CPU rewrites replace nodes (a BatchNorm adjoint's per-channel arithmetic) whose shape constants then
    go unread; onnxruntime would log a warning for each one every time a session opens (forty for ResNet-18),
    so the copy is pruned."""
    rng = np.random.default_rng(24)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y", "new_mean", "new_var"],
                              training_mode=1),
             helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["z"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, 16, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 16, 16, 16])],
        [numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32), "w2"),
         numpy_helper.from_array(np.ones(16, np.float32), "gamma"),
         numpy_helper.from_array(np.zeros(16, np.float32), "beta"),
         numpy_helper.from_array(np.zeros(16, np.float32), "mean"),
         numpy_helper.from_array(np.ones(16, np.float32), "var")])
    engine = GradientEngine(_saved(graph, tmp_path / "model.onnx"), batch_size=4, loss="mse",
                            cache_dir=tmp_path / "cache")
    cpu = engine._for_placement(engine._graph.model)
    assert cpu is not engine._graph.model      # rewritten for the CPU
    read = {name for node in cpu.graph.node for name in node.input} | {value.name for value in cpu.graph.output}
    assert [tensor.name for tensor in cpu.graph.initializer if tensor.name not in read] == []
    batch = {"x": rng.standard_normal((4, 16, 16, 16)).astype(np.float32),
             "labels": rng.standard_normal((4, 16, 16, 16)).astype(np.float32)}
    loss, gradients = engine.gradients({**engine.parameters(), **engine.state()}, batch)
    assert np.isfinite(loss) and {"w", "w2", "gamma", "beta"} <= set(gradients)


@pytest.mark.parametrize("mode, block", [("CRD", 2), ("DCR", 2), ("CRD", 3), ("DCR", 3)])
def test_a_depth_to_space_becomes_one_col2im_on_the_cpu(mode: str, block: int) -> None:
    rng = np.random.default_rng(15)
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=block, mode=mode)
    model = _model([node], {"x": [2, 3 * block * block, 4, 5]}, ["y"])
    feeds = {"x": rng.standard_normal((2, 3 * block * block, 4, 5)).astype(np.float32)}
    before = _run(model, feeds)[0]
    assert depth_to_space_as_col2im(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "DepthToSpace" not in ops and ops.count("Col2Im") == 1
    np.testing.assert_array_equal(_run(model, feeds)[0], before)


def test_depth_to_space_stays_below_opset_18_and_for_other_element_types() -> None:
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="CRD")
    older = _model([node], {"x": [2, 12, 4, 5]}, ["y"])
    older.opset_import[0].version = 17
    assert depth_to_space_as_col2im(older) == 0
    doubles = _model([node], {"x": [2, 12, 4, 5]}, ["y"])
    doubles.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    assert depth_to_space_as_col2im(doubles) == 0


def test_a_trainable_strided_transposed_conv_runs_col2im_on_the_cpu_and_its_gradients_hold(
        tmp_path: Path, monkeypatch) -> None:
    """A stride-2 ConvTranspose with a trainable weight (an upsampling decoder's): the cached gradient graph
    keeps DepthToSpace for every execution provider; the CPU session runs Col2Im; the gradients are those of
    the session without that rewrite."""
    rng = np.random.default_rng(20)
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2])]
    graph = helper.make_graph(
        nodes, "up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 10, 10])],
        [numpy_helper.from_array(rng.standard_normal((4, 3, 2, 2)).astype(np.float32), "w")])
    batch = {"x": rng.standard_normal((4, 4, 5, 5)).astype(np.float32),
             "labels": rng.standard_normal((4, 3, 10, 10)).astype(np.float32)}
    engine, plain = _with_and_without(graph, tmp_path, monkeypatch, engine_module, "depth_to_space_as_col2im")
    cached = {n.op_type for n in engine._graph.model.graph.node}
    assert "DepthToSpace" in cached and "Col2Im" not in cached
    running = {n.op_type for n in engine._for_placement(engine._graph.model).graph.node}
    assert "Col2Im" in running and "DepthToSpace" not in running
    loss, gradients = engine.gradients(engine.parameters(), batch)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), batch)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    np.testing.assert_allclose(gradients["w"], plain_gradients["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("side, restored_as", [
    (8, "ConvTranspose"),     # 64 positions, 3 output channels: onnxruntime's ConvTranspose
    (4, "Col2Im"),            # 16 positions: a GEMM and a Col2Im on the CPU
])
def test_a_trained_strided_transposed_conv_whose_phases_do_not_gain_is_computed_whole_after_differentiation(
        tmp_path: Path, monkeypatch, side: int, restored_as: str) -> None:
    """A decoder's last layer (4 x 4 kernel at stride 2, to 3 channels) whose weight is computed from a trainable
    one (so its adjoint cannot be written from a detached input): split into phase Convs for onnx-ad, then its
    forward value computed by the ConvTranspose again (`restore_transposed_convs`); no phase Conv is left, the
    metadata that carried it is gone, and the gradients are those of the phases."""
    rng = np.random.default_rng(23)
    nodes = [helper.make_node("Mul", ["w", "two"], ["w2"]),
             helper.make_node("ConvTranspose", ["x", "w2", "b"], ["y"], strides=[2, 2], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "decode", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 2 * side, 2 * side])],
        [numpy_helper.from_array(rng.standard_normal((8, 3, 4, 4)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b"),
         numpy_helper.from_array(np.array(2, np.float32), "two")])
    batch = {"x": rng.standard_normal((4, 8, side, side)).astype(np.float32),
             "labels": rng.standard_normal((4, 3, 2 * side, 2 * side)).astype(np.float32)}
    engine, plain = _with_and_without(graph, tmp_path, monkeypatch, rewrites, "restore_transposed_convs")
    cached = engine._graph.model
    assert [n.op_type for n in cached.graph.node].count("ConvTranspose") == 1
    assert not [p for p in cached.metadata_props if p.key == RESTORED_KEY]
    convs = [sum(n.op_type == "Conv" for n in model.graph.node) for model in (cached, plain._graph.model)]
    assert convs[0] < convs[1], convs     # the phase Convs of the forward value are gone
    running = [n.op_type for n in engine._for_placement(cached).graph.node]
    assert restored_as in running
    loss, gradients = engine.gradients(engine.parameters(), batch)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), batch)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for name in ("w", "b"):
        np.testing.assert_allclose(gradients[name], plain_gradients[name], rtol=1e-4, atol=1e-5)


def _transposed_conv_weight_gradient(x: np.ndarray, dy: np.ndarray, kernel: list[int], stride: int,
                                     pads: list[int]) -> np.ndarray:
    """dW[c, o, a, b] = sum over n, i, j of x[n, c, i, j] * dY[n, o, s * i + a - pad, s * j + b - pad] (numpy)."""
    batch, channels, height, width = x.shape
    grad = np.zeros((channels, dy.shape[1], *kernel))
    for a, b, i, j in itertools.product(range(kernel[0]), range(kernel[1]), range(height), range(width)):
        row, column = stride * i + a - pads[0], stride * j + b - pads[1]
        if 0 <= row < dy.shape[2] and 0 <= column < dy.shape[3]:
            grad[:, :, a, b] += x[:, :, i, j].T.astype(np.float64) @ dy[:, :, row, column]
    return grad


@pytest.mark.parametrize("side, kernel, stride, attributes", [
    (4, 4, 2, {"pads": [1, 1, 1, 1]}),                               # a DCGAN generator's upsampling
    (8, 4, 2, {"pads": [1, 1, 1, 1]}),
    (5, 3, 2, {"pads": [1, 1, 1, 1], "output_padding": [1, 1]}),    # a ResNet-style decoder's
    (3, 3, 3, {"pads": [0, 1, 2, 0]}),                               # stride 3, uneven pads
    (4, 2, 2, {}),                                                   # kernel = stride
])
def test_a_trained_strided_transposed_conv_keeps_its_op_and_gets_its_weight_adjoint_from_the_engine(
        tmp_path: Path, side: int, kernel: int, stride: int, attributes: dict) -> None:
    """A strided ConvTranspose whose weight trains is detached from onnx-ad (which has no weight adjoint for it)
    and keeps its own op; its weight gradient is written from its input and its output's adjoint by phase
    planes and one GEMM (`grouped._transposed_weight_adjoint`). Against the definition, in numpy."""
    rng = np.random.default_rng(25)
    x_shape, w_shape = [4, 6, side, side], [6, 3, kernel, kernel]
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[stride, stride], **attributes)
    probe = _model([node], {"x": x_shape, "w": w_shape, "b": [3]}, ["y"])
    weight = rng.standard_normal(w_shape).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y_shape = list(_run(probe, {"x": x, "w": weight, "b": bias})[0].shape)
    graph = helper.make_graph(
        [node], "decode", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *y_shape[1:]])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    engine = GradientEngine(_saved(graph, tmp_path / "model.onnx"), batch_size=4, loss="mse",
                            cache_dir=tmp_path / "cache")
    cached = engine._graph.model
    ops = [n.op_type for n in cached.graph.node]
    assert ops.count("ConvTranspose") == 1 and "SpaceToDepth" in ops and ops.count("Gemm") == 1, ops
    assert not [v for v in cached.graph.input if v.name.startswith(("grouped_conv_", "batch_norm_stand_in"))]
    labels = rng.standard_normal([4, *y_shape[1:]]).astype(np.float32)
    loss, gradients = engine.gradients(engine.parameters(), {"x": x, "labels": labels})
    y = _run(probe, {"x": x, "w": weight, "b": bias})[0].astype(np.float64)
    dy = 2 * (y - labels) / y.size
    assert loss == pytest.approx(float(np.mean((y - labels) ** 2)), rel=1e-5)
    pads = attributes.get("pads", [0, 0, 0, 0])
    expected = _transposed_conv_weight_gradient(x, dy, [kernel, kernel], stride, pads)
    np.testing.assert_allclose(gradients["w"], expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gradients["b"], dy.sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("x, kernel, pads, strided", [
    ([2, 5, 4, 4], [3, 3], [1, 1, 1, 1], {}),       # a CIFAR ResNet's last stage: a 3 x 3 Conv's input adjoint
    ([2, 5, 3, 4], [3, 2], [0, 1, 2, 0], {}),       # uneven pads, a non-square kernel
    ([2, 5, 2, 2], [2, 2], [0, 0, 0, 0], {}),       # no padding: the output grows by the kernel
    ([2, 5, 4, 4], [3, 3], [1, 1, 1, 1], {"strides": [2, 2], "output_padding": [1, 1]}),  # a downsampling's
    ([2, 5, 4, 4], [4, 4], [1, 1, 1, 1], {"strides": [2, 2]}),       # a decoder's 4 x 4 upsampling
    ([2, 5, 3, 4], [3, 2], [0, 1, 1, 0], {"strides": [3, 2], "output_padding": [2, 0]}),
    ([2, 5, 4, 4], [4, 4], [1, 1, 1, 1], {"strides": [2, 2], "bias": True}),   # a generator's, trained with a bias
])
def test_a_transposed_conv_over_a_small_map_becomes_a_gemm_and_a_col2im_on_the_cpu(
        x: list[int], kernel: list[int], pads: list[int], strided: dict) -> None:
    rng = np.random.default_rng(21)
    biased = strided.pop("bias", False)
    node = helper.make_node("ConvTranspose", ["g", "w", "b"] if biased else ["g", "w"], ["y"], name="adjoint",
                            pads=pads, **strided)
    w = [x[1], 3, *kernel]
    model = _model([node], {"g": x, "w": w} | ({"b": [3]} if biased else {}), ["y"])
    feeds = {"g": rng.standard_normal(x).astype(np.float32), "w": rng.standard_normal(w).astype(np.float32)}
    if biased:
        feeds["b"] = rng.standard_normal(3).astype(np.float32)
    count, changed = _rewritten_agrees(model, small_transposed_convs_as_col2im, feeds)
    assert count == 1
    ops = [n.op_type for n in changed.graph.node]
    assert "ConvTranspose" not in ops and ops.count("MatMul") == 1 and ops.count("Col2Im") == 1, ops
    assert ops.count("Add") == int(biased)


@pytest.mark.parametrize("change", ["larger_map", "grouped", "dilated", "output_shape", "opset_17", "doubles",
                                    "one_tap"])
def test_transposed_convs_the_gemm_and_col2im_do_not_cover_are_left_alone(change: str) -> None:
    side = 5 if change == "larger_map" else 4           # 25 positions: more than SMALL_MAP_POSITIONS
    assert side * side > SMALL_MAP_POSITIONS or change != "larger_map"
    attributes: dict = {"pads": [0, 0, 0, 0] if change == "one_tap" else [1, 1, 1, 1]}   # one tap: nothing to flip
    attributes |= {"grouped": {"group": 5}, "dilated": {"dilations": [2, 2]},
                   "output_shape": {"output_shape": [4, 4]}}.get(change, {})
    channels = 1 if change == "grouped" else 3
    inputs = ["g", "w", "b"] if change == "bias" else ["g", "w"]
    kernel = [1, 1] if change == "one_tap" else [3, 3]
    shapes = {"g": [2, 5, side, side], "w": [5, channels, *kernel]}
    model = _model([helper.make_node("ConvTranspose", inputs, ["y"], **attributes)],
                   shapes | ({"b": [channels]} if change == "bias" else {}), ["y"])
    if change == "opset_17":
        model.opset_import[0].version = 17
    if change == "doubles":
        for value in model.graph.input:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    before = [n.op_type for n in model.graph.node]
    assert small_transposed_convs_as_col2im(model) == 0
    assert [n.op_type for n in model.graph.node] == before


def test_a_convs_input_adjoint_over_a_small_map_stays_a_convtranspose_in_the_cache_and_is_col2im_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Convs on 4 x 4 maps: the second one's input adjoint is a ConvTranspose in the cached gradient graph
    (a CUDA session runs it as it is), a GEMM and a Col2Im in the CPU session; the gradients are those of the
    engine that flips it into a Conv as on larger maps."""
    rng = np.random.default_rng(22)
    weights = {"conv1.w": (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32),
               "conv2.w": (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "conv1.w"], ["c1"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("Conv", ["r1", "conv2.w"], ["c2"], pads=[1, 1, 1, 1])],
        "small", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("c2", TensorProto.FLOAT, ["batch", 8, 4, 4])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    engine, flipped = _with_and_without(graph, tmp_path, monkeypatch, rewrites, "small_map_transposed_conv",
                                        lambda node: False)   # none picked: every one flipped
    assert "ConvTranspose" in {n.op_type for n in engine._graph.model.graph.node}
    running = [n.op_type for n in engine._for_placement(engine._graph.model).graph.node]
    assert "ConvTranspose" not in running and "Col2Im" in running
    assert "ConvTranspose" not in {n.op_type for n in flipped._graph.model.graph.node}
    batch = {"image": rng.standard_normal((4, 3, 4, 4)).astype(np.float32),
             "labels": rng.standard_normal((4, 8, 4, 4)).astype(np.float32)}
    loss, gradients = engine.gradients(engine.parameters(), batch)
    flipped_loss, flipped_gradients = flipped.gradients(flipped.parameters(), batch)
    assert loss == pytest.approx(flipped_loss, rel=1e-6)
    for name, want in flipped_gradients.items():
        np.testing.assert_allclose(gradients[name], want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()),
                                   err_msg=name)


def test_a_volume_conv_that_widens_its_channels_keeps_its_transposed_conv_adjoint_and_its_gradients_hold(
        tmp_path: Path, monkeypatch) -> None:
    """Three 3-D Convs, 2 -> 3 -> 6 -> 3 channels: the first's input adjoint is not needed (its input is data);
    the second's makes 3 channels of 6 and stays a ConvTranspose (`narrowing_volume_transposed_conv`); the
    third's makes 6 of 3 and is flipped into a Conv. The gradients are those of the engine that flips every
    one."""
    rng = np.random.default_rng(23)
    weights = {"w1": (rng.standard_normal((3, 2, 3, 3, 3)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((6, 3, 3, 3, 3)) * 0.3).astype(np.float32),
               "w3": (rng.standard_normal((3, 6, 3, 3, 3)) * 0.3).astype(np.float32)}
    pads = [1] * 6
    graph = helper.make_graph(
        [helper.make_node("Conv", ["volume", "w1"], ["c1"], pads=pads), helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=pads), helper.make_node("Relu", ["c2"], ["r2"]),
         helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=pads)],
        "volumes", [helper.make_tensor_value_info("volume", TensorProto.FLOAT, ["batch", 2, 5, 5, 5])],
        [helper.make_tensor_value_info("c3", TensorProto.FLOAT, ["batch", 3, 5, 5, 5])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    engine, flipped = _with_and_without(graph, tmp_path, monkeypatch, rewrites, "narrowing_volume_transposed_conv",
                                        lambda node: False)   # none kept: every one flipped
    kept = [n for n in engine._graph.model.graph.node if n.op_type == "ConvTranspose"]
    assert [n.input[1] for n in kept] == ["w2"], [n.input for n in kept]
    assert "ConvTranspose" not in {n.op_type for n in flipped._graph.model.graph.node}
    batch = {"volume": rng.standard_normal((4, 2, 5, 5, 5)).astype(np.float32),
             "labels": rng.standard_normal((4, 3, 5, 5, 5)).astype(np.float32)}
    loss, gradients = engine.gradients(engine.parameters(), batch)
    flipped_loss, flipped_gradients = flipped.gradients(flipped.parameters(), batch)
    assert loss == pytest.approx(flipped_loss, rel=1e-6)
    for name, want in flipped_gradients.items():
        np.testing.assert_allclose(gradients[name], want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()),
                                   err_msg=name)


def _crd_adjoint(blocks: tuple[int, int] = (2, 2), perm: Sequence[int] = (0, 1, 3, 5, 2, 4),
                 batch: int = 2) -> onnx.ModelProto:
    """onnx-ad's adjoint of DepthToSpace in CRD mode: Reshape to [N, C, H, s, W, s], Transpose, Reshape back."""
    sh, sw = blocks
    split = numpy_helper.from_array(np.array([batch, 3, 4, sh, 5, sw], np.int64), "split")
    merged = numpy_helper.from_array(np.array([batch, 3 * sh * sw, 4, 5], np.int64), "merged")
    nodes = [helper.make_node("Reshape", ["g", "split"], ["blocks"]),
             helper.make_node("Transpose", ["blocks"], ["moved"], perm=list(perm)),
             helper.make_node("Reshape", ["moved", "merged"], ["y"])]
    model = _model(nodes, {"g": [batch, 3, 4 * sh, 5 * sw]}, ["y"])
    model.graph.initializer.extend([split, merged])
    return model


@pytest.mark.parametrize("batch", [2, 1])
def test_a_depth_to_space_adjoints_transpose_becomes_one_space_to_depth(batch: int) -> None:
    rng = np.random.default_rng(16)
    model = _crd_adjoint(batch=batch)
    feeds = {"g": rng.standard_normal((batch, 3, 8, 10)).astype(np.float32)}
    count, changed = _rewritten_agrees(model, space_to_depth_transposes, feeds)
    assert count == 1
    ops = [n.op_type for n in changed.graph.node]
    assert "Transpose" not in ops and ops.count("SpaceToDepth") == 1
    expected = feeds["g"].reshape(batch, 3, 4, 2, 5, 2).transpose(0, 1, 3, 5, 2, 4).reshape(batch, 12, 4, 5)
    np.testing.assert_array_equal(_run(changed, feeds)[0], expected)


@pytest.mark.parametrize("blocks, perm", [
    ((2, 3), (0, 1, 3, 5, 2, 4)),     # blocks that differ per axis: no SpaceToDepth for them
    ((2, 2), (0, 1, 5, 3, 2, 4)),     # another permutation
])
def test_other_transposes_are_left_to_transpose(blocks: tuple[int, int], perm: Sequence[int]) -> None:
    rng = np.random.default_rng(17)
    model = _crd_adjoint(blocks, perm)
    feeds = {"g": rng.standard_normal((2, 3, 4 * blocks[0], 5 * blocks[1])).astype(np.float32)}
    count, _ = _rewritten_agrees(model, space_to_depth_transposes, feeds)
    assert count == 0


def test_a_pixel_shuffles_gradients_hold_without_a_six_axis_transpose(tmp_path: Path, monkeypatch) -> None:
    """A Conv, torch's PixelShuffle (DepthToSpace, CRD) and a Conv: the engine's gradients equal those of the
    graph built without the rewrite, and its adjoint has no Transpose of rank 6 left."""
    rng = np.random.default_rng(18)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["wide"], pads=[1, 1, 1, 1]),
             helper.make_node("DepthToSpace", ["wide"], ["shuffled"], blocksize=2, mode="CRD"),
             helper.make_node("Conv", ["shuffled", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 12, 12])],
        [numpy_helper.from_array(rng.standard_normal((16, 3, 3, 3)).astype(np.float32), "w1"),
         numpy_helper.from_array(rng.standard_normal((2, 4, 3, 3)).astype(np.float32), "w2")])
    batch = {"x": rng.standard_normal((4, 3, 6, 6)).astype(np.float32),
             "labels": rng.standard_normal((4, 2, 12, 12)).astype(np.float32)}
    engine, plain = _with_and_without(graph, tmp_path, monkeypatch, rewrites, "space_to_depth_transposes")

    def six_axis_transposes(built: GradientEngine) -> int:
        shapes = static_shapes(built._graph.model)
        return sum(1 for n in built._graph.model.graph.node
                   if n.op_type == "Transpose" and len(shapes.get(n.input[0], ())) == 6)

    assert six_axis_transposes(plain) >= 1 and six_axis_transposes(engine) == 0
    assert "SpaceToDepth" in {n.op_type for n in engine._graph.model.graph.node}
    loss, gradients = engine.gradients(engine.parameters(), batch)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), batch)
    assert loss == pytest.approx(plain_loss)
    assert set(gradients) == {"w1", "w2"}
    for name in gradients:
        np.testing.assert_allclose(gradients[name], plain_gradients[name], rtol=1e-5, atol=1e-6)


def test_an_lstms_gate_slices_come_back_as_concats_and_its_gradients_hold(tmp_path: Path, monkeypatch) -> None:
    """The torch LSTM fixture: onnx-ad's adjoints of the gates cut from the stacked weights, biases and input
    projection are zero Pads summed; with the rewrite the graph has none, and the gradients match torch's."""
    engine, plain = lstm_engines(tmp_path, monkeypatch, "concat_padded_pieces")

    def pads(built: GradientEngine) -> int:
        return sum(n.op_type == "Pad" for n in built._graph.model.graph.node)

    assert pads(plain) >= 4 and pads(engine) == 0
    assert_lstm_gradients_hold(engine, plain)
