"""A Conv3d without a bias as torch's dynamo exporter writes it (onnxscript 0.6): a model onnxruntime loads and
then cannot run, which read_model mends (worker_client/engine/repairs.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv3d_without_bias(path: Path, bias_shape: list[int] | None = None, zero: float = 0.0) -> Path:
    """x [N, 2, 3, 4, 4] -> Conv3d(w [4, 2, 3, 3, 3], pads 1) -> mean over D, H, W: the Conv's bias as torch's dynamo
    exporter writes that of a Conv3d without one (onnxscript 0.6's aten_conv3d): Expand(CastLike(0, x),
    Concat(Shape(w)[0:1], [2])), a [4, 2] tensor where ONNX takes [4]. `bias_shape` given: a bias of that shape;
    `zero`: the value expanded."""
    rng = np.random.default_rng(8)
    if bias_shape is None:
        shape_nodes = [helper.make_node("Shape", ["w"], ["w_dim0"], start=0, end=1),
                       helper.make_node("Constant", [], ["two"], value_ints=[2]),
                       helper.make_node("Concat", ["w_dim0", "two"], ["bias_shape"], axis=0)]
    else:
        shape_nodes = [helper.make_node("Constant", [], ["bias_shape"], value_ints=bias_shape)]
    graph = helper.make_graph(
        shape_nodes + [
            helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(zero, np.float32))),
            helper.make_node("CastLike", ["zero", "x"], ["zero_like"]),
            helper.make_node("Expand", ["zero_like", "bias_shape"], ["bias"]),
            helper.make_node("Conv", ["x", "w", "bias"], ["c"], pads=[1] * 6),
            helper.make_node("ReduceMean", ["c", "axes"], ["y"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array((rng.standard_normal((4, 2, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
         numpy_helper.from_array(np.array([2, 3, 4], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def conv3d_reference(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The spatial mean of a pads-1 3 x 3 x 3 Conv without bias, in float64: the kernel against the input's mean
    window at each tap."""
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 4, 4), axis=(2, 3, 4)).mean(axis=(5, 6, 7))
    return np.einsum("ocdhw,ncdhw->no", weight.astype(np.float64), windows)
