"""The rule that says which of a model's floating-point initializers are parameters.

ONNX does not say which initializers a training run should change: an exporter writes
weights, running statistics and numeric constants alike as initializers (tf2onnx writes
every constant of the TensorFlow graph that way, epsilons included). `classify` gives each
floating-point initializer one role, by the first rule that applies:

1. **state** -- it reaches only BatchNormalization's running mean or variance (through
   Identity). Kept by the model, updated by training-mode BatchNormalization, never
   differentiated.
2. **constant (configuration)** -- every use, followed through value-preserving ops, is an
   operand the op reads as configuration, not data (`CONFIGURATION_OPERANDS`: a shape, a
   bound, an index, a scale factor, an exponent, a ratio), or an operand of an op whose
   derivative is zero everywhere (a comparison, Floor, Sign, ...). Except, in a torch model,
   a Pow's exponent and a Clip's bounds (`TORCH_TRAINED_OPERANDS`: a generalized-mean pool's
   p, a learned clipping level), which torch trains and its exporters never write as an
   initializer of their own when they are literals.
3. **constant (not finite)** -- it holds an infinite or NaN element: a mask (a causal attention mask's -inf
   above the diagonal, which torch's exporters write as an initializer from a registered buffer). No
   optimizer step can train such a value, and training its finite entries would turn the mask into a
   learned bias.
4. **constant (stabilizer)** -- it has one element and is added to a value that is
   non-negative by construction (a variance, a squared norm, a square root): an epsilon.
5. **constant (exporter constant)** -- it has one element and the model comes from an
   exporter that writes every constant as an initializer: tf2onnx (every constant of the
   TensorFlow graph) or jax2onnx (every closed-over array, and a 0-d zero as each Gemm's
   bias). Except, in a tf2onnx model, a layer's bias: the one-element bias of a Dense(1) or
   a Conv2D(filters=1) (a binary classifier's head), which is a Conv's or Gemm's bias
   input or is added to a MatMul's, Gemm's or Conv's output.
   torch.onnx's dynamo exporter (its optimizer, on by default) writes literals the same way
   (an attention's scale, a mask's -inf, Softplus's beta): in its models, a one-element
   initializer is a constant unless a node it feeds came from a torch op that read a torch
   parameter of that name (the exporter records each node's torch.fx node: `%p_<name>`).
   The same exporter writes a GroupNorm as an InstanceNormalization over the groups with a
   unit scale and a zero shift of its own, then GroupNorm's weight and bias: that scale and
   shift are constants too. And its record names a torch buffer (`%b_<name>`: a positional
   encoding's table, a rotary embedding's cos and sin, from register_buffer) or a tensor
   constant (`%c_<name>`: a tensor forward() builds from literals, such as an affine grid's
   identity transform) as one: such an initializer, of any size, is a constant, as torch
   trains neither. (The legacy exporter writes a buffer as it writes a weight: rule 6.)
6. **parameter** -- everything else: it trains.

`include` / `exclude` patterns (trainables.py) override the rule.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["CONFIGURATION_OPERANDS", "FLOAT_TYPES", "TORCH_FX_NODE", "Role", "classify", "consumers",
           "from_torch_dynamo", "names_torch_parameter", "node_metadata", "only_running_statistics",
           "reads_torch_parameter", "torch_export_name"]

#: Element types a parameter can have.
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                         TensorProto.BFLOAT16})
#: BatchNormalization's input indices of its running mean and variance.
RUNNING_STATISTICS = (3, 4)
#: Per op, the input indices that configure it rather than carry data.
CONFIGURATION_OPERANDS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}), "Pad": frozenset({1, 2, 3}),
    "Resize": frozenset({1, 2, 3}), "Upsample": frozenset({1}), "Clip": frozenset({1, 2}),
    "Range": frozenset({0, 1, 2}), "OneHot": frozenset({1, 2}), "Dropout": frozenset({1, 2}),
    "TopK": frozenset({1}), "Pow": frozenset({1}), "Split": frozenset({1}),
    "Squeeze": frozenset({1}), "Unsqueeze": frozenset({1}), "CumSum": frozenset({1}),
    "Gather": frozenset({1}), "GatherElements": frozenset({1}), "GatherND": frozenset({1}),
    "ScatterElements": frozenset({1}), "ScatterND": frozenset({1}), "Trilu": frozenset({1}),
    "ConstantOfShape": frozenset({0}), "RoiAlign": frozenset({1, 2}),
    "ReduceSum": frozenset({1}), "ReduceMean": frozenset({1}), "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}), "ReduceProd": frozenset({1}),
}
#: The operands above that torch trains when a parameter feeds them: Pow's exponent (a generalized-mean pool's
#: p) and Clip's bounds (a learned clipping level). torch's exporters never write a literal there as an
#: initializer of its own -- the legacy one writes a Constant node, the dynamo one a one-element initializer that
#: rule 5 tells from a parameter by its record -- so in a torch model an initializer there is a parameter; other
#: exporters (tf2onnx, hand-built graphs) write their literal exponents and bounds as initializers.
TORCH_TRAINED_OPERANDS: dict[str, frozenset[int]] = {"Pow": frozenset({1}), "Clip": frozenset({1, 2})}
#: Ops whose derivative is zero wherever it exists: an operand used only by them is inert.
ZERO_DERIVATIVE_OPS = frozenset({
    "Shape", "Size", "NonZero", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
    "ArgMax", "ArgMin", "IsNaN", "IsInf", "Sign", "Floor", "Ceil", "Round", "Hardmax",
    "EyeLike", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"})
#: Ops that hand their first input on unchanged in value: uses are followed through them.
VALUE_PRESERVING = frozenset({"Identity", "Cast", "Reshape", "Flatten", "Squeeze",
                              "Unsqueeze", "Transpose"})
#: Ops whose output is non-negative whatever their (real) input.
_NON_NEGATIVE = frozenset({"Abs", "Sqrt", "ReduceSumSquare", "ReduceL1", "ReduceL2"})
#: Ops that keep a non-negative input non-negative.
_SIGN_KEEPING = frozenset({"ReduceMean", "ReduceSum", "Identity", "Cast", "Reshape",
                           "Squeeze", "Unsqueeze", "Flatten", "Transpose"})
#: torch.onnx's producer name, either exporter (ModelProto.producer_name).
TORCH_PRODUCER = "pytorch"
#: The producer whose every graph constant is an initializer (ModelProto.producer_name).
TF2ONNX = "tf2onnx"
#: Producers that write every constant as an initializer, one-element ones included.
CONSTANTS_AS_INITIALIZERS = frozenset({TF2ONNX, "jax2onnx"})


@dataclass(frozen=True)
class Role:
    """An initializer's role: "parameter", "state" or "constant", and why."""

    kind: str
    reason: str


