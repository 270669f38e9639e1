"""SiLU's adjoint from its output (rewrites/gates.py): the same gradients as onnx-ad's term-by-term form and as
the closed form, in fewer passes; gates that are not a SiLU left alone."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import worker_client.engine.rewrites as rewrites
from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
from worker_client.engine.rewrites import gates
from worker_client.engine.rewrites.toolkit import static_shapes

SHAPE = (4, 6, 5, 5)


def _model(gate_input: str, *, skip: bool) -> onnx.ModelProto:
    """loss = sum(x * Sigmoid(gate_input) * r), plus sum(x * q) with `skip` (x read elsewhere too)."""
    nodes = [helper.make_node("Sigmoid", [gate_input], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"]),
             helper.make_node("Mul", ["y", "r"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["gated_loss"], keepdims=0)]
    if skip:
        nodes += [helper.make_node("Mul", ["x", "q"], ["skipped"]),
                  helper.make_node("ReduceSum", ["skipped"], ["skip_loss"], keepdims=0),
                  helper.make_node("Add", ["gated_loss", "skip_loss"], ["loss"])]
    else:
        nodes.append(helper.make_node("Identity", ["gated_loss"], ["loss"]))
    graph = helper.make_graph(
        nodes, "silu",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, SHAPE) for name in ("x", "g", "r", "q")],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {name: (3 * rng.standard_normal(SHAPE)).astype(np.float32) for name in ("x", "g", "r", "q")}


def _built(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch, *, rewrite: bool) -> tuple[onnx.ModelProto, int]:
    """The gradient graph as the engine builds it, with or without the SiLU rewrite; and how many it rewrote."""
    counted = []

    def counting(graph: onnx.ModelProto) -> int:
        counted.append(gates.silu_adjoints(graph) if rewrite else 0)
        return counted[-1]

    monkeypatch.setattr(rewrites, "silu_adjoints", counting)
    derived = rewrites.rewrite_adjoints(differentiate(model, ["x", "g"], "loss"))
    return derived, sum(counted)


def _gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run([GRAD_PREFIX + "x", GRAD_PREFIX + "g"], feeds)
    return {"x": values[0].reshape(SHAPE), "g": values[1].reshape(SHAPE)}


def _full_size_muls(model: onnx.ModelProto) -> int:
    shapes = static_shapes(model)
    return sum(1 for node in model.graph.node if node.op_type in ("Mul", "Add", "Sub", "Sum")
               and math.prod(shapes.get(node.output[0], ())) == math.prod(SHAPE))


@pytest.mark.parametrize("skip", [False, True])   # with a skip connection x's adjoint sums three terms
def test_a_silu_adjoint_is_computed_from_its_output(skip: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, feeds = _model("x", skip=skip), _feeds()
    plain, none = _built(model, monkeypatch, rewrite=False)
    rewritten, count = _built(model, monkeypatch, rewrite=True)
    assert none == 0 and count == 1
    # six passes become four; beside a skip term, the new one is added to it (five)
    assert _full_size_muls(rewritten) <= _full_size_muls(plain) - (1 if skip else 2)
    x, r, q = (feeds[name].astype(np.float64) for name in ("x", "r", "q"))
    s = 1 / (1 + np.exp(-x))
    expected = r * (s + x * s * (1 - s)) + (q if skip else 0)
    got, before = _gradients(rewritten, feeds)["x"], _gradients(plain, feeds)["x"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(got, before, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_a_gate_of_another_tensor_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """x * Sigmoid(g) (a GLU's or squeeze-excitation's gate) is not a SiLU: its adjoint is not rewritten."""
    model, feeds = _model("g", skip=False), _feeds()
    rewritten, count = _built(model, monkeypatch, rewrite=True)
    assert count == 0
    x, g, r = (feeds[name].astype(np.float64) for name in ("x", "g", "r"))
    s = 1 / (1 + np.exp(-g))
    got = _gradients(rewritten, feeds)
    np.testing.assert_allclose(got["x"], r * s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["g"], r * x * s * (1 - s), rtol=1e-4, atol=1e-5 * np.abs(r * x).max())
