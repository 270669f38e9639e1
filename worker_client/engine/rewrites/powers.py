"""Powers by a constant exponent as products, roots and reciprocals: onnxruntime's Pow is a libm call an element.

onnxruntime's CPU Pow has fast paths for the exponents 2 and 3 alone; any other runs std::pow on every element.
onnx-ad writes the adjoint of Pow(x, e) as e * Pow(x, e - 1) * dy, so the adjoint of every square -- an
RMSNorm's (Llama, T5, Gemma), a legacy export's LayerNorm, a variance -- is a Pow(x, 1), once the exponent's
arithmetic is folded. On [32, 64, 128] float32, one thread: Pow(x, 1) 2.9 ms against 0.06 for a copy, Pow(x, 0.5)
2.9 against 0.12 for Sqrt, Pow(x, -1) 1.7-2.9 against 0.09 for Reciprocal, and even the fast path Pow(x, 2) 0.25
against 0.07 for Mul(x, x); five RMSNorm adjoints were 20 of a small Llama's 166 ms step.

Each Pow whose exponent is a constant of one element, equal to one of the exponents below, is replaced by the
same value computed from cheaper ops; a broadcast of x to more axes (an exponent of higher rank) is left alone.
The values agree with std::pow's to the rounding of a product (x * x is exactly pow(x, 2)'s correctly rounded
value; 1 / sqrt(x) within an ulp of pow(x, -0.5)); NaN, infinities and zeros come out as pow gives them, but for
the sign of the zero Sqrt(-0.0) returns (-0.0, where pow returns +0.0).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from worker_client.engine.rewrites.toolkit import Emitter, Writer, constants, rebuild, shapes_and_types

__all__ = ["powers_as_products"]

#: Float element types (onnx.TensorProto's enum): the roots and reciprocals are defined for these alone.
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


def _fourth(write: Writer, x: str, out: str) -> None:
    square = write.node("Mul", [x, x])
    write.node("Mul", [square, square], out)


#: exponent -> (whether x must be a float, the power written with a Writer: (writer, x, output name) -> None)
_FORMS: dict[float, tuple[bool, Callable[[Writer, str, str], object]]] = {
    1.0: (False, lambda w, x, out: w.node("Identity", [x], out)),
    2.0: (False, lambda w, x, out: w.node("Mul", [x, x], out)),
    3.0: (False, lambda w, x, out: w.node("Mul", [w.node("Mul", [x, x]), x], out)),
    4.0: (False, _fourth),
    0.5: (True, lambda w, x, out: w.node("Sqrt", [x], out)),
    1.5: (True, lambda w, x, out: w.node("Mul", [x, w.node("Sqrt", [x])], out)),
    -0.5: (True, lambda w, x, out: w.node("Reciprocal", [w.node("Sqrt", [x])], out)),
    -1.0: (True, lambda w, x, out: w.node("Reciprocal", [x], out)),
    -2.0: (True, lambda w, x, out: w.node("Reciprocal", [w.node("Mul", [x, x])], out)),
}


def powers_as_products(model: onnx.ModelProto) -> int:
    """Each main-graph Pow by a constant exponent of _FORMS replaced by its cheaper form, in place; returns how
    many. The exponent must be an initializer or a Constant (fold its arithmetic first)."""
    values = constants(model)
    exponents = {node.input[1]: float(values[node.input[1]].reshape(-1)[0]) for node in model.graph.node
                 if node.op_type == "Pow" and node.domain in ("", "ai.onnx") and node.input[1] in values
                 and values[node.input[1]].size == 1}
    if not any(e in _FORMS for e in exponents.values()):
        return 0
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, "power")

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type != "Pow" or node.domain not in ("", "ai.onnx") or node.input[1] not in exponents:
            return None
        form = _FORMS.get(exponents[node.input[1]])
        x = node.input[0]
        if form is None or (form[0] and types.get(x) not in _FLOATS):
            return None
        if values[node.input[1]].ndim > 0 and (x not in shapes or values[node.input[1]].ndim > len(shapes[x])):
            return None   # the exponent's axes would broadcast x to a higher rank: not the same shape as x
        write = Writer(emit)
        form[1](write, x, node.output[0])
        return write.nodes

    return rebuild(model, emit, replace)

