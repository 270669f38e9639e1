"""Weight gradients that come out of their GEMM in the weight's layout, written straight into the graph's outputs.

rewrites/matmul.py's `sum_batched_products` (a sum over a batched product's batches as one GEMM),
`untranspose_products` (a Transpose of a product moved onto its operands) and rewrites/outputs.py's `compute_outputs_in_place` (onnx-ad's seed-axis tail dropped from each
gradient output): the same values, without the two copies.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.lstm_fixture import lstm_batch, lstm_engines
from worker_client import GradientEngine
from worker_client.engine.rewrites.matmul import sum_batched_products, untranspose_products
from worker_client.engine.rewrites.outputs import compute_outputs_in_place
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.toolkit import static_shapes

_F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _weight_adjoint(extra_reader: bool = False, expand: bool = False) -> onnx.ModelProto:
    """onnx-ad's form of a Linear's weight gradient: (X^T @ dY)^T, dY with a broadcast batch axis of 1; with
    `expand`, the product also goes through a Reshape adding the seed axis and an Expand to its own shape (its
    form for a Linear on 3-D inputs)."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xt", "dy"], ["product"])]
    if expand:
        nodes += [helper.make_node("Reshape", ["product", "seeded"], ["with_seed"]),
                  helper.make_node("Expand", ["with_seed", "seeded"], ["full"]),
                  helper.make_node("Reshape", ["full", "flat"], ["matrix"])]
    else:
        nodes.append(helper.make_node("Reshape", ["product", "flat"], ["matrix"]))
    nodes.append(helper.make_node("Transpose", ["matrix"], ["grad"], perm=[1, 0]))
    outputs = [helper.make_tensor_value_info("grad", _F, None)]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["product"], ["other"]))
        outputs.append(helper.make_tensor_value_info("other", _F, None))
    return _model(nodes, [helper.make_tensor_value_info("x", _F, [8, 6]),
                          helper.make_tensor_value_info("dy", _F, [1, 8, 5])],
                  outputs, [numpy_helper.from_array(np.array([6, 5], np.int64), "flat"),
                            numpy_helper.from_array(np.array([6, 5, 1], np.int64), "seeded")])


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((8, 6)).astype(np.float32),
            "dy": rng.standard_normal((1, 8, 5)).astype(np.float32)}


@pytest.mark.parametrize("expand", [False, True])
def test_a_transposed_product_is_computed_in_the_transposed_layout_with_the_inner_transpose_cancelled(
        expand: bool) -> None:
    model = _weight_adjoint(expand=expand)
    before = _run(model, _feeds())
    assert untranspose_products(model) == 1
    after = _run(model, _feeds())
    np.testing.assert_allclose(after["grad"], before["grad"], rtol=1e-6)
    np.testing.assert_allclose(after["grad"], _feeds()["dy"][0].T @ _feeds()["x"], rtol=1e-5)
    product = next(n for n in model.graph.node if n.output[0] == "grad")
    assert product.op_type == "MatMul"
    assert product.input[1] == "x"   # X^T transposed back is X: no Transpose of it is left
    dy_t = next(n for n in model.graph.node if n.output[0] == product.input[0])
    assert dy_t.op_type == "Transpose"   # onnxruntime folds it into the GEMM (transA)
    assert untranspose_products(model) == 0


def test_a_product_read_elsewhere_keeps_its_transpose() -> None:
    """Rewriting would compute the product twice: the pass leaves it."""
    model = _weight_adjoint(extra_reader=True)
    assert untranspose_products(model) == 0
    assert [n.op_type for n in model.graph.node].count("Transpose") == 2


def _seeded_tail(prefix: str) -> tuple[onnx.ModelProto, str]:
    """A gradient the way onnx-ad ends one: a Reshape adding the seed axis, an Expand to the same shape, an
    Identity onto the output's name."""
    out = f"{prefix}w"
    nodes = [helper.make_node("MatMul", ["a", "b"], ["computed"]),
             helper.make_node("Reshape", ["computed", "seeded"], ["with_seed"]),
             helper.make_node("Expand", ["with_seed", "seeded"], ["full"]),
             helper.make_node("Identity", ["full"], [out])]
    model = _model(nodes, [helper.make_tensor_value_info("a", _F, [4, 3]), helper.make_tensor_value_info("b", _F, [3, 2])],
                   [helper.make_tensor_value_info(out, _F, [4, 2, "nseed"])],
                   [numpy_helper.from_array(np.array([4, 2, 1], np.int64), "seeded")])
    return model, out


