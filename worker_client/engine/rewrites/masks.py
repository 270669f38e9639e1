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

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, constants

__all__ = ["masks_as_products"]


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
