"""Stage "training mode": BatchNormalization and Dropout as their source framework trains them.

Exported in training mode, BatchNormalization normalizes with the batch's own statistics
and moves its running statistics, and Dropout samples a mask. Neither is a deterministic
function of the graph's inputs as it stands; both are, given the batch and the mask:

- `training_form` rewrites each training-mode BatchNormalization into the arithmetic it
  performs (ReduceMean over every axis but the channel one, the centred square's mean,
  the centred input times scale / std, shift) -- onnx-ad differentiates that exactly, batch statistics
  included -- and computes the new running statistics as extra outputs
  (``running * momentum + batch * (1 - momentum)``; the variance is the unbiased one for a
  torch export, as torch keeps it, and the biased one as ONNX specifies otherwise). Each
  training-mode Dropout becomes ``X * mask * 1 / (1 - ratio)`` with the mask a new graph
  input, which the worker draws from a seeded generator and feeds. With ``scaled_masks``
  (the engine's own sessions) the input is the mask already divided by the keep rate and
  the Dropout is one ``X * mask``: one pass over the tensor fewer forward and backward,
  the engine scaling the mask as it draws it. A Dropout of ratio 0 (``dropout=0.0``, common
  in transformer configurations) is the identity, with no mask.
- `inference_form` is the same model for evaluation: BatchNormalization with its running
  statistics (training_mode=0), Dropout the identity.

The running statistics are state (selection.py): graph inputs fed with every call, like the
parameters, never differentiated; the step returns their new values.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.rewrites.fold import fold_shape_queries
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.toolkit import Emitter, attribute, constants, opset_of
from worker_client.engine.support import infer_shapes, node_label

__all__ = ["MASK_PREFIX", "STATE_PREFIX", "TrainingForms", "has_training_forms",
           "inference_form", "state_initializers", "training_form"]

#: Prefix of the graph input that feeds a Dropout's mask (then the Dropout node's label).
MASK_PREFIX = "dropout_mask:"
#: Prefix of the output holding a state tensor's new value (then the state's name).
STATE_PREFIX = "state_update:"
#: BatchNormalization's attribute defaults (ONNX).
_EPSILON, _MOMENTUM = 1e-5, 0.9
#: Dropout's default ratio (ONNX), and the input indices of its ratio and training flag.
_DROPOUT_RATIO, _RATIO_INPUT, _TRAINING_INPUT = 0.5, 1, 2
#: The opset from which ReduceMean takes its axes as an input.
_AXES_AS_INPUT = 18
#: Producers whose running variance is the unbiased batch variance.
_UNBIASED_PRODUCERS = frozenset({"pytorch"})


@dataclass
class TrainingForms:
    """What `training_form` added: state name -> output of its new value, and mask input
    name -> the Dropout's ratio."""

    state_outputs: dict[str, str] = field(default_factory=dict)
    dropout_rates: dict[str, float] = field(default_factory=dict)


def _is_training_batch_norm(node: onnx.NodeProto) -> bool:
    """training_mode set, or (the form before opset 14, whose outputs beyond Y exist only in training) more than
    one output."""
    return node.op_type == "BatchNormalization" and (
        bool(attribute(node, "training_mode", 0)) or any(node.output[1:]))


def _dropout_training(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> bool:
    """Whether a Dropout runs in training mode; UnsupportedModelError when its flag is
    computed at run time."""
    if node.op_type != "Dropout":
        return False
    if len(node.input) <= _TRAINING_INPUT or not node.input[_TRAINING_INPUT]:
        return False
    flag = values.get(node.input[_TRAINING_INPUT])
    if flag is None:
        raise UnsupportedModelError(
            f"node {node_label(node)!r} (Dropout): its training_mode input "
            f"{node.input[_TRAINING_INPUT]!r} is computed at run time; export it as a "
            f"constant (torch.onnx.export's training= argument does)")
    return bool(flag.reshape(-1)[0])


def has_training_forms(model: onnx.ModelProto) -> bool:
    """Whether the model holds a training-mode BatchNormalization or Dropout."""
    values = constants(model)
    return any(_is_training_batch_norm(n) or _dropout_training(n, values)
               for n in model.graph.node)


def state_initializers(model: onnx.ModelProto) -> list[str]:
    """The running statistics (initializers) of the training-mode BatchNormalizations: the
    model's state, in initializer order."""
    read = {name for node in model.graph.node if _is_training_batch_norm(node)
            for name in node.input[3:5]}
    return [t.name for t in model.graph.initializer if t.name in read]


def inference_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for evaluation: BatchNormalization with running statistics, Dropout the
    identity (its mask output, if used, all true)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    values = constants(result)
    emit = Emitter(result, "eval_form")
    nodes = []
    for node in result.graph.node:
        if _is_training_batch_norm(node):
            kept = [a for a in node.attribute if a.name not in ("training_mode", "momentum")]
            del node.attribute[:]
            node.attribute.extend(kept)
            node.output[:] = node.output[:1]
            nodes.append(node)
        elif _dropout_training(node, values):
            nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]],
                                          name=node.name or emit.name()))
            if len(node.output) > 1 and node.output[1]:
                nodes += _all_true_like(node.input[0], node.output[1], emit)
        else:
            nodes.append(node)
    result.graph.ClearField("node")
    result.graph.node.extend(nodes)
    result.graph.initializer.extend(emit.initializers)
    prune(result)   # the Dropouts' ratio and flag constants
    return result


