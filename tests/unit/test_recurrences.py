"""A reverse Scan reads what the forward Scan computed at the same step instead of computing it again
(rewrites/recurrences.py): the same values, fewer nodes per step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.engines import with_and_without
from tests.helpers.lstm_fixture import assert_lstm_gradients_hold, lstm_engines
from worker_client import GradientEngine
from worker_client.engine import rewrites
from worker_client.engine.rewrites.recurrences import reuse_forward_values
_F = TensorProto.FLOAT
STEPS, BATCH, WIDTH = 5, 3, 4


def _scan_bodies(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    return [next(a.g for a in n.attribute if a.name == "body") for n in model.graph.node if n.op_type == "Scan"]


def _forward_body() -> onnx.GraphProto:
    """s' = s + tanh(x W); the state taped each step (as onnx-ad tapes a recurrent layer's states)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]),
             helper.make_node("Tanh", ["a"], ["g"]),
             helper.make_node("Add", ["s", "g"], ["s_next"]),
             helper.make_node("Identity", ["s"], ["tape_s"])]
    return helper.make_graph(nodes, "forward",
                             [helper.make_tensor_value_info("s", _F, [BATCH, WIDTH]),
                              helper.make_tensor_value_info("x", _F, [BATCH, WIDTH])],
                             [helper.make_tensor_value_info("s_next", _F, [BATCH, WIDTH]),
                              helper.make_tensor_value_info("tape_s", _F, [BATCH, WIDTH])])


def _reverse_body(also_reads_tape: bool) -> onnx.GraphProto:
    """r' = r + tanh(x W) * tanh(x W) (+ the taped state): tanh(x W) recomputed, as onnx-ad's reverse sweep does."""
    nodes = [helper.make_node("MatMul", ["rx", "w"], ["ra"]),
             helper.make_node("Tanh", ["ra"], ["rg"]),
             helper.make_node("Mul", ["rg", "rg"], ["square"]),
             helper.make_node("Add", ["r", "square"], ["r_next"])]
    inputs = [helper.make_tensor_value_info("r", _F, [BATCH, WIDTH]),
              helper.make_tensor_value_info("rx", _F, [BATCH, WIDTH])]
    outputs = [helper.make_tensor_value_info("r_next", _F, [BATCH, WIDTH]),
               helper.make_tensor_value_info("rg_out", _F, [BATCH, WIDTH])]
    nodes.append(helper.make_node("Identity", ["rg"], ["rg_out"]))
    if also_reads_tape:
        inputs.append(helper.make_tensor_value_info("rs", _F, [BATCH, WIDTH]))
        nodes[-2] = helper.make_node("Sum", ["r", "square", "rs"], ["r_next"])
    return helper.make_graph(nodes, "reverse", inputs, outputs)


