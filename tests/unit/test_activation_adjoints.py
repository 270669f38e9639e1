"""SiLU's and GELU's adjoints in fewer passes (rewrites/gates.py): the same gradients as onnx-ad's term-by-term
form and as the closed form; gates that are not a SiLU, and near-GELUs, left alone."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import worker_client.engine.rewrites as rewrites
from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
from worker_client.engine.rewrites import gates
from worker_client.engine.rewrites.toolkit import static_shapes

SHAPE = (4, 6, 5, 5)


def _model(gate_input: str, *, skip: bool) -> onnx.ModelProto:
    """loss = sum(x * Sigmoid(gate_input) * r), plus sum(x * q) with `skip` (x read elsewhere too)."""
    return _weighted_loss([helper.make_node("Sigmoid", [gate_input], ["s"]),
                           helper.make_node("Mul", ["x", "s"], ["y"])], skip=skip)


def _weighted_loss(activation: list[onnx.NodeProto], *, skip: bool,
                   constants: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """loss = sum(y * r) of the `activation` nodes' y (so r is y's adjoint), plus sum(x * q) with `skip`."""
    nodes = [*activation,
             helper.make_node("Mul", ["y", "r"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["activation_loss"], keepdims=0)]
    if skip:
        nodes += [helper.make_node("Mul", ["x", "q"], ["skipped"]),
                  helper.make_node("ReduceSum", ["skipped"], ["skip_loss"], keepdims=0),
                  helper.make_node("Add", ["activation_loss", "skip_loss"], ["loss"])]
    else:
        nodes.append(helper.make_node("Identity", ["activation_loss"], ["loss"]))
    graph = helper.make_graph(
        nodes, "activation",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, SHAPE) for name in ("x", "g", "r", "q")],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], list(constants))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {name: (3 * rng.standard_normal(SHAPE)).astype(np.float32) for name in ("x", "g", "r", "q")}


def _built(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch, *, rewrite: bool,
           kind: str = "silu_adjoints") -> tuple[onnx.ModelProto, int]:
    """The gradient graph as the engine builds it, with or without the rewrite `kind`; and how many it rewrote."""
    counted = []

    def counting(graph: onnx.ModelProto) -> int:
        counted.append(getattr(gates, kind)(graph) if rewrite else 0)
        return counted[-1]

    monkeypatch.setattr(rewrites, kind, counting)
    derived = rewrites.rewrite_adjoints(differentiate(model, ["x", "g"], "loss"))
    return derived, sum(counted)


def _gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run([GRAD_PREFIX + "x", GRAD_PREFIX + "g"], feeds)
    return {"x": values[0].reshape(SHAPE), "g": values[1].reshape(SHAPE)}


#: The elementwise ops a SiLU's adjoint is written with; a GELU's also Exp, Neg and Div.
ARITHMETIC = ("Mul", "Add", "Sub", "Sum")


def _passes_of(model: onnx.ModelProto, ops: tuple[str, ...] = ARITHMETIC) -> int:
    """The nodes of `ops` that write a tensor of the activation's size: each a pass over memory."""
    shapes = static_shapes(model)
    return sum(1 for node in model.graph.node if node.op_type in ops
               and math.prod(shapes.get(node.output[0], ())) == math.prod(SHAPE))


