"""What exporters do to a model that training would not notice: variables folded away.

tf2onnx freezes a Keras model before converting it, and TensorFlow's graph optimizer then
simplifies ``x + 0`` to ``x`` and ``x * 1`` to ``x``: a Dense or Conv bias initialized to
zeros, or a LayerNormalization's beta, is no longer in the graph and cannot train. Nothing
in the ONNX file says a variable was there; the one trace is a weight layer with no bias
after it. `folded_bias_layers` finds those, and the engine warns about them.
"""

from __future__ import annotations

from collections.abc import Collection

import onnx

from worker_client.engine.selection import TF2ONNX, VALUE_PRESERVING, consumers
from worker_client.engine.support import node_label

__all__ = ["folded_bias_layers", "folded_variables_warning"]

#: Weight layers and the input index of their own bias, if the op has one.
_WEIGHT_LAYERS = {"MatMul": None, "Gemm": 2, "Conv": 2, "ConvTranspose": 2}


def folded_bias_layers(model: onnx.ModelProto,
                       trainable: Collection[str]) -> list[onnx.NodeProto]:
    """The weight layers of a tf2onnx model whose trainable weight has no bias after it
    (neither their own bias input nor an Add of a trainable value); [] for other producers."""
    if model.producer_name != TF2ONNX:
        return []
    uses = consumers(model.graph)
    trainable = set(trainable)
    found = []
    for node in model.graph.node:
        if node.op_type not in _WEIGHT_LAYERS or len(node.input) < 2 or \
                node.input[1] not in trainable:
            continue
        own_bias = _WEIGHT_LAYERS[node.op_type]
        if own_bias is not None and len(node.input) > own_bias and node.input[own_bias]:
            continue
        if not _biased(node.output[0], uses, trainable):
            found.append(node)
    return found


def _biased(value: str, uses, trainable: set[str]) -> bool:
    """Whether `value` (or a value-preserving view of it) is added to a trainable value."""
    for node, index in uses.get(value, []):
        if node.op_type == "Add" and len(node.input) == 2 and \
                node.input[1 - index] in trainable:
            return True
        if node.op_type in VALUE_PRESERVING and index == 0 and \
                _biased(node.output[0], uses, trainable):
            return True
    return False


def folded_variables_warning(layers: list[onnx.NodeProto]) -> str:
    """The warning about `layers` (from `folded_bias_layers`)."""
    listed = ", ".join(f"{node_label(n)} ({n.op_type})" for n in layers)
    return (f"{len(layers)} weight layer(s) of this tf2onnx model have no bias: {listed}. If "
            f"the Keras layers had one (use_bias=True, the default), tf2onnx folded the "
            f"zero-initialized bias away and it will not train; LayerNormalization's beta "
            f"goes the same way. Re-export with the marker recipe in docs/models.md, or "
            f"pass --expect-parameters N to make a mismatch an error")
