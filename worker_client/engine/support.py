"""Helpers several stages share; no stage of its own."""

from __future__ import annotations

import os
import sys
import warnings

import onnx

from ps_common.errors import UnsupportedModelError

__all__ = ["infer_shapes", "node_label", "warn_caller"]

#: This package's folder: frames in files under it are the engine's own, not its caller's.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def node_label(node: onnx.NodeProto) -> str:
    """The node's name, or for an unnamed node its op and first output, for messages."""
    return node.name or f"<unnamed {node.op_type} -> {node.output[0] if node.output else ''}>"


def nodes_listed(nodes) -> str:
    """Nodes for a message: "name (OpType), name (OpType)"."""
    return ", ".join(f"{node_label(n)} ({n.op_type})" for n in nodes)


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference with data propagation, so shapes computed by Shape/Concat/Reshape
    chains (how exporters spell a dynamic flatten) become static once the batch is.

    onnx's data propagator for Add, Sub and Mul (onnx/defs/data_propagators.h) takes the
    values it follows for 1-D shapes and fails when their lengths do not broadcast: an integer
    grid made by broadcasting a column against a row -- Unsqueeze(Range(0, 3), -1) +
    Range(0, 6), as torch's dynamo exporter writes adaptive_avg_pool2d to a size that does not
    divide the input -- is refused as lengths 3 and 6 ("Invalid rank for Add broadcasting"),
    though the model is valid and onnxruntime runs it. Then inference runs again without data
    propagation; only an error there is the model's."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError:
        pass
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:
        raise UnsupportedModelError(f"ONNX shape inference failed: {exc}") from exc


def warn_caller(message: str) -> None:
    """A UserWarning reported at the line that called into the engine (the first frame
    outside this package), however deep in the pipeline the stage that warns runs."""
    depth, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        depth, frame = depth + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=depth + 1)
