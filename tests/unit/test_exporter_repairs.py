"""Exporter faults that read_model mends (engine/repairs.py), and ops no runtime has, refused by name.

A value defined twice: torch's dynamo exporter names a node's output after its torch.fx node ("mean") and a
buffer after its module path, so a buffer called like an op is defined twice and onnxruntime refuses the file.
read_model renames the later definition; every reader gets the value it meant. An Erfc node in the ONNX domain:
tf2onnx's exact GELU, which no opset has; read_model writes it as 1 - Erf."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError

from tests.helpers.conv3d_fixture import conv3d_reference, conv3d_without_bias
from worker_client.engine import GradientEngine
from worker_client.engine.load import read_model
from worker_client.engine.repairs import unique_definitions

MEAN = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def saved(graph: onnx.GraphProto, path: Path, opset: int, **fields: str) -> Path:
    """`graph` as a model file at `path` (IR 8, the ONNX domain at `opset`; `fields`: producer_name, ...)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **fields)
    model.ir_version = 8
    onnx.save(model, path)
    return path


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
    return saved(graph, path, 18)


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


def erfc_model(path: Path, dtype: int = TensorProto.FLOAT, opset: int = 15) -> Path:
    """y = Erfc(x) + If(true, Erfc(x), 0): tf2onnx's exact GELU fault, at the top and inside a branch."""
    then = helper.make_graph([helper.make_node("Erfc", ["x"], ["inner"])], "then", [],
                             [helper.make_tensor_value_info("inner", dtype, None)])
    otherwise = helper.make_graph([helper.make_node("Sub", ["x", "x"], ["zero"])], "else", [],
                                  [helper.make_tensor_value_info("zero", dtype, None)])
    graph = helper.make_graph(
        [helper.make_node("Erfc", ["x"], ["e"], name="gelu/Erfc"),
         helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
         helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=otherwise),
         helper.make_node("Add", ["e", "branch"], ["y"])], "erfc",
        [helper.make_tensor_value_info("x", dtype, ["N", 3])], [helper.make_tensor_value_info("y", dtype, ["N", 3])])
    return saved(graph, path, opset, producer_name="tf2onnx", producer_version="1.17.0")


# (onnxruntime 1.32 has no float64 Erf kernel: a float64 model gets its CastLike, then onnxruntime's refusal)
@pytest.mark.parametrize("dtype, numpy_type, opset", [(TensorProto.FLOAT, np.float32, 15),
                                                      (TensorProto.FLOAT, np.float32, 13)])
def test_an_erfc_node_is_written_as_one_minus_erf_and_computes_erfc(tmp_path, dtype, numpy_type, opset):
    path = erfc_model(tmp_path / "m.onnx", dtype, opset)
    with pytest.raises(Exception, match="Erfc"):   # as written, onnxruntime has no such op
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = read_model(path)
    assert not [n for n in model.graph.node if n.op_type == "Erfc"]
    assert next(n for n in model.graph.node if n.output[0] == "e").name == "gelu/Erfc"   # the node keeps its name
    x = np.linspace(-3, 3, 12).reshape(4, 3).astype(numpy_type)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert out.dtype == numpy_type
    expected = 2 * np.array([math.erfc(v) for v in x.ravel().astype(np.float64)]).reshape(x.shape)
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-7)


def test_the_engine_differentiates_through_the_repaired_erfc(tmp_path):
    # y = Erfc(x W): dL/dW = x^T (dL/dy * -2/sqrt(pi) exp(-(xW)^2)), with the If's copy doubling it
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((3, 3)) * 0.5).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Erfc", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [numpy_helper.from_array(w, "W")])
    saved(graph, tmp_path / "m.onnx", 15)
    engine = GradientEngine(tmp_path / "m.onnx", batch_size=4, loss="mse", intra_op_threads=1)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    result = engine.step({**engine.parameters(), **engine.state()},
                         {"x": x, "labels": np.zeros((4, 3), np.float32)})
    h = x.astype(np.float64) @ w
    y = np.vectorize(math.erfc)(h)
    d_h = (2 * y / y.size) * (-2 / math.sqrt(math.pi) * np.exp(-h * h))
    np.testing.assert_allclose(result.gradients["W"], x.T @ d_h, rtol=1e-4, atol=1e-7)


