"""Rewrite of the adjoints: SiLU's and GELU's input adjoints in fewer passes over the tensor.

Each elementwise op is a pass over memory on onnxruntime's CPU kernels (its inference build has no fused
adjoint ops such as GeluGrad), and onnx-ad writes an activation's adjoint term by term.

A SiLU, y = x * s with s = Sigmoid(x) -- how torch exports nn.SiLU and TensorFlow swish, in EfficientNet,
MobileNetV3's blocks, YOLO and the gated MLPs of transformers --, gets

    dx = dy * s + (dy * x) * (s * (1 - s))           six passes: 3 Muls, the Sub, one more Mul, the Add

which is dy * (s + x * s * (1 - s)) = dy * (s + y * (1 - s)), y being the forward's own output.
`silu_adjoints` rewrites that sum as Mul(dy, Add(s, Mul(y, 1 - s))), reusing onnx-ad's 1 - s: four passes.

A GELU in its exact form, y = x * (Erf(x / sqrt 2) + 1) * 0.5 (torch's nn.GELU, in transformers' MLPs),
gets ten passes: dm = dy * 0.5, dm * a, dm * x, u * u, Neg, Exp, the erf slope, the product, / sqrt 2, the
sum. Its derivative is 0.5 * a + x * exp(-u * u) / sqrt(2 pi); `gelu_adjoints` writes that (the density's
scale folded into the exponent as a logarithm), times dy: seven passes.

Both are the same arithmetic up to rounding (the products are regrouped: the gradients agree to float32
rounding, not bit for bit). The terms onnx-ad wrote become dead and are pruned. Matched through the
Reshapes and Unsqueezes of onnx-ad's seed axis (values of the same size), where each of its products is
read only by the next; an adjoint summed with other terms (x read elsewhere too) is rewritten inside the Sum.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.toolkit import SAME_DATA_OPS, Emitter, constants, reader_counts, static_shapes

__all__ = ["gelu_adjoints", "silu_adjoints"]


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


#: GELU's constants: u = x / sqrt(2); erf's derivative 2 / sqrt(pi); 1 / sqrt(2 pi), the Gaussian density's scale.
_SQRT2 = math.sqrt(2.0)
_ERF_SLOPE = 2 / math.sqrt(math.pi)
_DENSITY = 1 / math.sqrt(2 * math.pi)


def gelu_adjoints(model: onnx.ModelProto) -> int:
    """Each GELU's input adjoint as onnx-ad writes it, dy * 0.5 * a + ((dy * 0.5 * x) * (2/sqrt(pi) * exp(-u*u)))
    / sqrt(2) -- ten passes -- rewritten as dy * (0.5 * a + x * exp(ln(1/sqrt(2 pi)) - u*u)), seven, in place.

    The GELU is torch's exact (erf) form as exported: u = x / sqrt(2) (or x times 1/sqrt(2)), a = Erf(u) + 1,
    y = x * a * 0.5; its derivative is 0.5 * a + x * phi(x), phi the standard Gaussian density, exp(-u*u)
    / sqrt(2 pi). onnx-ad's u*u is reused, its Neg, Exp and the products that become dead are pruned. The
    gradients agree to float32 rounding. Returns the number rewritten."""
    graph = model.graph
    shapes = static_shapes(model)
    fixed = constants(model)
    producers = {out: node for node in graph.node for out in node.output}
    readers = reader_counts(graph)
    emit = Emitter(model, "gelu_adjoint")

    def source(name: str) -> str:
        while name in producers and producers[name].op_type in SAME_DATA_OPS and name in shapes and \
                producers[name].input[0] in shapes and \
                math.prod(shapes[producers[name].input[0]]) == math.prod(shapes[name]):
            name = producers[name].input[0]
        return name

    def value(name: str) -> float | None:
        """The one-element constant `name` comes from, or None."""
        found = fixed.get(source(name))
        return float(found.reshape(-1)[0]) if found is not None and found.size == 1 else None

    def split(name: str, op: str, single: bool = True) -> tuple[str, str] | None:
        """The two operands (sources) of the `op` node that `name` comes from (read only once, with `single`)."""
        name = source(name)
        node = producers.get(name)
        if node is None or node.op_type != op or len(node.input) != 2 or (single and readers[name] != 1):
            return None
        return source(node.input[0]), source(node.input[1])

    def by_constant(operands: tuple[str, str] | None, constant: float, *, divisor: bool = False) -> str | None:
        """The non-constant operand of a pair whose other operand is `constant` (to float32 precision); with
        `divisor`, only where the constant is the second operand (a Div's)."""
        if operands is None:
            return None
        for other, k in (operands,) if divisor else (operands, operands[::-1]):
            found = value(k)
            if found is not None and math.isclose(found, constant, rel_tol=1e-6):
                return other
        return None

    gelus = _forward_gelus(graph, producers, by_constant, split, value)
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(graph.node):
        if node.op_type not in ("Add", "Sum") or len(node.input) < 2 or node.output[0] not in shapes or \
                (node.op_type == "Add" and len(node.input) != 2):
            continue
        target = shapes[node.output[0]]
        for direct, chained in itertools.permutations(dict.fromkeys(node.input), 2):
            found = _gelu_terms(direct, chained, gelus, split, by_constant, source, producers, readers)
            if found is None:
                continue
            dy_operand, (x, u, a, square) = found
            if shapes.get(dy_operand) != target or any(
                    name not in shapes or math.prod(shapes[name]) != math.prod(target) for name in (x, a, square)):
                continue
            offset, halving, exponent, density, spread, half, slope = (emit.name() for _ in range(7))
            emit.initializers += [numpy_helper.from_array(np.array(math.log(_DENSITY), np.float32), offset),
                                  numpy_helper.from_array(np.array(0.5, np.float32), halving)]
            nodes = [helper.make_node("Sub", [offset, square], [exponent], name=exponent),
                     helper.make_node("Exp", [exponent], [density], name=density),
                     helper.make_node("Mul", [x, density], [spread], name=spread),
                     helper.make_node("Mul", [a, halving], [half], name=half),
                     helper.make_node("Add", [half, spread], [slope], name=slope)]
            if shapes[x] != target:
                lift, slope = emit.reshape(slope, list(target))
                nodes.append(lift)
            rest = [name for name in node.input if name not in (direct, chained)]
            gradient = emit.name() if rest else node.output[0]
            nodes.append(helper.make_node("Mul", [dy_operand, slope], [gradient], name=gradient))
            if rest:
                summed = onnx.NodeProto()
                summed.CopyFrom(node)
                summed.ClearField("input")
                summed.input.extend([gradient, *rest])
                if len(summed.input) == 2:
                    summed.op_type = "Add"
                nodes.append(summed)
            replacements[index] = nodes
            break
    if not replacements:
        return 0
    rebuilt = []
    for index, node in enumerate(graph.node):
        rebuilt += replacements.get(index, [node])
    graph.ClearField("node")
    graph.node.extend(rebuilt)
    graph.initializer.extend(emit.initializers)
    return len(replacements)


def _forward_gelus(graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto], by_constant, split, value
                   ) -> dict[str, tuple[str, str, str]]:
    """The exact GELUs of the forward: {a (= Erf(u) + 1): (x, u, a)} where u = x / sqrt(2) and x * a is halved."""
    found = {}
    for node in graph.node:
        if node.op_type != "Erf":
            continue
        u = node.input[0]
        x = by_constant(split(u, "Div", single=False), _SQRT2, divisor=True)
        if x is None:
            x = by_constant(split(u, "Mul", single=False), 1 / _SQRT2)
        if x is None:
            continue
        for reader in graph.node:
            if reader.op_type == "Add" and node.output[0] in reader.input and \
                    by_constant(split(reader.output[0], "Add", single=False), 1.0) == node.output[0]:
                found[reader.output[0]] = (x, u, reader.output[0])
    return found


