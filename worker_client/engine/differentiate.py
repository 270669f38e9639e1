"""Stage "differentiate": onnx-ad's reverse pass, giving the loss's gradient for each parameter."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ad
from onnx import helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.exporters import torch_origin
from worker_client.engine.load import clamp_ir_version
from worker_client.engine.rewrites.batch_norms import attach_batch_norm_stand_ins
from worker_client.engine.rewrites.detaches import attach_detached
from worker_client.engine.rewrites.group_norms import attach_group_norm_adjoints, group_norm_probes
from worker_client.engine.rewrites.grouped import attach_grouped_weight_adjoints, probe_inputs
from worker_client.engine.support import infer_shapes, node_label
from worker_client.engine.training_mode import TrainingForms

__all__ = ["GRAD_PREFIX", "METADATA_KEY", "GradientGraph", "StepResult", "differentiate",
           "gradient_graph"]

#: Prefix of the gradient outputs and seed input onnx-ad emits.
GRAD_PREFIX = "grad__"
#: Name of the seed-count dimension onnx-ad appends; the engine always uses one seed.
SEED_DIM = "nseed"
#: metadata_props key under which a built gradient model describes itself.
METADATA_KEY = "onnx_ps.gradient_graph"


@dataclass(frozen=True)
class GradientGraph:
    """A differentiated model and the names the engine feeds and fetches."""

    model: onnx.ModelProto
    loss_output: str
    labels: str | None                 # the labels input the loss added, if any
    gradient_outputs: dict[str, str]   # parameter name -> output holding its gradient
    state_outputs: dict[str, str] = field(default_factory=dict)     # state -> its new value
    dropout_rates: dict[str, float] = field(default_factory=dict)   # mask input -> ratio
    # a vector-Jacobian product (loss "vjp"): seeded output -> the input its cotangent feeds
    seed_inputs: dict[str, str] = field(default_factory=dict)
    # data input -> output holding the loss's (or the VJP's) gradient with respect to it
    input_gradient_outputs: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The JSON stored in the model's metadata so a cached copy describes itself."""
        return json.dumps({"loss_output": self.loss_output, "labels": self.labels,
                           "gradient_outputs": self.gradient_outputs,
                           "state_outputs": self.state_outputs,
                           "dropout_rates": self.dropout_rates,
                           "seed_inputs": self.seed_inputs,
                           "input_gradient_outputs": self.input_gradient_outputs},
                          sort_keys=True)

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> GradientGraph:
        """Read back a model written by `gradient_graph`."""
        entries = {p.key: p.value for p in model.metadata_props}
        if METADATA_KEY not in entries:
            raise ValueError(f"the model has no {METADATA_KEY!r} metadata entry")
        described = json.loads(entries[METADATA_KEY])
        return cls(model=model, loss_output=described["loss_output"],
                   labels=described["labels"],
                   gradient_outputs=dict(described["gradient_outputs"]),
                   state_outputs=dict(described.get("state_outputs", {})),
                   dropout_rates=dict(described.get("dropout_rates", {})),
                   seed_inputs=dict(described.get("seed_inputs", {})),
                   input_gradient_outputs=dict(described.get("input_gradient_outputs", {})))


@dataclass(frozen=True)
class StepResult:
    """One training step's results: the loss, a gradient per trainable parameter, the new
    value of every state tensor (running statistics), and the gradient with respect to each
    data input the engine was asked to differentiate (`input_gradients`; a pipeline stage
    sends them back to the stage before it)."""

    loss: float
    gradients: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    input_gradients: dict[str, np.ndarray] = field(default_factory=dict)


#: How onnx-ad's UnsupportedOperator names the op and the node it has no reverse rule for.
_RULE_MESSAGE = re.compile(r"no reverse rule for (\S+) \(node '([^']*)'\)")


