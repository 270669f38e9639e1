"""Rewrite of the adjoints: an attention's softmax row sums from its output, not from its probabilities.

The adjoint of P = Softmax(S) over the last axis is dS = P * (dP - t), t = sum_j P_ij dP_ij: onnx-ad writes t as a
Mul of P by dP and a ReduceSum, two passes over the [batch, heads, T, T] probabilities. Where P is read by a
MatMul O = P @ V (an attention's output) and dP is nothing but that MatMul's adjoint, dP = dO @ V^T, the sum is

    t_i = sum_j P_ij sum_d dO_id V_jd = sum_d dO_id O_id

a Mul and a ReduceSum over [batch, heads, T, d] instead -- the row sums FlashAttention's backward takes, d / T of
the work. At T = 256 and d = 16 (the zoo's unet_attn, batch 32, 4 heads, one thread) the two full-size passes
took 15.8 and 2.9 ms; the Sub after them then reads dP first and takes part of that time back (5.6 -> 16.5 ms:
dP comes from memory, not cache, whichever op reads it first), so the step gains 2-3%, more as T grows against
d. Where d > T / 2 the rewrite is not made: the sum over [.., T, d] would save little or nothing (a ViT's 65
tokens of 64 features a head; the zoo's prenorm, 48 tokens of 64, would do more work), and `front`, which
onnxruntime otherwise fuses into the MatMul as a transposed operand, may then be transposed on its own. Equal to
float32 rounding (the same sum taken in another order); where P reaches the MatMul through
anything else (a Dropout, a Reshape) or is read by more than the MatMul and the adjoints, dP has other terms and
the sum stays as it is. An inference-mode Dropout between them (the identity: torch's MultiheadAttention exported
as the legacy exporter writes it) is looked through.

onnx-ad's form, matched here: `front` is dO with the seed axis first; the MatMul's rule computes
left = MatMul(front, Transpose(V)), moves the seed axis back (Transpose) and the Softmax's rule reads it (after an
Expand to the same shape) as dP: ReduceSum(Mul(Unsqueeze(P), dP), [axis], keepdims=1).
"""

from __future__ import annotations

import onnx

from worker_client.engine.rewrites.toolkit import (Emitter, Writer, attribute, constants, readers_of, rebuild,
                                                   static_shapes)

__all__ = ["softmax_sums_from_outputs"]


def softmax_sums_from_outputs(model: onnx.ModelProto) -> int:
    """Each softmax adjoint's row sum over P * dP, where P feeds one attention MatMul, taken as the sum over its
    output times the output's adjoint instead (module docstring), in place; returns how many."""
    graph = model.graph
    if not any(node.op_type == "Softmax" for node in graph.node):
        return 0   # no shape inference for a graph without one
    producers = {out: node for node in graph.node for out in node.output}
    readers = readers_of(graph)
    shapes = static_shapes(model)
    values = constants(model)
    plans: dict[int, tuple[str, str, list[int]]] = {}   # id(ReduceSum) -> (front, O, seed_last perm)
    for softmax in graph.node:
        if softmax.op_type != "Softmax" or softmax.output[0] not in shapes:
            continue
        p = softmax.output[0]
        rank = len(shapes[p])
        if rank < 2 or int(attribute(softmax, "axis", -1)) % rank != rank - 1:
            continue
        read = p
        identities = [n for n in readers.get(p, []) if n.op_type == "Dropout" and _is_identity(n, values)]
        if len(identities) == 1 and len(readers.get(identities[0].output[0], [])) <= 2:
            read = identities[0].output[0]   # an inference-mode Dropout (torch's MultiheadAttention's): the identity
        forward = [n for n in readers.get(read, []) if n.op_type == "MatMul" and n.input[0] == read]
        others = [n for n in readers.get(p, []) + (readers.get(read, []) if read != p else [])
                  if n.op_type not in ("MatMul", "Unsqueeze", "Transpose") and n not in identities]
        if len(forward) != 1 or others:
            continue
        attend = forward[0]
        out, v = attend.output[0], attend.input[1]
        if shapes.get(out, ())[:-1] != shapes[p][:-1] or len(shapes.get(v, ())) != rank:
            continue   # P broadcast against V's batch axes, or a matrix-vector product: not the form matched
        if 2 * shapes[out][-1] > shapes[p][-1]:
            continue   # d > T / 2: the passes over [.., T, d] would cost about what they save (module docstring)
        for lift in readers.get(p, []):
            if lift.op_type != "Unsqueeze":
                continue
            for mul in readers.get(lift.output[0], []):
                plan = _plan(mul, lift.output[0], v, rank, producers, readers, shapes, values)
                if plan is not None:
                    reduce_sum, front, perm = plan
                    plans[id(reduce_sum)] = (front, out, perm)
    if not plans:
        return 0
    emit = Emitter(model, "row_sum")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if id(node) not in plans:
            return None
        front, out, perm = plans[id(node)]
        write = Writer(emit)
        products = write.node("Mul", [front, out])
        sums = write.node("ReduceSum", [products, emit.ints([-1])], keepdims=1)
        write.node("Transpose", [sums], node.output[0], perm=perm)
        return write.nodes

    return rebuild(model, emit, replace)