Uses = dict[str, list[tuple[onnx.NodeProto, int]]]


def consumers(graph: onnx.GraphProto) -> Uses:
    """Tensor name -> the (node, input index) pairs reading it in the top-level graph."""
    found: Uses = defaultdict(list)
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name:
                found[name].append((node, index))
    return found


#: The node metadata in which torch.onnx's dynamo exporter records the torch.fx node a node came from.
TORCH_FX_NODE = "pkg.torch.onnx.fx_node"


def node_metadata(node: onnx.NodeProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in node.metadata_props}


def from_torch_dynamo(model: onnx.ModelProto) -> bool:
    """Whether torch.onnx's dynamo exporter wrote the model (its nodes carry the fx node they came from)."""
    return model.producer_name == TORCH_PRODUCER and any(TORCH_FX_NODE in node_metadata(n) for n in model.graph.node)


def torch_export_name(name: str, kind: str = "p") -> str:
    """What torch.export calls the torch parameter `name` in the records: ``p_`` + the name, dots as underscores
    (`kind` "b": the torch buffer `name`, ``b_`` + the name; "c": the lifted tensor constant `name`)."""
    return f"{kind}_" + re.sub(r"\W", "_", name)


def reads_torch_parameter(node: onnx.NodeProto, name: str, kind: str = "p") -> bool:
    """Whether `node` came from a torch op that read the torch parameter `name` (`torch_export_name`, in the record
    the dynamo exporter keeps on each node); with `kind` "b", the torch buffer `name`."""
    reference = re.escape("%" + torch_export_name(name, kind)) + r"\b"
    return re.search(reference, node_metadata(node).get(TORCH_FX_NODE, "")) is not None


