"""Stage "loss": the loss appended to the model as its one, scalar output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.rewrites.toolkit import opset_of
from worker_client.engine.trainables import FLOAT_TYPES

__all__ = ["LossSpec", "attach_loss", "parse_loss", "probability_output"]


@dataclass(frozen=True)
class LossSpec:
    """Which loss to attach: "cross_entropy" (over axis 1 of (batch, classes, d1, ...) logits: per position,
    a segmentation map's, when there are more axes), "bce" (binary cross-entropy on one logit per example, or
    one per label of a multi-label output), "mse", "output" (a scalar the model outputs), or
    "vjp": none -- every floating-point output is seeded with a cotangent the caller feeds, so
    the gradients are a vector-Jacobian product (a pipeline stage's backward pass)."""

    kind: str
    output: str | None = None

    def key(self) -> str:
        """The spelling used in cache keys and metadata."""
        return self.kind if self.output is None else f"output:{self.output}"


def parse_loss(loss: str) -> LossSpec:
    """`"cross_entropy"`, `"bce"`, `"mse"`, `"output:NAME"` or `"vjp"` as a LossSpec."""
    if loss in ("cross_entropy", "bce", "mse", "vjp"):
        return LossSpec(loss)
    if loss.startswith("output:") and len(loss) > len("output:"):
        return LossSpec("output", loss[len("output:"):])
    raise ValueError(f"loss must be 'cross_entropy', 'bce', 'mse', 'output:NAME', 'vjp' or None, "
                     f"got {loss!r}")


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None] | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor_type.shape.dim]


def _shape_of(model: onnx.ModelProto, name: str) -> tuple[int, list[int | str | None] | None]:
    """(elem_type, dims) of a value as declared or inferred in `model`."""
    graph = model.graph
    for value in list(graph.output) + list(graph.value_info) + list(graph.input):
        if value.name == name:
            return value.type.tensor_type.elem_type, _dims(value)
    for tensor in graph.initializer:
        if tensor.name == name:
            return tensor.data_type, list(tensor.dims)
    return TensorProto.UNDEFINED, None


#: The first output's activation that makes it probabilities, and the loss that reads the activation's input
#: (the logits) in its place.
_PROBABILITIES = {"Softmax": "cross_entropy", "Sigmoid": "bce"}


def _probability_node(model: onnx.ModelProto) -> onnx.NodeProto | None:
    """The node that makes the first output probabilities: a Softmax over the classes' axis (1) or a Sigmoid."""
    graph = model.graph
    if not graph.output:
        return None
    prediction = graph.output[0].name
    node = next((n for n in graph.node if prediction in n.output), None)
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _PROBABILITIES:
        return None
    if node.op_type == "Sigmoid":
        return node
    _, dims = _shape_of(model, prediction)
    if dims is None:
        return None
    rank = len(dims)
    default = -1 if opset_of(model) >= _LOG_SOFTMAX_ON_AN_AXIS else 1
    axis = next((a.i for a in node.attribute if a.name == "axis"), default)
    axis = axis + rank if axis < 0 else axis
    # below opset 13 a Softmax flattens from its axis: one row of classes only for (batch, classes)
    if axis != 1 or (opset_of(model) < _LOG_SOFTMAX_ON_AN_AXIS and rank != 2):
        return None
    return node


def probability_output(model: onnx.ModelProto, loss: str | None = None) -> str | None:
    """"softmax" when the model's first output is a Softmax over the classes' axis (a Keras classifier's
    Dense(activation="softmax"), a torch model ending in nn.Softmax(dim=1)), "sigmoid" when it is a Sigmoid, else
    None; given a `loss` kind, only when that is the loss that reads the activation's input, the logits
    (cross-entropy, binary cross-entropy): applied to the probabilities themselves it would take a second softmax
    (sigmoid), a different loss, and train the model towards it."""
    node = _probability_node(model)
    if node is None or loss is not None and _PROBABILITIES[node.op_type] != loss:
        return None
    return node.op_type.lower()