def training_form(model: onnx.ModelProto, state: list[str], *, scaled_masks: bool = False
                  ) -> tuple[onnx.ModelProto, TrainingForms]:
    """A copy with every training-mode BatchNormalization and Dropout rewritten (module
    docstring), and what was added. `state` names the running-statistics inputs; with
    `scaled_masks` each Dropout's mask input holds mask / (1 - ratio), not the 0/1 mask."""
    result = infer_shapes(model)
    ranks = _ranks(result)
    if any(_is_training_batch_norm(node) and node.input[0] not in ranks for node in result.graph.node) and \
            fold_shape_queries(result):
        # torch's nn.Unflatten exports its target shape as a Slice of Shape(x) whose bounds are integer arithmetic
        # on constants (Add, Mod), which onnx's shape inference does not evaluate: the Reshape's rank, and that of
        # every value after it, is unknown until that arithmetic is folded into constants
        result = infer_shapes(result)
        ranks = _ranks(result)
    values = constants(result)
    elements = _elements(result)
    forms = TrainingForms()
    emit = Emitter(result, "train_form")
    unbiased = result.producer_name in _UNBIASED_PRODUCERS
    opset = opset_of(result)
    nodes: list[onnx.NodeProto] = []
    # a BatchNorm module called more than once (a siamese network's two views through one encoder): torch moves
    # its running statistics once a call, in order, so each call's moving average starts from the last one's
    readers = Counter(name for node in result.graph.node if _is_training_batch_norm(node) for name in node.input[3:5])
    moved: dict[str, str] = {}
    for node in result.graph.node:
        if _is_training_batch_norm(node):
            nodes += _batch_norm(node, ranks, elements, emit, forms, state, unbiased, opset, moved, readers)
        elif _dropout_training(node, values):
            nodes += _dropout(node, values, result, emit, forms, scaled_masks)
        else:
            nodes.append(node)
    for running in [name for name in moved if readers[name] > 1 and name in state]:   # after the last call
        nodes.append(helper.make_node("Identity", [moved[running]], [STATE_PREFIX + running], name=emit.name()))
        forms.state_outputs[running] = STATE_PREFIX + running
    result.graph.ClearField("node")
    result.graph.node.extend(nodes)
    result.graph.initializer.extend(emit.initializers)
    result.graph.ClearField("value_info")
    for name, output in forms.state_outputs.items():
        elem = next(v.type.tensor_type.elem_type for v in result.graph.input if v.name == name)
        result.graph.output.append(helper.make_tensor_value_info(output, elem, None))
    return result, forms


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    return {v.name: len(v.type.tensor_type.shape.dim)
            for v in list(graph.input) + list(graph.value_info) + list(graph.output)
            if v.type.tensor_type.HasField("shape")}


def _elements(model: onnx.ModelProto) -> dict[str, int]:
    """The ONNX element type of every typed value (inputs, initializers, inferred values)."""
    graph = model.graph
    found = {v.name: v.type.tensor_type.elem_type
             for v in list(graph.input) + list(graph.value_info) + list(graph.output)
             if v.type.tensor_type.elem_type}
    found.update((tensor.name, tensor.data_type) for tensor in graph.initializer)
    return found


def _reduce_mean(opset: int, axes: list[int], axes_input: str):
    """A keepdims ReduceMean over `axes`, spelled for `opset` (axes an input from 18 on)."""
    def make(value: str, out: str) -> onnx.NodeProto:
        if opset >= _AXES_AS_INPUT:
            return helper.make_node("ReduceMean", [value, axes_input], [out], name=out,
                                    keepdims=1)
        return helper.make_node("ReduceMean", [value], [out], name=out, axes=axes, keepdims=1)
    return make


