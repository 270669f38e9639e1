"""Stage "load": the model file read, at an IR version the installed onnxruntime accepts."""

from __future__ import annotations

import functools
import os

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

__all__ = ["clamp_ir_version", "load_model", "max_ir_version"]


def load_model(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The model stored at `path`, its IR version lowered to what onnxruntime loads."""
    model = onnx.load(path)
    clamp_ir_version(model)
    return model


@functools.cache
def max_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads.

    onnx writes its own newest IR version (helper.make_model), which can be ahead of what
    onnxruntime accepts ("Unsupported model IR version"); onnxruntime exposes no query for
    it, so a one-node model is loaded at decreasing versions until one is accepted.
    """
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    for version in range(onnx.IR_VERSION, 7, -1):
        probe.ir_version = version
        try:
            ort.InferenceSession(probe.SerializeToString(),
                                 providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 -- any refusal means: try an older version
            continue
        return version
    return 7


def clamp_ir_version(model: onnx.ModelProto) -> None:
    """Lower `model.ir_version` (in place) to what onnxruntime loads, if it is newer."""
    model.ir_version = min(model.ir_version, max_ir_version())