def _is_torch_buffer(name: str, uses: Uses) -> bool:
    """Whether the dynamo exporter's record says initializer `name` is a torch buffer (register_buffer, ``b_``) or
    a tensor constant (``c_``: torch.export lifts a tensor that forward() builds from literals, or a plain tensor
    attribute, as one), and no node reads it as a parameter."""
    return any(reads_torch_parameter(node, name, kind) for node, _ in uses.get(name, []) for kind in ("b", "c")) \
        and not names_torch_parameter(name, uses)


def names_torch_parameter(name: str, uses: Uses) -> bool:
    """Whether a node that reads initializer `name` came from a torch op that read the torch parameter `name`."""
    return any(reads_torch_parameter(node, name) for node, _ in uses.get(name, []))


def _is_group_norm_unit(name: str, uses: Uses) -> bool:
    """Whether `name` is read only as the scale or shift of InstanceNormalizations that came from a torch
    group_norm (and names no torch parameter): the dynamo exporter's own ones and zeros."""
    readers = uses.get(name, [])
    return bool(readers) and not names_torch_parameter(name, uses) and all(
        node.op_type == "InstanceNormalization" and index in (1, 2) and
        "aten.group_norm" in node_metadata(node).get(TORCH_FX_NODE, "") for node, index in readers)


def classify(model: onnx.ModelProto) -> dict[str, Role]:
    """The role of every floating-point initializer, in initializer order (module docstring)."""
    graph = model.graph
    uses = consumers(graph)
    producers = {out: node for node in graph.node for out in node.output if out}
    constants = {t.name: t for t in graph.initializer}
    exporter = model.producer_name if model.producer_name in CONSTANTS_AS_INITIALIZERS else None
    dynamo = from_torch_dynamo(model)
    from_torch = model.producer_name == TORCH_PRODUCER
    roles = {}
    for tensor in graph.initializer:
        if tensor.data_type not in FLOAT_TYPES:
            continue
        single = int(np.prod(tensor.dims, dtype=np.int64)) == 1
        if only_running_statistics(tensor.name, uses):
            roles[tensor.name] = Role("state", "BatchNormalization running statistics")
        elif _only(tensor.name, uses, lambda node, index: _is_configuration(node, index, from_torch),
                   follow=VALUE_PRESERVING):
            roles[tensor.name] = Role("constant", "used only as configuration (a shape, "
                                                  "bound, index, scale factor or exponent) "
                                                  "or by ops without a derivative")
        elif not _finite(tensor):
            roles[tensor.name] = Role("constant", "it holds an infinite or NaN value (a mask), which no "
                                                  "optimizer step can train")
        elif dynamo and _is_torch_buffer(tensor.name, uses):
            roles[tensor.name] = Role("constant", "a torch buffer (register_buffer) or tensor constant, which "
                                                  "torch does not train: torch.onnx's dynamo exporter records it "
                                                  "as one")
        elif single and _is_stabilizer(tensor.name, uses, producers, constants):
            roles[tensor.name] = Role("constant", "an epsilon: added to a non-negative "
                                                  "value (a variance or a norm)")
        elif single and exporter == TF2ONNX and _is_layer_bias(tensor.name, uses, producers):
            roles[tensor.name] = Role("parameter", "a weight (the one-element bias of a layer with one output)")
        elif single and exporter:
            roles[tensor.name] = Role("constant", f"a one-element constant of a {exporter} "
                                                  f"model ({exporter} writes every constant "
                                                  f"as an initializer)")
        elif dynamo and _is_group_norm_unit(tensor.name, uses):
            roles[tensor.name] = Role("constant", "the unit scale or zero shift of the InstanceNormalization that "
                                                  "torch.onnx's dynamo exporter writes a GroupNorm as")
        elif single and dynamo and not names_torch_parameter(tensor.name, uses):
            roles[tensor.name] = Role("constant", "a one-element literal that torch.onnx's dynamo exporter wrote "
                                                  "as an initializer (no torch parameter of that name reads it)")
        else:
            roles[tensor.name] = Role("parameter", "a weight")
    return roles


