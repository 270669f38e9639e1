"""A reverse step's per-gate products with the recurrent weights, summed, become one product
(rewrites/gate_products.py): the same values to float32 rounding, one GEMM left in the body."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.lstm_fixture import assert_lstm_gradients_hold, lstm_engines
from tests.helpers.scan_models import body_ops, reverse_op_counts, scan_model
from worker_client.engine.rewrites.gate_products import merge_gate_products

_F = TensorProto.FLOAT
STEPS, BATCH, K, N = 5, 3, 4, 6
GATES = 3


def _ints(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(*, weight_inside: bool = False, weight_first: bool = False, read_twice: bool = False,
           other_target: bool = False, plain_term: bool = False) -> onnx.ModelProto:
    """A Scan like a reverse LSTM sweep: per step, Sum over gates of Reshape(MatMul(Reshape(g_i), W_i)) into
    the seed axis's [B, N, 1], added to a state and handed out. The keywords break the pattern one way each."""
    nodes, outputs = [], []
    for i in range(GATES):
        weight = f"w{i}_in" if weight_inside else f"W{i}"
        if weight_inside:
            nodes.append(helper.make_node("Identity", [f"W{i}"], [weight]))
        nodes.append(helper.make_node("Reshape", [f"g{i}", "flat"], [f"rows{i}"]))
        operands = [weight, f"rows{i}"] if weight_first and i == 0 else [f"rows{i}", weight]
        nodes.append(helper.make_node("MatMul", operands, [f"prod{i}"]))
        target = "seed_other" if other_target and i == 1 else "seed"
        nodes.append(helper.make_node("Reshape", [f"prod{i}", target], [f"term{i}"]))
    terms = [f"term{i}" for i in range(GATES)]
    if plain_term:
        terms[-1] = "extra"
        nodes.append(helper.make_node("Identity", ["acc"], ["extra"]))
    nodes += [helper.make_node("Sum", terms, ["dh"]),
              helper.make_node("Add", ["acc", "dh"], ["acc_out"]),
              helper.make_node("Identity", ["dh"], ["dh_out"])]
    outputs = [helper.make_tensor_value_info("acc_out", _F, [BATCH, N, 1]),
               helper.make_tensor_value_info("dh_out", _F, [BATCH, N, 1])]
    if read_twice:
        nodes.append(helper.make_node("Identity", ["term0"], ["term0_out"]))
        outputs.append(helper.make_tensor_value_info("term0_out", _F, [BATCH, N, 1]))
    body = helper.make_graph(
        nodes, "adjoint_body",
        [helper.make_tensor_value_info("acc", _F, [BATCH, N, 1])] +
        [helper.make_tensor_value_info(f"g{i}", _F, [BATCH, K, 1]) for i in range(GATES)],
        outputs, [_ints("flat", [BATCH, K]), _ints("seed", [BATCH, N, 1]), _ints("seed_other", [BATCH, 1, N])])
    scan_outputs = ["acc_final", "dh_steps"] + (["term0_steps"] if read_twice else [])
    scan = helper.make_node("Scan", ["acc0", *[f"G{i}" for i in range(GATES)]], scan_outputs, body=body,
                            num_scan_inputs=GATES)
    return scan_model(scan, [helper.make_tensor_value_info("acc0", _F, [BATCH, N, 1])] +
                      [helper.make_tensor_value_info(f"G{i}", _F, [STEPS, BATCH, K, 1]) for i in range(GATES)] +
                      [helper.make_tensor_value_info(f"W{i}", _F, [K, N]) for i in range(GATES)])


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    feeds = {"acc0": rng.standard_normal((BATCH, N, 1)).astype(np.float32)}
    feeds |= {f"G{i}": rng.standard_normal((STEPS, BATCH, K, 1)).astype(np.float32) for i in range(GATES)}
    feeds |= {f"W{i}": rng.standard_normal((K, N)).astype(np.float32) for i in range(GATES)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_the_gates_products_summed_are_one_product_of_the_gates_side_by_side() -> None:
    model = _model()
    before = _run(model)
    assert merge_gate_products(model) == GATES - 1
    ops = body_ops(model)
    assert ops.count("MatMul") == 1 and "Sum" not in ops and ops.count("Concat") == 1, ops
    assert [n.op_type for n in model.graph.node] == ["Concat", "Scan"]     # the weights stacked once, outside
    for a, b in zip(before, _run(model)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_sums_other_terms_are_added_to_the_one_product() -> None:
    """A GRU's hidden-state adjoint: its gates' products and the update gate's direct share in one Sum."""
    model = _model(plain_term=True)
    before = _run(model)
    assert merge_gate_products(model) == GATES - 2
    ops = body_ops(model)
    assert ops.count("MatMul") == 1 and "Sum" not in ops and ops.count("Add") == 2, ops
    for a, b in zip(before, _run(model)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("broken", "merged"), [("weight_inside", 0), ("other_target", 0), ("weight_first", 1),
                                                ("read_twice", 1)])
def test_only_products_of_body_values_by_outer_weights_into_one_shape_are_merged(broken: str, merged: int) -> None:
    """Weights computed in the body, or products reshaped to different shapes: nothing merged. A product with the
    weight first, or one also read elsewhere, stays beside the merged product of the others."""
    model = _model(**{broken: True})
    before_ops, before = body_ops(model), _run(model) if broken == "read_twice" else None   # the others: no valid run
    assert merge_gate_products(model) == merged
    ops = body_ops(model)
    if not merged:
        assert ops == before_ops
        return
    assert ops.count("MatMul") == 2 and ops.count("Concat") == 1, ops
    if before is not None:
        for a, b in zip(before, _run(model)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_an_lstms_reverse_steps_make_one_product_each_and_its_gradients_match_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch LSTM fixture: one GEMM per reverse step where there were four, the gradients those of the graph
    built without the pass and torch's to float32 rounding."""
    engine, plain = lstm_engines(tmp_path, monkeypatch, "merge_gate_products")

    def reverse_products(built) -> list[int]:
        return reverse_op_counts(built._graph.model, "MatMul")

    assert reverse_products(plain) and all(count == 4 for count in reverse_products(plain)), reverse_products(plain)
    assert all(count == 1 for count in reverse_products(engine)), reverse_products(engine)
    assert_lstm_gradients_hold(engine, plain, exact=False)