class _Names:
    """Fresh tensor names that collide with nothing in the graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.taken = {v.name for v in list(graph.input) + list(graph.output)
                      + list(graph.value_info)}
        self.taken.update(t.name for t in graph.initializer)
        self.taken.update(out for node in graph.node for out in node.output)

    def __call__(self, stem: str) -> str:
        name, counter = stem, 0
        while name in self.taken:
            counter += 1
            name = f"{stem}_{counter}"
        self.taken.add(name)
        return name


def _constant(names: _Names, nodes: list[onnx.NodeProto], array: np.ndarray,
              stem: str) -> str:
    out = names(stem)
    nodes.append(helper.make_node("Constant", [], [out], name=out,
                                  value=numpy_helper.from_array(array, out)))
    return out


#: The opset from which LogSoftmax works on one axis (before, it flattens the input to 2-D, and onnx-ad refuses it).
_LOG_SOFTMAX_ON_AN_AXIS = 13


def _log_softmax(logits: str, out: str, model: onnx.ModelProto, names) -> list[onnx.NodeProto]:
    """LogSoftmax over axis 1 of (batch, classes) logits. Below opset 13 (a model the version converter could not
    upgrade) spelled out -- x - max - log(sum(exp(x - max))), with the reductions' axes as attributes -- since
    onnx-ad refuses that opset's LogSoftmax, though on 2-D logits its flattening changes nothing."""
    if opset_of(model) >= _LOG_SOFTMAX_ON_AN_AXIS:
        return [helper.make_node("LogSoftmax", [logits], [out], name=out, axis=1)]
    peak, shifted, exp, total, log_total = (names(stem) for stem in (
        "ce_peak", "ce_shifted", "ce_exp", "ce_sum", "ce_log_sum"))
    return [helper.make_node("ReduceMax", [logits], [peak], name=peak, axes=[1], keepdims=1),
            helper.make_node("Sub", [logits, peak], [shifted], name=shifted),
            helper.make_node("Exp", [shifted], [exp], name=exp),
            helper.make_node("ReduceSum", [exp], [total], name=total, axes=[1], keepdims=1),
            helper.make_node("Log", [total], [log_total], name=log_total),
            helper.make_node("Sub", [shifted, log_total], [out], name=out)]


def _mean_of(total: str, labels: str, batch_size: int, positions: list, sign: float, elem_type: int,
             dtype: np.dtype, loss: str, names: "_Names", constants: list[onnx.NodeProto], stem: str
             ) -> list[onnx.NodeProto]:
    """Nodes writing `loss` = sign * total / (the labels' count): a constant scale where every axis of the labels
    past the batch's is static (one label per example: 1 / batch), else the labels' Size read at run time. The
    constants go into `constants` now, the nodes returned after the ones that compute `total`."""
    if all(isinstance(d, int) for d in positions):
        count = batch_size * int(np.prod(positions, dtype=np.int64))
        scale = _constant(names, constants, np.array(sign / count, dtype), f"{stem}_scale")
        return [helper.make_node("Mul", [total, scale], [loss], name=loss)]
    size, count, mean = names(f"{stem}_size"), names(f"{stem}_count"), names(f"{stem}_mean")
    signed = _constant(names, constants, np.array(sign, dtype), f"{stem}_sign")
    return [helper.make_node("Size", [labels], [size], name=size),
            helper.make_node("Cast", [size], [count], name=count, to=elem_type),
            helper.make_node("Div", [total, count], [mean], name=mean),
            helper.make_node("Mul", [mean, signed], [loss], name=loss)]


