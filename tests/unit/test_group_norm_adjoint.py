"""Group and instance normalizations detached from onnx-ad and differentiated by the engine
(rewrites/group_norms.py): the closed-form gradients, in fewer passes over the activations, for every form the
rewrite takes, and the forms it leaves to onnx-ad."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import worker_client.engine.rewrites as rewrites
from tests.helpers.engines import with_and_without
from worker_client.engine import GradientEngine
from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
from worker_client.engine.rewrites import rewrite_adjoints
from worker_client.engine.rewrites.group_norms import PROBE_PREFIX, STAND_IN_PREFIX, UNITS_KEY, detach_group_norms
from worker_client.engine.rewrites.toolkit import static_shapes

SHAPE = (4, 6, 5, 3)
EPSILON = 1e-5


def _value(name: str, dims, element: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, element, list(dims))


def _group_norm_model(shape: tuple[int, ...] = SHAPE, groups: int = 3, *, affine: bool = True,
                      extra_reader: bool = False, element: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """loss = sum(GroupNorm(x) * r) (+ sum(x * r2) with `extra_reader`), GroupNorm as torch exports it: Reshape to
    [N, G, M], InstanceNormalization with a unit scale and zero shift, Reshape back (to the Shape of x), Mul by
    the Unsqueezed weight, Add the Unsqueezed bias."""
    dtype = helper.tensor_dtype_to_np_dtype(element)
    channels, rank = shape[1], len(shape)
    nodes = [helper.make_node("Reshape", ["x", "grouped_shape"], ["grouped"]),
             helper.make_node("InstanceNormalization", ["grouped", "unit", "zero"], ["normal"], epsilon=EPSILON),
             helper.make_node("Shape", ["x"], ["x_shape"]),
             helper.make_node("Reshape", ["normal", "x_shape"], ["back"])]
    last = "back"
    if affine:
        nodes += [helper.make_node("Unsqueeze", ["gamma", "channel_axes"], ["gamma_c"]),
                  helper.make_node("Mul", ["back", "gamma_c"], ["scaled"]),
                  helper.make_node("Unsqueeze", ["beta", "channel_axes"], ["beta_c"]),
                  helper.make_node("Add", ["scaled", "beta_c"], ["y"])]
        last = "y"
    nodes += [helper.make_node("Mul", [last, "r"], ["weighted"]),
              helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    if extra_reader:
        nodes[-1].output[0] = "main"
        nodes += [helper.make_node("Mul", ["x", "r2"], ["also"]),
                  helper.make_node("ReduceSum", ["also"], ["side"], keepdims=0),
                  helper.make_node("Add", ["main", "side"], ["loss"])]
    initializers = [numpy_helper.from_array(np.array([shape[0], groups, -1], np.int64), "grouped_shape"),
                    numpy_helper.from_array(np.ones(groups, dtype), "unit"),
                    numpy_helper.from_array(np.zeros(groups, dtype), "zero"),
                    numpy_helper.from_array(np.arange(1, rank - 1, dtype=np.int64), "channel_axes")]
    inputs = [_value("x", shape, element), _value("r", shape, element)] + \
        ([_value("gamma", [channels], element), _value("beta", [channels], element)] if affine else []) + \
        ([_value("r2", shape, element)] if extra_reader else [])
    graph = helper.make_graph(nodes, "group_norm", inputs, [_value("loss", [], element)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _instance_norm_model(shape: tuple[int, ...]) -> onnx.ModelProto:
    """loss = sum(InstanceNormalization(x, gamma, beta) * r): InstanceNorm with its affine, as torch exports it."""
    nodes = [helper.make_node("InstanceNormalization", ["x", "gamma", "beta"], ["y"], epsilon=EPSILON),
             helper.make_node("Mul", ["y", "r"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "instance_norm", [
        _value("x", shape), _value("r", shape), _value("gamma", [shape[1]]), _value("beta", [shape[1]])],
        [_value("loss", [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _closed_form(feeds: dict[str, np.ndarray], groups: int) -> dict[str, np.ndarray]:
    """The normalization's gradients in float64, the loss's adjoint of y being r (plus r2 for x where fed)."""
    x, dy = feeds["x"].astype(np.float64), feeds["r"].astype(np.float64)
    shape = x.shape
    channels = shape[1]
    gamma = feeds.get("gamma", np.ones(channels)).astype(np.float64).reshape(1, -1, *[1] * (len(shape) - 2))
    grouped = x.reshape(shape[0], groups, -1)
    mean = grouped.mean(axis=2, keepdims=True)
    std = np.sqrt(((grouped - mean) ** 2).mean(axis=2, keepdims=True) + EPSILON)
    xhat = ((grouped - mean) / std).reshape(shape)
    dz = (dy * gamma).reshape(shape[0], groups, -1)
    flat_xhat = xhat.reshape(shape[0], groups, -1)
    dx = (dz - dz.mean(axis=2, keepdims=True) - flat_xhat * (dz * flat_xhat).mean(axis=2, keepdims=True)) / std
    axes = tuple(a for a in range(len(shape)) if a != 1)
    return {"x": dx.reshape(shape) + feeds.get("r2", 0.0), "gamma": (dy * xhat).sum(axis=axes),
            "beta": dy.sum(axis=axes)}


def _feeds(model: onnx.ModelProto, offset: float = 0.0, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if value.name == "x":
            feeds["x"] = (offset + 3 * rng.standard_normal(dims)).astype(dtype)
        elif value.name == "gamma":
            feeds["gamma"] = rng.uniform(0.5, 1.5, dims).astype(dtype)
        else:
            feeds[value.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def _gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str], *, detached: bool
               ) -> tuple[dict[str, np.ndarray], onnx.ModelProto, int]:
    """(the gradients of `wrt`, the gradient graph as the engine builds it, the number of units detached)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    rewritten = detach_group_norms(model) if detached else 0
    derived = rewrite_adjoints(differentiate(model, wrt, "loss"))
    session = ort.InferenceSession(derived.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {value.name for value in derived.graph.input}
    values = session.run([GRAD_PREFIX + name for name in wrt], {k: v for k, v in feeds.items() if k in names})
    return {name: value.reshape(feeds[name].shape) for name, value in zip(wrt, values)}, derived, rewritten


def _passes(model: onnx.ModelProto, shape: tuple[int, ...]) -> int:
    """The passes over memory at the activation's size: the nodes that write such a tensor (layout ops aside)
    and the reductions that read one."""
    shapes = static_shapes(model)
    size = math.prod(shape)

    def full(name: str) -> bool:
        return name in shapes and math.prod(shapes[name]) == size

    free = {"Reshape", "Squeeze", "Unsqueeze", "Identity"}
    writes = sum(1 for node in model.graph.node if node.op_type not in free and any(map(full, node.output)))
    reads = sum(1 for node in model.graph.node if node.op_type.startswith("Reduce") and full(node.input[0]))
    return writes + reads


def _assert_close(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], tolerance: float = 1e-4) -> None:
    for name, value in got.items():
        reference = expected[name]
        error = np.abs(value - reference).max() / np.abs(reference).max()
        assert error < tolerance, (name, error)