def test_a_gradient_output_is_written_by_the_node_that_computes_it() -> None:
    model, out = _seeded_tail("grad__")
    rng = np.random.default_rng(4)
    feeds = {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal((3, 2)).astype(np.float32)}
    before = _run(model, feeds)[out]
    assert compute_outputs_in_place(model, "grad__") == 1
    producer = next(n for n in model.graph.node if out in n.output)
    assert producer.op_type == "MatMul"
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [4, 2]
    after = _run(model, feeds)[out]
    np.testing.assert_array_equal(after, before.reshape(4, 2))


def test_outputs_without_the_prefix_and_values_read_elsewhere_keep_their_tail() -> None:
    model, _ = _seeded_tail("state_")
    assert compute_outputs_in_place(model, "grad__") == 0
    model, out = _seeded_tail("grad__")
    model.graph.node.append(helper.make_node("Relu", ["computed"], ["other"]))
    model.graph.output.append(helper.make_tensor_value_info("other", _F, None))
    assert compute_outputs_in_place(model, "grad__") == 0


@pytest.mark.parametrize("with_input_gradient", [False, True])
def test_a_linear_layers_gradients_are_exact_and_leave_the_graph_without_either_copy(tmp_path,
                                                                                      with_input_gradient: bool) -> None:
    """A torch Linear as the legacy exporter writes it (Gemm, transB=1): the weight gradient, the bias's and (asked
    for) the input's match the hand-computed ones; no gradient output is a Reshape, Expand or Identity of another
    value and no Transpose reads a MatMul's result."""
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((4, 6)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    model = _model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                   [helper.make_tensor_value_info("x", _F, ["batch", 6])],
                   [helper.make_tensor_value_info("y", _F, ["batch", 4])],
                   [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    path = tmp_path / "linear.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=3, loss="mse", cache_dir=tmp_path / "cache",
                            input_gradients=["x"] if with_input_gradient else ())
    x = rng.standard_normal((3, 6)).astype(np.float32)
    target = rng.standard_normal((3, 4)).astype(np.float32)
    result = engine.step(engine.parameters(), {"x": x, "labels": target})
    dy = 2 * (x @ weight.T + bias - target) / target.size
    np.testing.assert_allclose(result.gradients["w"], dy.T @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.gradients["b"], dy.sum(0), rtol=1e-5, atol=1e-6)
    assert result.gradients["w"].shape == (4, 6)
    if with_input_gradient:
        assert result.input_gradients["x"].shape == (3, 6)
        np.testing.assert_allclose(result.input_gradients["x"], dy @ weight, rtol=1e-5, atol=1e-6)
    cached, = (tmp_path / "cache").glob("*.onnx")
    graph = onnx.load(cached, load_external_data=False).graph
    producers = {out: n for n in graph.node for out in n.output}
    assert producers["grad__w"].op_type == "MatMul"
    for transpose in (n for n in graph.node if n.op_type == "Transpose"):
        source = producers.get(transpose.input[0])
        while source is not None and source.op_type == "Reshape":
            source = producers.get(source.input[0])
        assert source is None or source.op_type != "MatMul", transpose


def _batch_summed(*, reshape: bool, transposed_left: bool, batch_of_right: int = 5,
                  extra_reader: bool = False) -> onnx.ModelProto:
    """onnx-ad's weight adjoint of MatMul(X[T, B, I], W) written per batch: X[t]^T @ G[t] for every t, then a
    ReduceSum over t (through a Reshape that merges each product into a row, as the layout pass writes it)."""
    nodes = []
    if transposed_left:
        nodes.append(helper.make_node("Transpose", ["x"], ["left"], perm=[0, 2, 1]))
        left_info = helper.make_tensor_value_info("x", _F, [5, 4, 3])
    else:
        left_info = helper.make_tensor_value_info("left", _F, [5, 3, 4])
    nodes.append(helper.make_node("MatMul", ["left", "g"], ["product"]))
    if reshape:
        nodes += [helper.make_node("Reshape", ["product", "rows"], ["flat"]),
                  helper.make_node("ReduceSum", ["flat", "axis0"], ["summed"], keepdims=1),
                  helper.make_node("Reshape", ["summed", "matrix"], ["grad"])]
    else:
        nodes += [helper.make_node("ReduceSum", ["product", "axis01"], ["summed"], keepdims=0),
                  helper.make_node("Identity", ["summed"], ["grad"])]
    outputs = [helper.make_tensor_value_info("grad", _F, None)]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["product"], ["other"]))
        outputs.append(helper.make_tensor_value_info("other", _F, None))
    return _model(nodes, [left_info, helper.make_tensor_value_info("g", _F, [1, batch_of_right, 4, 6])], outputs,
                  [numpy_helper.from_array(np.array([5, 18], np.int64), "rows"),
                   numpy_helper.from_array(np.array([0], np.int64), "axis0"),
                   numpy_helper.from_array(np.array([0, 1], np.int64), "axis01"),
                   numpy_helper.from_array(np.array([3, 6], np.int64), "matrix")])


