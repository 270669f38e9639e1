"""Grouped and depthwise convolutions: the written-out form, the engine's own weight adjoint, gradients that match."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine, UnsupportedModelError
from worker_client.engine.differentiate import differentiate
from worker_client.engine.rewrites import rewrite_adjoints
from worker_client.engine.rewrites.conv import explicit_auto_pads
from worker_client.engine.rewrites.indexing import index_without_steps_or_copying_pads
from worker_client.engine.rewrites.grouped import (
    DETACHED_PREFIX,
    PROBE_PREFIX,
    detach_grouped_weights,
    expand_grouped_convs,
    probe_inputs,
)

OPSET = 18

#: (input shape, weight shape, group, Conv attributes, with a bias)
CASES = {
    "depthwise": ((2, 4, 7, 7), (4, 1, 3, 3), 4, {"pads": [1, 1, 1, 1]}, True),
    "depthwise_multiplier": ((2, 3, 6, 6), (6, 1, 3, 3), 3, {}, False),
    "two_groups_strided_dilated": ((2, 4, 9, 8), (6, 2, 3, 2), 2,
                                   {"strides": [2, 1], "dilations": [2, 1],
                                    "pads": [1, 0, 2, 1]}, True),
    "same_upper": ((1, 4, 5, 5), (4, 2, 3, 3), 2,
                   {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, False),
    "one_dimensional": ((3, 6, 10), (6, 2, 4), 3, {"pads": [1, 2]}, True),
}


def _conv_model(x_shape, w_shape, group, attributes, bias, *, dtype=TensorProto.FLOAT,
                weight_as_input: bool = True) -> onnx.ModelProto:
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    inputs = ["x", "w"] + (["b"] if bias else [])
    graph_inputs = [helper.make_tensor_value_info("x", dtype, list(x_shape))]
    initializers = []
    weight = rng.standard_normal(w_shape).astype(np_type)
    if weight_as_input:
        graph_inputs.append(helper.make_tensor_value_info("w", dtype, list(w_shape)))
    else:
        initializers.append(numpy_helper.from_array(weight, "w"))
    if bias:
        graph_inputs.append(helper.make_tensor_value_info("b", dtype, [w_shape[0]]))
    graph = helper.make_graph(
        [helper.make_node("Conv", inputs, ["y"], name="grouped", group=group, **attributes)],
        "g", graph_inputs, [helper.make_tensor_value_info("y", dtype, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rewrite_computes_exactly_what_the_grouped_conv_computes(case: str) -> None:
    x_shape, w_shape, group, attributes, bias = CASES[case]
    model = _conv_model(x_shape, w_shape, group, attributes, bias)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert expand_grouped_convs(rewritten) == 1
    assert "Conv" not in {n.op_type for n in rewritten.graph.node}
    rng = np.random.default_rng(1)
    feed = {"x": rng.standard_normal(x_shape).astype(np.float32),
            "w": rng.standard_normal(w_shape).astype(np.float32)}
    if bias:
        feed["b"] = rng.standard_normal(w_shape[0]).astype(np.float32)
    expected, = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    got, = ort.InferenceSession(rewritten.SerializeToString()).run(None, feed)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_grouped_conv_with_a_constant_weight_keeps_its_kernel() -> None:
    model = _conv_model((1, 4, 5, 5), (4, 1, 3, 3), 4, {}, False, weight_as_input=False)
    assert expand_grouped_convs(model) == 0


def _classifier(path: Path, depthwise: np.ndarray, group: int) -> Path:
    """Conv (`depthwise` weight, `group`, bias, stride 2, padding) -> Tanh -> pointwise Conv
    -> spatial mean as logits."""
    rng = np.random.default_rng(2)
    values = {"dw": depthwise, "dw_b": rng.standard_normal(4) * 0.1,
              "pw": rng.standard_normal((3, 4, 1, 1)) * 0.5}
    nodes = [helper.make_node("Conv", ["x", "dw", "dw_b"], ["d"], name="depthwise",
                              group=group, pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Tanh", ["d"], ["a"]),
             helper.make_node("Conv", ["a", "pw"], ["p"], name="pointwise"),
             helper.make_node("ReduceMean", ["p", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in values.items()]
        + [numpy_helper.from_array(np.array([2, 3], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def test_depthwise_gradients_equal_those_of_the_block_diagonal_ungrouped_conv(
        tmp_path: Path) -> None:
    """A depthwise Conv is an ungrouped Conv whose weight is zero off the diagonal: the
    gradient of the depthwise weight is the diagonal of the ungrouped one's gradient."""
    channels = 4
    depthwise = np.random.default_rng(5).standard_normal((channels, 1, 3, 3)) * 0.5
    dense = np.zeros((channels, channels, 3, 3))
    for c in range(channels):
        dense[c, c] = depthwise[c, 0]
    rng = np.random.default_rng(3)
    inputs = {"x": rng.standard_normal((3, channels, 5, 5)), "labels": np.array([0, 2, 1])}
    results = []
    for name, weight, group in (("grouped", depthwise, channels), ("dense", dense, 1)):
        engine = GradientEngine(_classifier(tmp_path / f"{name}.onnx", weight, group),
                                batch_size=3, cache_dir=tmp_path)
        assert engine.trainable_names == ["dw", "dw_b", "pw"]
        results.append(engine.gradients(engine.parameters(), inputs))
    (loss, grads), (dense_loss, dense_grads) = results
    assert loss == pytest.approx(dense_loss, rel=1e-6)
    diagonal = np.stack([dense_grads["dw"][c, c] for c in range(channels)])[:, None]
    assert np.abs(diagonal).min() > 0
    np.testing.assert_allclose(grads["dw"], diagonal, rtol=1e-5, atol=1e-7)
    for name in ("dw_b", "pw"):
        np.testing.assert_allclose(grads[name], dense_grads[name], rtol=1e-5, atol=1e-7)