def differentiate(model: onnx.ModelProto, parameters: Sequence[str],
                  loss_output: str | None, *, seeded: Sequence[str] = ()) -> onnx.ModelProto:
    """The model computing `loss_output` and its gradient for each of `parameters`.

    `model` has the parameters as graph inputs and the scalar loss as its output. onnx-ad's
    reverse pass emits one gradient output per parameter, named GRAD_PREFIX + parameter.
    The seed of the scalar loss is baked in as a constant 1.0 initializer, so onnxruntime
    folds everything that depends only on it.

    With `loss_output` None, the outputs `seeded` are differentiated instead, each with its
    seed left as an input GRAD_PREFIX + output (shape: the output's, then a seed axis of 1):
    fed a cotangent, the gradients are the vector-Jacobian product. `parameters` may name
    data inputs as well as parameters: any floating-point graph input differentiates.

    The weight adjoints onnx-ad does not write (grouped Convs, detached from it by
    rewrites.grouped.detach_grouped_weights) are written here, after its pass, from the
    gradients of their probes; so are the group and instance normalizations'
    (rewrites.group_norms.detach_group_norms), in place of the adjoints onnx-ad wrote for
    their zero terms.
    """
    model = infer_shapes(model)
    outputs = [loss_output] if loss_output is not None else list(seeded)
    try:
        derived = onnx_ad.reverse(model, inputs=[*parameters, *probe_inputs(model), *group_norm_probes(model)],
                                  outputs=outputs, prefix=GRAD_PREFIX, dim=SEED_DIM, layout="onnx")
    except onnx_ad.UnsupportedOperator as exc:
        match = _RULE_MESSAGE.search(str(exc))
        foreign = [n for n in model.graph.node if n.domain not in ("", "ai.onnx", "ai.onnx.ml")]
        if foreign:   # onnx infers no shape through them, which surfaced as an unknown rank in the engine's own loss
            listed = ", ".join(f"{node_label(n)!r} ({n.domain}:{n.op_type})" for n in foreign[:5])
            raise UnsupportedModelError(
                f"the model has {len(foreign)} node(s) of a custom domain -- {listed} -- which onnx's shape "
                f"inference and onnx-ad's rules do not know, so its gradient cannot be built (onnx-ad "
                f"{onnx_ad.__version__} says: {exc}); export the model with standard ONNX ops") from exc
        if match is None:
            node = _failing_node(exc)
            origin, remedy = torch_origin(model, node.name) if node is not None else ("", "")
            loop = _shapeless_loop_before(model, node) if node is not None else None
            if loop is not None:
                remedy += (f" Its input comes from Loop {node_label(loop)!r}, whose outputs have no static shape "
                           f"onnx's inference can find: tf2onnx writes a Keras GRU or SimpleRNN as such a while-loop "
                           f"(docs/models.md, \"Keras / TensorFlow\": use an LSTM, or export the model from torch)")
            where = "the model" if node is None else f"node {node_label(node)!r} ({node.op_type}{origin})"
            raise UnsupportedModelError(
                f"cannot differentiate {where}: onnx-ad {onnx_ad.__version__} says: {exc}. "
                f"Exclude the parameters upstream of it (exclude=[...] patterns), give the "
                f"model static shapes, or re-export it without that form of the op "
                f"(docs/models.md lists the known limits).{remedy}") from exc
        op_type, node = match.groups()
        origin, remedy = torch_origin(model, node)
        raise UnsupportedModelError(
            f"cannot differentiate node {node!r} ({op_type}{origin}): onnx-ad "
            f"{onnx_ad.__version__} has no reverse rule for {op_type}, and the node lies "
            f"between a trainable parameter and the loss. Exclude the parameters upstream "
            f"of it (exclude=[...] patterns) or replace the op.{remedy}") from exc
    attach_grouped_weight_adjoints(derived, GRAD_PREFIX)
    attach_group_norm_adjoints(derived, GRAD_PREFIX)
    attach_batch_norm_stand_ins(derived)
    attach_detached(derived)
    if loss_output is None:
        return derived
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


#: How many producers back from a failing node `_shapeless_loop_before` looks.
_LOOP_SEARCH_DEPTH = 12


def _shapeless_loop_before(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.NodeProto | None:
    """A Loop within a few producers before `node` one of whose outputs that `node`'s inputs come from has no
    static inferred shape, or None."""
    producers = {out: n for n in model.graph.node for out in n.output}
    typed = {v.name for v in [*model.graph.value_info, *model.graph.output, *model.graph.input]
             if v.type.tensor_type.HasField("shape")
             and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
    frontier, seen = list(node.input), set()
    for _ in range(_LOOP_SEARCH_DEPTH):
        following = []
        for name in frontier:
            producer = producers.get(name)
            if producer is None or name in seen:
                continue
            seen.add(name)
            if producer.op_type == "Loop" and name not in typed:
                return producer
            following.extend(producer.input)
        frontier = following
    return None


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
                   parameters: Sequence[str], forms: TrainingForms | None = None, *,
                   seeded: Sequence[str] = (), inputs: Sequence[str] = ()) -> GradientGraph:
    """The differentiated `model` with the names the engine feeds and fetches written into
    its metadata (so a cached copy describes itself), at an IR version onnxruntime loads.
    `seeded`: the outputs of a vector-Jacobian product (loss_output ""); `inputs`: the data
    inputs differentiated besides the parameters."""
    result = GradientGraph(model=model, loss_output=loss_output, labels=labels,
                           gradient_outputs={p: GRAD_PREFIX + p for p in parameters},
                           state_outputs=dict(forms.state_outputs) if forms else {},
                           dropout_rates=dict(forms.dropout_rates) if forms else {},
                           seed_inputs={o: GRAD_PREFIX + o for o in seeded},
                           input_gradient_outputs={i: GRAD_PREFIX + i for i in inputs})
    del model.metadata_props[:]
    model.metadata_props.add(key=METADATA_KEY, value=result.describe())
    clamp_ir_version(model)
    return result
