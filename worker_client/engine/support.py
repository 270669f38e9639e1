"""Helpers several stages share; no stage of its own."""

from __future__ import annotations

import onnx

from ps_common.errors import UnsupportedModelError

__all__ = ["infer_shapes", "node_label"]


def node_label(node: onnx.NodeProto) -> str:
    """The node's name, or for an unnamed node its op and first output, for messages."""
    return node.name or f"<unnamed {node.op_type} -> {node.output[0] if node.output else ''}>"


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference with data propagation, so shapes computed by Shape/Concat/Reshape
    chains (how exporters spell a dynamic flatten) become static once the batch is."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise UnsupportedModelError(f"ONNX shape inference failed: {exc}") from exc
