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
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.toolkit import SAME_DATA_OPS, Emitter, constants, reader_counts, rebuild, static_shapes

__all__ = ["gelu_adjoints", "silu_adjoints"]

#: GELU's constants: u = x / sqrt(2); erf's derivative 2 / sqrt(pi); 1 / sqrt(2 pi), the Gaussian density's scale.
_SQRT2 = math.sqrt(2.0)
_ERF_SLOPE = 2 / math.sqrt(math.pi)
_DENSITY = 1 / math.sqrt(2 * math.pi)


class _Adjoints:
    """The differentiated graph as both rewrites read it: values through onnx-ad's seed-axis Reshapes, the
    operands of its products, one-element constants; and the replacement of two terms of a sum."""

    def __init__(self, model: onnx.ModelProto, stem: str) -> None:
        self.model, self.graph = model, model.graph
        self.shapes = static_shapes(model)
        self.fixed = constants(model)
        self.producers = {out: node for node in self.graph.node for out in node.output}
        self.readers = reader_counts(self.graph)
        self.emit = Emitter(model, stem)

    def source(self, name: str) -> str:
        """The value `name` hands on unchanged through same-data ops (the seed axis' Reshapes, Unsqueezes)."""
        producers, shapes = self.producers, self.shapes
        while name in producers and producers[name].op_type in SAME_DATA_OPS and name in shapes and \
                producers[name].input[0] in shapes and \
                math.prod(shapes[producers[name].input[0]]) == math.prod(shapes[name]):
            name = producers[name].input[0]
        return name

    def split(self, name: str, op: str = "Mul", single: bool = True) -> tuple[str, str] | None:
        """The two operands (sources) of the `op` node that `name` comes from, read only once with `single`."""
        name = self.source(name)
        node = self.producers.get(name)
        if node is None or node.op_type != op or len(node.input) != 2 or (single and self.readers[name] != 1):
            return None
        return self.source(node.input[0]), self.source(node.input[1])

    def by_constant(self, operands: tuple[str, str] | None, constant: float, *, divisor: bool = False) -> str | None:
        """The other operand of a pair one of whose operands is the one-element `constant` (to float32
        precision); with `divisor`, only where the constant is the second operand (a Div's)."""
        if operands is None:
            return None
        for other, k in (operands,) if divisor else (operands, operands[::-1]):
            found = self.fixed.get(self.source(k))
            if found is not None and found.size == 1 and \
                    math.isclose(float(found.reshape(-1)[0]), constant, rel_tol=1e-6):
                return other
        return None

    def sums(self) -> Iterator[onnx.NodeProto]:
        """The Adds and Sums of static shape that accumulate adjoint terms."""
        for node in self.graph.node:
            if (node.op_type == "Add" and len(node.input) == 2 or node.op_type == "Sum" and len(node.input) >= 2) \
                    and node.output[0] in self.shapes:
                yield node

    def lifted(self, name: str, shape: tuple[int, ...], nodes: list[onnx.NodeProto],
               current: tuple[int, ...] | None = None) -> str:
        """`name` (a value of the forward's shape, `current` where the graph does not hold it yet) reshaped to
        `shape` (the seed axis's), the Reshape appended to `nodes`."""
        if (current or self.shapes[name]) == shape:
            return name
        lift, out = self.emit.reshape(name, list(shape))
        nodes.append(lift)
        return out

    def in_place_of(self, node: onnx.NodeProto, terms: tuple[str, str], nodes: list[onnx.NodeProto],
                    gradient: str) -> list[onnx.NodeProto]:
        """`nodes`, which compute the two `terms` of `node` as one value `gradient`, then `node` summing that with
        its other terms; `gradient` renamed to the node's output where it has no other terms."""
        rest = [name for name in node.input if name not in terms]
        if not rest:
            nodes[-1].output[0] = nodes[-1].name = node.output[0]
            return nodes
        summed = onnx.NodeProto()
        summed.CopyFrom(node)
        summed.ClearField("input")
        summed.input.extend([gradient, *rest])
        if len(summed.input) == 2:
            summed.op_type = "Add"
        return [*nodes, summed]

    def splice(self, replacements: dict[int, list[onnx.NodeProto]]) -> int:
        """Each node (by id) in `replacements` swapped for its nodes; returns how many."""
        return rebuild(self.model, self.emit, lambda node: replacements.get(id(node)))


