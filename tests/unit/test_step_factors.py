"""A Scan body's product of a state by two per-step factors, regrouped so the factors meet first
(rewrites/step_factors.py), then taken out of the loop by the stateless pass: the same values to float32
rounding, one Mul left in the body where there were two."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.helpers.lstm_fixture import assert_lstm_gradients_hold, lstm_engines
from tests.helpers.scan_models import body_ops, reverse_op_counts, scan_model
from worker_client.engine.rewrites.stateless import batch_stateless_steps
from worker_client.engine.rewrites.step_factors import regroup_step_factors

_F = TensorProto.FLOAT
STEPS, BATCH, N = 5, 3, 4


def _model(products: list[tuple[str, str, str]], outputs: list[str]) -> onnx.ModelProto:
    """A Scan with one state `s` ([BATCH, N]), scanned factors a, b, c ([BATCH, N] a step) and an outer `w` ([N]):
    the body computes `products` (Mul operands, result) in order, its next state `s_out` = the last result + s,
    and hands out `outputs` (body values) each step."""
    nodes = [helper.make_node("Mul", [x, y], [out]) for x, y, out in products]
    nodes.append(helper.make_node("Add", [products[-1][2], "s"], ["s_out"]))
    handed = []
    for name in outputs:
        nodes.append(helper.make_node("Identity", [name], [f"{name}_each"]))
        handed.append(f"{name}_each")
    body = helper.make_graph(
        nodes, "adjoint_body",
        [helper.make_tensor_value_info(name, _F, [BATCH, N]) for name in ("s", "a", "b", "c")],
        [helper.make_tensor_value_info(name, _F, [BATCH, N]) for name in ["s_out", *handed]])
    scan_outputs = ["s_final", *[f"{name}_steps" for name in outputs]]
    scan = helper.make_node("Scan", ["s0", "A", "B", "C"], scan_outputs, body=body, num_scan_inputs=3,
                            scan_input_directions=[1, 1, 1])
    return scan_model(scan, [helper.make_tensor_value_info("s0", _F, [BATCH, N])] +
                      [helper.make_tensor_value_info(name, _F, [STEPS, BATCH, N]) for name in ("A", "B", "C")] +
                      [helper.make_tensor_value_info("w", _F, [N])])


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    feeds = {"s0": rng.standard_normal((BATCH, N)).astype(np.float32), "w": rng.standard_normal(N).astype(np.float32)}
    feeds |= {name: rng.uniform(0.5, 1.5, (STEPS, BATCH, N)).astype(np.float32) for name in ("A", "B", "C")}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal to float32 rounding, against the largest value (the state adds up products of any sign)."""
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * float(np.abs(expected).max()))


@pytest.mark.parametrize("products", [
    [("s", "a", "sa"), ("sa", "b", "sab")],      # (s * a) * b
    [("a", "s", "sa"), ("b", "sa", "sab")],      # (a * s) * b, the other operand orders
    [("s", "w", "sa"), ("sa", "b", "sab")],      # a factor from outside the loop
], ids=["state_first", "state_second", "outer_factor"])
def test_a_state_times_two_factors_keeps_one_mul_in_the_body(products: list[tuple[str, str, str]]) -> None:
    model = _model(products, [])
    before = _run(model)
    assert regroup_step_factors(model) == 1
    assert batch_stateless_steps(model) == 1      # the factors' product, for all steps before the Scan
    assert body_ops(model) == ["Mul", "Add"]
    assert [n.op_type for n in model.graph.node] == ["Mul", "Scan"]
    for a, b in zip(before, _run(model)):
        _close(b, a)


def test_a_chain_of_three_factors_gathers_them_one_by_one() -> None:
    model = _model([("s", "a", "sa"), ("sa", "b", "sab"), ("c", "sab", "sabc")], [])
    before = _run(model)
    assert regroup_step_factors(model) == 2
    batch_stateless_steps(model)
    assert body_ops(model) == ["Mul", "Add"]
    for a, b in zip(before, _run(model)):
        _close(b, a)


@pytest.mark.parametrize(("products", "outputs"), [
    ([("s", "a", "sa"), ("sa", "b", "sab")], ["sa"]),                         # the inner product handed out
    ([("s", "a", "sa"), ("sa", "b", "sab"), ("sa", "c", "sac"), ("sab", "sac", "both")], []),   # read twice
    ([("s", "a", "sa"), ("s", "b", "sb"), ("sa", "sb", "both")], []),        # the second factor reads the state
    ([("s", "s", "ss"), ("ss", "b", "ssb")], []),                            # both inner operands do
    ([("a", "b", "ab"), ("ab", "c", "abc")], []),                            # neither does: the stateless pass's
], ids=["handed_out", "read_twice", "stateful_factor", "square", "stateless"])
def test_products_that_are_read_elsewhere_or_not_of_one_state_stay(products: list[tuple[str, str, str]],
                                                                   outputs: list[str]) -> None:
    model = _model(products, outputs)
    ops, before = body_ops(model), _run(model)
    assert regroup_step_factors(model) == 0
    assert body_ops(model) == ops
    for a, b in zip(before, _run(model)):
        np.testing.assert_array_equal(b, a)


def test_an_lstms_reverse_steps_lose_their_second_factors_and_its_gradients_match_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch LSTM fixture: fewer Muls in every reverse step, the gradients those of the graph built without the
    pass and torch's to float32 rounding."""
    engine, plain = lstm_engines(tmp_path, monkeypatch, "regroup_step_factors")

    def reverse_muls(built) -> list[int]:
        return reverse_op_counts(built._graph.model, "Mul")

    regrouped, plain_muls = reverse_muls(engine), reverse_muls(plain)
    assert plain_muls and len(regrouped) == len(plain_muls)
    assert all(m < p for m, p in zip(regrouped, plain_muls)), (regrouped, plain_muls)
    assert_lstm_gradients_hold(engine, plain, exact=False)
