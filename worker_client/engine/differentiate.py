"""Stage "differentiate": onnx-ad's reverse pass, giving the loss's gradient for each parameter."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ad
from onnx import helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.load import clamp_ir_version
from worker_client.engine.support import infer_shapes, node_label

__all__ = ["GRAD_PREFIX", "METADATA_KEY", "GradientGraph", "differentiate", "gradient_graph",
           "refuse_training_mode"]

#: Prefix of the gradient outputs and seed input onnx-ad emits.
GRAD_PREFIX = "grad__"
#: Name of the seed-count dimension onnx-ad appends; the engine always uses one seed.
SEED_DIM = "nseed"
#: metadata_props key under which a built gradient model describes itself.
METADATA_KEY = "onnx_ps.gradient_graph"
#: Input index of Dropout's training_mode flag (opset 12 on).
_DROPOUT_TRAINING_MODE = 2


@dataclass(frozen=True)
class GradientGraph:
    """A differentiated model and the names the engine feeds and fetches."""

    model: onnx.ModelProto
    loss_output: str
    labels: str | None                 # the labels input the loss added, if any
    gradient_outputs: dict[str, str]   # parameter name -> output holding its gradient

    def describe(self) -> str:
        """The JSON stored in the model's metadata so a cached copy describes itself."""
        return json.dumps({"loss_output": self.loss_output, "labels": self.labels,
                           "gradient_outputs": self.gradient_outputs}, sort_keys=True)

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> GradientGraph:
        """Read back a model written by `gradient_graph`."""
        entries = {p.key: p.value for p in model.metadata_props}
        if METADATA_KEY not in entries:
            raise ValueError(f"the model has no {METADATA_KEY!r} metadata entry")
        described = json.loads(entries[METADATA_KEY])
        return cls(model=model, loss_output=described["loss_output"],
                   labels=described["labels"],
                   gradient_outputs=dict(described["gradient_outputs"]))


def _constant_value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """The value of the initializer or Constant node `name`; None when it is computed."""
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
    return None


def refuse_training_mode(model: onnx.ModelProto) -> None:
    """Raise UnsupportedModelError, naming the node, for a BatchNormalization or Dropout in
    training mode: neither has a deterministic gradient here."""
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and any(
                a.name == "training_mode" and a.i for a in node.attribute):
            raise UnsupportedModelError(
                f"node {node_label(node)!r} (BatchNormalization) is in training mode: it "
                f"normalizes with batch statistics and updates running ones, which the "
                f"gradient engine does not differentiate. Export the model in eval mode, "
                f"where BatchNormalization is an affine map of its running statistics "
                f"(model.eval(); torch.onnx.export(..., training=torch.onnx.TrainingMode."
                f"EVAL, keep_initializers_as_inputs=True) -- the last flag skips the "
                f"de-duplication that ties equal-valued parameters), or fold it into the "
                f"preceding Conv")
        if node.op_type == "Dropout" and len(node.input) > _DROPOUT_TRAINING_MODE and \
                node.input[_DROPOUT_TRAINING_MODE]:
            flag = _constant_value(model, node.input[_DROPOUT_TRAINING_MODE])
            if flag is None or bool(flag.reshape(-1)[0]):
                raise UnsupportedModelError(
                    f"node {node_label(node)!r} (Dropout) is in training mode: it samples "
                    f"a random mask on every call, which the gradient engine does not "
                    f"differentiate. Export the model in eval mode, where Dropout is the "
                    f"identity (model.eval(); torch.onnx.export(..., training=torch.onnx."
                    f"TrainingMode.EVAL, keep_initializers_as_inputs=True) -- the last flag "
                    f"skips the de-duplication that ties equal-valued parameters), or "
                    f"remove the Dropout layers; training then runs without dropout")


#: How onnx-ad's UnsupportedOperator names the op and the node it has no reverse rule for.
_RULE_MESSAGE = re.compile(r"no reverse rule for (\S+) \(node '([^']*)'\)")


def differentiate(model: onnx.ModelProto, parameters: Sequence[str],
                  loss_output: str) -> onnx.ModelProto:
    """The model computing `loss_output` and its gradient for each of `parameters`.

    `model` has the parameters as graph inputs and the scalar loss as its output. onnx-ad's
    reverse pass emits one gradient output per parameter, named GRAD_PREFIX + parameter.
    The seed of the scalar loss is baked in as a constant 1.0 initializer, so onnxruntime
    folds everything that depends only on it.
    """
    model = infer_shapes(model)
    try:
        derived = onnx_ad.reverse(model, inputs=list(parameters), outputs=[loss_output],
                                  prefix=GRAD_PREFIX, dim=SEED_DIM, layout="onnx")
    except onnx_ad.UnsupportedOperator as exc:
        match = _RULE_MESSAGE.search(str(exc))
        if match is None:
            node = _failing_node(exc)
            where = "the model" if node is None else \
                f"node {node_label(node)!r} ({node.op_type})"
            raise UnsupportedModelError(
                f"cannot differentiate {where}: onnx-ad {onnx_ad.__version__} says: {exc}. "
                f"Exclude the parameters upstream of it (exclude=[...] patterns), give the "
                f"model static shapes, or re-export it without that form of the op "
                f"(docs/models.md lists the known limits)") from exc
        op_type, node = match.groups()
        raise UnsupportedModelError(
            f"cannot differentiate node {node!r} ({op_type}): onnx-ad "
            f"{onnx_ad.__version__} has no reverse rule for {op_type}, and the node lies "
            f"between a trainable parameter and the loss. Exclude the parameters upstream "
            f"of it (exclude=[...] patterns) or replace the op") from exc
    seed = GRAD_PREFIX + loss_output
    graph = derived.graph
    kept = [value for value in graph.input if value.name != seed]
    graph.ClearField("input")
    graph.input.extend(kept)
    loss_type = next(v for v in model.graph.output
                     if v.name == loss_output).type.tensor_type.elem_type
    graph.initializer.append(numpy_helper.from_array(
        np.ones((1,), helper.tensor_dtype_to_np_dtype(loss_type)), seed))
    return derived


def _failing_node(exc: BaseException) -> onnx.NodeProto | None:
    """The node whose rule raised `exc`: onnx-ad's rule messages do not name it, but the
    rule's frame holds it as its `node` argument (the innermost frame that has one)."""
    found = None
    trace = exc.__traceback__
    while trace is not None:
        candidate = trace.tb_frame.f_locals.get("node")
        if isinstance(candidate, onnx.NodeProto):
            found = candidate
        trace = trace.tb_next
    return found


def gradient_graph(model: onnx.ModelProto, loss_output: str, labels: str | None,
                   parameters: Sequence[str]) -> GradientGraph:
    """The differentiated `model` with the names the engine feeds and fetches written into
    its metadata (so a cached copy describes itself), at an IR version onnxruntime loads."""
    result = GradientGraph(model=model, loss_output=loss_output, labels=labels,
                           gradient_outputs={p: GRAD_PREFIX + p for p in parameters})
    del model.metadata_props[:]
    model.metadata_props.add(key=METADATA_KEY, value=result.describe())
    clamp_ir_version(model)
    return result
