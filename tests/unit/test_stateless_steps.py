"""A Scan body's nodes that read no state run before the Scan, for all steps at once
(rewrites/stateless.py): the same values, bit for bit, fewer nodes per step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.lstm_fixture import assert_lstm_gradients_hold, lstm_engines
from worker_client.engine import rewrites
from worker_client.engine.rewrites.stateless import batch_stateless_steps

_F = TensorProto.FLOAT
STEPS, BATCH, WIDTH = 5, 3, 4


def _value(name: str, shape: list[int] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _F, shape)


def _model(nodes: list[onnx.NodeProto], *, direction: int = 0, body_outputs: tuple[str, ...] = ("g",),
           initializers: tuple[onnx.TensorProto, ...] = (), opset: int = 17) -> onnx.ModelProto:
    """A Scan with one state s ([BATCH, WIDTH]) and two scanned inputs x, y, read in `direction`: s' = s * q,
    where q comes out of `nodes`; `body_outputs` handed out per step."""
    body = helper.make_graph(
        [*nodes, helper.make_node("Mul", ["s", "q"], ["s_next"])], "body",
        [_value("s", [BATCH, WIDTH]), _value("x", [BATCH, WIDTH]), _value("y", [BATCH, WIDTH])],
        [_value("s_next", [BATCH, WIDTH]), *(_value(name, None) for name in body_outputs)],
        list(initializers))
    scan = helper.make_node("Scan", ["s0", "X", "Y"], ["s_final", *(f"{name}s" for name in body_outputs)],
                            body=body, num_scan_inputs=2, scan_input_directions=[direction, direction])
    weight = numpy_helper.from_array(np.random.default_rng(3).standard_normal((WIDTH, WIDTH)).astype(np.float32), "w")
    graph = helper.make_graph(
        [scan], "scan", [_value("s0", [BATCH, WIDTH]), _value("X", [STEPS, BATCH, WIDTH]),
                         _value("Y", [STEPS, BATCH, WIDTH])],
        [_value(name, None) for name in ("s_final", *(f"{n}s" for n in body_outputs))], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    feeds = {"s0": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
             "X": rng.standard_normal((STEPS, BATCH, WIDTH)).astype(np.float32),
             "Y": rng.standard_normal((STEPS, BATCH, WIDTH)).astype(np.float32)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _body(model: onnx.ModelProto) -> onnx.GraphProto:
    scan = next(n for n in model.graph.node if n.op_type == "Scan")
    return next(a.g for a in scan.attribute if a.name == "body")


def _moved_exactly(model: onnx.ModelProto, moved: int) -> onnx.ModelProto:
    before = _run(model)
    assert batch_stateless_steps(model) == moved
    after = _run(model)
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new, old)
    return model


def _derivative_nodes() -> list[onnx.NodeProto]:
    """q = unsqueeze(sigmoid(x) * (1 - sigmoid(x))) reshaped back, times tanh(x W^T) + y: all per step, no state."""
    return [helper.make_node("Sigmoid", ["x"], ["sx"]),
            helper.make_node("Sub", ["one", "sx"], ["rest"]),
            helper.make_node("Mul", ["sx", "rest"], ["d"]),
            helper.make_node("Unsqueeze", ["d", "last"], ["du"]),
            helper.make_node("Reshape", ["du", "flat"], ["dr"]),
            helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),      # reads only a weight from outside
            helper.make_node("MatMul", ["x", "wt"], ["xw"]),
            helper.make_node("Tanh", ["xw"], ["t"]),
            helper.make_node("Transpose", ["t"], ["tt"], perm=[1, 0]),
            helper.make_node("Transpose", ["tt"], ["t2"], perm=[1, 0]),
            helper.make_node("Add", ["t2", "y"], ["ty"]),
            helper.make_node("Mul", ["dr", "ty"], ["q"]),
            helper.make_node("Identity", ["q"], ["g"])]


def _constants() -> tuple[onnx.TensorProto, ...]:
    return (numpy_helper.from_array(np.array(1.0, np.float32), "one"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array([BATCH, WIDTH], np.int64), "flat"))


@pytest.mark.parametrize("direction", [0, 1])
def test_the_nodes_that_read_no_state_run_once_before_the_scan(direction: int) -> None:
    """Every node but the state's update moves (the weight's transpose once, the rest over the stacked steps);
    the body reads their result per step, in the Scan's direction."""
    model = _moved_exactly(_model(_derivative_nodes(), direction=direction, initializers=_constants()), 13)
    body = _body(model)
    assert sorted(n.op_type for n in body.node) == ["Identity", "Mul"]
    scan = next(n for n in model.graph.node if n.op_type == "Scan")
    directions = next(a.ints for a in scan.attribute if a.name == "scan_input_directions")
    assert set(directions) == {direction}
    assert "X" not in scan.input and "Y" not in scan.input        # read only by the moved nodes: dropped
    assert [n.op_type for n in model.graph.node][-1] == "Scan"


