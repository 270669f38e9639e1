"""Rewrite of the adjoints: SiLU's (Swish's) adjoint from its output, in four passes over the tensor instead of six.

A SiLU, y = x * s with s = Sigmoid(x) -- how torch exports nn.SiLU and TensorFlow swish, in EfficientNet,
MobileNetV3's blocks, YOLO and the gated MLPs of transformers --, gets from onnx-ad the adjoint of the product
and of the Sigmoid written out term by term:

    dx = dy * s + (dy * x) * (s * (1 - s))           six passes: 3 Muls, the Sub, one more Mul, the Add

which is dy * (s + x * s * (1 - s)) = dy * (s + y * (1 - s)), y being the forward's own output. Here that sum
is rewritten as Mul(dy, Add(s, Mul(y, 1 - s))), reusing onnx-ad's 1 - s: four passes, the same arithmetic up
to rounding (each product is regrouped: the gradients agree to float32 rounding, not bit for bit). The terms
onnx-ad wrote become dead and are pruned. Matched through the Reshapes and Unsqueezes of onnx-ad's seed axis
(values of the same size), where each of its products is read only by the next.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import SAME_DATA_OPS, Emitter, constants, reader_counts, static_shapes

__all__ = ["silu_adjoints"]


def silu_adjoints(model: onnx.ModelProto) -> int:
    """Each Add or Sum that adds a SiLU's two input-adjoint terms as onnx-ad writes them (module docstring) given
    dy * (s + y * (1 - s)) in their place, in place. Returns the number rewritten."""
    graph = model.graph
    shapes = static_shapes(model)
    fixed = constants(model)
    producers = {out: node for node in graph.node for out in node.output}
    readers = reader_counts(graph)
    emit = Emitter(model, "silu_adjoint")

    def source(name: str) -> str:
        """The value `name` hands on unchanged through same-data ops (the seed axis' Reshapes, Unsqueezes)."""
        while name in producers and producers[name].op_type in SAME_DATA_OPS and name in shapes and \
                producers[name].input[0] in shapes and \
                math.prod(shapes[producers[name].input[0]]) == math.prod(shapes[name]):
            name = producers[name].input[0]
        return name

    def product(name: str) -> tuple[str, str] | None:
        """The operands' sources of the Mul that `name` comes from, where only one node reads that Mul."""
        name = source(name)
        node = producers.get(name)
        if node is None or node.op_type != "Mul" or len(node.input) != 2 or readers[name] != 1:
            return None
        return source(node.input[0]), source(node.input[1])

    # forward SiLUs: the Sigmoid's output -> (its input x, the output y of Mul(x, s))
    sigmoids = {node.output[0]: node.input[0] for node in graph.node if node.op_type == "Sigmoid"}
    silus: dict[str, tuple[str, str]] = {}
    for node in graph.node:
        if node.op_type == "Mul" and len(node.input) == 2:
            for s, x in (node.input, node.input[::-1]):
                if sigmoids.get(s) == x:
                    silus[s] = (x, node.output[0])

    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(graph.node):
        if node.op_type not in ("Add", "Sum") or len(node.input) < 2 or node.output[0] not in shapes or \
                (node.op_type == "Add" and len(node.input) != 2):
            continue
        target = shapes[node.output[0]]
        match = _match(node, silus, product, producers, source, fixed)
        if match is None:
            continue
        terms, (dy_operand, s_operand, y, complement) = match
        if any(name not in shapes or math.prod(shapes[name]) != math.prod(target)
               for name in (dy_operand, s_operand, y, complement)) or \
                len({shapes[name] for name in (dy_operand, s_operand, *terms)} | {target}) != 1:
            continue
        nodes = []
        y_operand, complement_operand = y, complement     # the forward's values, lifted to the seed axis's shape
        if shapes[y] != target:
            lift, y_operand = emit.reshape(y, list(target))
            nodes.append(lift)
        if shapes[complement] != target:
            lift, complement_operand = emit.reshape(complement, list(target))
            nodes.append(lift)
        scaled, slope, gradient = emit.name(), emit.name(), emit.name()
        rest = [name for name in node.input if name not in terms]
        if not rest:   # the adjoint is the SiLU's alone
            gradient = node.output[0]
        nodes += [helper.make_node("Mul", [y_operand, complement_operand], [scaled], name=scaled),
                  helper.make_node("Add", [s_operand, scaled], [slope], name=slope),
                  helper.make_node("Mul", [dy_operand, slope], [gradient], name=gradient)]
        if rest:       # the other terms of the accumulation, and this one in place of the two
            summed = onnx.NodeProto()
            summed.CopyFrom(node)
            summed.ClearField("input")
            summed.input.extend([gradient, *rest])
            if len(summed.input) == 2:
                summed.op_type = "Add"
            nodes.append(summed)
        replacements[index] = nodes
    if not replacements:
        return 0
    rebuilt = []
    for index, node in enumerate(graph.node):
        rebuilt += replacements.get(index, [node])
    graph.ClearField("node")
    graph.node.extend(rebuilt)
    graph.initializer.extend(emit.initializers)
    return len(replacements)


def _match(node: onnx.NodeProto, silus: dict[str, tuple[str, str]], product, producers: dict[str, onnx.NodeProto],
           source, fixed: dict[str, np.ndarray]) -> tuple[tuple[str, str], tuple[str, str, str, str]] | None:
    """((the two terms of `node`'s inputs that are dy * s and (dy * x) * (s * (1 - s))), (dy's operand, s's
    operand -- both as the first product reads them --, the forward's y, the value 1 - s)), else None."""
    for direct, chained in itertools.permutations(dict.fromkeys(node.input), 2):
        first = _operands(direct, producers, source)
        second = product(chained)
        if first is None or second is None or product(direct) is None:
            continue
        for dy_operand, s_operand in first:
            dy, s = source(dy_operand), source(s_operand)
            if s not in silus:
                continue
            x, y = silus[s]
            for left, right in (second, second[::-1]):
                gated = product(left)          # dy * x
                slope = product(right)         # s * (1 - s)
                if gated is None or slope is None or sorted(gated) != sorted([dy, x]) or s not in slope:
                    continue
                complement = slope[1] if slope[0] == s else slope[0]
                sub = producers.get(complement)
                if sub is None or sub.op_type != "Sub" or source(sub.input[1]) != s or \
                        not _is_one(fixed.get(sub.input[0])):
                    continue
                return (direct, chained), (dy_operand, s_operand, y, complement)
    return None


def _operands(name: str, producers: dict[str, onnx.NodeProto], source) -> list[tuple[str, str]] | None:
    """The Mul behind `name`'s operands as (a, b) and (b, a), as that Mul reads them."""
    node = producers.get(source(name))
    if node is None or node.op_type != "Mul" or len(node.input) != 2:
        return None
    a, b = node.input
    return [(a, b), (b, a)]


def _is_one(value: np.ndarray | None) -> bool:
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == 1.0
