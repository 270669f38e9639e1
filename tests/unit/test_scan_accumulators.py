"""A Scan state that sums one matrix product per step becomes one product after the Scan
(rewrites/accumulators.py): the same values to float32 rounding, the product gone from the body."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.lstm_fixture import assert_lstm_gradients_hold, lstm_engines
from tests.helpers.scan_models import body_ops, reverse_op_counts
from worker_client import GradientEngine
from worker_client.engine.rewrites import accumulators
from worker_client.engine.rewrites.accumulators import hoist_scan_accumulators

_F = TensorProto.FLOAT
STEPS, BATCH, ROWS, COLS = 6, 3, 4, 5


def _body(nodes: list[onnx.NodeProto], inputs: list[tuple[str, list[int]]],
          outputs: list[tuple[str, list[int]]]) -> onnx.GraphProto:
    return helper.make_graph(nodes, "body", [helper.make_tensor_value_info(n, _F, s) for n, s in inputs],
                             [helper.make_tensor_value_info(n, _F, s) for n, s in outputs])


def _model(body: onnx.GraphProto, states: list[str], scanned: list[str], outputs: list[str],
           directions: list[int] | None = None, output_directions: list[int] | None = None,
           initializers: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:
    attributes: dict = {"num_scan_inputs": len(scanned)}
    if directions:
        attributes["scan_input_directions"] = directions
    if output_directions:
        attributes["scan_output_directions"] = output_directions
    scan = helper.make_node("Scan", [*states, *scanned], outputs, body=body, **attributes)
    inputs = [helper.make_tensor_value_info("A", _F, [STEPS, BATCH, ROWS]),
              helper.make_tensor_value_info("B", _F, [STEPS, BATCH, COLS]),
              helper.make_tensor_value_info("init", _F, [ROWS, COLS]),
              helper.make_tensor_value_info("init3", _F, [ROWS, COLS, 1])]
    graph = helper.make_graph([scan], "scan", inputs, [helper.make_tensor_value_info(n, _F, None) for n in outputs],
                              initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"A": rng.standard_normal((STEPS, BATCH, ROWS)).astype(np.float32),
            "B": rng.standard_normal((STEPS, BATCH, COLS)).astype(np.float32),
            "init": rng.standard_normal((ROWS, COLS)).astype(np.float32),
            "init3": rng.standard_normal((ROWS, COLS, 1)).astype(np.float32)}


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _feeds()
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def _states(model: onnx.ModelProto) -> int:
    scan = next(n for n in model.graph.node if n.op_type == "Scan")
    return len(scan.input) - next(a.i for a in scan.attribute if a.name == "num_scan_inputs")


def _hoisted_equal(model: onnx.ModelProto, hoisted: int) -> onnx.ModelProto:
    """The model rewritten: `hoisted` states gone, every output as before to float32 rounding."""
    before = _run(model)
    states = _states(model)
    assert hoist_scan_accumulators(model) == hoisted
    assert _states(model) == states - hoisted
    after = _run(model)
    assert len(after) == len(before)
    for x, y in zip(before, after):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
    return model


def _gradient_like_body(left_transposed: bool, right_transposed: bool, state_shape: list[int]) -> onnx.GraphProto:
    """acc' = acc + P @ Q with P = a^T (or a computed [ROWS, BATCH] value) and Q = tanh(b) (or its transpose
    of a [COLS, BATCH] value); tanh(b) also handed out per step."""
    nodes = [helper.make_node("Tanh", ["b"], ["g"]), helper.make_node("Identity", ["g"], ["g_out"])]
    if left_transposed:
        nodes.append(helper.make_node("Transpose", ["a"], ["p"], perm=[1, 0]))
    else:       # a [ROWS, BATCH] matrix the body computes, not a transpose
        nodes += [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
                  helper.make_node("Sigmoid", ["at"], ["p"])]
    if right_transposed:       # Q = (g^T)^T read through a Transpose of a computed [COLS, BATCH] value
        nodes += [helper.make_node("Transpose", ["g"], ["gt"], perm=[1, 0]),
                  helper.make_node("Neg", ["gt"], ["ngt"]),
                  helper.make_node("Transpose", ["ngt"], ["q"], perm=[1, 0])]
    else:
        nodes.append(helper.make_node("Identity", ["g"], ["q"]))
    nodes += [helper.make_node("MatMul", ["p", "q"], ["pq"]),
              helper.make_node("Reshape", ["pq", "state_shape"], ["term"]),
              helper.make_node("Add", ["acc", "term"], ["acc_next"])]
    body = _body(nodes, [("acc", state_shape), ("a", [BATCH, ROWS]), ("b", [BATCH, COLS])],
                 [("acc_next", state_shape), ("g_out", [BATCH, COLS])])
    body.initializer.append(numpy_helper.from_array(np.array(state_shape, np.int64), "state_shape"))
    return body


@pytest.mark.parametrize("left_transposed, right_transposed", [(True, False), (False, False), (True, True),
                                                               (False, True)])
@pytest.mark.parametrize("direction", [0, 1])
def test_an_accumulated_product_is_one_product_after_the_scan(left_transposed: bool, right_transposed: bool,
                                                              direction: int) -> None:
    """Every layout of the two operands, the steps scanned forward or backward: the sum is the same, the
    state and its MatMul leave the body."""
    body = _gradient_like_body(left_transposed, right_transposed, [ROWS, COLS, 1])
    model = _model(body, ["init3"], ["A", "B"], ["acc", "gs"], directions=[direction, direction])
    _hoisted_equal(model, 1)
    assert "MatMul" not in body_ops(model)
    producer = next(n for n in model.graph.node if "acc" in n.output)
    assert producer.op_type == "Add"        # the initial value added to the product of the stacked steps


def test_an_initial_value_that_is_not_zeros_is_added_and_zeros_are_not() -> None:
    body = _gradient_like_body(True, False, [ROWS, COLS])
    model = _model(body, ["init"], ["A", "B"], ["acc", "gs"])
    _hoisted_equal(model, 1)
    assert [n.op_type for n in model.graph.node].count("Add") == 1

    zeros = numpy_helper.from_array(np.zeros((ROWS, COLS), np.float32), "zeros")
    model = _model(_gradient_like_body(True, False, [ROWS, COLS]), ["zeros"], ["A", "B"], ["acc", "gs"],
                   initializers=[zeros])
    _hoisted_equal(model, 1)
    assert "Add" not in [n.op_type for n in model.graph.node]


def test_operands_stacked_in_opposite_orders_are_aligned_step_by_step() -> None:
    """a scanned backward, tanh(b) handed out forward already: the product pairs step t with step t."""
    body = _gradient_like_body(True, False, [ROWS, COLS])
    model = _model(body, ["init"], ["A", "B"], ["acc", "gs"], directions=[1, 0], output_directions=[0])
    _hoisted_equal(model, 1)


def test_a_state_that_is_read_elsewhere_or_sums_no_product_of_per_step_values_stays() -> None:
    body = _gradient_like_body(True, False, [ROWS, COLS])
    body.node.append(helper.make_node("ReduceSum", ["acc"], ["total"], keepdims=0))   # the state read again
    body.output.append(helper.make_tensor_value_info("total", _F, []))
    _hoisted_equal(_model(body, ["init"], ["A", "B"], ["acc", "gs", "totals"]), 0)

    # the term is a function of a product, not a product
    nodes = [helper.make_node("Tanh", ["b"], ["g"]), helper.make_node("Transpose", ["a"], ["a_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["a_t", "g"], ["pq"]), helper.make_node("Sigmoid", ["pq"], ["term"]),
             helper.make_node("Add", ["acc", "term"], ["acc_next"])]
    squashed = _body(nodes, [("acc", [ROWS, COLS]), ("a", [BATCH, ROWS]), ("b", [BATCH, COLS])],
                     [("acc_next", [ROWS, COLS])])
    _hoisted_equal(_model(squashed, ["init"], ["A", "B"], ["acc"]), 0)

    # one operand the same every step (a weight from outside): nothing to stack
    weight = numpy_helper.from_array(np.ones((BATCH, COLS), np.float32), "w")
    captured = _body([nodes[1], helper.make_node("MatMul", ["a_t", "w"], ["pq"]),
                      helper.make_node("Add", ["acc", "pq"], ["acc_next"])],
                     [("acc", [ROWS, COLS]), ("a", [BATCH, ROWS]), ("b", [BATCH, COLS])], [("acc_next", [ROWS, COLS])])
    _hoisted_equal(_model(captured, ["init"], ["A", "B"], ["acc"], initializers=[weight]), 0)


def test_operands_too_large_to_stack_keep_their_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """tanh(b) is not stacked yet; with room for fewer elements than its steps hold, the state stays."""
    body = _gradient_like_body(True, False, [ROWS, COLS])
    body.output.pop()                      # tanh(b) no longer handed out
    monkeypatch.setattr(accumulators, "MAX_STACKED_ELEMENTS", STEPS * BATCH * COLS - 1)
    _hoisted_equal(_model(body, ["init"], ["A", "B"], ["acc"]), 0)
    monkeypatch.setattr(accumulators, "MAX_STACKED_ELEMENTS", STEPS * BATCH * COLS)
    _hoisted_equal(_model(_gradient_like_body(True, False, [ROWS, COLS]), ["init"], ["A", "B"], ["acc", "gs"]), 1)


def test_an_lstms_recurrent_weight_gradient_is_one_product_per_gate_and_matches_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch LSTM fixture: no product left in a reverse body but the hidden state's adjoint, and the
    gradients those of the graph built without the pass and torch's to float32 rounding."""
    engine, plain = lstm_engines(tmp_path, monkeypatch, "hoist_scan_accumulators")

    def reverse_products(built: GradientEngine) -> int:
        return sum(reverse_op_counts(built._graph.model, "MatMul"))

    # four gates: 4 accumulated products gone, and the 4 products of the hidden state's adjoint one (gate_products)
    assert reverse_products(plain) - reverse_products(engine) == 4 and reverse_products(engine) > 0
    assert_lstm_gradients_hold(engine, plain, exact=False)
