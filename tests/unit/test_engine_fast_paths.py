"""The engine's fast paths compute what they replace: adjoint rewrites onto onnxruntime's faster
kernels, and the gradient run's bound inputs and outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from worker_client.engine.rewrites.conv import flip_unit_stride_transposed_convs, split_strided_transposed_convs

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
    ([1, 1], [0, 0, 0, 0], [1, 1], None),          # a 1x1 projection
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
    assert "ConvTranspose" not in {n.op_type for n in changed.graph.node}


@pytest.mark.parametrize("attributes", [
    {"strides": [2, 2], "pads": [1, 1, 1, 1]},     # strided: left to ConvTranspose
    {"group": 5, "pads": [1, 1, 1, 1]},            # grouped
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


@pytest.mark.parametrize("size, kernel, stride, attributes", [
    (4, 1, 2, {"output_shape": [8, 8]}),             # a 1x1 projection: phases with no tap
    (4, 3, 2, {"pads": [1, 1, 1, 1]}),               # 7 x 7 out: not a multiple of the stride
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