def silu_adjoints(model: onnx.ModelProto) -> int:
    """Each Add or Sum that adds a SiLU's two input-adjoint terms as onnx-ad writes them (module docstring) given
    dy * (s + y * (1 - s)) in their place, in place. Returns the number rewritten."""
    view = _Adjoints(model, "silu_adjoint")
    # forward SiLUs: the Sigmoid's output -> (its input x, the output y of Mul(x, s))
    sigmoids = {node.output[0]: node.input[0] for node in view.graph.node if node.op_type == "Sigmoid"}
    silus: dict[str, tuple[str, str]] = {}
    for node in view.graph.node:
        if node.op_type == "Mul" and len(node.input) == 2:
            for s, x in (node.input, node.input[::-1]):
                if sigmoids.get(s) == x:
                    silus[s] = (x, node.output[0])
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for node in view.sums():
        target = view.shapes[node.output[0]]
        match = _silu_terms(node, silus, view)
        if match is None:
            continue
        terms, (dy_operand, s_operand, y, complement) = match
        if any(name not in view.shapes or math.prod(view.shapes[name]) != math.prod(target)
               for name in (dy_operand, s_operand, y, complement)) or \
                len({view.shapes[name] for name in (dy_operand, s_operand, *terms)} | {target}) != 1:
            continue
        nodes: list[onnx.NodeProto] = []
        y_operand, complement_operand = view.lifted(y, target, nodes), view.lifted(complement, target, nodes)
        scaled, slope, gradient = (view.emit.name() for _ in range(3))
        nodes += [helper.make_node("Mul", [y_operand, complement_operand], [scaled], name=scaled),
                  helper.make_node("Add", [s_operand, scaled], [slope], name=slope),
                  helper.make_node("Mul", [dy_operand, slope], [gradient], name=gradient)]
        replacements[id(node)] = view.in_place_of(node, terms, nodes, gradient)
    return view.splice(replacements)


def _silu_terms(node: onnx.NodeProto, silus: dict[str, tuple[str, str]], view: _Adjoints
                ) -> tuple[tuple[str, str], tuple[str, str, str, str]] | None:
    """((the two terms of `node`'s inputs that are dy * s and (dy * x) * (s * (1 - s))), (dy's operand, s's
    operand -- both as the first product reads them --, the forward's y, the value 1 - s)), else None."""
    for direct, chained in itertools.permutations(dict.fromkeys(node.input), 2):
        first = view.producers.get(view.source(direct))
        second = view.split(chained)
        if first is None or first.op_type != "Mul" or len(first.input) != 2 or second is None or \
                view.split(direct) is None:
            continue
        for dy_operand, s_operand in (first.input, first.input[::-1]):
            dy, s = view.source(dy_operand), view.source(s_operand)
            if s not in silus:
                continue
            x, y = silus[s]
            for left, right in (second, second[::-1]):
                gated = view.split(left)          # dy * x
                slope = view.split(right)         # s * (1 - s)
                # x as its source, as `split` gives it: a value reshaped from another (a normalization's
                # output, rewrites/group_norms.py) is read by onnx-ad through the Reshape's input
                if gated is None or slope is None or sorted(gated) != sorted([dy, view.source(x)]) or s not in slope:
                    continue
                complement = slope[1] if slope[0] == s else slope[0]
                sub = view.producers.get(complement)
                if sub is None or sub.op_type != "Sub" or view.source(sub.input[1]) != s or \
                        view.by_constant((s, sub.input[0]), 1.0) != s:
                    continue
                return (direct, chained), (dy_operand, s_operand, y, complement)
    return None