def _batch_norm(node: onnx.NodeProto, ranks: dict[str, int], elements: dict[str, int], emit: Emitter,
                forms: TrainingForms, state: list[str], unbiased: bool,
                opset_of_axes: int, moved: dict[str, str], readers: Counter) -> list[onnx.NodeProto]:
    """The node's training form; `moved` holds each running statistic's latest moving average (this node's
    added), `readers` how many BatchNormalizations read each: one that several read gets its state output after
    the last of them (`training_form`). Its constants take the element type of what they meet: a float64
    model's statistics are float64 throughout."""
    x, scale, bias, running_mean, running_var = node.input[:5]
    element = elements.get(x, TensorProto.FLOAT)
    rank = ranks.get(x)
    if rank is None or rank < 2:
        raise UnsupportedModelError(
            f"node {node_label(node)!r} (BatchNormalization, training mode): the rank of its "
            f"input {x!r} is unknown; export the model with static input ranks")
    epsilon = float(attribute(node, "epsilon", _EPSILON))
    momentum = float(attribute(node, "momentum", _MOMENTUM))
    axes = emit.ints([0] + list(range(2, rank)))
    reduce = _reduce_mean(opset_of_axes, [0] + list(range(2, rank)), axes)
    channel_shape = emit.ints([1, -1] + [1] * (rank - 2))
    names = {key: emit.name() for key in (
        "mean", "centred", "squared", "var", "stabilized", "std", "factor", "scale", "shift",
        "scaled", "count", "flat_mean", "flat_var")}
    n = names
    # scale / std is folded per channel before it meets the tensor: normalize-then-scale as
    # one multiplication, one pass over the activations fewer forward and three backward
    nodes = [
        reduce(x, n["mean"]),
        helper.make_node("Sub", [x, n["mean"]], [n["centred"]], name=n["centred"]),
        helper.make_node("Mul", [n["centred"], n["centred"]], [n["squared"]], name=n["squared"]),
        reduce(n["squared"], n["var"]),
        helper.make_node("Add", [n["var"], emit.scalar(epsilon, element)], [n["stabilized"]],
                         name=n["stabilized"]),
        helper.make_node("Sqrt", [n["stabilized"]], [n["std"]], name=n["std"]),
        helper.make_node("Reshape", [scale, channel_shape], [n["scale"]], name=n["scale"]),
        helper.make_node("Reshape", [bias, channel_shape], [n["shift"]], name=n["shift"]),
        helper.make_node("Div", [n["scale"], n["std"]], [n["factor"]], name=n["factor"]),
        helper.make_node("Mul", [n["centred"], n["factor"]], [n["scaled"]], name=n["scaled"]),
        helper.make_node("Add", [n["scaled"], n["shift"]], [node.output[0]],
                         name=node.name or n["scaled"] + "_shift"),
        helper.make_node("Reshape", [n["mean"], emit.ints([-1])], [n["flat_mean"]],
                         name=n["flat_mean"]),
        helper.make_node("Reshape", [n["var"], emit.ints([-1])], [n["flat_var"]],
                         name=n["flat_var"]),
    ]
    batch_var = n["flat_var"]
    if unbiased:
        nodes += _unbiased(x, n["flat_var"], axes, element, emit)
        batch_var = nodes[-1].output[0]
    for running, batch, index in ((running_mean, n["flat_mean"], 1),
                                  (running_var, batch_var, 2)):
        average = _moving_average(moved.get(running, running), batch, momentum,
                                  elements.get(running, element), element, emit)
        nodes += average
        new_value = moved[running] = average[-1].output[0]
        if len(node.output) > index and node.output[index]:
            nodes.append(helper.make_node("Identity", [new_value], [node.output[index]],
                                          name=emit.name()))
        if running in state and readers[running] == 1:
            output = STATE_PREFIX + running
            nodes.append(helper.make_node("Identity", [new_value], [output], name=emit.name()))
            forms.state_outputs[running] = output
    return nodes


