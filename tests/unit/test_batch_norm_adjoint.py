"""A training-mode batch norm with its statistics detached through stand-ins (rewrites/batch_norms.py): the same
gradients as the form it replaces and as the closed form, in fewer passes over the activations, and the
normalizations it leaves alone."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
from worker_client.engine.rewrites import rewrite_adjoints
from worker_client.engine.rewrites.batch_norms import STAND_IN_PREFIX, detach_batch_norm_statistics
from worker_client.engine.rewrites.toolkit import static_shapes
from worker_client.engine.training_mode import training_form

SHAPE = (8, 3, 5, 4)
EPSILON = 1e-5


def _norm_model(shape: tuple[int, ...] = SHAPE) -> onnx.ModelProto:
    """loss = sum(BatchNormalization(x, gamma, beta) * r), in training mode: the loss's adjoint of y is r."""
    channels = shape[1]
    nodes = [helper.make_node("BatchNormalization", ["x", "gamma", "beta", "running_mean", "running_var"],
                              ["y", "new_mean", "new_var"], epsilon=EPSILON, momentum=0.9, training_mode=1),
             helper.make_node("Mul", ["y", "r"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "norm",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in
         (("x", shape), ("gamma", [channels]), ("beta", [channels]), ("r", shape),
          ("running_mean", [channels]), ("running_var", [channels]))],   # state: inputs, as the engine lifts it
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, detached: bool
               ) -> tuple[dict[str, np.ndarray], onnx.ModelProto, int]:
    """(the gradients of x, gamma and beta; the gradient graph; the number of norms rewritten)."""
    trained, _ = training_form(model, ["running_mean", "running_var"])
    rewritten = detach_batch_norm_statistics(trained) if detached else 0
    derived = rewrite_adjoints(differentiate(trained, ["x", "gamma", "beta"], "loss"))   # as the engine builds it
    session = ort.InferenceSession(derived.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [GRAD_PREFIX + name for name in ("x", "gamma", "beta")]
    values = session.run(names, feeds)
    return {name: value.reshape(feeds[name].shape) for name, value in zip(("x", "gamma", "beta"), values)}, \
        derived, rewritten


def _closed_form(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch norm's gradients in float64: dx = gamma / std * (dy - mean(dy) - xhat * mean(dy * xhat))."""
    x, dy = feeds["x"].astype(np.float64), feeds["r"].astype(np.float64)
    gamma = feeds["gamma"].astype(np.float64).reshape(1, -1, 1, 1)
    axes = (0, 2, 3)
    mean = x.mean(axis=axes, keepdims=True)
    std = np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + EPSILON)
    xhat = (x - mean) / std
    dx = gamma / std * (dy - dy.mean(axis=axes, keepdims=True) - xhat * (dy * xhat).mean(axis=axes, keepdims=True))
    return {"x": dx, "gamma": (dy * xhat).sum(axis=axes), "beta": dy.sum(axis=axes)}


def _feeds(offset: float, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": (offset + rng.standard_normal(SHAPE)).astype(np.float32),
            "gamma": rng.uniform(0.5, 1.5, SHAPE[1]).astype(np.float32),
            "beta": rng.standard_normal(SHAPE[1]).astype(np.float32),
            "r": rng.standard_normal(SHAPE).astype(np.float32),
            "running_mean": np.zeros(SHAPE[1], np.float32), "running_var": np.ones(SHAPE[1], np.float32)}


def _passes(model: onnx.ModelProto, shape: tuple[int, ...]) -> int:
    """The passes over memory at the activation's size: the nodes that write such a tensor (layout ops aside)
    and the reductions that read one."""
    shapes = static_shapes(model)
    size = math.prod(shape)
    free = {"Reshape", "Squeeze", "Unsqueeze", "Identity"}

    def full(name: str) -> bool:
        return name in shapes and math.prod(shapes[name]) == size

    writes = sum(1 for node in model.graph.node if node.op_type not in free and any(map(full, node.output)))
    reads = sum(1 for node in model.graph.node if node.op_type.startswith("Reduce") and full(node.input[0]))
    return writes + reads


@pytest.mark.parametrize("offset", [0.0, 1000.0])   # a mean a thousand times the spread: no digits lost
def test_the_detached_form_gives_the_closed_form_gradients(offset: float) -> None:
    feeds = _feeds(offset)
    model = _norm_model()
    expected = _closed_form(feeds)
    plain, _, _ = _gradients(model, feeds, detached=False)
    detached, derived, rewritten = _gradients(model, feeds, detached=True)
    assert rewritten == 1
    assert not [value.name for value in derived.graph.input if value.name.startswith(STAND_IN_PREFIX)]
    for name, reference in expected.items():
        scale = np.abs(reference).max()
        plain_error = np.abs(plain[name] - reference).max() / scale
        detached_error = np.abs(detached[name] - reference).max() / scale
        assert detached_error < 1e-4, (name, detached_error)
        assert detached_error <= 4 * plain_error + 1e-6, (name, detached_error, plain_error)


def test_the_detached_form_passes_over_the_activations_fewer_times() -> None:
    feeds = _feeds(0.0)
    model = _norm_model()
    _, plain, _ = _gradients(model, feeds, detached=False)
    _, detached, _ = _gradients(model, feeds, detached=True)
    before, after = _passes(plain, SHAPE), _passes(detached, SHAPE)
    assert after <= before - 3, (before, after)   # the Neg, the ReduceSum of dc, the Mul c * dv twice
    for graph, negated in ((plain, 1), (detached, 0)):   # the mean's sum of dc, negated, is gone
        shapes = static_shapes(graph)
        assert len([n for n in graph.graph.node if n.op_type == "Neg"
                    and math.prod(shapes.get(n.output[0], ())) == math.prod(SHAPE)]) == negated


def _decomposed(variance_axes: list[int], *, factor_shape: list[int], extra_reader: bool = False,
                keepdims: int = 1) -> onnx.ModelProto:
    """mean, centred, variance and y = c * factor + shift written out, with one departure from the form."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0, 2, 3], keepdims=1),
             helper.make_node("Sub", ["x", "mean"], ["c"]),
             helper.make_node("Mul", ["c", "c"], ["square"]),
             helper.make_node("ReduceMean", ["square"], ["var"], axes=variance_axes, keepdims=keepdims),
             helper.make_node("Mul", ["c", "factor"], ["scaled"]),
             helper.make_node("Add", ["scaled", "shift"], ["y"]),
             helper.make_node("Mul", ["y", "r"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
               helper.make_tensor_value_info("var", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "decomposed",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in
         (("x", SHAPE), ("factor", factor_shape), ("shift", [1, SHAPE[1], 1, 1]), ("r", SHAPE))],
        outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_decomposed_form_is_matched_where_exported_as_arithmetic() -> None:
    assert detach_batch_norm_statistics(_decomposed([0, 2, 3], factor_shape=[1, SHAPE[1], 1, 1])) == 1


@pytest.mark.parametrize("variance_axes, factor_shape, extra_reader, keepdims", [
    ([0, 2], [1, SHAPE[1], 1, 1], False, 1),          # the variance over other axes than the mean
    ([0, 2, 3], [1, 1, 1, SHAPE[3]], False, 1),       # a factor that varies along a reduced axis
    ([0, 2, 3], [1, SHAPE[1], 1, 1], True, 1),        # the centred values read elsewhere (a graph output)
    ([0, 2, 3], [1, SHAPE[1], 1, 1], False, 0),       # a variance without its reduced axes
])
def test_normalizations_outside_the_form_are_left_alone(variance_axes: list[int], factor_shape: list[int],
                                                        extra_reader: bool, keepdims: int) -> None:
    model = _decomposed(variance_axes, factor_shape=factor_shape, extra_reader=extra_reader, keepdims=keepdims)
    before = model.SerializeToString()
    assert detach_batch_norm_statistics(model) == 0
    assert model.SerializeToString() == before


@pytest.mark.filterwarnings("ignore:.*feeds 2 layers.*trained as one tied parameter")   # one module: it is tied
def test_a_batch_norm_called_twice_moves_its_running_statistics_once_a_call(tmp_path) -> None:
    """One BatchNorm module applied to two views (a siamese network): two training-mode nodes read the same running
    statistics. torch moves them once a call, in order; the engine's state is the second call's moving average of
    the first's, and the model loads (each call's update had an output of the same name)."""
    from worker_client.engine import GradientEngine   # here: the other tests need no engine
    rng = np.random.default_rng(6)
    statistics = ["scale", "shift", "mean", "var"]
    nodes = [helper.make_node("BatchNormalization", ["x", *statistics], ["a", "a_mean", "a_var"], training_mode=1,
                              momentum=0.9),
             helper.make_node("Neg", ["x"], ["flipped"]),
             helper.make_node("Mul", ["flipped", "two"], ["view"]),
             helper.make_node("BatchNormalization", ["view", *statistics], ["b", "b_mean", "b_var"], training_mode=1,
                              momentum=0.9),
             helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "siamese", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, 4])], [
        onnx.numpy_helper.from_array(np.ones(3, np.float32), "scale"),
        onnx.numpy_helper.from_array(np.zeros(3, np.float32), "shift"),
        onnx.numpy_helper.from_array(np.full(3, 0.5, np.float32), "mean"),
        onnx.numpy_helper.from_array(np.full(3, 2.0, np.float32), "var"),
        onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              tmp_path / "siamese.onnx")
    engine = GradientEngine(tmp_path / "siamese.onnx", batch_size=5, loss="mse", cache_dir=tmp_path / "cache")
    x = rng.normal(1.0, 2.0, size=(5, 3, 4)).astype(np.float32)
    result = engine.step({**engine.parameters(), **engine.state()},
                         {"x": x, "labels": np.zeros((5, 3, 4), np.float32)})
    mean, var = np.full(3, 0.5), np.full(3, 2.0)
    for view in (x, -2 * x):   # ONNX's variance is the biased one (a non-torch producer)
        mean = 0.9 * mean + 0.1 * view.mean((0, 2))
        var = 0.9 * var + 0.1 * view.var((0, 2))
    np.testing.assert_allclose(result.state["mean"], mean, rtol=1e-5)
    np.testing.assert_allclose(result.state["var"], var, rtol=1e-5)


def test_a_float64_batch_norm_trains_in_float64(tmp_path) -> None:
    """A float64 model's training-mode BatchNormalization (a torch module after .double()): its training form's
    constants -- epsilon, momentum, torch's unbiased variance count -- are float64 too (float32 ones made onnxruntime
    refuse the model), and its gradients and moving statistics are float64's."""
    from worker_client.engine import GradientEngine   # here: the other tests need no engine
    rng = np.random.default_rng(7)
    scale, shift = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "shift", "mean", "var"], ["y", "m", "v"],
                              training_mode=1, momentum=0.9, epsilon=EPSILON)]
    graph = helper.make_graph(nodes, "double", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["n", 3, 4])], [
        onnx.numpy_helper.from_array(scale, "scale"), onnx.numpy_helper.from_array(shift, "shift"),
        onnx.numpy_helper.from_array(np.full(3, 0.5), "mean"), onnx.numpy_helper.from_array(np.full(3, 2.0), "var")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="pytorch")   # torch keeps the unbiased variance
    onnx.save(model, tmp_path / "double.onnx")
    engine = GradientEngine(tmp_path / "double.onnx", batch_size=5, loss="mse", cache_dir=tmp_path / "cache")
    x = rng.normal(1.0, 2.0, size=(5, 3, 4))
    result = engine.step({**engine.parameters(), **engine.state()}, {"x": x, "labels": np.zeros((5, 3, 4))})
    mean, var = x.mean((0, 2), keepdims=True), x.var((0, 2), keepdims=True)
    xhat = (x - mean) / np.sqrt(var + EPSILON)
    y = scale.reshape(1, 3, 1) * xhat + shift.reshape(1, 3, 1)
    dy = 2 * y / y.size   # the mean squared error against zeros
    assert result.gradients["scale"].dtype == np.float64
    np.testing.assert_allclose(result.gradients["scale"], (dy * xhat).sum((0, 2)), rtol=1e-10)
    np.testing.assert_allclose(result.gradients["shift"], dy.sum((0, 2)), rtol=1e-10)
    assert result.state["var"].dtype == np.float64
    momentum = float(np.float32(0.9))   # an ONNX attribute's float is a float32
    np.testing.assert_allclose(result.state["mean"], momentum * 0.5 + (1 - momentum) * mean.ravel(), rtol=1e-12)
    np.testing.assert_allclose(result.state["var"], momentum * 2.0 + (1 - momentum) * x.var((0, 2), ddof=1),
                               rtol=1e-12)