def test_onnx_ads_refusals_name_the_node_they_come_from() -> None:
    """What a grouped Conv that the rewrite did not take (no static shapes) would meet:
    onnx-ad's rule message names no node, the engine's error does."""
    model = _conv_model((1, 4, 5, 5), (4, 1, 3, 3), 4, {}, False)
    model.graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    with pytest.raises(UnsupportedModelError,
                       match=r"cannot differentiate node 'grouped' \(Conv\): onnx-ad .* "
                             r"grouped Conv is not differentiated"):
        differentiate(model, ["w"], "loss")


#: Beside CASES: a depthwise Conv whose N x C planes the blocked kernels take (its weight adjoint is one
#: depthwise correlation), a strided and dilated one, and a 1-D one (window by window).
ADJOINT_CASES = {
    **CASES,
    "depthwise_blocked": ((2, 16, 9, 9), (16, 1, 3, 3), 16, {"pads": [1, 1, 1, 1]}, True),
    "depthwise_blocked_strided_dilated": ((4, 8, 11, 10), (8, 1, 3, 2), 8,
                                          {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]}, False),
    "grouped_wide": ((2, 8, 6, 6), (12, 4, 3, 3), 2, {"pads": [1, 1, 1, 1]}, False),
    # MobileNet's downsampling depthwise Conv: its input adjoint becomes grouped phase Convs
    "depthwise_blocked_strided": ((2, 16, 9, 9), (16, 1, 3, 3), 16, {"strides": [2, 2], "pads": [1, 1, 1, 1]}, False),
}


def _with_loss(model: onnx.ModelProto, y_shape: tuple[int, ...], reads_weight_too: bool) -> onnx.ModelProto:
    """`model` with the scalar loss sum(y * R) (R fixed), so dL/dy = R; with `reads_weight_too` the loss
    adds sum(w * w), which onnx-ad differentiates itself."""
    graph = model.graph
    rng = np.random.default_rng(7)
    graph.initializer.append(numpy_helper.from_array(rng.standard_normal(y_shape).astype(np.float32), "R"))
    graph.node.extend([helper.make_node("Mul", ["y", "R"], ["yr"]),
                       helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)])
    if reads_weight_too:
        graph.node.extend([helper.make_node("Mul", ["w", "w"], ["ww"]),
                           helper.make_node("ReduceSum", ["ww"], ["wsum"], keepdims=0),
                           helper.make_node("Add", ["loss", "wsum"], ["total"])])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("total" if reads_weight_too else "loss", TensorProto.FLOAT, []))
    return model