def _gelu_terms(direct: str, chained: str, gelus: dict[str, tuple[str, str, str]], split, by_constant, source,
                producers: dict[str, onnx.NodeProto], readers) -> tuple[str, tuple[str, str, str, str]] | None:
    """(dy's operand, (x, u, a, u * u)) where `direct` is dm * a and `chained` is ((dm * x) * (2/sqrt(pi) * exp(-u*u)))
    / sqrt(2) (or times 1/sqrt(2)), dm = dy * 0.5 -- onnx-ad's two terms of a GELU's input adjoint --, else None."""
    first = split(direct, "Mul")
    quotient = by_constant(split(chained, "Div"), _SQRT2, divisor=True) or \
        by_constant(split(chained, "Mul"), 1 / _SQRT2)     # du/dx as the forward wrote u: / sqrt 2 or * 1/sqrt 2
    if first is None or quotient is None:
        return None
    for dm, a in (first, first[::-1]):
        if a not in gelus:
            continue
        x, u, _ = gelus[a]
        scaled = producers.get(dm)
        if scaled is None or scaled.op_type != "Mul" or readers[dm] != 2:   # read by dm * a and dm * x alone
            continue
        dy_operand = next((name for name, other in (scaled.input, scaled.input[::-1])
                           if by_constant((source(name), source(other)), 0.5) == source(name)), None)
        product = split(quotient, "Mul")
        if dy_operand is None or product is None:
            continue
        for left, right in (product, product[::-1]):
            if sorted(split(left, "Mul") or ()) != sorted([dm, x]):
                continue
            exp = producers.get(by_constant(split(right, "Mul"), _ERF_SLOPE) or "")
            negated = producers.get(exp.input[0]) if exp is not None and exp.op_type == "Exp" else None
            square = negated.input[0] if negated is not None and negated.op_type == "Neg" else None
            if square is not None and sorted(split(square, "Mul", single=False) or ()) == [u, u]:
                return dy_operand, (x, u, a, source(square))
    return None