def _batch_feeds(transposed_left: bool, batch_of_right: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(6)
    left = rng.standard_normal((5, 4, 3) if transposed_left else (5, 3, 4)).astype(np.float32)
    return {"x" if transposed_left else "left": left,
            "g": rng.standard_normal((1, batch_of_right, 4, 6)).astype(np.float32)}


@pytest.mark.parametrize("reshape", [True, False])
@pytest.mark.parametrize("transposed_left", [True, False])
def test_a_sum_over_a_batched_products_batches_is_one_gemm(reshape: bool, transposed_left: bool) -> None:
    model = _batch_summed(reshape=reshape, transposed_left=transposed_left)
    feeds = _batch_feeds(transposed_left)
    before = _run(model, feeds)["grad"]
    assert sum_batched_products(model) == 1
    assert untranspose_products(model) == 0
    prune(model)
    after = _run(model, feeds)["grad"]
    left = feeds["x"].transpose(0, 2, 1) if transposed_left else feeds["left"]
    expected = sum(left[t] @ feeds["g"][0, t] for t in range(5))
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    ops = [n.op_type for n in model.graph.node]
    assert "ReduceSum" not in ops and ops.count("MatMul") == 1
    product = next(n for n in model.graph.node if n.op_type == "MatMul")
    by_output = {n.output[0]: n for n in model.graph.node}
    assert len(_shape_of(model, product.input[1])) == 2       # [T*B, 6]: the batches side by side
    if transposed_left:   # X's own rows, transposed once (folded into the GEMM by onnxruntime)
        rows = by_output[by_output[product.input[0]].input[0]]
        assert rows.op_type == "Reshape" and rows.input[0] == "x"


def _shape_of(model: onnx.ModelProto, name: str) -> tuple[int, ...]:
    return static_shapes(model)[name]


def test_sums_over_part_of_the_batch_broadcast_operands_and_shared_products_are_left() -> None:
    model = _batch_summed(reshape=True, transposed_left=True, extra_reader=True)
    assert sum_batched_products(model) == 0
    model = _batch_summed(reshape=True, transposed_left=True, batch_of_right=1)   # G broadcast over t
    assert sum_batched_products(model) == 0
    model = _batch_summed(reshape=False, transposed_left=True)
    axes = next(t for t in model.graph.initializer if t.name == "axis01")
    axes.CopyFrom(numpy_helper.from_array(np.array([1], np.int64), "axis01"))   # the batch's size-1 axis only
    assert sum_batched_products(model) == 0


def _batch_summed_products(model: onnx.ModelProto) -> int:
    """ReduceSums that read a batched (rank > 2) MatMul's result, directly or through one Reshape."""
    shapes = static_shapes(model)
    producers = {out: n for n in model.graph.node for out in n.output}
    found = 0
    for node in (n for n in model.graph.node if n.op_type == "ReduceSum"):
        source = producers.get(node.input[0])
        if source is not None and source.op_type == "Reshape":
            source = producers.get(source.input[0])
        if source is not None and source.op_type == "MatMul" and len(shapes.get(source.output[0], ())) > 2:
            found += 1
    return found


def test_an_lstms_input_weight_gradients_are_single_gemms_and_match_torch(tmp_path, monkeypatch) -> None:
    """The torch LSTM fixture (reference gradients from torch): onnx-ad writes its input projection's weight
    gradient as per-step products summed; with the pass there is none such and the gradients hold."""
    engine, plain = lstm_engines(tmp_path, monkeypatch, "sum_batched_products")
    assert _batch_summed_products(plain._graph.model) >= 1
    assert _batch_summed_products(engine._graph.model) == 0
    inputs, reference = lstm_batch()
    _, gradients = engine.gradients(engine.parameters(), inputs)
    assert reference
    for name, expected in reference.items():
        np.testing.assert_allclose(gradients[name], expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