def gelu_adjoints(model: onnx.ModelProto) -> int:
    """Each GELU's input adjoint as onnx-ad writes it, dy * 0.5 * a + ((dy * 0.5 * x) * (2/sqrt(pi) * exp(-u*u)))
    / sqrt(2) -- ten passes -- rewritten as dy * (0.5 * a + x * exp(ln(1/sqrt(2 pi)) - u*u)), seven, in place.

    The GELU is torch's exact (erf) form as exported: u = x / sqrt(2) (or x times 1/sqrt(2)), a = Erf(u) + 1,
    y = x * a * 0.5; its derivative is 0.5 * a + x * phi(x), phi the standard Gaussian density, exp(-u*u)
    / sqrt(2 pi). onnx-ad's u*u is reused, its Neg, Exp and the products that become dead are pruned. The
    gradients agree to float32 rounding. Returns the number rewritten."""
    view = _Adjoints(model, "gelu_adjoint")
    gelus = _forward_gelus(view)
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for node in view.sums():
        target = view.shapes[node.output[0]]
        for terms in itertools.permutations(dict.fromkeys(node.input), 2):
            found = _gelu_terms(*terms, gelus, view)
            if found is None:
                continue
            dy_operand, (x, a, square) = found
            if view.shapes.get(dy_operand) != target or any(
                    name not in view.shapes or math.prod(view.shapes[name]) != math.prod(target)
                    for name in (x, a, square)):
                continue
            emit = view.emit
            # x and u * u as their sources: where the GELU's input is a Reshape's output (a group norm's value,
            # rewrites/group_norms.py) they have the shape it was computed in; the products take the GELU's
            nodes: list[onnx.NodeProto] = []
            shape = view.shapes[a]
            x, square = view.lifted(x, shape, nodes), view.lifted(square, shape, nodes)
            offset, halving, exponent, density, spread, half, slope, gradient = (emit.name() for _ in range(8))
            emit.initializers += [numpy_helper.from_array(np.array(math.log(_DENSITY), np.float32), offset),
                                  numpy_helper.from_array(np.array(0.5, np.float32), halving)]
            nodes += [helper.make_node("Sub", [offset, square], [exponent], name=exponent),
                      helper.make_node("Exp", [exponent], [density], name=density),
                      helper.make_node("Mul", [x, density], [spread], name=spread),
                      helper.make_node("Mul", [a, halving], [half], name=half),
                      helper.make_node("Add", [half, spread], [slope], name=slope)]
            slope = view.lifted(slope, target, nodes, current=shape)
            nodes.append(helper.make_node("Mul", [dy_operand, slope], [gradient], name=gradient))
            replacements[id(node)] = view.in_place_of(node, terms, nodes, gradient)
            break
    return view.splice(replacements)


def _forward_gelus(view: _Adjoints) -> dict[str, tuple[str, str]]:
    """The exact GELUs of the forward: {a (= Erf(u) + 1): (x, u)} where u = x / sqrt(2) (or x * 1/sqrt(2))."""
    found = {}
    for node in view.graph.node:
        if node.op_type != "Erf":
            continue
        u = node.input[0]
        x = view.by_constant(view.split(u, "Div", single=False), _SQRT2, divisor=True) or \
            view.by_constant(view.split(u, "Mul", single=False), 1 / _SQRT2)
        if x is None:
            continue
        for reader in view.graph.node:
            if reader.op_type == "Add" and node.output[0] in reader.input and \
                    view.by_constant(view.split(reader.output[0], "Add", single=False), 1.0) == node.output[0]:
                found[reader.output[0]] = (x, u)
    return found


def _gelu_terms(direct: str, chained: str, gelus: dict[str, tuple[str, str]], view: _Adjoints
                ) -> tuple[str, tuple[str, str, str]] | None:
    """(dy's operand, (x, a, u * u)) where `direct` is dm * a and `chained` is ((dm * x) * (2/sqrt(pi) *
    exp(-u*u))) / sqrt(2) (or times 1/sqrt(2)), dm = dy * 0.5 -- onnx-ad's two terms of a GELU's input
    adjoint --, else None."""
    first = view.split(direct)
    quotient = view.by_constant(view.split(chained, "Div"), _SQRT2, divisor=True) or \
        view.by_constant(view.split(chained), 1 / _SQRT2)     # du/dx as the forward wrote u: / sqrt 2 or * 1/sqrt 2
    if first is None or quotient is None:
        return None
    for dm, a in (first, first[::-1]):
        if a not in gelus:
            continue
        x, u = gelus[a]
        scaled = view.producers.get(dm)
        if scaled is None or scaled.op_type != "Mul" or view.readers[dm] != 2:   # read by dm * a and dm * x alone
            continue
        dy_operand = next((name for name, other in (scaled.input, scaled.input[::-1])
                           if view.by_constant((view.source(name), other), 0.5) == view.source(name)), None)
        product = view.split(quotient)
        if dy_operand is None or product is None:
            continue
        for left, right in (product, product[::-1]):
            if sorted(view.split(left) or ()) != sorted([dm, x]):
                continue
            exp = view.producers.get(view.by_constant(view.split(right), _ERF_SLOPE) or "")
            negated = view.producers.get(exp.input[0]) if exp is not None and exp.op_type == "Exp" else None
            square = negated.input[0] if negated is not None and negated.op_type == "Neg" else None
            if square is not None and sorted(view.split(square, single=False) or ()) == [u, u]:
                return dy_operand, (x, a, view.source(square))
    return None