@pytest.mark.parametrize("offset", [0.0, 1000.0])   # a mean some 300 times the spread: no digits lost
def test_a_group_norm_gets_the_closed_form_gradients_in_fewer_passes(offset: float) -> None:
    model = _group_norm_model()
    feeds = _feeds(model, offset)
    wrt = ["x", "gamma", "beta"]
    detached, derived, count = _gradients(model, feeds, wrt, detached=True)
    plain, original, _ = _gradients(model, feeds, wrt, detached=False)
    assert count == 1
    expected = _closed_form(feeds, 3)
    _assert_close(detached, expected)
    for name in wrt:   # no less accurate than onnx-ad's own form
        scale = np.abs(expected[name]).max()
        assert np.abs(detached[name] - expected[name]).max() / scale <= \
            4 * np.abs(plain[name] - expected[name]).max() / scale + 1e-6, name
    assert not [n for n in derived.graph.node if n.op_type == "InstanceNormalization"]
    left = [v.name for v in list(derived.graph.input) + list(derived.graph.output)
            if v.name.startswith((STAND_IN_PREFIX, PROBE_PREFIX, GRAD_PREFIX + PROBE_PREFIX))]
    assert not left
    assert UNITS_KEY not in {p.key for p in derived.metadata_props}
    before, after = _passes(original, SHAPE), _passes(derived, SHAPE)
    assert after <= before - 8, (before, after)