def _finite(tensor: onnx.TensorProto) -> bool:
    """Whether every element of an initializer is finite (one stored outside the file is taken as finite: its
    bytes are not read here)."""
    if tensor.data_location == TensorProto.EXTERNAL:
        return True
    return bool(np.isfinite(numpy_helper.to_array(tensor).astype(np.float32, copy=False)).all())


#: Weight layers and the input index of their own bias.
_BIASED_LAYERS = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}
#: Ops whose output a bias is added to.
_LAYERS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})


def _is_layer_bias(name: str, uses: Uses, producers: dict[str, onnx.NodeProto]) -> bool:
    """Whether every use of `name` is a layer's bias: a Conv's or Gemm's bias input, or an Add to the output of a
    MatMul, Gemm or Conv (through value-preserving ops such as a Reshape)."""
    found = uses.get(name, [])

    def layer_output(value: str, depth: int = 0) -> bool:
        node = producers.get(value)
        if node is None or depth > _MAX_DEPTH:
            return False
        if node.op_type in _LAYERS:
            return True
        return node.op_type in VALUE_PRESERVING and bool(node.input) and layer_output(node.input[0], depth + 1)

    return bool(found) and all(
        index == _BIASED_LAYERS.get(node.op_type)
        or (node.op_type == "Add" and len(node.input) == 2 and layer_output(node.input[1 - index]))
        for node, index in found)


def only_running_statistics(name: str, uses: Uses) -> bool:
    """Whether `name` is read, and every reader (followed through Identities) reads it as a BatchNormalization's
    running mean or variance: rule 1's state."""
    return _only(name, uses, _is_running_statistic, follow={"Identity"})


def _is_running_statistic(node: onnx.NodeProto, index: int) -> bool:
    return node.op_type == "BatchNormalization" and index in RUNNING_STATISTICS


def _is_configuration(node: onnx.NodeProto, index: int, from_torch: bool = False) -> bool:
    if from_torch and index in TORCH_TRAINED_OPERANDS.get(node.op_type, ()):
        return False
    return node.op_type in ZERO_DERIVATIVE_OPS or \
        index in CONFIGURATION_OPERANDS.get(node.op_type, ())


def _only(name: str, uses: Uses, accepted, *, follow: frozenset[str] | set[str]) -> bool:
    """Whether `name` is used, and every use -- followed through the ops in `follow` (at
    their first input) -- is one `accepted(node, index)` accepts."""
    found = uses.get(name, [])
    if not found:
        return False
    for node, index in found:
        if accepted(node, index):
            continue
        if node.op_type in follow and index == 0 and node.output and \
                _only(node.output[0], uses, accepted, follow=follow):
            continue
        return False
    return True


def _is_stabilizer(name: str, uses: Uses, producers: dict[str, onnx.NodeProto],
                   constants: dict[str, onnx.TensorProto]) -> bool:
    """Whether every use of `name` adds it to a value that is non-negative by construction."""
    found = uses.get(name, [])
    return bool(found) and all(
        node.op_type == "Add" and len(node.input) == 2
        and _non_negative(node.input[1 - index], producers, constants)
        for node, index in found)


def _non_negative(name: str, producers: dict[str, onnx.NodeProto],
                  constants: dict[str, onnx.TensorProto], depth: int = 0) -> bool:
    """Whether the value `name` is >= 0 by the ops that compute it (a square, an absolute
    value, a square root, a norm, or a mean or sum of one of those)."""
    node = producers.get(name)
    if node is None or depth > _MAX_DEPTH:
        return False
    if node.op_type in _NON_NEGATIVE:
        return True
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return True
    if node.op_type == "Pow" and len(node.input) == 2 and node.input[1] in constants:
        exponent = numpy_helper.to_array(constants[node.input[1]])
        return exponent.size == 1 and float(exponent.reshape(-1)[0]) % 2 == 0
    if node.op_type in _SIGN_KEEPING:
        return _non_negative(node.input[0], producers, constants, depth + 1)
    return False


#: How many sign-keeping ops `_non_negative` looks back through.
_MAX_DEPTH = 8
