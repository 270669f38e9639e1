"""Stage "opset": a model below the opset the gradient rules need, upgraded to it.

onnx-ad writes the adjoint of Gather, GatherND and MaxPool as a ScatterND with
reduction="add", which ONNX has from opset 16 on. Exporters still default lower (tf2onnx:
15), so such a model is upgraded with onnx's version converter before anything else reads
it; a model that the converter cannot upgrade goes on at its own opset, with a warning
(only the ops that need the newer opset are then refused, naming the node).
"""

from __future__ import annotations

import os

import onnx
from onnx import version_converter

from worker_client.engine.load import clamp_ir_version
from worker_client.engine.rewrites.toolkit import opset_of
from worker_client.engine.support import warn_caller

__all__ = ["GRADIENT_OPSET", "upgrade_opset"]

#: The opset from which ScatterND takes reduction="add": the adjoint of Gather, GatherND
#: and MaxPool.
GRADIENT_OPSET = 16


def upgrade_opset(model: onnx.ModelProto, source: str | os.PathLike[str]) -> onnx.ModelProto:
    """`model` itself at GRADIENT_OPSET or above, else a copy converted to GRADIENT_OPSET
    (its IR version clamped again); `model` unchanged, with a warning naming `source`, the
    two opsets and the converter's error, when the conversion fails."""
    current = opset_of(model)
    if current >= GRADIENT_OPSET:
        return model
    try:
        upgraded = version_converter.convert_version(model, GRADIENT_OPSET)
        onnx.checker.check_model(upgraded)
    except Exception as exc:  # noqa: BLE001 -- the converter raises a bare RuntimeError
        warn_caller(
            f"{source}: onnx's version converter could not upgrade the model from opset "
            f"{current} to {GRADIENT_OPSET} ({type(exc).__name__}: {exc}); it is "
            f"differentiated at opset {current}, where the adjoints of Gather, GatherND and "
            f"MaxPool are unavailable. Re-export at opset {GRADIENT_OPSET} or later")
        return model
    clamp_ir_version(upgraded)
    return upgraded