def _gradients(model: onnx.ModelProto, parameters: list[str], feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    loss = model.graph.output[0].name
    derived = rewrite_adjoints(differentiate(model, parameters, loss))   # as the engine builds it
    session = ort.InferenceSession(derived.SerializeToString())
    names = ["grad__" + p for p in parameters]
    return {p: value.reshape(feed[p].shape) for p, value in zip(parameters, session.run(names, feed))}


@pytest.mark.parametrize("reads_weight_too", [False, True])
@pytest.mark.parametrize("case", sorted(ADJOINT_CASES))
def test_the_engines_grouped_weight_adjoint_equals_onnx_ads_adjoint_of_the_written_out_conv(
        case: str, reads_weight_too: bool) -> None:
    """The grouped Conv kept, its weight adjoint written by the engine (detached from onnx-ad, attached
    after), against onnx-ad's own gradient of the same Conv written out as MatMuls (the exact rewrite above);
    the input's and the bias's gradients, which onnx-ad writes in both, too."""
    x_shape, w_shape, group, attributes, bias = ADJOINT_CASES[case]
    model = _conv_model(x_shape, w_shape, group, attributes, bias)
    y_shape = tuple(d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim)
    model = _with_loss(model, y_shape, reads_weight_too)
    explicit_auto_pads(model)   # as rewrite_forward does first: onnx-ad refuses SAME
    rng = np.random.default_rng(8)
    feed = {"x": rng.standard_normal(x_shape).astype(np.float32),
            "w": rng.standard_normal(w_shape).astype(np.float32)}
    if bias:
        feed["b"] = rng.standard_normal(w_shape[0]).astype(np.float32)
    parameters = list(feed)
    written_out, detached = onnx.ModelProto(), onnx.ModelProto()
    written_out.CopyFrom(model)
    detached.CopyFrom(model)
    assert expand_grouped_convs(written_out) == 1
    index_without_steps_or_copying_pads(written_out)   # as rewrite_forward does next: onnx-ad refuses stepped Slices
    assert detach_grouped_weights(detached) == 1
    assert probe_inputs(detached) == [PROBE_PREFIX + "y"]
    expected = _gradients(written_out, parameters, feed)
    got = _gradients(detached, parameters, feed)
    for name in parameters:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-4 * np.abs(expected[name]).max(),
                                   err_msg=f"{case}: the gradient of {name}")
    assert np.abs(got["w"]).max() > 0


def test_the_differentiated_graph_keeps_the_grouped_conv_and_no_trace_of_the_detachment() -> None:
    x_shape, w_shape, group, attributes, bias = ADJOINT_CASES["depthwise_blocked"]
    model = _with_loss(_conv_model(x_shape, w_shape, group, attributes, bias), (2, 16, 9, 9), False)
    detach_grouped_weights(model)
    derived = differentiate(model, ["w", "b"], "loss")
    names = {v.name for v in [*derived.graph.input, *derived.graph.output, *derived.graph.value_info]}
    names |= {name for node in derived.graph.node for name in [*node.input, *node.output]}
    assert not {name for name in names if name.startswith((PROBE_PREFIX, DETACHED_PREFIX))}
    forward = [n for n in derived.graph.node if n.op_type == "Conv" and list(n.output) == ["y"]]
    assert len(forward) == 1 and list(forward[0].input) == ["x", "w", "b"]
    assert [o.name for o in derived.graph.output] == ["loss", "grad__w", "grad__b"]


