"""A Scan body's products of a state by two per-step factors regrouped, so that the factors meet before the loop.

onnx-ad's reverse LSTM (GRU) step multiplies the adjoint flowing back through the cell by one taped factor and
the result by another -- (acc * dσ(f)) * c for the forget gate's input, (acc * o) * (1 - tanh² c) for the
cell -- eleven Muls a step in the 2-layer LSTM of ps_bench.zoo_models, five of them such pairs. The second
factor reads no state either, so Mul(Mul(s, a), b) is Mul(s, Mul(a, b)): the inner product now reads no state
and `stateless.batch_stateless_steps` (which runs after this) computes it for all steps at once before the
Scan, and the body keeps one Mul of the two. The same for a chain of three or more factors (they gather one
by one) and for either operand order.

Matched in the body of each Scan of the main graph: a Mul whose one operand is the output of another Mul read
by nothing else (not a body output either), where that inner Mul's other operand and the outer Mul's other
operand read no state of the loop (they depend only on scanned inputs, values from outside and constants).
The inner Mul's output name is reused for the factors' product, so no name is added to the body.
Multiplication regrouped: equal to float32 rounding, not bit for bit (the product is broadcast the same way).
"""

from __future__ import annotations

import onnx

from worker_client.engine.rewrites.scans import body_of, main_scans, scan_layout
from worker_client.engine.rewrites.toolkit import reader_counts, replace_items, subgraph_reads

__all__ = ["regroup_step_factors"]


def regroup_step_factors(model: onnx.ModelProto) -> int:
    """Regroup the products of each Scan body of the main graph (module docstring), in place. Returns the
    number of products regrouped."""
    return sum(_regroup(body_of(scan), scan_layout(scan)[0]) for scan in main_scans(model))


def _stateful(body: onnx.GraphProto, states: int) -> set[str]:
    """The body's values that depend on a state of the loop (the first `states` body inputs)."""
    stateful = {value.name for value in body.input[:states]}
    for node in body.node:   # a graph's nodes are in topological order
        if any(name in stateful for name in node.input) or subgraph_reads(node) & stateful:
            stateful.update(node.output)
    return stateful


def _regroup(body: onnx.GraphProto, states: int) -> int:
    regrouped = 0
    while (found := _next_pair(body, states)) is not None:
        outer, side, inner, state, first, second = found
        # the inner Mul becomes the factors' product (its output has no other reader); it is already ahead
        # of the outer Mul, and both factors are defined ahead of the outer Mul: move it just before it
        del inner.input[:]
        inner.input.extend([first, second])
        outer.input[1 - side] = state
        outer.input[side] = inner.output[0]
        nodes = [node for node in body.node if node is not inner]
        position = next(i for i, node in enumerate(nodes) if node is outer)
        nodes.insert(position, inner)
        replace_items(body.node, nodes)
        regrouped += 1
    return regrouped


def _next_pair(body: onnx.GraphProto, states: int) -> tuple[onnx.NodeProto, int, onnx.NodeProto, str, str, str] | None:
    """The first Mul(Mul(s, a), b) of the body to regroup: (the outer Mul, the side its inner Mul is on, the
    inner Mul, s, a, b), or None."""
    stateful = _stateful(body, states)
    readers = reader_counts(body)
    producers = {name: node for node in body.node for name in node.output}
    for outer in body.node:
        if outer.op_type != "Mul" or outer.domain not in ("", "ai.onnx") or len(outer.input) != 2:
            continue
        for side in (0, 1):
            inner = producers.get(outer.input[side])
            factor = outer.input[1 - side]
            if inner is None or inner.op_type != "Mul" or inner.domain not in ("", "ai.onnx") or \
                    readers[inner.output[0]] != 1 or factor in stateful:
                continue
            kept = [name for name in inner.input if name in stateful]
            # exactly one operand reads state (with neither, the stateless pass takes the product whole)
            if len(kept) == 1:
                return outer, side, inner, kept[0], next(n for n in inner.input if n != kept[0]), factor
    return None