def _plan(mul: onnx.NodeProto, lifted: str, v: str, rank: int, producers: dict[str, onnx.NodeProto],
          readers: dict[str, list[onnx.NodeProto]], shapes: dict[str, tuple[int, ...]],
          values: dict) -> tuple[onnx.NodeProto, str, list[int]] | None:
    """(the ReduceSum of the softmax rule's Mul(Unsqueeze(P), dP), the seed-first dO its MatMul adjoint read, the
    perm that moves the seed axis back) where `mul` is that Mul and dP is the attention MatMul's adjoint alone."""
    if mul.op_type != "Mul" or lifted not in mul.input:
        return None
    dp = mul.input[1] if mul.input[0] == lifted else mul.input[0]
    sums = [n for n in readers.get(mul.output[0], []) if n.op_type == "ReduceSum"]
    if len(sums) != 1 or not _sums_last_axis(sums[0], rank, values):
        return None
    seed_last = producers.get(dp)
    if seed_last is not None and seed_last.op_type == "Expand":   # onnx-ad's `full`: a no-op where shapes agree
        if shapes.get(seed_last.input[0]) is None or shapes.get(seed_last.input[0]) != shapes.get(dp):
            return None
        seed_last = producers.get(seed_last.input[0])
    if seed_last is None or seed_last.op_type != "Transpose":
        return None
    left = producers.get(seed_last.input[0])
    if left is None or left.op_type != "MatMul":
        return None
    transposed_v = producers.get(left.input[1])
    if transposed_v is None or transposed_v.op_type != "Transpose" or transposed_v.input[0] != v:
        return None
    front = left.input[0]
    perm = list(attribute(seed_last, "perm", []))
    # the seed axis first in `front` and last after the perm: [S, *O's shape] -> [*P's batch and rows, .., S]
    if len(perm) != rank + 1 or perm != list(range(1, rank + 1)) + [0] or len(shapes.get(front, ())) != rank + 1:
        return None
    return sums[0], front, perm


def _is_identity(dropout: onnx.NodeProto, values: dict) -> bool:
    """Whether a Dropout is the identity: no training_mode input, or a constant false one (the engine's training
    form has written every training-mode Dropout as a Mul by its mask before this)."""
    if len(dropout.input) < 3 or not dropout.input[2]:
        return True
    flag = values.get(dropout.input[2])
    return flag is not None and not bool(flag.reshape(-1)[0])


def _sums_last_axis(node: onnx.NodeProto, rank: int, values: dict) -> bool:
    """Whether a ReduceSum over a softmax adjoint of `rank` + 1 axes (the seed last) sums P's last axis alone,
    keeping it."""
    if int(attribute(node, "keepdims", 1)) != 1:
        return False
    axes = attribute(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1] in values:
        axes = [int(a) for a in values[node.input[1]].reshape(-1)]
    return axes is not None and [a % (rank + 1) for a in axes] == [rank - 1]
