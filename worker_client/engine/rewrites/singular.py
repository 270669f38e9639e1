"""Square roots and fractional powers with torch's gradient at exactly zero: 0, not infinity.

sqrt(a) and a ** e for 0 < e < 1 have an infinite derivative at a = 0, and onnx-ad writes it as such: e * a **
(e - 1) is inf there. torch's is inf too, but torch never lets it through where a is zero for a reason: a ReLU
before it masks its adjoint with a Where (threshold_backward), so sqrt(relu(x)) gets 0 where x <= 0, and a norm's
backward fills the zero norms with 0 (linalg_vector_norm_backward). onnx-ad masks a ReLU's adjoint with a product,
g * (x > 0), and inf * 0 is NaN: an LPPool2d after a ReLU (a window of zeros), sqrt(relu(x)), or the norm of a
group of zeros gave NaN for every parameter before it, where torch's gradients are finite.

`guard_singular_zeros` (before differentiation) writes each such root or power of `a` as

    z = a == 0;   root(Where(z, 1, a)) - Cast(z)

the same value everywhere (root(1) - 1 = 0 at a = 0, root(a) - 0 elsewhere), whose derivative at a = 0 is 0:
Where's adjoint passes nothing to a there. A ReduceL2 becomes the square root of a ReduceSumSquare, guarded so.
A root of a value plus a positive constant (a normalization's variance + epsilon) cannot be zero and is left
alone.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import Emitter, Writer, constants, rebuild, shapes_and_types

__all__ = ["guard_singular_zeros"]

#: The ops the rewrite guards (a Pow only with an exponent between 0 and 1).
_ROOTS = frozenset({"Sqrt", "Pow", "ReduceL2"})


def _exponent(node: onnx.NodeProto, known: dict[str, np.ndarray]) -> float | None:
    """A Pow's exponent when it is one constant value."""
    value = known.get(node.input[1]) if len(node.input) > 1 else None
    if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.floating):
        return None
    return float(value.reshape(-1)[0])


def _stabilized(value: str, producers: dict[str, onnx.NodeProto], known: dict[str, np.ndarray]) -> bool:
    """Whether `value` is an Add of a positive constant (an epsilon) to something else."""
    node = producers.get(value)
    return node is not None and node.op_type == "Add" and any(
        name in known and known[name].size and float(np.min(known[name])) > 0 for name in node.input)


def guard_singular_zeros(model: onnx.ModelProto) -> int:
    """Each Sqrt, Pow with a constant exponent strictly between 0 and 1, and ReduceL2 of a floating-point value,
    written with a zero derivative at zero (module docstring); in place. Returns the number rewritten."""
    if not any(node.op_type in _ROOTS for node in model.graph.node):
        return 0   # no shape inference for a graph without a root (most)
    known = constants(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    types = shapes_and_types(model)[1]
    emit = Emitter(model, "singular_zero")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type == "Pow":
            exponent = _exponent(node, known)
            if exponent is None or not 0 < exponent < 1:
                return None
        elif node.op_type not in _ROOTS:
            return None
        element = types.get(node.input[0])
        if element not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16) or \
                _stabilized(node.input[0], producers, known):
            return None
        write = Writer(emit)
        base = node.input[0]
        if node.op_type == "ReduceL2":   # the root of the sum of squares, guarded below
            squares = helper.make_node("ReduceSumSquare", list(node.input), [emit.name()], name=emit.name())
            squares.attribute.extend(node.attribute)
            write.nodes.append(squares)
            base = squares.output[0]
        zero = write.node("Equal", [base, emit.scalar(0.0, element)])
        safe = write.node("Where", [zero, emit.scalar(1.0, element), base])
        root = write.node("Pow", [safe, node.input[1]]) if node.op_type == "Pow" else write.node("Sqrt", [safe])
        write.node("Sub", [root, write.node("Cast", [zero], to=element)], out=node.output[0])
        return write.nodes

    return rebuild(model, emit, replace)