def test_an_op_no_onnx_opset_has_is_refused_by_name_with_its_producer(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="dense"),
         helper.make_node("FancyGelu", ["h"], ["y"], name="block/act")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")])
    saved(graph, tmp_path / "m.onnx", 15, producer_name="someexporter", producer_version="0.1")
    with pytest.raises(UnsupportedModelError) as caught:
        GradientEngine(tmp_path / "m.onnx", batch_size=2, loss="mse", intra_op_threads=1)
    message = str(caught.value)
    assert "block/act (FancyGelu, domain '')" in message and "someexporter 0.1" in message, message
    assert "m.onnx" in message, message


def keras_dense_bn(path: Path, *, folded: bool, keras2: bool = False) -> Path:
    """A tf2onnx-style Dense + BatchNormalization: folded, the BN is a Mul and an Add named after the layer's TF ops
    (Keras 3: <layer>/batchnorm/mul_1; Keras 2: <layer>/FusedBatchNormV3); else a BatchNormalization node."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "kernel:0"),
             numpy_helper.from_array(np.ones(3, np.float32), "bn/scale:0"),
             numpy_helper.from_array(np.zeros(3, np.float32), "bn/shift:0")]
    layer = "functional_1/batch_normalization_1"
    if folded:
        op = f"{layer}/FusedBatchNormV3" if keras2 else f"{layer}/batchnorm/mul_1"
        nodes = [helper.make_node("MatMul", ["x", "kernel:0"], ["h"], name="functional_1/dense_1/MatMul"),
                 helper.make_node("Mul", ["h", "bn/scale:0"], ["s"], name=op),
                 helper.make_node("Add", ["s", "bn/shift:0"], ["y"], name=f"{op}_add")]
    else:
        inits += [numpy_helper.from_array(np.zeros(3, np.float32), "bn/mean:0"),
                  numpy_helper.from_array(np.ones(3, np.float32), "bn/var:0")]
        nodes = [helper.make_node("MatMul", ["x", "kernel:0"], ["h"], name="functional_1/dense_1/MatMul"),
                 helper.make_node("BatchNormalization", ["h", "bn/scale:0", "bn/shift:0", "bn/mean:0", "bn/var:0"],
                                  ["y"], name=f"{layer}/FusedBatchNormV3")]
    graph = helper.make_graph(nodes, "keras", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    return saved(graph, path, 15, producer_name="tf2onnx", producer_version="1.17.0")


@pytest.mark.parametrize("keras2", [False, True])
def test_a_keras_batch_norm_folded_by_tf2onnx_is_named_in_a_warning(tmp_path, keras2):
    path = keras_dense_bn(tmp_path / "m.onnx", folded=True, keras2=keras2)
    with pytest.warns(UserWarning, match="BatchNormalization") as caught:
        GradientEngine(path, batch_size=2, loss="mse", intra_op_threads=1)
    message = next(str(w.message) for w in caught if "BatchNormalization" in str(w.message))
    assert "1 Keras BatchNormalization layer(s)" in message and "(functional_1/batch_normalization_1)" in message
    assert "batch statistics" in message and str(path) in message, message


def test_a_batch_norm_node_left_in_a_tf2onnx_model_draws_no_such_warning(tmp_path):
    import warnings

    path = keras_dense_bn(tmp_path / "m.onnx", folded=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradientEngine(path, batch_size=2, loss="mse", intra_op_threads=1)
    assert not [w for w in caught if "BatchNormalization layer" in str(w.message)], [str(w.message) for w in caught]


def test_nodes_out_of_order_are_sorted_stably_and_the_engine_trains_the_model(tmp_path):
    from worker_client.engine.repairs import topological_order

    rng = np.random.default_rng(6)
    w1, w2 = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    then = helper.make_graph([helper.make_node("Identity", ["r"], ["picked_then"])], "then", [],
                             [helper.make_tensor_value_info("picked_then", TensorProto.FLOAT, None)])
    otherwise = helper.make_graph([helper.make_node("Neg", ["r"], ["picked_else"])], "else", [],
                                  [helper.make_tensor_value_info("picked_else", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["picked", "W2"], ["y"], name="last"),
             helper.make_node("If", ["cond"], ["picked"], name="if", then_branch=then, else_branch=otherwise),
             helper.make_node("Constant", [], ["cond"], name="cond", value=helper.make_tensor("c", TensorProto.BOOL,
                                                                                           [], [True])),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["x", "W1"], ["h"], name="first")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    saved(graph, tmp_path / "m.onnx", 17)
    loaded = read_model(tmp_path / "m.onnx")
    # the If reads r inside its branches only: it must come after relu all the same
    assert [n.name for n in loaded.graph.node] == ["cond", "first", "relu", "if", "last"]
    assert not topological_order(loaded.graph)   # sorted: nothing moves again
    engine = GradientEngine(tmp_path / "m.onnx", batch_size=3, loss="mse", intra_op_threads=1)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    result = engine.step({**engine.parameters(), **engine.state()},
                         {"x": x, "labels": np.zeros((3, 3), np.float32)})
    r = np.maximum(x.astype(np.float64) @ w1, 0)
    y = r @ w2
    np.testing.assert_allclose(result.loss, np.mean(y ** 2), rtol=1e-5)
    np.testing.assert_allclose(result.gradients["W2"], r.T @ (2 * y / y.size), rtol=1e-4, atol=1e-7)


def test_a_cycle_is_left_as_it_is(tmp_path):
    from worker_client.engine.repairs import topological_order

    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Neg", ["a"], ["b"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    before = graph.SerializeToString()
    assert not topological_order(graph)
    assert graph.SerializeToString() == before


def test_a_refusal_after_a_loop_without_static_shapes_names_the_loop(tmp_path):
    # tf2onnx's Keras GRU: a while-Loop whose scan output has an unknown length, a Slice of it, a Dense after
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Relu", ["h"], ["step"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("step", TensorProto.FLOAT, ["N", 4])])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]),
         helper.make_node("Loop", ["trips", "go"], ["steps"], name="rnn/while_loop", body=body),
         helper.make_node("Slice", ["steps", "starts", "ends", "axes"], ["last"], name="rnn/strided_slice_3"),
         helper.make_node("Squeeze", ["last", "axes"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("trips", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "W"),
         numpy_helper.from_array(np.array(True), "go"),
         numpy_helper.from_array(np.array([-1], np.int64), "starts"),
         numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "ends"),
         numpy_helper.from_array(np.array([0], np.int64), "axes")])
    saved(graph, tmp_path / "m.onnx", 17, producer_name="tf2onnx")
    with pytest.raises(UnsupportedModelError) as caught:
        GradientEngine(tmp_path / "m.onnx", batch_size=2, loss="mse", intra_op_threads=1)
    message = str(caught.value)
    assert "rnn/strided_slice_3" in message and "Loop 'rnn/while_loop'" in message, message
    assert "Keras GRU or SimpleRNN" in message, message


@pytest.mark.parametrize("readers, warned", [
    (["functional_1/time_distributed_1/MatMul", "functional_1/time_distributed_1/MatMul_1"], False),
    (["functional_1/dense_1/MatMul", "functional_1/dense_2/MatMul"], True),
])
def test_a_keras_layer_applying_its_own_kernel_twice_draws_no_tie_warning(tmp_path, readers, warned):
    # TimeDistributed(Dense) through tf2onnx: one kernel, a MatMul per time step, all in the layer's scope; a
    # kernel read from two layers' scopes is what tf2onnx's merging of equal values looks like
    import warnings

    kernel = "functional_1/time_distributed_1/Cast/ReadVariableOp:0"
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", kernel], ["p"], name=readers[0]),
         helper.make_node("MatMul", ["b", kernel], ["q"], name=readers[1]), helper.make_node("Add", ["p", "q"], ["y"])],
        "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), kernel)])
    saved(graph, tmp_path / "m.onnx", 15, producer_name="tf2onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradientEngine(tmp_path / "m.onnx", batch_size=2, loss="mse", intra_op_threads=1)
    ties = [str(w.message) for w in caught if "feeds 2 layers" in str(w.message)]
    assert bool(ties) == warned, [str(w.message) for w in caught]


def test_a_conv3d_without_bias_from_the_dynamo_exporter_runs_once_read(tmp_path):
    path = conv3d_without_bias(tmp_path / "conv3d.onnx")
    x = np.random.default_rng(9).standard_normal((2, 2, 3, 4, 4)).astype(np.float32)
    as_written = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])   # loads, then fails to run
    with pytest.raises(Exception, match="bias must be a 1D tensor"):
        as_written.run(None, {"x": x})
    model = read_model(path)
    assert [list(n.input) for n in model.graph.node if n.op_type == "Conv"] == [["x", "w"]]
    assert [n.op_type for n in model.graph.node] == ["Conv", "ReduceMean"]   # the bias's computation gone
    got, = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    np.testing.assert_allclose(got, conv3d_reference(weight, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, zero", [([4], 0.5), ([4], 0.0)])
def test_a_conv_bias_that_is_not_an_expanded_zero_or_is_already_right_is_kept_or_dropped_exactly(tmp_path, shape,
                                                                                                  zero):
    """A bias expanded from a non-zero is the model's: kept. A well-formed zero bias is no bias: dropped, same
    result."""
    path = conv3d_without_bias(tmp_path / "conv3d.onnx", bias_shape=shape, zero=zero)
    model = read_model(path)
    convs = [list(n.input) for n in model.graph.node if n.op_type == "Conv"]
    assert convs == ([["x", "w", "bias"]] if zero else [["x", "w"]])
    x = np.random.default_rng(10).standard_normal((2, 2, 3, 4, 4)).astype(np.float32)
    expected, = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got, = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_the_engine_trains_a_conv3d_without_bias_from_the_dynamo_exporter(tmp_path):
    path = conv3d_without_bias(tmp_path / "conv3d.onnx")
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    assert engine.trainable_names == ["w"]
    rng = np.random.default_rng(11)
    x, labels = rng.standard_normal((2, 2, 3, 4, 4)), rng.standard_normal((2, 4))
    result = engine.step(engine.parameters(), {"x": x, "labels": labels})
    weight = engine.parameters()["w"]
    residual = conv3d_reference(weight, x.astype(np.float32)) - labels
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 4, 4), axis=(2, 3, 4)).mean(axis=(5, 6, 7))
    assert result.loss == pytest.approx(float((residual ** 2).mean()), rel=1e-5)
    np.testing.assert_allclose(result.gradients["w"], np.einsum("no,ncdhw->ocdhw", 2 * residual / residual.size,
                                                                windows), rtol=1e-4, atol=1e-6)


def _dropouts_model(path: Path, *, trained: bool, idle_ratio: float) -> Path:
    """x -> Dropout (training flag `trained`, ratio 0.1) -> Dropout (ratio `idle_ratio`, no flag) -> MatMul w."""
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["d1"], name="/layers.0/dropout1/Dropout"),
             helper.make_node("Dropout", ["d1", "idle_ratio"], ["d2"], name="/layers.0/self_attn/Dropout"),
             helper.make_node("MatMul", ["d2", "w"], ["y"], name="/linear/MatMul")]
    graph = helper.make_graph(
        nodes, "dropouts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
         numpy_helper.from_array(np.array(trained), "training"),
         numpy_helper.from_array(np.array(idle_ratio, np.float32), "idle_ratio"),
         numpy_helper.from_array(np.ones((3, 2), np.float32), "w")])
    return saved(graph, path, 17)


def test_a_dropout_without_its_flag_beside_training_ones_is_named_in_a_warning(tmp_path: Path) -> None:
    """torch.onnx's legacy exporter writes nn.MultiheadAttention's attention dropout without a training flag (the
    identity) while the model's other Dropouts train: the engine says which, and why it differs from torch."""
    path = _dropouts_model(tmp_path / "m.onnx", trained=True, idle_ratio=0.1)
    with pytest.warns(UserWarning, match=r"m\.onnx: 1 Dropout\(s\) have a ratio but no training_mode input") as caught:
        GradientEngine(path, batch_size=2, loss="mse", intra_op_threads=1)
    message = next(str(w.message) for w in caught if "training_mode" in str(w.message))
    assert "/layers.0/self_attn/Dropout" in message and "dropout1" not in message
    assert "dropout=0.0" in message


@pytest.mark.parametrize("trained, idle_ratio", [(False, 0.1), (True, 0.0)])
def test_no_dropout_warning_for_an_inference_export_or_a_zero_ratio(tmp_path: Path, trained: bool,
                                                                      idle_ratio: float) -> None:
    """Every Dropout without a flag (an eval-mode export: none trains), or the flagless one of ratio 0: nothing to
    say."""
    path = _dropouts_model(tmp_path / "m.onnx", trained=trained, idle_ratio=idle_ratio)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradientEngine(path, batch_size=2, loss="mse", intra_op_threads=1)
    assert not [w for w in caught if "training_mode input" in str(w.message)]
