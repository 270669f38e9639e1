"""Graph surgery behind the gradient engine: parameters, batch, loss, and the reverse pass."""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ad
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError

from worker_client.engine.rewrites import rewrite_adjoints, rewrite_forward

__all__ = [
    "FLOAT_TYPES",
    "GradientGraph",
    "LossSpec",
    "UnsupportedModelError",
    "build_gradient_graph",
    "clamp_ir_version",
    "data_inputs",
    "lift_parameters",
    "max_ir_version",
    "parse_loss",
    "select_trainable",
    "shared_parameters",
    "tie_warning",
]

#: Element types a parameter can have.
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                         TensorProto.BFLOAT16})
#: Ops that hold a layer's own weights; one initializer feeding two of them ties two layers.
LAYER_OPS = frozenset({"Gemm", "MatMul", "Conv", "ConvTranspose", "Einsum", "Gather", "Add",
                       "Mul", "LayerNormalization", "BatchNormalization", "GroupNormalization",
                       "InstanceNormalization", "RMSNormalization", "PRelu"})
#: Ops that hand a weight on unchanged in value; a tie is looked for through them.
PASS_THROUGH = frozenset({"Identity", "Cast", "Transpose", "Reshape", "Flatten", "Squeeze",
                          "Unsqueeze"})
#: Prefix of the gradient outputs and seed input onnx-ad emits.
GRAD_PREFIX = "grad__"
#: Name of the seed-count dimension onnx-ad appends; the engine always uses one seed.
SEED_DIM = "nseed"
#: metadata_props key under which a built gradient model describes itself.
METADATA_KEY = "onnx_ps.gradient_graph"

_EXPORT_HINT = ("torch.onnx.export(..., training=torch.onnx.TrainingMode.TRAINING, "
                "do_constant_folding=False)")


@dataclass(frozen=True)
class LossSpec:
    """Which loss to attach: "cross_entropy", "mse", or "output" (a scalar the model outputs)."""

    kind: str
    output: str | None = None

    def key(self) -> str:
        """The spelling used in cache keys and metadata."""
        return self.kind if self.output is None else f"output:{self.output}"


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
        """Read back a model written by `build_gradient_graph`."""
        entries = {p.key: p.value for p in model.metadata_props}
        if METADATA_KEY not in entries:
            raise ValueError(f"the model has no {METADATA_KEY!r} metadata entry")
        described = json.loads(entries[METADATA_KEY])
        return cls(model=model, loss_output=described["loss_output"],
                   labels=described["labels"],
                   gradient_outputs=dict(described["gradient_outputs"]))


def parse_loss(loss: str) -> LossSpec:
    """`"cross_entropy"`, `"mse"` or `"output:NAME"` as a LossSpec."""
    if loss in ("cross_entropy", "mse"):
        return LossSpec(loss)
    if loss.startswith("output:") and len(loss) > len("output:"):
        return LossSpec("output", loss[len("output:"):])
    raise ValueError(f"loss must be 'cross_entropy', 'mse', 'output:NAME' or None, "
                     f"got {loss!r}")


def _node_label(node: onnx.NodeProto) -> str:
    return node.name or f"<unnamed {node.op_type} -> {node.output[0] if node.output else ''}>"


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """Tensor name -> the (node, input index) pairs reading it in the top-level graph."""
    found: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name:
                found[name].append((node, index))
    return found


def _statistics_only(graph: onnx.GraphProto, name: str,
                     consumers: dict[str, list[tuple[onnx.NodeProto, int]]]) -> bool:
    """Whether `name` only ever reaches BatchNormalization's running mean or variance."""
    uses = consumers.get(name, [])
    if not uses:
        return False
    for node, index in uses:
        if node.op_type == "Identity":
            if not _statistics_only(graph, node.output[0], consumers):
                return False
        elif not (node.op_type == "BatchNormalization" and index in (3, 4)):
            return False
    return True


