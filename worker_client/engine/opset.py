"""Stage "opset": a model below the opset the gradient rules need, upgraded to it.

onnx-ad writes the adjoint of Gather, GatherND and MaxPool as a ScatterND with
reduction="add", which ONNX has from opset 16 on. Exporters still default lower (tf2onnx:
15), so such a model is upgraded with onnx's version converter before anything else reads
it; a model that the converter cannot upgrade goes on at its own opset, with a warning
(only the ops that need the newer opset are then refused, naming the node). Training-mode
BatchNormalizations and Dropouts of the older opsets keep training through the conversion
(`_training_forms_before_conversion`).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from worker_client.engine.load import clamp_ir_version
from worker_client.engine.rewrites.toolkit import opset_of
from worker_client.engine.support import warn_caller

__all__ = ["GRADIENT_OPSET", "upgrade_opset"]

#: The opset from which ScatterND takes reduction="add": the adjoint of Gather, GatherND
#: and MaxPool.
GRADIENT_OPSET = 16
#: The opset from which BatchNormalization says training_mode, and Dropout takes a training_mode input.
_BATCH_NORM_TRAINING_MODE = 14
_DROPOUT_TRAINING_INPUT = 12


def upgrade_opset(model: onnx.ModelProto, source: str | os.PathLike[str]) -> onnx.ModelProto:
    """`model` itself at GRADIENT_OPSET or above, else a copy converted to GRADIENT_OPSET
    (its IR version clamped again); `model` unchanged, with a warning naming `source`, the
    two opsets and the converter's error, when the conversion fails."""
    current = opset_of(model)
    if current >= GRADIENT_OPSET:
        return model
    prepared, batch_norms, dropouts = _training_forms_before_conversion(model, current)
    try:
        upgraded = version_converter.convert_version(prepared, GRADIENT_OPSET)
        _training_forms_after_conversion(upgraded, batch_norms, dropouts)
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


def _training_forms_before_conversion(model: onnx.ModelProto, current: int
                                      ) -> tuple[onnx.ModelProto, set[str], set[str]]:
    """A copy the converter takes, and the training-mode BatchNormalizations and Dropouts it would lose (by their
    first output).

    Before opset 14 a BatchNormalization trains when it has more than one output (torch writes five: Y, the
    running statistics and the saved batch statistics), and the converter's 13 -> 14 step refuses more than three
    (an assertion) and writes no training_mode: the model stayed at its opset, where the engine read it as an
    eval-mode BatchNormalization and gave wrong gradients, and MaxPool and the loss's LogSoftmax had no adjoint.
    The saved statistics, which nothing reads, are dropped here and training_mode set after. Before opset 12 a
    Dropout has no training flag, and the converter writes none (so it would be the identity); torch writes one
    only when exporting for training, with its mask as a second output, and such a Dropout gets training_mode
    true after. A Dropout of one output stays what the converter makes it."""
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    batch_norms: set[str] = set()
    dropouts: set[str] = set()
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    for node in prepared.graph.node:
        outputs = [o for o in node.output[1:] if o]
        if node.op_type == "BatchNormalization" and current < _BATCH_NORM_TRAINING_MODE and outputs:
            if any(o in read for o in node.output[3:]):
                continue   # the saved statistics are read: left to the converter (which refuses them)
            del node.output[3:]
            batch_norms.add(node.output[0])
        elif node.op_type == "Dropout" and current < _DROPOUT_TRAINING_INPUT and outputs:
            dropouts.add(node.output[0])
    return prepared, batch_norms, dropouts


def _training_forms_after_conversion(model: onnx.ModelProto, batch_norms: set[str], dropouts: set[str]) -> None:
    """training_mode on the BatchNormalizations and Dropouts `_training_forms_before_conversion` found."""
    flag = None
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and node.output[0] in batch_norms:
            kept = [a for a in node.attribute if a.name != "training_mode"]
            node.ClearField("attribute")
            node.attribute.extend(kept + [helper.make_attribute("training_mode", 1)])
        elif node.op_type == "Dropout" and node.output[0] in dropouts:
            if flag is None:
                taken = {t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
                flag = next(f"dropout_training_{i}" for i in range(len(taken) + 1)
                            if f"dropout_training_{i}" not in taken)
                model.graph.initializer.append(numpy_helper.from_array(np.array(True), flag))
            while len(node.input) < 2:
                node.input.append("")
            del node.input[2:]
            node.input.append(flag)
