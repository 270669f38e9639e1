"""A value defined twice in a model file: torch's dynamo exporter names a node's output after its torch.fx node
("mean") and a buffer after its module path, so a buffer called like an op is defined twice and onnxruntime
refuses the file. read_model renames the later definition; every reader gets the value it meant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine import GradientEngine
from worker_client.engine.load import read_model, unique_definitions

MEAN = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def normalizing_model(path: Path) -> Path:
    """x [N, 3] -> (x - mean) @ W, then ReduceMean of that as "mean" again, read by the output and by an If's
    branch: the initializer `mean` and a node's output `mean`, as the dynamo exporter writes them."""
    rng = np.random.default_rng(0)
    then = helper.make_graph([helper.make_node("Identity", ["mean"], ["branch"])], "then", [],
                             [helper.make_tensor_value_info("branch", TensorProto.FLOAT, None)])
    otherwise = helper.make_graph([helper.make_node("Neg", ["mean"], ["branch2"])], "else", [],
                                  [helper.make_tensor_value_info("branch2", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Sub", ["x", "mean"], ["centred"]),
             helper.make_node("MatMul", ["centred", "W"], ["h"]),
             helper.make_node("ReduceMean", ["h", "axes"], ["mean"], keepdims=1),
             helper.make_node("Greater", ["one", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["picked"], then_branch=then, else_branch=otherwise),
             helper.make_node("Add", ["h", "picked"], ["y"])]
    graph = helper.make_graph(
        nodes, "normalize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(MEAN, "mean"),
         numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
         numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
         numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")],
        value_info=[helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["N", 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def expected(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
    h = (x - MEAN) @ w
    return h + h.mean(axis=1, keepdims=True)


def test_onnxruntime_refuses_the_file_as_written(tmp_path):
    path = normalizing_model(tmp_path / "m.onnx")
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:   # noqa: BLE001 -- onnxruntime's own Fail class
        assert "Duplicate definition" in str(exc) and "mean" in str(exc), exc
    else:
        raise AssertionError("onnxruntime loaded a graph with a value defined twice: the test proves nothing")


def test_read_model_renames_the_later_definition_and_every_reader_gets_what_it_meant(tmp_path):
    model = read_model(normalizing_model(tmp_path / "m.onnx"))
    assert [t.name for t in model.graph.initializer][0] == "mean"   # the weight keeps its name
    reduce = next(n for n in model.graph.node if n.op_type == "ReduceMean")
    assert reduce.output[0] == "mean__2"
    assert next(n for n in model.graph.node if n.op_type == "Sub").input[1] == "mean"    # before: the weight
    branch = next(n for n in model.graph.node if n.op_type == "If").attribute[0].g.node[0]
    assert branch.input[0] == "mean__2"                                                 # after: the node's
    assert not [v for v in model.graph.value_info if v.name == "mean"]
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, expected(model, x), rtol=1e-5, atol=1e-5)


def test_a_model_without_duplicates_is_left_as_it_is(tmp_path):
    model = read_model(normalizing_model(tmp_path / "m.onnx"))
    before = model.SerializeToString()
    assert unique_definitions(model.graph) == []
    assert model.SerializeToString() == before


def test_a_third_definition_gets_a_name_of_its_own(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["a"]),
         helper.make_node("Neg", ["a"], ["a"]), helper.make_node("Identity", ["a"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    assert unique_definitions(graph) == ["a", "a"]
    assert [list(n.output) for n in graph.node] == [["a"], ["a__2"], ["a__3"], ["y"]]
    assert [list(n.input) for n in graph.node] == [["x"], ["a"], ["a__2"], ["a__3"]]


def test_the_engine_trains_such_a_model(tmp_path):
    path = normalizing_model(tmp_path / "m.onnx")
    engine = GradientEngine(path, batch_size=4, loss="mse", intra_op_threads=1)
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    labels = np.zeros((4, 4), dtype=np.float32)
    result = engine.step({**engine.parameters(), **engine.state()}, {"x": x, "labels": labels})
    model = read_model(path)
    out = expected(model, x)
    np.testing.assert_allclose(result.loss, np.mean(out ** 2), rtol=1e-5)
    d_out = 2 * out / out.size
    d_h = d_out @ (np.eye(4) + np.full((4, 4), 0.25))   # out = h (I + J / 4), J symmetric
    np.testing.assert_allclose(result.gradients["W"], (x - MEAN).T @ d_h, rtol=1e-4, atol=1e-6)
