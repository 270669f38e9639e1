"""Rewrite of the adjoints: a masked adjoint, Where(mask, adjoint, 0), as the adjoint times the mask.

onnx-ad writes the adjoint of Clip (ReLU6, Hardtanh), of Where (masked_fill), of Max and Min and of
other piecewise ops as Where(mask, g, 0) or Where(mask, 0, g). onnxruntime's CPU Where is neither
vectorized nor parallel (microsoft/onnxruntime#5896, open): on [32, 128, 16, 16] at one thread it
took 6.3 ms where a Cast of the mask and a Mul took 0.7; the depthwise model of ps_bench.zoo_models
(ReLU6 and Hardswish) spent 18 of its 180 ms in such Wheres. Here each becomes Mul(g, Cast(mask))
(or of Not(mask)), which is what onnx-ad writes itself for Relu's adjoint. A Where choosing between a
finite constant k and 0 (Clip's adjoint builds its mask so with k = 1, HardSigmoid's and Hardswish's
with their slope) is the cast mask times k, anywhere in the graph: exact, its branches being constants
(three such Wheres took 1.3 ms of the zoo mobilenet's 46 ms step; 44.8 -> 44.2 ms).

The values are the same wherever g is finite. Where g is infinite or NaN at a masked-out position
the product is NaN where Where gave 0 -- as for onnx-ad's own Relu adjoint. Only adjoints are
rewritten (nodes that depend on a seed, the inputs and initializers named with the gradient
prefix): a forward Where that hides a non-finite branch (Where(x > 0, log(x), 0)) is left as it is.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.prune import live
from worker_client.engine.rewrites.toolkit import Emitter, constants, shapes_and_types

__all__ = ["masks_as_products", "selects_as_products"]

#: The fewest elements of a Where rewritten by selects_as_products: below, the six nodes' fixed costs count.
_MIN_SELECT = 2 ** 14
_FLOAT = onnx.TensorProto.FLOAT


def masks_as_products(model: onnx.ModelProto, prefix: str) -> int:
    """Each Where of the adjoints (depending on a value named with `prefix`) whose one branch is a
    scalar zero constant and whose other branch is an adjoint, as a Mul by the cast mask, in place.
    Returns the number rewritten."""
    graph = model.graph
    fixed = constants(model)
    seeded = {value.name for value in graph.input if value.name.startswith(prefix)}
    seeded |= {tensor.name for tensor in graph.initializer if tensor.name.startswith(prefix)}
    emit = Emitter(model, "masked")
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        if any(name in seeded for name in node.input):
            seeded.update(node.output)
        if node.op_type != "Where" or len(node.input) != 3:
            nodes.append(node)
            continue
        mask, chosen, other = node.input
        select = _constant_select(fixed.get(chosen), fixed.get(other))
        if select is not None:     # Where(mask, k, 0): the cast mask, times k (Clip's and HardSigmoid's adjoints)
            keep, value = select
            factor = None if value == 1 else (chosen if keep else other)
        else:                      # Where(mask, g, 0) of an adjoint g: g times the cast mask
            factor, keep = next(((b, k) for b, z, k in ((chosen, other, True), (other, chosen, False))
                                 if b in seeded and _zero(fixed.get(z))), (None, True))
            if factor is None:
                nodes.append(node)
                continue
            value = fixed[other if keep else chosen]
        nodes += _times_mask(node, mask, keep, factor, helper.np_dtype_to_tensor_dtype(value.dtype), emit)
        changed += 1
    if changed:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return changed


def _times_mask(node: onnx.NodeProto, mask: str, keep: bool, factor: str | None, element: int,
                emit: Emitter) -> list[onnx.NodeProto]:
    """The Where's output as Cast(mask) (of Not(mask) where the value is chosen where the mask is false) of
    type `element`, times `factor` unless it is None."""
    nodes = []
    if not keep:
        flipped = emit.name()
        nodes.append(helper.make_node("Not", [mask], [flipped], name=flipped))
        mask = flipped
    if factor is None:
        return [*nodes, helper.make_node("Cast", [mask], [node.output[0]], name=node.name or emit.name(), to=element)]
    cast = emit.name()
    return [*nodes, helper.make_node("Cast", [mask], [cast], name=cast, to=element),
            helper.make_node("Mul", [factor, cast], [node.output[0]], name=node.name or emit.name())]


def _constant_select(chosen: np.ndarray | None, other: np.ndarray | None) -> tuple[bool, np.ndarray] | None:
    """(True, k) for floating-point scalar branches k and 0, (False, k) for 0 and k, k finite; else None."""
    if chosen is None or other is None or chosen.ndim or other.ndim or chosen.dtype != other.dtype \
            or not np.issubdtype(chosen.dtype, np.floating) or not (np.isfinite(chosen) and np.isfinite(other)):
        return None
    if not other.any() and chosen.any():
        return True, chosen
    if not chosen.any() and other.any():
        return False, other
    return None


def _zero(value: np.ndarray | None) -> bool:
    """Whether `value` is a floating-point scalar zero (it broadcasts into nothing: the Mul's shape is the Where's)."""
    return value is not None and value.ndim == 0 and np.issubdtype(value.dtype, np.floating) and not value.any()


def selects_as_products(model: onnx.ModelProto, prefix: str) -> int:
    """Each float32 Where of static shape that only the gradients read, one of whose branches is a whole tensor,
    as Cast(mask) * a + Cast(Not(mask)) * b, in place; for a CPU session's copy of the graph. Returns the number
    rewritten.

    onnx-ad writes the slopes of piecewise activations so -- an ELU's Where(x > 0, 1, elu(x) + 1), a PReLU's
    Where(x >= 0, 1, slope) and Where(x >= 0, 0, x) -- from forward values, then multiplies the adjoint by them.
    onnxruntime's Where takes 4-7 ns an element where a branch is a whole tensor (on [32, 64, 32, 32] at one
    thread 8.1 ms with the other a scalar, 15.2 with both whole, where the casts, two Muls and an Add take 1.8);
    with both branches smaller it is quick and is left alone. a * 1 + b * 0 is a exactly wherever the branch not
    taken is finite. Only nodes no output but a gradient (`prefix`) depends on are rewritten: a forward Where
    (an attention mask's Where(pad, -inf, scores)) keeps its op; a non-finite slope in an adjoint-only branch
    not taken (Where(x > 0, 1 / x, 0)) would give NaN where Where gave the other branch, as masks_as_products
    documents for the masked adjoints."""
    graph = model.graph
    shapes, types = shapes_and_types(model)
    fixed = constants(model)
    forward = live(graph, [value.name for value in graph.output if not value.name.startswith(prefix)])[1]
    emit = Emitter(model, "select")
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        out = node.output[0] if node.output else ""
        size = math.prod(shapes[out]) if out in shapes else 0
        if node.op_type != "Where" or len(node.input) != 3 or out in forward or types.get(out) != _FLOAT or \
                size < _MIN_SELECT or not any(math.prod(shapes.get(name, ())) == size for name in node.input[1:]) or \
                any(name in fixed and not np.all(np.isfinite(fixed[name])) for name in node.input[1:]):
            nodes.append(node)
            continue
        mask, chosen, other = node.input
        flipped, taken, left, first, second = (emit.name() for _ in range(5))
        nodes += [helper.make_node("Cast", [mask], [taken], name=taken, to=_FLOAT),
                  helper.make_node("Not", [mask], [flipped], name=flipped),
                  helper.make_node("Cast", [flipped], [left], name=left, to=_FLOAT),
                  helper.make_node("Mul", [chosen, taken], [first], name=first),
                  helper.make_node("Mul", [other, left], [second], name=second),
                  helper.make_node("Add", [first, second], [out], name=node.name or emit.name())]
        changed += 1
    if changed:
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(emit.initializers)
    return changed