@pytest.mark.parametrize("skip", [False, True])   # with a skip connection x's adjoint sums three terms
def test_a_silu_adjoint_is_computed_from_its_output(skip: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, feeds = _model("x", skip=skip), _feeds()
    plain, none = _built(model, monkeypatch, rewrite=False)
    rewritten, count = _built(model, monkeypatch, rewrite=True)
    assert none == 0 and count == 1
    # six passes become four; beside a skip term, the new one is added to it (five)
    assert _passes_of(rewritten) <= _passes_of(plain) - (1 if skip else 2)
    x, r, q = (feeds[name].astype(np.float64) for name in ("x", "r", "q"))
    s = 1 / (1 + np.exp(-x))
    expected = r * (s + x * s * (1 - s)) + (q if skip else 0)
    got, before = _gradients(rewritten, feeds)["x"], _gradients(plain, feeds)["x"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(got, before, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_a_silu_of_a_reshaped_value_is_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SiLU's input is a Reshape's output (a group norm's value: rewrites/group_norms.py), which onnx-ad's
    terms read through the Reshape: still the SiLU's adjoint. Once through Reshapes alone, once computed in
    another shape (x as rows, times one) and reshaped."""
    for computed in (False, True):
        rows = "kept" if computed else "rows"
        model = _weighted_loss(
            [helper.make_node("Reshape", ["x", "flat"], ["rows"]),
             *([helper.make_node("Mul", ["rows", "one"], ["kept"])] if computed else []),
             helper.make_node("Reshape", [rows, "square"], ["v"]),
             helper.make_node("Sigmoid", ["v"], ["s"]),
             helper.make_node("Mul", ["v", "s"], ["y"])], skip=False,
            constants=[numpy_helper.from_array(np.array([SHAPE[0], -1], np.int64), "flat"),
                       numpy_helper.from_array(np.array(SHAPE, np.int64), "square"),
                       helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
        feeds = _feeds()
        plain, _ = _built(model, monkeypatch, rewrite=False)
        rewritten, count = _built(model, monkeypatch, rewrite=True)
        assert count == 1
        assert _passes_of(rewritten) <= _passes_of(plain) - 2
        np.testing.assert_allclose(_gradients(rewritten, feeds)["x"], _gradients(plain, feeds)["x"], rtol=1e-5,
                                   atol=1e-5)


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


def _gelu_model(*, scale: str = "div", constant: float = math.sqrt(2.0), skip: bool = False,
                reshaped: bool = False) -> onnx.ModelProto:
    """loss = sum(GELU(x) * r) with GELU as torch exports its exact form: x * (Erf(x / sqrt 2) + 1) * 0.5
    (`scale` "mul": x times 1 / sqrt 2); plus sum(x * q) with `skip`. With `reshaped` the GELU's input is
    computed in another shape and reshaped, as a group norm's value is (rewrites/group_norms.py): x as rows,
    times one, reshaped back."""
    k = constant if scale == "div" else 1 / constant
    v = "v" if reshaped else "x"
    shaping = [helper.make_node("Reshape", ["x", "flat"], ["rows"]),
               helper.make_node("Mul", ["rows", "one"], ["kept"]),
               helper.make_node("Reshape", ["kept", "square"], ["v"])] if reshaped else []
    return _weighted_loss(
        [*shaping,
         helper.make_node("Div" if scale == "div" else "Mul", [v, "k"], ["u"]),
         helper.make_node("Erf", ["u"], ["e"]),
         helper.make_node("Add", ["e", "one"], ["a"]),
         helper.make_node("Mul", [v, "a"], ["m"]),
         helper.make_node("Mul", ["m", "half"], ["y"])], skip=skip,
        constants=[*(helper.make_tensor(name, TensorProto.FLOAT, [], [v]) for name, v in (("k", k), ("one", 1.0),
                                                                                            ("half", 0.5))),
                   numpy_helper.from_array(np.array([SHAPE[0], -1], np.int64), "flat"),
                   numpy_helper.from_array(np.array(SHAPE, np.int64), "square")])


@pytest.mark.parametrize("scale, skip, reshaped", [("div", False, False), ("mul", False, False), ("div", True, False),
                                                   ("div", False, True), ("mul", True, True)])
def test_a_gelu_adjoint_takes_three_passes_fewer(scale: str, skip: bool, reshaped: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Also where the GELU's input is a Reshape's output, which onnx-ad's terms read through the Reshape: the
    rewrite's products then take each operand in the GELU's shape (they once mixed the two shapes, and
    onnxruntime refused the graph)."""
    model, feeds = _gelu_model(scale=scale, skip=skip, reshaped=reshaped), _feeds()
    plain, _ = _built(model, monkeypatch, rewrite=False, kind="gelu_adjoints")
    rewritten, count = _built(model, monkeypatch, rewrite=True, kind="gelu_adjoints")
    assert count == 1
    # ten passes become seven; beside a skip term, the new one is added to it
    gelu_ops = (*ARITHMETIC, "Exp", "Neg", "Div")
    assert _passes_of(rewritten, gelu_ops) <= _passes_of(plain, gelu_ops) - (2 if skip else 3)
    x, r, q = (feeds[name].astype(np.float64) for name in ("x", "r", "q"))
    erf = np.vectorize(math.erf)
    expected = r * (0.5 * (1 + erf(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)) \
        + (q if skip else 0)
    got, before = _gradients(rewritten, feeds)["x"], _gradients(plain, feeds)["x"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(got, before, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_a_near_gelu_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """x * (Erf(x / 2) + 1) * 0.5 is not a GELU (its derivative has another density): not rewritten."""
    model, feeds = _gelu_model(constant=2.0), _feeds()
    rewritten, count = _built(model, monkeypatch, rewrite=True, kind="gelu_adjoints")
    assert count == 0
    x, r = feeds["x"].astype(np.float64), feeds["r"].astype(np.float64)
    erf = np.vectorize(math.erf)
    expected = r * (0.5 * (1 + erf(x / 2)) + x * np.exp(-x * x / 4) / (2 * math.sqrt(math.pi)))
    np.testing.assert_allclose(_gradients(rewritten, feeds)["x"], expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
