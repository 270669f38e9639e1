"""Small ONNX models of one float input `x` and one output `y`, written by hand for the loss and training tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import TensorProto, helper


def save_model(path: Path, nodes: Sequence[onnx.NodeProto], x_dims: Sequence[int | str],
               y_dims: Sequence[int | str], initializers: Sequence[onnx.TensorProto]) -> Path:
    """`nodes` from `x` (float, `x_dims`) to `y` (float, `y_dims`) as an opset-17 model saved at `path`."""
    graph = helper.make_graph(list(nodes), "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_dims)], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path