def attach_loss(model: onnx.ModelProto, spec: LossSpec,
                batch_size: int) -> tuple[onnx.ModelProto, str, str | None]:
    """Append the loss to `model` (in place); its only output becomes the scalar loss.

    Returns the model, the loss output's name and the labels input's name (None when the
    loss adds none). Cross-entropy is spelled LogSoftmax, OneHot, Mul and ReduceSum: every
    one has an onnx-ad rule at any opset, where GatherElements' adjoint needs opset 16
    (ScatterElements with reduction), and a ReduceSum without axes means "all axes" in both
    its attribute (< 13) and input (>= 13) forms, so one spelling serves every opset.
    """
    graph = model.graph
    names = _Names(model)
    nodes: list[onnx.NodeProto] = []
    labels = None
    if spec.kind == "output" and spec.output is not None:
        output = spec.output
        if output not in {v.name for v in graph.output}:
            raise UnsupportedModelError(
                f"loss='output:{output}' names no graph output; the outputs are "
                f"{[v.name for v in graph.output]}")
        elem_type, dims = _shape_of(model, output)
        sizes = [d for d in dims or [] if isinstance(d, int)]
        if dims is None or len(sizes) != len(dims) or int(np.prod(sizes)) != 1:
            raise UnsupportedModelError(
                f"loss output {output!r} must be a scalar (one element), but its shape is "
                f"{dims if dims is not None else 'unknown'}")
        if elem_type not in FLOAT_TYPES:
            raise UnsupportedModelError(
                f"loss output {output!r} has element type "
                f"{TensorProto.DataType.Name(elem_type)}, not a floating-point type")
        if not dims:
            loss = output
        else:
            loss = names("loss")
            nodes.append(helper.make_node("ReduceSum", [output], [loss], name=loss,
                                          keepdims=0))
    else:
        if not graph.output:
            raise UnsupportedModelError(
                f"the graph has no outputs; the {spec.kind} loss reads the model's first output "
                f"(re-export it with its prediction as an output)")
        prediction = graph.output[0].name
        elem_type, dims = _shape_of(model, prediction)
        activation = _probability_node(model)
        if activation is not None and _PROBABILITIES[activation.op_type] == spec.kind:
            prediction = activation.input[0]   # the logits, of the probabilities' shape (probability_output)
        if elem_type not in FLOAT_TYPES:
            raise UnsupportedModelError(
                f"the loss {spec.kind!r} needs a floating-point first output, but "
                f"{prediction!r} has element type {TensorProto.DataType.Name(elem_type)}")
        if "labels" in {v.name for v in graph.input}:
            raise UnsupportedModelError(
                "the model already has an input named 'labels'; compute the loss in the "
                "model and pass loss='output:NAME'")
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        labels = "labels"
        names.taken.add(labels)
        if spec.kind == "cross_entropy":
            # torch's F.cross_entropy: logits (batch, classes) and a label per example, or (batch, classes, d1,
            # ...) and a label per position (batch, d1, ...); the mean over every label
            if dims is not None and len(dims) < 2:
                raise UnsupportedModelError(
                    f"cross_entropy needs logits shaped (batch, classes) or (batch, classes, d1, ...), but the "
                    f"first output {prediction!r} has shape {dims}")
            positions = list(dims[2:]) if dims is not None else []   # an unknown rank: taken for (batch, classes)
            graph.input.append(helper.make_tensor_value_info(labels, TensorProto.INT64,
                                                             [batch_size, *positions]))
            log_probs, shape, depth, onehot, picked, total, loss = (names(stem) for stem in (
                "ce_log_probs", "ce_shape", "ce_depth", "ce_onehot", "ce_picked",
                "ce_total", "loss"))
            # onnxruntime's OneHot kernels produce float32 (not float64 or float16)
            one_hot_values = _constant(names, nodes, np.array([0, 1], np.float32),
                                       "ce_values")
            class_axis = _constant(names, nodes, np.array(1, np.int64), "ce_class_axis")
            mean = _mean_of(total, labels, batch_size, positions, -1.0, elem_type, dtype, loss, names, nodes, "ce")
            nodes += _log_softmax(prediction, log_probs, model, names)
            nodes += [
                helper.make_node("Shape", [prediction], [shape], name=shape),
                helper.make_node("Gather", [shape, class_axis], [depth], name=depth, axis=0),
                # the classes' axis after the batch's (-1 for a label per example: the same axis)
                helper.make_node("OneHot", [labels, depth, one_hot_values], [onehot],
                                 name=onehot, axis=1 if positions else -1),
            ]
            if elem_type != TensorProto.FLOAT:
                float_onehot, onehot = onehot, names("ce_onehot_cast")
                nodes.append(helper.make_node("Cast", [float_onehot], [onehot], name=onehot,
                                              to=elem_type))
            nodes += [
                helper.make_node("Mul", [onehot, log_probs], [picked], name=picked),
                helper.make_node("ReduceSum", [picked], [total], name=total, keepdims=0),
                *mean,
            ]
        elif spec.kind == "bce":
            # binary cross-entropy on logits z with labels y in {0, 1}, the mean over the labels, in the stable form
            # max(z, 0) - z y + log(1 + exp(-|z|)); the labels are reshaped to z's shape
            # one logit per example, (batch,) or (batch, 1), with a label per example; or several, (batch, d1,
            # ...) -- a multi-label output, torch's BCEWithLogitsLoss -- with a label per logit: the mean of all
            if dims is not None and not dims:
                raise UnsupportedModelError(
                    f"bce needs logits shaped (batch,), (batch, 1) or (batch, d1, ...), but the first output "
                    f"{prediction!r} is a scalar")
            # several logits an example where an axis is known to be longer than one (an unknown one: one logit)
            per_label = list(dims[1:]) if dims and any(isinstance(d, int) and d != 1 for d in dims[1:]) else []
            graph.input.append(helper.make_tensor_value_info(labels, elem_type, [batch_size, *per_label]))
            shape, targets, positive, product, magnitude, negative, softplus, terms, total, loss = (
                names(stem) for stem in ("bce_shape", "bce_targets", "bce_positive", "bce_product",
                                         "bce_magnitude", "bce_negative", "bce_softplus", "bce_terms",
                                         "bce_total", "loss"))
            mean = _mean_of(total, labels, batch_size, per_label, 1.0, elem_type, dtype, loss, names, nodes, "bce")
            nodes += [
                helper.make_node("Shape", [prediction], [shape], name=shape),
                helper.make_node("Reshape", [labels, shape], [targets], name=targets),
                helper.make_node("Relu", [prediction], [positive], name=positive),
                helper.make_node("Mul", [prediction, targets], [product], name=product),
                helper.make_node("Abs", [prediction], [magnitude], name=magnitude),
                helper.make_node("Neg", [magnitude], [negative], name=negative),
                helper.make_node("Softplus", [negative], [softplus], name=softplus),
                helper.make_node("Sub", [positive, product], [terms + "_a"], name=terms + "_a"),
                helper.make_node("Add", [terms + "_a", softplus], [terms], name=terms),
                helper.make_node("ReduceSum", [terms], [total], name=total, keepdims=0),
                *mean,
            ]
        else:
            graph.input.append(helper.make_tensor_value_info(labels, elem_type, dims))
            difference, squared, total, size, count, loss = (names(stem) for stem in (
                "mse_difference", "mse_squared", "mse_total", "mse_size", "mse_count",
                "loss"))
            nodes += [
                helper.make_node("Sub", [prediction, labels], [difference], name=difference),
                helper.make_node("Mul", [difference, difference], [squared], name=squared),
                helper.make_node("ReduceSum", [squared], [total], name=total, keepdims=0),
                helper.make_node("Size", [difference], [size], name=size),
                helper.make_node("Cast", [size], [count], name=count, to=elem_type),
                helper.make_node("Div", [total, count], [loss], name=loss),
            ]
    graph.node.extend(nodes)
    graph.ClearField("output")
    graph.output.append(helper.make_tensor_value_info(loss, elem_type, []))
    return model, loss, labels
