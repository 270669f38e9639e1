"""A Scan body's work that reads no state is done before the Scan, for all steps at once.

onnxruntime runs a Scan's body node by node once per time step. Some of a body's nodes read no state of
the loop, only what the Scan scans in and values from outside: in onnx-ad's reverse sweep of an LSTM the
gates' derivatives -- s * (1 - s) of each sigmoid, 1 - t * t of each tanh, from the values the forward
sweep taped -- and the Unsqueezes of those values onto the seed axis, 21 of the bidirectional LSTM's 51
nodes per reverse step. Each such node is the same op on the stacked steps, with the steps as a leading
axis, so it runs once before the Scan and the body reads its result as one more scanned input (a value
that reads nothing per step, as a value from outside). On ps_bench.zoo_models' bidirectional LSTM that
is one pass over [40, 32, 96] for each of those nodes instead of 40 over [32, 96].

A node moves where every input is scanned in (at axis 0, all in the same direction), moved already, a
constant or a value from outside, and where its batched form is known: elementwise ops whose stacked
operands have the node's full rank (the leading step axis then lines up, an outside operand broadcasts
as before), a MatMul of such operands, Unsqueeze, Squeeze and Reshape with constant axes or shape,
Transpose. Exact: the same arithmetic on the same values, element for element. Random ops and nodes
holding subgraphs stay.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.scans import (
    body_as_model,
    body_of,
    drop_dead_body_nodes,
    rebuild_around_scans,
    rescan_inputs,
    scan_layout,
)
from worker_client.engine.rewrites.toolkit import (
    RANDOM_OPS,
    Emitter,
    constants,
    opset_of,
    replace_items,
    set_attribute,
    shapes_and_types,
    subgraph_reads,
    subgraphs,
)

__all__ = ["batch_stateless_steps"]

#: Elementwise ops of one tensor input (any further input a scalar or outside value, checked by rank).
_UNARY = frozenset({"Abs", "Ceil", "Cos", "Elu", "Erf", "Exp", "Floor", "HardSigmoid", "Identity", "LeakyRelu",
                    "Log", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin",
                    "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "Cast", "CastLike", "Clip"})
#: Elementwise ops that broadcast their inputs numpy's way.
_BROADCASTING = frozenset({"Add", "And", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
                           "Max", "Mean", "Min", "Mod", "Mul", "Or", "Pow", "PRelu", "Sub", "Sum", "Where",
                           "Xor"})


def batch_stateless_steps(model: onnx.ModelProto) -> int:
    """Move the body nodes of each Scan of the main graph that read no state before the Scan (module
    docstring); in place. Returns the number of nodes moved."""
    outer_constants = constants(model)
    return rebuild_around_scans(model, "stateless", lambda scan, shapes, types, emit:
                                _Batch(model, scan, shapes, types, outer_constants, emit).run())


def _shifted(axes: np.ndarray | list[int]) -> list[int]:
    """A step's axes as the stacked value's (non-negative ones move one right)."""
    return [int(a) + 1 if a >= 0 else int(a) for a in np.asarray(axes).reshape(-1)]


class _Batch:
    """One Scan: which of its body's nodes move, and the outer nodes computing them for all steps."""

    def __init__(self, model: onnx.ModelProto, scan: onnx.NodeProto, shapes: dict[str, tuple[int, ...]],
                 types: dict[str, int], outer_constants: dict[str, np.ndarray], emit: Emitter) -> None:
        self.scan, self.body, self.emit = scan, body_of(scan), emit
        self.opset = opset_of(model)
        self.outer_nodes: list[onnx.NodeProto] = []
        wrapper = body_as_model(model, scan, self.body, shapes, types)
        self.ok = wrapper is not None
        if wrapper is None:
            return
        self.step_shapes, self.step_types = shapes_and_types(wrapper)
        self.values = {**outer_constants, **constants(wrapper)}
        self.states, in_axes, in_dirs, _, _ = scan_layout(scan)
        #: body value -> ("step", direction, stacked outer name) | ("outside", outer name, or None: a body
        #: constant not yet copied out)
        self.kind: dict[str, tuple] = {}
        for position in range(self.states, len(self.body.input)):
            outer = scan.input[position]
            rank = len(shapes.get(outer, ()))
            if outer and rank and in_axes[position - self.states] % rank == 0:
                self.kind[self.body.input[position].name] = ("step", in_dirs[position - self.states], outer)
        defined = {value.name for value in self.body.input} | {n for node in self.body.node for n in node.output}
        for tensor in self.body.initializer:
            self.kind[tensor.name] = ("outside", None)
            defined.add(tensor.name)
        for node in self.body.node:
            for name in [*node.input, *subgraph_reads(node)]:
                if name and name not in defined:
                    self.kind[name] = ("outside", name)

    def run(self) -> tuple[int, list[onnx.NodeProto], list[onnx.NodeProto]] | None:
        """The Scan rewritten: (the nodes moved, the nodes computing them before it, none after), or None."""
        if not self.ok:
            return None
        kept = [node for node in self.body.node if not self.try_move(node)]
        moved = len(self.body.node) - len(kept)
        if not moved:
            return None
        self.feed_back(kept)
        return moved, self.outer_nodes, []

    def outer_name(self, value: str) -> str:
        """The name before the Scan of a value a moved node reads (a body constant is copied out)."""
        kind = self.kind[value]
        if kind[0] == "step":
            return kind[2]
        if kind[1] is None:
            copy = self.emit.name(value)
            self.emit.initializers.append(numpy_helper.from_array(self.values[value], copy))
            self.kind[value] = ("outside", copy)
            return copy
        return kind[1]

    def ints(self, values: list[int]) -> str:
        name = self.emit.ints(values)
        self.kind[name] = ("outside", name)
        return name

    def try_move(self, node: onnx.NodeProto) -> bool:
        """Move `node` out when it reads no state and has a batched form (module docstring)."""
        if node.op_type == "Constant" and node.output[0] in self.values:
            self.kind[node.output[0]] = ("outside", None)    # copied out for a moved reader; the body keeps it
            return False
        if node.domain not in ("", "ai.onnx") or node.op_type in RANDOM_OPS or subgraphs(node) or not node.output:
            return False
        inputs = [name for name in node.input if name]
        if any(name not in self.kind for name in inputs) or \
                any(name and name not in self.step_types for name in node.output):
            return False
        steps = [name for name in inputs if self.kind[name][0] == "step"]
        directions = {self.kind[name][1] for name in steps}
        if len(directions) > 1:
            return False
        direction = next(iter(directions), 0)
        outer = onnx.NodeProto()
        outer.CopyFrom(node)
        if steps and not self._batched(node, outer, steps):
            return False
        outer.input[:] = [self.outer_name(name) if name else "" for name in outer.input]
        results = {name: self.emit.name(name) for name in node.output if name}
        outer.output[:] = [results.get(name, "") for name in node.output]
        outer.name = self.emit.name(node.name or node.op_type)
        self.outer_nodes.append(outer)
        for name, result in results.items():
            self.kind[name] = ("step", direction, result) if steps else ("outside", result)
        return True

    def _rank(self, name: str) -> int | None:
        if self.kind[name][0] == "outside" and name in self.values:
            return int(np.ndim(self.values[name]))
        shape = self.step_shapes.get(name)
        return None if shape is None else len(shape)

    def _batched(self, node: onnx.NodeProto, outer: onnx.NodeProto, steps: list[str]) -> bool:
        """Whether `node` has a batched form over its stacked inputs; `outer` rewritten to it."""
        op, data = node.op_type, node.input[0]
        if op in _UNARY or op in _BROADCASTING or op == "MatMul":
            if op in _UNARY and data not in steps:
                return False
            ranks = [self._rank(name) for name in node.input if name]
            if any(rank is None for rank in ranks):
                return False
            full = max(ranks)      # type: ignore[type-var]
            if any(self._rank(name) != full for name in steps):
                return False
            return op != "MatMul" or min(ranks) >= 2      # type: ignore[type-var, operator]
        if data not in steps or any(name in steps for name in node.input[1:] if name):
            return False
        rank = self._rank(data)
        if rank is None:
            return False
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Transpose":
            perm = list(attributes.get("perm", list(range(rank))[::-1]))
            set_attribute(outer, "perm", [0] + [p + 1 for p in perm])
            return True
        if op in ("Unsqueeze", "Squeeze"):
            if self.opset >= 13:
                if len(node.input) < 2 or node.input[1] not in self.values:
                    return False
                outer.input[1] = self.ints(_shifted(self.values[node.input[1]]))
                return True
            if "axes" not in attributes:
                return False
            set_attribute(outer, "axes", _shifted(attributes["axes"]))
            return True
        if op == "Reshape":
            if attributes.get("allowzero", 0) or len(node.input) < 2 or node.input[1] not in self.values:
                return False
            outer.input[1] = self.ints([0, *[int(v) for v in self.values[node.input[1]].reshape(-1)]])
            return True
        return False

    def feed_back(self, kept: list[onnx.NodeProto]) -> None:
        """The body keeps `kept`; what it still reads of the moved values comes in as scanned inputs (values
        per step) or from outside (the rest); scanned inputs nothing reads any more are dropped."""
        scan, body = self.scan, self.body
        kept_ids = {id(node) for node in kept}
        moved = {name for node in body.node if id(node) not in kept_ids for name in node.output if name}
        reads = {name for node in kept for name in [*node.input, *subgraph_reads(node)]}
        outputs = {value.name for value in body.output}
        renamed: dict[str, str] = {}
        copies: list[onnx.NodeProto] = []
        new_inputs: list[tuple[str, onnx.ValueInfoProto, int]] = []
        for name in sorted(moved & (reads | outputs)):
            kind = self.kind[name]
            if kind[0] == "outside":
                renamed[name] = kind[1]
                if name in outputs:
                    copies.append(helper.make_node("Identity", [kind[1]], [name]))
                continue
            inner = name if name not in outputs else self.emit.name(name)
            shape = self.step_shapes.get(name)
            new_inputs.append((kind[2], helper.make_tensor_value_info(
                inner, self.step_types[name], list(shape) if shape is not None else None), kind[1]))
            if name in outputs:
                copies.append(helper.make_node("Identity", [inner], [name]))
        for node in kept:
            node.input[:] = [renamed.get(name, name) for name in node.input]
        for node in kept:
            for graph in subgraphs(node):
                _rename_reads(graph, renamed)
        replace_items(body.node, [*copies, *kept])       # the copies read only inputs and outer values
        rescan_inputs(scan, body, new_inputs)
        drop_dead_body_nodes(body)          # a Constant only moved nodes read, say
        body.ClearField("value_info")


def _rename_reads(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Reads of renamed outer values inside a nested subgraph (and its own subgraphs)."""
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        for inner in subgraphs(node):
            _rename_reads(inner, renamed)
    for value in graph.output:
        if value.name in renamed:
            value.name = renamed[value.name]