def test_nodes_that_read_the_state_or_mix_directions_stay() -> None:
    nodes = [helper.make_node("Tanh", ["s"], ["ts"]),                  # reads the state
             helper.make_node("Add", ["ts", "x"], ["q"]),
             helper.make_node("Identity", ["q"], ["g"])]
    _moved_exactly(_model(nodes), 0)

    mixed = _model([helper.make_node("Add", ["x", "y"], ["q"]), helper.make_node("Identity", ["q"], ["g"])])
    scan = mixed.graph.node[0]
    for attribute in scan.attribute:
        if attribute.name == "scan_input_directions":
            attribute.ints[:] = [0, 1]                                # x forward, y backward
    _moved_exactly(mixed, 0)


def test_a_random_node_a_subgraph_or_an_unknown_batched_form_stays() -> None:
    random = [helper.make_node("RandomNormalLike", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["q0"]),
              helper.make_node("Mul", ["q0", "zero"], ["q1"]), helper.make_node("Add", ["q1", "x"], ["q"]),
              helper.make_node("Identity", ["q"], ["g"])]
    model = _model(random, initializers=(numpy_helper.from_array(np.zeros((), np.float32), "zero"),))
    assert batch_stateless_steps(model) == 0
    # a reduction over a step's axis has no batched form here: it and what reads it stay
    reduced = [helper.make_node("ReduceSum", ["x", "axis"], ["r"], keepdims=1),
               helper.make_node("Add", ["r", "y"], ["q"]), helper.make_node("Identity", ["q"], ["g"])]
    _moved_exactly(_model(reduced, initializers=(numpy_helper.from_array(np.array([0], np.int64), "axis"),)), 0)


def test_a_moved_value_the_body_hands_out_is_still_handed_out_per_step() -> None:
    """q is both read by the state's update and a body output: it comes in scanned and is copied out."""
    nodes = [helper.make_node("Add", ["x", "y"], ["q"])]
    model = _moved_exactly(_model(nodes, body_outputs=("q",)), 1)
    assert sorted(n.op_type for n in _body(model).node) == ["Identity", "Mul"]


def test_a_step_value_of_lower_rank_than_an_outside_operand_stays() -> None:
    """x flattened to [12] per step moves; added to an outside [1, 12] it would meet the stacked steps' axis
    where each step broadcast against a unit axis: the Add and what follows stay."""
    nodes = [helper.make_node("Reshape", ["x", "row"], ["xf"]),
             helper.make_node("Add", ["xf", "c"], ["wide"]),
             helper.make_node("Reshape", ["wide", "flat"], ["q"]),
             helper.make_node("Identity", ["q"], ["g"])]
    constants = (numpy_helper.from_array(np.array([BATCH * WIDTH], np.int64), "row"),
                 numpy_helper.from_array(np.ones((1, BATCH * WIDTH), np.float32), "c"),
                 numpy_helper.from_array(np.array([BATCH, WIDTH], np.int64), "flat"))
    model = _moved_exactly(_model(nodes, initializers=constants), 1)
    assert [n.op_type for n in _body(model).node][:1] == ["Add"]


def test_opset_11_unsqueezes_with_axes_attributes_move_and_opset_8_scans_are_left_alone() -> None:
    nodes = [helper.make_node("Unsqueeze", ["x"], ["xu"], axes=[0]),
             helper.make_node("Squeeze", ["xu"], ["xs"], axes=[0]),
             helper.make_node("Neg", ["xs"], ["q"]), helper.make_node("Identity", ["q"], ["g"])]
    _moved_exactly(_model(nodes, opset=11), 4)
    model = _model(nodes, opset=11)
    model.opset_import[0].version = 8
    assert batch_stateless_steps(model) == 0


def test_an_lstms_gradients_are_bit_for_bit_those_without_the_pass(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch LSTM fixture: the reverse bodies lose the gates' derivatives; gradients bit for bit as built
    without the pass, and torch's to float32 rounding. Both built without merging the gates' products, which
    regroups a sum (and matches only once the pass has run)."""
    monkeypatch.setattr(rewrites, "merge_gate_products", lambda model: 0)
    engine, plain = lstm_engines(tmp_path, monkeypatch, "batch_stateless_steps")

    def reverse_nodes(built) -> int:    # type: ignore[no-untyped-def]
        return sum(len(_body_of(n).node) for n in built._graph.model.graph.node
                   if n.op_type == "Scan" and "adjoint" in _body_of(n).name)

    assert reverse_nodes(engine) < reverse_nodes(plain)
    assert_lstm_gradients_hold(engine, plain)


def _body_of(scan: onnx.NodeProto) -> onnx.GraphProto:
    return next(a.g for a in scan.attribute if a.name == "body")