def select_trainable(model: onnx.ModelProto, *, include: Sequence[str] = (),
                     exclude: Sequence[str] = ()) -> list[str]:
    """Names of the trainable initializers, in initializer order.

    Every floating-point initializer is a candidate, except BatchNormalization running
    statistics (they are not differentiable operands). A non-empty `include` keeps the
    candidates matching one of its glob patterns; `exclude` then drops those matching one of
    its own.
    """
    graph = model.graph
    consumers = _consumers(graph)
    chosen = []
    for tensor in graph.initializer:
        if tensor.data_type not in FLOAT_TYPES or _statistics_only(graph, tensor.name,
                                                                    consumers):
            continue
        if include and not any(fnmatch.fnmatchcase(tensor.name, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(tensor.name, p) for p in exclude):
            continue
        chosen.append(tensor.name)
    return chosen


def shared_parameters(model: onnx.ModelProto,
                      names: Iterable[str]) -> dict[str, list[onnx.NodeProto]]:
    """Parameters (of two or more elements) that feed two or more layer nodes.

    A weight is followed through value-preserving ops (Identity, Transpose, Reshape, ...),
    which is how torch.onnx.export's eval-mode initializer de-duplication wires one merged
    initializer into every layer that held the same values.
    """
    graph = model.graph
    consumers = _consumers(graph)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    shared = {}
    for name in names:
        if sizes.get(name, 0) < 2:
            continue
        layers: dict[int, onnx.NodeProto] = {}
        frontier, seen = [name], {name}
        while frontier:
            tensor = frontier.pop()
            for node, index in consumers.get(tensor, []):
                if node.op_type in PASS_THROUGH and index == 0:
                    fresh = [out for out in node.output if out and out not in seen]
                    seen.update(fresh)
                    frontier.extend(fresh)
                elif node.op_type in LAYER_OPS:
                    layers[id(node)] = node
        if len(layers) >= 2:
            shared[name] = list(layers.values())
    return shared


def tie_warning(name: str, nodes: Sequence[onnx.NodeProto]) -> str:
    """The text of the warning about one parameter shared by several layers."""
    listed = ", ".join(f"{_node_label(n)} ({n.op_type})" for n in nodes)
    return (f"initializer {name!r} feeds {len(nodes)} layers: {listed}; they are trained as "
            f"one tied parameter. If the model came from torch.onnx.export in eval mode, "
            f"the exporter merged parameters that held equal values (fresh LayerNorms, zero "
            f"biases) into one initializer: re-export with {_EXPORT_HINT}. Ignore this "
            f"warning if the sharing is intended (tied embeddings), or exclude the "
            f"initializer if it is a constant")


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
    lifted.ir_version = max(lifted.ir_version, 4)  # initializers need not be inputs from IR 4
    graph.input.extend(helper.make_tensor_value_info(name, moved[name].data_type,
                                                     list(moved[name].dims))
                       for name in names)
    return lifted


def data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are not initializers."""
    initialized = {t.name for t in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initialized]


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None] | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor_type.shape.dim]


def _fix_batch(model: onnx.ModelProto, inputs: Sequence[str], batch_size: int) -> None:
    """Set axis 0 of `inputs`, and every dimension sharing its symbol, to `batch_size`.

    Several onnx-ad rules (Conv's input adjoint, for one) need static shapes; the batch is
    the one dimension a training step fixes.
    """
    graph = model.graph
    symbols: set[str] = set()
    for value in graph.input:
        if value.name not in inputs:
            continue
        dims = value.type.tensor_type.shape.dim
        if not value.type.tensor_type.HasField("shape") or len(dims) == 0:
            continue  # a scalar input (a flag, a rate) has no batch axis
        first = dims[0]
        if first.HasField("dim_value"):
            if first.dim_value != batch_size:
                raise ValueError(
                    f"input {value.name!r} has a fixed batch dimension of {first.dim_value}, "
                    f"but batch_size={batch_size}; export the model with a dynamic batch "
                    f"axis or use batch_size={first.dim_value}")
            continue
        if first.dim_param:
            symbols.add(first.dim_param)
        first.Clear()
        first.dim_value = batch_size
    for value in list(graph.input) + list(graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in symbols:
                dim.Clear()
                dim.dim_value = batch_size
    graph.ClearField("value_info")  # stale wherever the batch was symbolic


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference with data propagation, so shapes computed by Shape/Concat/Reshape
    chains (how exporters spell a dynamic flatten) become static once the batch is."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise UnsupportedModelError(f"ONNX shape inference failed: {exc}") from exc


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


def _attach_loss(model: onnx.ModelProto, spec: LossSpec,
                 batch_size: int) -> tuple[str, str | None]:
    """Append the loss to `model` (in place); its only output becomes the scalar loss.

    Returns the loss output's name and the labels input's name (None when the loss adds
    none). Cross-entropy is spelled LogSoftmax, OneHot, Mul and ReduceSum: every one has an
    onnx-ad rule at any opset, where GatherElements' adjoint needs opset 16 (ScatterElements
    with reduction), and a ReduceSum without axes means "all axes" in both its attribute
    (< 13) and input (>= 13) forms, so one spelling serves every opset.
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
        prediction = graph.output[0].name
        elem_type, dims = _shape_of(model, prediction)
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
            if dims is not None and len(dims) != 2:
                raise UnsupportedModelError(
                    f"cross_entropy needs logits shaped (batch, classes), but the first "
                    f"output {prediction!r} has shape {dims}")
            graph.input.append(helper.make_tensor_value_info(labels, TensorProto.INT64,
                                                             [batch_size]))
            log_probs, shape, depth, onehot, picked, total, loss = (names(stem) for stem in (
                "ce_log_probs", "ce_shape", "ce_depth", "ce_onehot", "ce_picked",
                "ce_total", "loss"))
            # onnxruntime's OneHot kernels produce float32 (not float64 or float16)
            one_hot_values = _constant(names, nodes, np.array([0, 1], np.float32),
                                       "ce_values")
            class_axis = _constant(names, nodes, np.array(1, np.int64), "ce_class_axis")
            scale = _constant(names, nodes, np.array(-1.0 / batch_size, dtype), "ce_scale")
            nodes += [
                helper.make_node("LogSoftmax", [prediction], [log_probs], name=log_probs,
                                 axis=1),
                helper.make_node("Shape", [prediction], [shape], name=shape),
                helper.make_node("Gather", [shape, class_axis], [depth], name=depth, axis=0),
                helper.make_node("OneHot", [labels, depth, one_hot_values], [onehot],
                                 name=onehot, axis=-1),
            ]
            if elem_type != TensorProto.FLOAT:
                float_onehot, onehot = onehot, names("ce_onehot_cast")
                nodes.append(helper.make_node("Cast", [float_onehot], [onehot], name=onehot,
                                              to=elem_type))
            nodes += [
                helper.make_node("Mul", [onehot, log_probs], [picked], name=picked),
                helper.make_node("ReduceSum", [picked], [total], name=total, keepdims=0),
                helper.make_node("Mul", [total, scale], [loss], name=loss),
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
    return loss, labels


def _constant_value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
    return None


def _reject_training_mode(model: onnx.ModelProto) -> None:
    """Training-mode BatchNormalization and Dropout have no deterministic gradient here."""
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and any(
                a.name == "training_mode" and a.i for a in node.attribute):
            raise UnsupportedModelError(
                f"node {_node_label(node)!r} (BatchNormalization) is in training mode: it "
                f"normalizes with batch statistics and updates running ones, which the "
                f"gradient engine does not differentiate. Export the model in eval mode, "
                f"where BatchNormalization is an affine map of its running statistics "
                f"(model.eval(); torch.onnx.export(..., training=torch.onnx.TrainingMode."
                f"EVAL, keep_initializers_as_inputs=True) -- the last flag skips the "
                f"de-duplication that ties equal-valued parameters), or fold it into the "
                f"preceding Conv")
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            flag = _constant_value(model, node.input[2])
            if flag is None or bool(flag.reshape(-1)[0]):
                raise UnsupportedModelError(
                    f"node {_node_label(node)!r} (Dropout) is in training mode: it samples "
                    f"a random mask on every call, which the gradient engine does not "
                    f"differentiate. Export the model in eval mode, where Dropout is the "
                    f"identity (model.eval(); torch.onnx.export(..., training=torch.onnx."
                    f"TrainingMode.EVAL, keep_initializers_as_inputs=True) -- the last flag "
                    f"skips the de-duplication that ties equal-valued parameters), or "
                    f"remove the Dropout layers; training then runs without dropout")


_RULE_MESSAGE = re.compile(r"no reverse rule for (\S+) \(node '([^']*)'\)")


def build_gradient_graph(lifted: onnx.ModelProto, *, parameters: Sequence[str],
                         loss: LossSpec, batch_size: int) -> GradientGraph:
    """The model computing the loss and its gradient with respect to `parameters`.

    `lifted` has its parameters as graph inputs (see `lift_parameters`). The batch axis of
    every data input is fixed to `batch_size`, the loss is appended, and onnx-ad's reverse
    pass emits one gradient output per parameter. The seed of the scalar loss is baked in
    as a constant 1.0 initializer, so onnxruntime folds everything that depends only on it.
    """
    _reject_training_mode(lifted)
    model = onnx.ModelProto()
    model.CopyFrom(lifted)
    inputs = [v.name for v in data_inputs(model) if v.name not in set(parameters)]
    _fix_batch(model, inputs, batch_size)
    model = _infer(model)
    loss_output, labels = _attach_loss(model, loss, batch_size)
    model = _infer(rewrite_forward(model))
    try:
        derived = onnx_ad.reverse(model, inputs=list(parameters), outputs=[loss_output],
                                  prefix=GRAD_PREFIX, dim=SEED_DIM, layout="onnx")
    except onnx_ad.UnsupportedOperator as exc:
        match = _RULE_MESSAGE.search(str(exc))
        if match is None:
            raise UnsupportedModelError(f"cannot differentiate the model: {exc}") from exc
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
    loss_type, _ = _shape_of(model, loss_output)
    graph.initializer.append(numpy_helper.from_array(
        np.ones((1,), helper.tensor_dtype_to_np_dtype(loss_type)), seed))
    rewrite_adjoints(derived)
    result = GradientGraph(model=derived, loss_output=loss_output, labels=labels,
                           gradient_outputs={p: GRAD_PREFIX + p for p in parameters})
    del derived.metadata_props[:]
    derived.metadata_props.add(key=METADATA_KEY, value=result.describe())
    clamp_ir_version(derived)
    return result


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