def _pair(reverse_direction: int, *, tape_direction: int | None = None, reverse_steps: int = STEPS
          ) -> onnx.ModelProto:
    """A forward Scan over X and a reverse Scan over X (or a longer Y) read in `reverse_direction`, with the
    forward's tape of its state read in `tape_direction` where given."""
    forward = helper.make_node("Scan", ["s0", "X"], ["s_final", "tapes"], body=_forward_body(), num_scan_inputs=1)
    reads_tape = tape_direction is not None
    scanned = ["X" if reverse_steps == STEPS else "Y"] + (["tapes"] if reads_tape else [])
    directions = [reverse_direction] + ([tape_direction] if reads_tape else [])
    reverse = helper.make_node("Scan", ["r0", *scanned], ["r_final", "gs"], body=_reverse_body(reads_tape),
                               num_scan_inputs=len(scanned), scan_input_directions=directions)
    inputs = [helper.make_tensor_value_info("X", _F, [STEPS, BATCH, WIDTH]),
              helper.make_tensor_value_info("Y", _F, [reverse_steps, BATCH, WIDTH]),
              helper.make_tensor_value_info("s0", _F, [BATCH, WIDTH]),
              helper.make_tensor_value_info("r0", _F, [BATCH, WIDTH])]
    outputs = [helper.make_tensor_value_info(name, _F, None) for name in ("s_final", "r_final", "gs")]
    weight = numpy_helper.from_array(np.random.default_rng(1).standard_normal((WIDTH, WIDTH)).astype(np.float32), "w")
    graph = helper.make_graph([forward, reverse], "pair", inputs, outputs, [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _feeds(reverse_steps: int = STEPS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {"X": rng.standard_normal((STEPS, BATCH, WIDTH)).astype(np.float32),
            "Y": rng.standard_normal((reverse_steps, BATCH, WIDTH)).astype(np.float32),
            "s0": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
            "r0": rng.standard_normal((BATCH, WIDTH)).astype(np.float32)}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("reverse_direction, tape_direction", [(1, None), (0, None), (1, 1), (0, 0)])
def test_a_recomputed_value_is_read_from_the_forward_scan_in_either_direction(
        reverse_direction: int, tape_direction: int | None) -> None:
    model = _pair(reverse_direction, tape_direction=tape_direction)
    before = _run(model, _feeds())
    assert reuse_forward_values(model) == 2                   # the MatMul and the Tanh
    after = _run(model, _feeds())
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new, old)
    forward_body, reverse_body = _scan_bodies(model)
    assert {n.op_type for n in reverse_body.node}.isdisjoint({"MatMul", "Tanh"})
    assert len(forward_body.output) == 3                      # the state's tape and tanh(x W)'s
    taped = forward_body.output[2].type.tensor_type           # onnxruntime's Scan wants each output's shape
    assert [d.dim_value for d in taped.shape.dim] == [BATCH, WIDTH]
    assert reuse_forward_values(model) == 0                   # nothing left to take


def test_steps_matched_both_ways_at_once_or_of_another_length_are_left_alone() -> None:
    """X read backwards but the forward's tape forwards: no single step of the forward matches a reverse step."""
    model = _pair(1, tape_direction=0)
    assert reuse_forward_values(model) == 0
    longer = _pair(1, reverse_steps=STEPS + 2)
    assert reuse_forward_values(longer) == 0
    np.testing.assert_array_equal(_run(longer, _feeds(STEPS + 2))[1], _run(_pair(1, reverse_steps=STEPS + 2),
                                                                          _feeds(STEPS + 2))[1])


def test_a_recomputed_value_the_reverse_body_hands_out_as_is_is_read_under_another_name() -> None:
    model = _pair(1)
    _, reverse_body = _scan_bodies(model)
    copy = next(n for n in reverse_body.node if n.op_type == "Identity")
    reverse_body.node.remove(copy)
    for node in reverse_body.node:
        node.input[:] = ["rg_out" if name == "rg" else name for name in node.input]
        node.output[:] = ["rg_out" if name == "rg" else name for name in node.output]
    before = _run(model, _feeds())
    assert reuse_forward_values(model) == 2
    for old, new in zip(before, _run(model, _feeds()), strict=True):
        np.testing.assert_array_equal(new, old)
    _, reverse_body = _scan_bodies(model)
    assert "rg_out" not in {value.name for value in reverse_body.input}


def test_a_random_draw_is_never_taken_from_the_other_scan() -> None:
    model = _pair(1)
    for body in _scan_bodies(model):
        tanh = next(n for n in body.node if n.op_type == "Tanh")
        tanh.op_type, tanh.domain = "RandomNormalLike", ""
        tanh.attribute.extend([helper.make_attribute("dtype", _F)])
    assert reuse_forward_values(model) == 1                   # the MatMul only


def test_an_lstms_reverse_sweep_no_longer_recomputes_its_gates_and_its_gradients_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch LSTM fixture (reference gradients from torch): bit for bit the gradients of the graph built
    without the pass, and no product by the recurrent weight left in a reverse body but the adjoint's. Both
    built without batch_stateless_steps, which would move the recomputed gates out of the loop instead."""
    monkeypatch.setattr(rewrites, "batch_stateless_steps", lambda model: 0)
    engine, plain = lstm_engines(tmp_path, monkeypatch, "reuse_forward_values")

    def reverse_matmuls(built: GradientEngine) -> int:
        return sum(sum(n.op_type == "MatMul" for n in body.node)
                   for body in _scan_bodies(built._graph.model) if "adjoint" in body.name)

    assert reverse_matmuls(engine) < reverse_matmuls(plain)
    assert_lstm_gradients_hold(engine, plain)


def _recurrent_model(op: str, direction: str, extra: dict) -> tuple[onnx.ModelProto, int]:
    """One ONNX LSTM, GRU or RNN node (batch-first), its outputs averaged over time: [batch, directions * 4]."""
    rng = np.random.default_rng(3)
    directions = 2 if direction == "bidirectional" else 1
    gates, hidden, features = {"LSTM": 4, "GRU": 3, "RNN": 1}[op], 4, 5
    weights = [rng.standard_normal((directions, gates * hidden, features)).astype(np.float32) * 0.3,
               rng.standard_normal((directions, gates * hidden, hidden)).astype(np.float32) * 0.3,
               rng.standard_normal((directions, 2 * gates * hidden)).astype(np.float32) * 0.1]
    nodes = [helper.make_node(op, ["x", "W", "R", "B"], ["Y"], hidden_size=hidden, direction=direction, layout=1,
                              **extra),
             helper.make_node("ReduceMean", ["Y", "time"], ["mean"], keepdims=0),
             helper.make_node("Reshape", ["mean", "flat"], ["out"])]
    graph = helper.make_graph(
        nodes, "recurrent", [helper.make_tensor_value_info("x", _F, ["batch", STEPS, features])],
        [helper.make_tensor_value_info("out", _F, ["batch", directions * hidden])],
        [*(numpy_helper.from_array(w, name) for w, name in zip(weights, "WRB")),
         numpy_helper.from_array(np.array([1], np.int64), "time"),
         numpy_helper.from_array(np.array([-1, directions * hidden], np.int64), "flat")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model, directions * hidden


@pytest.mark.parametrize("op, direction, extra", [
    ("LSTM", "reverse", {}),
    ("LSTM", "bidirectional", {}),
    ("GRU", "bidirectional", {"linear_before_reset": 1}),
    ("RNN", "bidirectional", {}),
])
def test_every_direction_of_every_recurrent_op_reuses_its_forward_and_keeps_its_gradients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str, direction: str, extra: dict) -> None:
    """ONNX's own recurrent nodes, each direction a forward and a reverse Scan in onnx-ad's expansion: every
    reverse body shrinks, and the gradients are those of the graph built without the pass."""
    monkeypatch.setattr(rewrites, "batch_stateless_steps", lambda model: 0)   # it would move the recomputation out
    model, width = _recurrent_model(op, direction, extra)
    path = tmp_path / "recurrent.onnx"
    onnx.save(model, path)
    engine, plain = with_and_without(path, tmp_path, monkeypatch, rewrites, "reuse_forward_values", batch_size=3,
                                     loss="mse")

    def reverse_bodies(built: GradientEngine) -> list[int]:
        return [len(body.node) for body in _scan_bodies(built._graph.model) if "adjoint" in body.name]

    sizes, plain_sizes = reverse_bodies(engine), reverse_bodies(plain)
    assert len(sizes) == len(plain_sizes) == (2 if direction == "bidirectional" else 1)
    assert all(a < b for a, b in zip(sizes, plain_sizes))
    rng = np.random.default_rng(4)
    batch = {"x": rng.standard_normal((3, STEPS, 5)).astype(np.float32),
             "labels": rng.standard_normal((3, width)).astype(np.float32)}
    loss, gradients = engine.gradients(engine.parameters(), batch)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), batch)
    assert loss == plain_loss
    assert set(gradients) == {"W", "R", "B"}
    for name in gradients:
        np.testing.assert_array_equal(gradients[name], plain_gradients[name])
