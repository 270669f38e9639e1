"""Stage "lift": the trainable initializers become graph inputs, fed with every call."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

__all__ = ["lift_parameters"]

#: The IR version from which initializers need not be listed as graph inputs.
_IR_INITIALIZERS_NOT_INPUTS = 4


def lift_parameters(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of `model` whose initializers `names` are graph inputs instead."""
    lifted = onnx.ModelProto()
    lifted.CopyFrom(model)
    graph = lifted.graph
    wanted = set(names)
    moved = {t.name: t for t in graph.initializer if t.name in wanted}
    kept = [t for t in graph.initializer if t.name not in wanted]
    missing = wanted - set(moved)
    if missing:
        raise ValueError(f"not initializers of the model: {sorted(missing)}")
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    # IR < 4 models (and keep_initializers_as_inputs=True exports) list initializers as
    # inputs too, which makes them overridable and keeps onnxruntime from folding them:
    # the remaining ones become plain constants, and the lifted ones are declared afresh
    frozen = {t.name for t in kept}
    existing = [value for value in graph.input
                if value.name not in wanted and value.name not in frozen]
    graph.ClearField("input")
    graph.input.extend(existing)
    lifted.ir_version = max(lifted.ir_version, _IR_INITIALIZERS_NOT_INPUTS)
    graph.input.extend(helper.make_tensor_value_info(name, moved[name].data_type,
                                                     list(moved[name].dims))
                       for name in names)
    return lifted

