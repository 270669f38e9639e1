"""A reverse sweep's per-gate products with the recurrent weights become one product per step.

onnx-ad's reverse body of an LSTM (GRU) step computes the adjoint of the hidden state the step started
from as a sum of one product per gate: that gate's adjoint [B, H] times its recurrent weight ([H, H], the
forward's weight transposed), four (three) small GEMMs each between the Reshapes that drop and restore
onnx-ad's seed axis, and a Sum of them -- per time step. Torch's cell backward makes one GEMM of the gates
side by side. Here too:

    sum_i G_i @ W_i = [G_1 ... G_k] @ [W_1; ...; W_k]          (G_i: [B, K_i], W_i: [K_i, N])

the gates' adjoints are concatenated in the body ([B, sum K_i]) and multiplied once by the weights
stacked outside the loop (once per run, not per step). On ps_bench.zoo_models' 2-layer LSTM each
reverse step lost 9 of its 26 nodes: three GEMMs, four Reshapes and the Sum for a Concat; the GRU's
loses two of its three GEMMs (its Sum keeps the update gate's direct share).

Matched, in the body of each Scan of the main graph: a Sum (or Add) with at least two terms that are each
a Reshape of a MatMul whose first operand is a body value of two axes or more (onnx-ad's Reshape to [1, B,
K]), all alike but for the last, and whose second is a 2-D value from outside the body; every intermediate
read once; the products of one static shape and type, and so the Reshapes' results. The sum's other terms
are added to the one product. Only the summation order changes (the GEMM adds the products in its own
order): equal to float32 rounding. On the zoo models, the same graph with and without, one thread:
LSTM 13.35 -> 13.06 ms a step, bidirectional LSTM 8.60 -> 8.33, GRU 10.93 -> 10.75.
"""

from __future__ import annotations

import onnx
from onnx import helper

from worker_client.engine.rewrites.scans import (
    body_as_model,
    body_names,
    body_of,
    drop_dead_body_nodes,
    rebuild_around_scans,
)
from worker_client.engine.rewrites.toolkit import Emitter, reader_counts, replace_items, shapes_and_types

__all__ = ["merge_gate_products"]

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def merge_gate_products(model: onnx.ModelProto) -> int:
    """Rewrite each matched sum of products in the main graph's Scan bodies as one product (module
    docstring); in place. Returns the number of GEMMs removed."""
    return rebuild_around_scans(model, "gate_products", lambda scan, shapes, types, emit:
                                _merge(model, scan, shapes, types, emit))


def _merge(model: onnx.ModelProto, scan: onnx.NodeProto, shapes: dict[str, tuple[int, ...]],
           types: dict[str, int], emit: Emitter) -> tuple[int, list[onnx.NodeProto], list[onnx.NodeProto]] | None:
    """One Scan's sums of products merged: (GEMMs removed, the weights' Concats to place before it, nothing
    after it); None when there is none."""
    body = body_of(scan)
    wrapper = body_as_model(model, scan, body, shapes, types)
    if wrapper is None:
        return None
    b_shapes, b_types = shapes_and_types(wrapper)
    defined = body_names(body)
    producers = {name: node for node in body.node for name in node.output}
    readers = reader_counts(body)

    def product(name: str) -> tuple[onnx.NodeProto, onnx.NodeProto, str, str] | None:
        """(the Reshape, the MatMul, the gate's 2-D operand, the outer weight) of one term, else None."""
        back = producers.get(name)
        if back is None or back.op_type != "Reshape" or readers.get(name) != 1:
            return None
        matmul = producers.get(back.input[0])
        if matmul is None or matmul.op_type != "MatMul" or readers.get(matmul.output[0]) != 1:
            return None
        gate, weight = matmul.input
        if weight in defined or gate not in defined or len(b_shapes.get(gate, ())) < 2 or \
                len(shapes.get(weight, ())) != 2 or types.get(weight) not in _FLOATS:
            return None
        return back, matmul, gate, weight

    before: list[onnx.NodeProto] = []
    dropped: set[int] = set()
    added: dict[int, list[onnx.NodeProto]] = {}
    removed = 0
    for position, node in enumerate(body.node):
        if node.op_type not in ("Sum", "Add") or len(node.input) < 2 or len(set(node.input)) != len(node.input):
            continue
        terms = [product(name) for name in node.input]
        others = [name for name, term in zip(node.input, terms) if term is None]
        terms = [term for term in terms if term is not None]
        if len(terms) < 2:
            continue
        backs, matmuls, gates, weights = zip(*terms)
        out_shapes = {b_shapes.get(m.output[0]) for m in matmuls}
        gate_rows = {b_shapes[g][:-1] for g in gates}    # all but the gates' own axis, the last
        summed_shapes = {b_shapes.get(b.output[0]) for b in backs}
        if len(out_shapes) != 1 or None in out_shapes or len(gate_rows) != 1 or len(summed_shapes) != 1 or \
                None in summed_shapes or len({b_types.get(g) for g in gates} | {types[w] for w in weights}) != 1:
            continue
        stacked = emit.name()
        before.append(helper.make_node("Concat", list(weights), [stacked], name=stacked, axis=0))
        side_by_side, merged = emit.name(), emit.name()
        total = emit.name() if others else node.output[0]
        added[position] = [
            helper.make_node("Concat", list(gates), [side_by_side], name=side_by_side,
                             axis=len(b_shapes[gates[0]]) - 1),
            helper.make_node("MatMul", [side_by_side, stacked], [merged], name=merged),
            helper.make_node("Reshape", [merged, backs[0].input[1]], [total], name=emit.name()),
        ]
        added[position][-1].attribute.extend(backs[0].attribute)     # allowzero, where the Reshape had it
        if others:   # the sum's other terms (a GRU's update gate's share) added to the one product
            added[position].append(helper.make_node("Sum" if len(others) > 1 else "Add", [*others, total],
                                                    list(node.output), name=node.name or emit.name()))
        dropped |= {id(n) for n in (*backs, *matmuls, node)}
        removed += len(matmuls) - 1
    if not removed:
        return None
    nodes = []
    for position, node in enumerate(body.node):
        if id(node) not in dropped:
            nodes.append(node)
        nodes.extend(added.get(position, []))
    replace_items(body.node, nodes)
    drop_dead_body_nodes(body)     # the dropped Reshapes' shape constants
    return removed, before, []