def test_two_grouped_convs_sharing_a_weight_sum_their_adjoints_and_a_frozen_one_gets_none() -> None:
    """y = conv(x, w) + conv(x2, w) with w trained: the two engine-written terms are summed (checked against
    the written-out form); a grouped Conv whose weight input is not differentiated gets no adjoint at all."""
    shape, weight = [2, 16, 5, 5], [16, 1, 3, 3]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["a"], group=16, pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["x2", "w"], ["b"], group=16, pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["a", "frozen"], ["c"], group=16, pads=[1, 1, 1, 1]),
         helper.make_node("Add", ["b", "c"], ["y"])],
        "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
              for n, s in (("x", shape), ("x2", shape), ("w", weight), ("frozen", weight))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    model = _with_loss(onnx.shape_inference.infer_shapes(model), tuple(shape), False)
    rng = np.random.default_rng(9)
    feed = {"x": rng.standard_normal(shape).astype(np.float32), "x2": rng.standard_normal(shape).astype(np.float32),
            "w": rng.standard_normal(weight).astype(np.float32),
            "frozen": rng.standard_normal(weight).astype(np.float32)}
    written_out, detached = onnx.ModelProto(), onnx.ModelProto()
    written_out.CopyFrom(model)
    detached.CopyFrom(model)
    assert expand_grouped_convs(written_out) == 3
    assert detach_grouped_weights(detached) == 3
    derived = differentiate(detached, ["w"], "loss")
    assert [o.name for o in derived.graph.output] == ["loss", "grad__w"]
    got = ort.InferenceSession(derived.SerializeToString()).run(["grad__w"], feed)[0].reshape(weight)
    expected = _gradients(written_out, ["w"], {k: v for k, v in feed.items()})["w"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def _with_depthwise_head(path: Path, nodes: list[onnx.NodeProto], value: str,
                         initializers: list[onnx.TensorProto]) -> Path:
    """`nodes` (from the input x [N, 4, 5, 5] to `value`), then a depthwise Conv with a trained weight, a pointwise
    Conv and the spatial mean as 3 logits, saved at `path`."""
    rng = np.random.default_rng(4)
    weights = {"dw": rng.standard_normal((4, 1, 3, 3)) * 0.5, "pw": rng.standard_normal((3, 4, 1, 1)) * 0.5}
    nodes = [*nodes, helper.make_node("Conv", [value, "dw"], ["d"], name="depthwise", group=4, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["d", "pw"], ["p"], name="pointwise"),
             helper.make_node("ReduceMean", ["p", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
        + [numpy_helper.from_array(np.array([2, 3], np.int64), "axes")] + initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _computed_trains_as_constant(tmp_path: Path, build) -> None:  # type: ignore[no-untyped-def]
    """The model `build(path, computed)` writes trains with its shapes computed as with them constant."""
    rng = np.random.default_rng(6)
    inputs = {"x": rng.standard_normal((3, 4, 5, 5)), "labels": np.array([0, 2, 1])}
    results = {}
    for computed in (True, False):
        engine = GradientEngine(build(tmp_path / f"computed_{computed}.onnx", computed), batch_size=3,
                                cache_dir=tmp_path)
        assert engine.trainable_names == ["dw", "pw"]
        results[computed] = engine.gradients(engine.parameters(), inputs)
    (loss, grads), (constant_loss, constant_grads) = results[True], results[False]
    assert loss == pytest.approx(constant_loss, rel=1e-6)
    for name in ("dw", "pw"):
        assert np.abs(grads[name]).max() > 0
        np.testing.assert_allclose(grads[name], constant_grads[name], rtol=1e-5, atol=1e-7)


def _excited_depthwise(path: Path, computed_axes: bool) -> Path:
    """A squeeze-excitation gate (the spatial mean's sigmoid) before a depthwise Conv, the gate's ReduceMean axes
    either a constant or, as torch's dynamo exporter writes MobileNetV3's and EfficientNet's, a Reshape of
    Constants -- which onnx's shape inference does not evaluate, so every shape after it was unknown and the
    depthwise weight's adjoint was refused."""
    axes = [helper.make_node("Constant", [], ["axes_raw"], value=numpy_helper.from_array(np.array([-1, -2]))),
            helper.make_node("Constant", [], ["flat"], value_ints=[-1]),
            helper.make_node("Reshape", ["axes_raw", "flat"], ["se_axes"])] if computed_axes else []
    nodes = axes + [
        helper.make_node("ReduceMean", ["x", "se_axes"], ["squeezed"], keepdims=1),
        helper.make_node("Sigmoid", ["squeezed"], ["gate"]),
        helper.make_node("Mul", ["x", "gate"], ["excited"])]
    constant_axes = [] if computed_axes else [numpy_helper.from_array(np.array([-1, -2], np.int64), "se_axes")]
    return _with_depthwise_head(path, nodes, "excited", constant_axes)


def test_a_depthwise_weight_after_computed_reduction_axes_trains_as_after_constant_ones(tmp_path: Path) -> None:
    _computed_trains_as_constant(tmp_path, _excited_depthwise)


def _shuffled_depthwise(path: Path, shuffles: int, computed: bool) -> Path:
    """`shuffles` channel shuffles (ShuffleNet's: view as [N, 2, C / 2, H, W], swap the two group axes, view back)
    before a depthwise Conv, each view's shape either a constant or, as torch's legacy exporter writes it, computed
    from the Shape of the tensor it views with Constant nodes (Shape, Gather, Div, Cast, Unsqueeze, Concat, and -1
    for the channels viewed back): onnx's shape inference does not propagate the Div, so every shape after the first
    view was unknown, and the engine's folding took a sweep for each link of each chain."""
    nodes, value = [], "x"

    def constant(name: str, array: np.ndarray) -> str:
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name)))
        return name

    for k in range(shuffles):
        grouped, back = f"grouped{k}", f"back{k}"
        if computed:
            dims = []
            for axis in range(4):
                nodes += [helper.make_node("Shape", [value], [f"shape{k}_{axis}"]),
                          helper.make_node("Gather", [f"shape{k}_{axis}", constant(f"at{k}_{axis}",
                                                                                   np.array(axis))],
                                           [f"dim{k}_{axis}"], axis=0)]
                dims.append(f"dim{k}_{axis}")
            nodes += [helper.make_node("Div", [dims[1], constant(f"two{k}", np.array(2))], [f"quotient{k}"]),
                      helper.make_node("Cast", [f"quotient{k}"], [f"floor{k}"], to=TensorProto.INT64),
                      helper.make_node("Cast", [f"floor{k}"], [f"half{k}"], to=TensorProto.INT64)]
            view = [dims[0], constant(f"groups{k}", np.array(2)), f"half{k}", dims[2], dims[3]]
            flat = [dims[0], constant(f"rest{k}", np.array(-1)), dims[2], dims[3]]   # x.view(n, -1, h, w)
            for name in (view, flat):
                for i, scalar in enumerate(list(name)):
                    nodes.append(helper.make_node("Unsqueeze", [scalar, constant(f"{scalar}_axes{i}{len(name)}",
                                                                                  np.array([0]))],
                                                  [f"{scalar}_as_list{len(name)}"]))
                    name[i] = f"{scalar}_as_list{len(name)}"
            nodes += [helper.make_node("Concat", view, [f"view{k}"], axis=0),
                      helper.make_node("Concat", flat, [f"flat{k}"], axis=0)]
            view_shape, flat_shape = f"view{k}", f"flat{k}"
        else:
            view_shape, flat_shape = "view", "flat"
        nodes += [helper.make_node("Reshape", [value, view_shape], [grouped]),
                  helper.make_node("Transpose", [grouped], [f"swapped{k}"], perm=[0, 2, 1, 3, 4]),
                  helper.make_node("Reshape", [f"swapped{k}", flat_shape], [back])]
        value = back
    constants = [] if computed else [numpy_helper.from_array(np.array([3, 2, 2, 5, 5], np.int64), "view"),
                                     numpy_helper.from_array(np.array([3, 4, 5, 5], np.int64), "flat")]
    return _with_depthwise_head(path, nodes, value, constants)


def test_a_depthwise_weight_after_many_computed_views_trains_as_after_constant_ones(tmp_path: Path) -> None:
    _computed_trains_as_constant(tmp_path, lambda path, computed: _shuffled_depthwise(path, 24, computed))
