"""The adjoint passes inside Scan bodies (rewrites/scans.py) and the no-op layout ops they drop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.engines import with_and_without
from worker_client import GradientEngine
from worker_client.engine import rewrites
from worker_client.engine.rewrites.layout import drop_no_op_layout_ops
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.scans import rewrite_scan_bodies

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torch"


def test_no_op_expands_identities_and_size_one_transposes_go_and_the_values_stay() -> None:
    shape = [3, 4, 1]
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]),                 # to the shape it has
             helper.make_node("Identity", ["e"], ["i"]),
             helper.make_node("Transpose", ["i"], ["t"], perm=[2, 0, 1]),       # moves only the size-1 axis
             helper.make_node("Transpose", ["x"], ["swap"], perm=[1, 0, 2]),    # a real transpose: kept
             helper.make_node("Mul", ["t", "t"], ["m"]),
             helper.make_node("Identity", ["m"], ["y"]),                         # onto the output
             helper.make_node("Identity", ["swap"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 3, 1])],
                              [numpy_helper.from_array(np.array(shape, np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    feed = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    assert drop_no_op_layout_ops(model) == 5   # the Expand, the Identity, the Transpose, two output Identities
    prune(model)
    ops = [n.op_type for n in model.graph.node]
    assert sorted(ops) == ["Mul", "Reshape", "Transpose"]
    got = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    for new, old in zip(got, expected, strict=True):
        np.testing.assert_array_equal(new, old)


def test_an_output_copied_from_a_value_other_nodes_read_is_written_by_its_producer() -> None:
    """m goes out (through an Identity) and is read on by a Mul and by a second Identity onto another output:
    the Mul writes the output itself, its readers read it there, the second copy stays (an output's own
    name cannot be two values), and every output keeps its value."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["m"]),
             helper.make_node("Identity", ["m"], ["y"]),
             helper.make_node("Add", ["m", "x"], ["z"]),
             helper.make_node("Identity", ["m"], ["w"])]
    shape = [2, 3]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name in "yzw"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    feed = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    assert drop_no_op_layout_ops(model) == 1
    assert [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == [
        ("Mul", ["x", "x"], ["y"]), ("Add", ["y", "x"], ["z"]), ("Identity", ["y"], ["w"])]
    got = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    for new, old in zip(got, expected, strict=True):
        np.testing.assert_array_equal(new, old)


def test_a_value_a_subgraph_reads_is_not_bypassed() -> None:
    """An Identity whose output a Scan body captures keeps its node (the body reads that name)."""
    body = helper.make_graph([helper.make_node("Add", ["state", "captured"], ["next"]),
                              helper.make_node("Identity", ["next"], ["out"])], "body",
                             [helper.make_tensor_value_info("state", TensorProto.FLOAT, [2])],
                             [helper.make_tensor_value_info("next", TensorProto.FLOAT, [2]),
                              helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Identity", ["x"], ["captured"]),
             helper.make_node("Scan", ["x"], ["final", "steps"], body=body, num_scan_inputs=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("final", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert drop_no_op_layout_ops(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Identity", "Scan"]


def _body_sizes(engine: GradientEngine) -> list[int]:
    return [len(next(a.g for a in n.attribute if a.name == "body").node)
            for n in engine._graph.model.graph.node if n.op_type == "Scan"]


def test_the_reverse_scan_of_an_lstm_runs_fewer_nodes_per_step_and_its_gradients_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch LSTM fixture (its gradients checked against torch's here and in test_exporter_fixtures.py):
    its Scan bodies, against the same graph built without the pass; applied again, nothing is left to drop.
    Both built without hoisting the accumulators or merging the gates' products (which regroup sums): the
    gradients are then bit for bit."""
    monkeypatch.setattr(rewrites, "hoist_scan_accumulators", lambda model: 0)
    monkeypatch.setattr(rewrites, "merge_gate_products", lambda model: 0)
    data = np.load(FIXTURES / "lstm_reader.npz")
    inputs = {k[len("input:"):]: data[k] for k in data.files if k.startswith("input:")}
    inputs["labels"] = data["labels"]

    engine, plain = with_and_without(FIXTURES / "lstm_reader.onnx", tmp_path, monkeypatch, rewrites,
                                     "rewrite_scan_bodies", batch_size=len(inputs["labels"]), loss="cross_entropy")
    sizes, plain_sizes = _body_sizes(engine), _body_sizes(plain)
    assert len(sizes) == len(plain_sizes) >= 2
    assert all(a <= b for a, b in zip(sizes, plain_sizes)) and sum(sizes) < sum(plain_sizes)
    again = onnx.ModelProto()
    again.CopyFrom(engine._graph.model)
    assert rewrite_scan_bodies(again, [prune, drop_no_op_layout_ops, prune]) == 0
    loss, gradients = engine.gradients(engine.parameters(), inputs)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), inputs)
    assert loss == plain_loss
    reference = {k[len("grad:"):]: data[k] for k in data.files if k.startswith("grad:")}
    for name, expected in reference.items():
        np.testing.assert_array_equal(gradients[name], plain_gradients[name])
        np.testing.assert_allclose(gradients[name], expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