def test_the_forward_value_is_the_normalization_s() -> None:
    model = _group_norm_model()
    model.graph.output.append(_value("y", SHAPE))
    feeds = _feeds(model)
    detached = onnx.ModelProto.FromString(model.SerializeToString())
    detach_group_norms(detached)
    derived = rewrite_adjoints(differentiate(detached, ["x"], "loss"))
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session = ort.InferenceSession(derived.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {value.name for value in derived.graph.input}
    got = session.run(["y", "loss"], {k: v for k, v in feeds.items() if k in names})
    want = plain.run(["y", "loss"], feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("wrt", [["x"], ["gamma", "beta"], ["x", "beta"], ["gamma"]])
def test_only_the_adjoints_asked_for_are_written(wrt: list[str]) -> None:
    """x not differentiated (a normalization of the data itself: dy from the probe alone), a frozen weight."""
    model = _group_norm_model()
    feeds = _feeds(model)
    got, derived, count = _gradients(model, feeds, wrt, detached=True)
    assert count == 1
    _assert_close(got, _closed_form(feeds, 3))
    assert {v.name for v in derived.graph.output} == {"loss", *(GRAD_PREFIX + name for name in wrt)}


def test_a_group_norm_without_affine_and_an_input_read_elsewhere() -> None:
    model = _group_norm_model(affine=False, extra_reader=True)
    feeds = _feeds(model)
    got, _, count = _gradients(model, feeds, ["x"], detached=True)
    assert count == 1
    _assert_close(got, _closed_form(feeds, 3))


@pytest.mark.parametrize("shape", [(4, 5, 6, 7), (3, 4, 10), (2, 3, 4, 3, 2)])
def test_an_instance_norm_with_its_own_scale_and_shift(shape: tuple[int, ...]) -> None:
    model = _instance_norm_model(shape)
    feeds = _feeds(model)
    got, derived, count = _gradients(model, feeds, ["x", "gamma", "beta"], detached=True)
    assert count == 1
    _assert_close(got, _closed_form(feeds, shape[1]))
    assert not [n for n in derived.graph.node if n.op_type == "InstanceNormalization"]


def test_forms_it_does_not_take_are_left_to_onnx_ad() -> None:
    double = _group_norm_model(element=TensorProto.DOUBLE)       # no float32
    assert detach_group_norms(double) == 0
    dynamic = _instance_norm_model((4, 5, 6))
    dynamic.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"   # no static shape
    assert detach_group_norms(dynamic) == 0
    old = _instance_norm_model((4, 5, 6))
    old.opset_import[0].version = 11   # ReduceSum's axes as an attribute: not spelled here
    assert detach_group_norms(old) == 0


def test_the_engine_trains_a_group_norm_cnn_as_without_the_rewrite(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Conv -> GroupNorm -> SiLU -> Conv through the whole engine (the CPU session's copy too): the same loss and
    gradients as built without the rewrite, and the SiLU's adjoint still in its short form after a Reshape."""
    rng = np.random.default_rng(9)
    channels = 8
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "grouped_shape"], ["grouped"]),
             helper.make_node("InstanceNormalization", ["grouped", "unit", "zero"], ["normal"], epsilon=EPSILON),
             helper.make_node("Shape", ["c"], ["c_shape"]),
             helper.make_node("Reshape", ["normal", "c_shape"], ["back"]),
             helper.make_node("Mul", ["back", "gamma"], ["scaled"]),
             helper.make_node("Add", ["scaled", "beta"], ["n"]),
             helper.make_node("Sigmoid", ["n"], ["s"]),
             helper.make_node("Mul", ["n", "s"], ["a"]),
             helper.make_node("Conv", ["a", "w2"], ["z"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "gn", [_value("x", ["batch", 3, 8, 8])], [_value("z", ["batch", 4, 8, 8])],
        [numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((4, channels, 3, 3)).astype(np.float32) * 0.2, "w2"),
         numpy_helper.from_array(np.array([0, 4, -1], np.int64), "grouped_shape"),
         numpy_helper.from_array(np.ones(4, np.float32), "unit"),
         numpy_helper.from_array(np.zeros(4, np.float32), "zero"),
         numpy_helper.from_array(rng.uniform(0.5, 1.5, (channels, 1, 1)).astype(np.float32), "gamma"),
         numpy_helper.from_array(rng.standard_normal((channels, 1, 1)).astype(np.float32), "beta")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path / "gn.onnx"
    onnx.save(model, path)
    engine, plain = with_and_without(path, tmp_path, monkeypatch, rewrites, "detach_group_norms", batch_size=4,
                                     loss="mse")
    assert not [n for n in engine._graph.model.graph.node if n.op_type == "InstanceNormalization"]
    assert [n for n in plain._graph.model.graph.node if n.op_type == "InstanceNormalization"]
    for built in (engine, plain):
        assert [n for n in built._graph.model.graph.node if n.name.startswith("silu_adjoint")]
    batch = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    target = rng.standard_normal((4, 4, 8, 8)).astype(np.float32)
    inputs = {"x": batch, "labels": target}
    got, want = engine.step(engine.parameters(), inputs), plain.step(plain.parameters(), inputs)
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    for name, value in want.gradients.items():
        np.testing.assert_allclose(got.gradients[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_vector_jacobian_product_through_a_group_norm_whose_output_is_the_stage_s() -> None:
    """A pipeline stage ending at the normalization: y is a graph output, its cotangent a fed seed."""
    model = _group_norm_model()
    graph = model.graph
    kept = [node for node in graph.node if node.output[0] not in ("weighted", "loss")]
    graph.ClearField("node")
    graph.node.extend(kept)
    graph.ClearField("output")
    graph.output.append(_value("y", SHAPE))
    inputs = [value for value in graph.input if value.name != "r"]
    graph.ClearField("input")
    graph.input.extend(inputs)
    assert detach_group_norms(model) == 1
    derived = rewrite_adjoints(differentiate(model, ["x", "gamma", "beta"], None, seeded=["y"]))
    feeds = _feeds(_group_norm_model())
    session = ort.InferenceSession(derived.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run([GRAD_PREFIX + name for name in ("x", "gamma", "beta")],
                         {"x": feeds["x"], "gamma": feeds["gamma"], "beta": feeds["beta"],
                          GRAD_PREFIX + "y": feeds["r"][..., None]})
    _assert_close({name: value.reshape(feeds[name].shape) for name, value in zip(("x", "gamma", "beta"), values)},
                  _closed_form(feeds, 3))


def test_a_training_batch_norm_beside_an_instance_norm_keeps_its_running_statistics(tmp_path: Path) -> None:
    """The group norms' adjoints prune what no output reads, inside the differentiation: the running statistics'
    new values are outputs by then, so a model with both normalizations loads and updates its state."""
    rng = np.random.default_rng(10)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "bn_scale", "bn_shift", "mean", "var"],
                              ["b", "b_mean", "b_var"], training_mode=1, momentum=0.9),
             helper.make_node("InstanceNormalization", ["b", "gamma", "beta"], ["y"], epsilon=EPSILON)]
    graph = helper.make_graph(
        nodes, "bn_in", [_value("x", ["batch", 3, 6, 6])], [_value("y", ["batch", 4, 6, 6])],
        [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), "bn_scale"),
         numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "bn_shift"),
         numpy_helper.from_array(np.zeros(4, np.float32), "mean"),
         numpy_helper.from_array(np.ones(4, np.float32), "var"),
         numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), "gamma"),
         numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "beta")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "bn_in.onnx")
    engine = GradientEngine(tmp_path / "bn_in.onnx", batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
    assert engine.state_names == ["mean", "var"]
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    result = engine.step({**engine.parameters(), **engine.state()},
                         {"x": x, "labels": rng.standard_normal((4, 4, 6, 6)).astype(np.float32)})
    convolved = ort.InferenceSession(helper.make_model(helper.make_graph(
        nodes[:1], "conv", [_value("x", [4, 3, 6, 6])], [_value("c", [4, 4, 6, 6])], [graph.initializer[0]]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()).run(None, {"x": x})[0]
    # the new running mean: momentum 0.9 of the old (zeros) and 0.1 of the batch's
    np.testing.assert_allclose(result.state["mean"], 0.1 * convolved.mean((0, 2, 3)), rtol=1e-4, atol=1e-6)
    assert sorted(result.gradients) == ["beta", "bn_scale", "bn_shift", "gamma", "w"]