def _unbiased(x: str, variance: str, axes: str, element: int, emit: Emitter) -> list[onnx.NodeProto]:
    """variance * n / (n - 1), n the number of values each channel's statistic covers, in `element`."""
    shape, picked, count, as_float, less, ratio, out = (emit.name() for _ in range(7))
    return [
        helper.make_node("Shape", [x], [shape], name=shape),
        helper.make_node("Gather", [shape, axes], [picked], name=picked, axis=0),
        helper.make_node("ReduceProd", [picked], [count], name=count, keepdims=0),
        helper.make_node("Cast", [count], [as_float], name=as_float, to=element),
        helper.make_node("Sub", [as_float, emit.scalar(1.0, element)], [less], name=less),
        helper.make_node("Div", [as_float, less], [ratio], name=ratio),
        helper.make_node("Mul", [variance, ratio], [out], name=out),
    ]


def _moving_average(running: str, batch: str, momentum: float, running_element: int, batch_element: int,
                    emit: Emitter) -> list[onnx.NodeProto]:
    """running * momentum + batch * (1 - momentum) in the running statistic's element type (ONNX lets it differ
    from the input's)."""
    kept, added, out = emit.name(), emit.name(), emit.name()
    nodes = []
    if batch_element != running_element:
        cast = emit.name()
        nodes.append(helper.make_node("Cast", [batch], [cast], name=cast, to=running_element))
        batch = cast
    return nodes + [helper.make_node("Mul", [running, emit.scalar(momentum, running_element)], [kept], name=kept),
                    helper.make_node("Mul", [batch, emit.scalar(1.0 - momentum, running_element)], [added],
                                     name=added),
                    helper.make_node("Add", [kept, added], [out], name=out)]


def _dropout(node: onnx.NodeProto, values: dict[str, np.ndarray], model: onnx.ModelProto,
             emit: Emitter, forms: TrainingForms, scaled_mask: bool) -> list[onnx.NodeProto]:
    ratio = _DROPOUT_RATIO
    if len(node.input) > _RATIO_INPUT and node.input[_RATIO_INPUT]:
        given = values.get(node.input[_RATIO_INPUT])
        if given is None:
            raise UnsupportedModelError(
                f"node {node_label(node)!r} (Dropout): its ratio input "
                f"{node.input[_RATIO_INPUT]!r} is computed at run time; export it as a "
                f"constant")
        ratio = float(given.reshape(-1)[0])
    if not 0 <= ratio < 1:
        raise UnsupportedModelError(f"node {node_label(node)!r} (Dropout): ratio {ratio} is "
                                    f"not in [0, 1)")
    if ratio == 0:   # drops nothing: no mask to draw and feed, no Mul forward and backward
        nodes = [helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name or emit.name())]
        if len(node.output) > 1 and node.output[1]:   # its mask output: every element kept
            shape = emit.name()
            nodes += [helper.make_node("Shape", [node.input[0]], [shape], name=shape),
                      helper.make_node("ConstantOfShape", [shape], [node.output[1]], name=emit.name(),
                                       value=helper.make_tensor("kept", TensorProto.BOOL, [1], [True]))]
        return nodes
    mask = MASK_PREFIX + node_label(node)
    declared = next((v for v in list(model.graph.value_info) + list(model.graph.input)
                     if v.name == node.input[0]), None)
    if declared is None or not declared.type.tensor_type.HasField("shape"):
        raise UnsupportedModelError(
            f"node {node_label(node)!r} (Dropout, training mode): the shape of its input "
            f"{node.input[0]!r} is unknown, so no mask can be fed for it")
    elem = declared.type.tensor_type.elem_type
    value_info = helper.make_tensor_value_info(mask, elem, None)
    value_info.type.tensor_type.shape.CopyFrom(declared.type.tensor_type.shape)
    model.graph.input.append(value_info)
    forms.dropout_rates[mask] = ratio
    if scaled_mask:   # the fed mask is already over the keep rate
        nodes = [helper.make_node("Mul", [node.input[0], mask], [node.output[0]],
                                  name=node.name or emit.name())]
    else:
        kept = emit.name()
        nodes = [helper.make_node("Mul", [node.input[0], mask], [kept], name=kept),
                 helper.make_node("Mul", [kept, emit.scalar(1.0 / (1.0 - ratio), elem)],
                                  [node.output[0]], name=node.name or emit.name())]
    if len(node.output) > 1 and node.output[1]:
        nodes.append(helper.make_node("Cast", [mask], [node.output[1]], name=emit.name(),
                                      to=TensorProto.BOOL))
    return nodes


def _all_true_like(value: str, out: str, emit: Emitter) -> list[onnx.NodeProto]:
    shape = emit.name()
    return [helper.make_node("Shape", [value], [shape], name=shape),
            helper.make_node("ConstantOfShape", [shape], [out], name=emit.name(),
                             value=numpy_helper.from_array(np.array([True]), "value"))]
