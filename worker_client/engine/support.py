"""Helpers several stages share; no stage of its own."""

from __future__ import annotations

import os
import sys
import warnings

import onnx

from ps_common.errors import UnsupportedModelError
from worker_client.engine.rewrites.toolkit import subgraphs

__all__ = ["check_registered_ops", "infer_shapes", "node_label", "warn_caller"]

#: This package's folder: frames in files under it are the engine's own, not its caller's.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def node_label(node: onnx.NodeProto) -> str:
    """The node's name, or for an unnamed node its op and first output, for messages."""
    return node.name or f"<unnamed {node.op_type} -> {node.output[0] if node.output else ''}>"


def nodes_listed(nodes) -> str:
    """Nodes for a message: "name (OpType), name (OpType)"."""
    return ", ".join(f"{node_label(n)} ({n.op_type})" for n in nodes)


#: Domains whose every op onnx's schema registry knows.
_REGISTERED_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


def _unregistered(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    found = []
    for node in graph.node:
        if node.domain in _REGISTERED_DOMAINS and not onnx.defs.has(node.op_type, node.domain):
            found.append(node)
        for inner in subgraphs(node):
            found.extend(_unregistered(inner))
    return found


def check_registered_ops(model: onnx.ModelProto, source: str) -> None:
    """UnsupportedModelError naming each node whose op the ONNX domains it claims do not have (no runtime can run
    the model; left alone, it surfaces later as a value without a shape), with the producer that wrote it."""
    unknown = _unregistered(model.graph)
    if unknown:
        producer = " ".join(p for p in (model.producer_name, model.producer_version) if p) or "its exporter"
        raise UnsupportedModelError(
            f"{source}: {len(unknown)} node(s) use ops that no ONNX opset has, so no runtime can run the model: "
            + ", ".join(f"{node_label(n)} ({n.op_type}, domain {n.domain!r})" for n in unknown[:10])
            + f". {producer} wrote them; export with an op set it maps to standard ONNX ops, or replace them")


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
