"""The passes that put forms onnx-ad refuses into ones it differentiates (rewrites/indexing.py, transposed.py, and
conv.py's explicit_transposed_conv_pads and drop_idle_ceil_modes) compute what the graph computed; and a gradient
flowing back through a Conv padded more at its end is right (onnxruntime ignores the pads onnx-ad writes beside an
output_shape). Whole torch models with these layers are checked against torch autograd in test_gradient_engine.py
(fixtures conv_decoder and padded_strided)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine.rewrites.conv import explicit_auto_pads, explicit_transposed_conv_pads
from worker_client.engine.rewrites.indexing import gather_copying_pads, slice_cropping_pads, unstep_slices
from worker_client.engine.rewrites.pools import drop_idle_ceil_modes, pad_overhanging_average_pools
from worker_client.engine.rewrites.sequences import split_constant_sequences
from worker_client.engine.rewrites.transposed import convolve_trained_transposed_convs

OPSET = 18
INT64_MIN = int(np.iinfo(np.int64).min)


def _model(nodes, inputs, initializers=(), outputs=("y",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "rewrite",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)) for name, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    return model


def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _agrees(model: onnx.ModelProto, rewrite: Callable[[onnx.ModelProto], int], feeds: dict[str, np.ndarray],
            *, ops_left: tuple[str, ...] = ()) -> int:
    """Rewrite a copy; its outputs equal the original's exactly (the passes copy values, never compute them,
    except the convolutions, which sum the same products in another order). Returns the number rewritten."""
    before = _run(model, feeds)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    count = rewrite(changed)
    for op in ops_left:
        assert op not in {n.op_type for n in changed.graph.node}, f"a {op} is left"
    for old, new in zip(before, _run(changed, feeds)):
        assert old.shape == new.shape
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)
    return count


def _feeds(**shapes) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


# --- stepped slices -----------------------------------------------------------------------------------

@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([1], [7], [1], [2]),                      # every second of a middle stretch
    ([0], [7], [1], [3]),                      # the last window passes the end (7 = 3 * 3 - 2)
    ([-1], [INT64_MIN], [2], [-1]),            # a reversal
    ([-2], [0], [2], [-3]),                    # a reversed stride, stopping before index 0
    ([0, 8, 1], [5, 0, 6], [0, 2, 1], [2, -2, 1]),   # two stepped axes and a plain one
    ([100], [-100], [-1], [-4]),               # bounds past both ends, clamped
])
def test_a_stepped_slice_becomes_plain_slices_reshapes_and_gathers_with_the_same_values(
        starts, ends, axes, steps) -> None:
    model = _model([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"], name="slice")], [("x", (5, 7, 9))],
                   [_ints("s", starts), _ints("e", ends), _ints("a", axes), _ints("st", steps)])
    feeds = _feeds(x=(5, 7, 9))
    assert _agrees(model, unstep_slices, feeds) == 1


def test_a_slice_whose_bounds_are_computed_from_constants_and_shapes_is_rewritten_too() -> None:
    """As torch exports `h[:, ::2]` with constant folding off: Unsqueezes of Constants, and a Shape."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2, np.int64))),
        helper.make_node("Unsqueeze", ["two", "zero_axis"], ["step"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["width"], axis=0),
        helper.make_node("Unsqueeze", ["width", "zero_axis"], ["end"]),
        helper.make_node("Slice", ["x", "start", "end", "axis", "step"], ["y"], name="slice"),
    ]
    model = _model(nodes, [("x", (3, 6))], [_ints("zero_axis", [0]), _ints("one", 1), _ints("start", [0]),
                                          _ints("axis", [1])])
    assert _agrees(model, unstep_slices, _feeds(x=(3, 6))) == 1


def test_a_plain_slice_and_one_of_unknown_shape_are_left_alone() -> None:
    model = _model([helper.make_node("Slice", ["x", "s", "e", "a"], ["y"], name="plain")], [("x", (4, 4))],
                   [_ints("s", [1]), _ints("e", [3]), _ints("a", [0])])
    assert unstep_slices(model) == 0
    dynamic = _model([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"], name="dynamic")],
                     [("x", ("batch", 4))], [_ints("s", [0]), _ints("e", [4]), _ints("a", [0]), _ints("st", [2])])
    assert unstep_slices(dynamic) == 0


# --- copying pads -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, pads, axes", [
    ("edge", [0, 0, 2, 1, 0, 0, 1, 3], None),
    ("reflect", [0, 1, 2, 1, 0, 2, 1, 3], None),
    ("wrap", [0, 0, 3, 5, 0, 0, 1, 6], None),
    ("edge", [0, 0, -1, 2, 0, 0, 1, -2], None),    # a negative pad crops
    ("reflect", [2, 3, 1, 0], [3, 2]),              # pads for the axes named, in their order
])
def test_an_edge_reflect_or_wrap_pad_becomes_gathers_with_the_same_values(mode, pads, axes) -> None:
    inputs = ["x", "pads", "", "axes"] if axes is not None else ["x", "pads"]
    initializers = [_ints("pads", pads)] + ([_ints("axes", axes)] if axes is not None else [])
    model = _model([helper.make_node("Pad", inputs, ["y"], name="pad", mode=mode)], [("x", (2, 3, 5, 4))],
                   initializers)
    assert _agrees(model, gather_copying_pads, _feeds(x=(2, 3, 5, 4)), ops_left=("Pad",)) == 1


def test_a_constant_pad_and_a_reflect_pad_wider_than_its_axis_are_left_alone() -> None:
    constant = _model([helper.make_node("Pad", ["x", "pads"], ["y"], name="pad")], [("x", (2, 3))],
                      [_ints("pads", [1, 1, 1, 1])])
    assert gather_copying_pads(constant) == 0
    wide = _model([helper.make_node("Pad", ["x", "pads"], ["y"], name="pad", mode="reflect")], [("x", (2, 3))],
                  [_ints("pads", [0, 3, 0, 0])])
    assert gather_copying_pads(wide) == 0


@pytest.mark.parametrize("pads, value, axes", [
    ([0, 0, -1, 2, 0, 0, 1, -2], None, None),     # crop and fill on each axis
    ([0, 0, -1, -1, 0, 0, -1, -2], None, None),   # crop only
    ([-1, 2, 1, -3], 0.5, [3, 2]),                # the axes named, and a fill value
])
def test_a_constant_pad_that_crops_becomes_a_slice_and_a_pad_with_the_same_values(pads, value, axes) -> None:
    """onnx-ad's adjoint of a cropping Pad slices the gradient and never pads it back."""
    inputs = ["x", "pads", "value" if value is not None else "", "axes" if axes is not None else ""]
    initializers = [_ints("pads", pads)] + ([_ints("axes", axes)] if axes is not None else []) + \
        ([numpy_helper.from_array(np.array(value, np.float32), "value")] if value is not None else [])
    model = _model([helper.make_node("Pad", inputs, ["y"], name="pad")], [("x", (2, 3, 5, 6))], initializers)
    assert _agrees(model, slice_cropping_pads, _feeds(x=(2, 3, 5, 6))) == 1


# --- auto_pad ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, x, attributes", [
    ("Conv", (2, 3, 7, 6), {"auto_pad": "SAME_UPPER"}),                       # kernel from the weight: 4 x 3
    ("Conv", (2, 3, 7, 6), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ("Conv", (2, 3, 7, 6), {"auto_pad": "SAME_UPPER", "strides": [2, 3]}),
    ("Conv", (2, 3, 7, 6), {"auto_pad": "VALID", "strides": [2, 2]}),
    ("MaxPool", (2, 3, 7, 6), {"auto_pad": "SAME_UPPER", "kernel_shape": [3, 2], "strides": [2, 2]}),
    ("AveragePool", (2, 3, 7, 6), {"auto_pad": "SAME_LOWER", "kernel_shape": [2, 2], "strides": [2, 2]}),
])
def test_auto_pad_becomes_the_explicit_pads_it_means(op: str, x, attributes) -> None:
    inputs, shapes = (["x", "w"], [("x", x), ("w", (4, 3, 4, 3))]) if op == "Conv" else (["x"], [("x", x)])
    model = _model([helper.make_node(op, inputs, ["y"], name="node", **attributes)], shapes)
    feeds = _feeds(x=x, w=(4, 3, 4, 3)) if op == "Conv" else _feeds(x=x)
    assert _agrees(model, explicit_auto_pads, feeds) == 1


# --- transposed convolutions --------------------------------------------------------------------------

@pytest.mark.parametrize("x, w, attributes, bias", [
    ((2, 3, 5, 5), (3, 4, 3, 3), {"pads": [1, 1, 1, 1]}, True),                               # stride 1
    ((2, 3, 5, 5), (3, 4, 2, 2), {}, False),                                                  # a map one larger
    ((2, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, True),
    ((2, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, False),           # 4 -> 7, odd
    ((2, 3, 4, 5), (3, 2, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    ((2, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "output_shape": [8, 9]}, False),
    ((2, 3, 6), (3, 4, 3), {"pads": [2, 0]}, True),                                          # 1-D
    ((2, 3, 6), (3, 4, 4), {"strides": [2], "pads": [1, 1]}, True),                          # 1-D, strided
    ((2, 3, 5), (3, 2, 3), {"strides": [3], "pads": [0, 1], "output_padding": [2]}, False),
    ((1, 2, 3, 4, 3), (2, 2, 3, 2, 3), {"strides": [2, 2, 2], "pads": [1, 0, 1, 1, 0, 1]}, True),   # 3-D
    ((2, 3, 4, 5), (3, 2, 3, 4), {"strides": [1, 2], "pads": [1, 1, 1, 1]}, True),           # strides differ
    ((2, 3, 4, 3), (3, 2, 4, 3), {"strides": [3, 2], "output_shape": [11, 6]}, False),
    ((2, 4, 4, 4), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "group": 2}, True),     # grouped
    ((2, 4, 5, 5), (4, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 4}, False),                     # depthwise
])
def test_a_transposed_conv_with_a_fed_weight_becomes_convs_with_the_same_output(x, w, attributes, bias) -> None:
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    groups = attributes.get("group", 1)
    feeds = _feeds(x=x, w=w, **({"b": (w[1] * groups,)} if bias else {}))
    model = _model([helper.make_node("ConvTranspose", inputs, ["y"], name="up", **attributes)],
                   [("x", x), ("w", w)] + ([("b", (w[1] * groups,))] if bias else []))

    def rewrite(m: onnx.ModelProto) -> int:   # as rewrite_forward runs them: an output_shape made pads first
        explicit_transposed_conv_pads(m, adjoints=False)
        return convolve_trained_transposed_convs(m)

    assert _agrees(model, rewrite, feeds, ops_left=("ConvTranspose",)) == groups   # one per group


def test_a_transposed_conv_with_a_constant_weight_or_strided_and_dilated_is_left_alone() -> None:
    constant = _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up")], [("x", (1, 2, 3, 3))],
                      [numpy_helper.from_array(np.ones((2, 2, 3, 3), np.float32), "w")])
    assert convolve_trained_transposed_convs(constant) == 0
    dilated = _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up", strides=[2, 2],
                                       dilations=[2, 2])], [("x", (1, 2, 3, 3)), ("w", (2, 1, 3, 3))])
    assert convolve_trained_transposed_convs(dilated) == 0


@pytest.mark.parametrize("x, w, strides, output_shape, pads", [
    ((2, 3, 5, 5), (3, 2, 4, 4), [2, 2], [9, 10], [0, 0, 0, 0]),
    ((2, 3, 5, 5), (3, 2, 4, 4), [2, 2], [9, 10], [1, 0, 1, 0]),
    ((2, 3, 5, 5), (3, 2, 4, 4), [2, 2], [9, 10], [0, 1, 0, 1]),
    ((4, 1, 9, 9), (1, 2, 2, 2), [1, 1], [8, 8], [1, 1, 1, 1]),   # onnx infers [4, 2] for this one
])
def test_an_output_shape_becomes_the_pads_onnxruntime_would_use(x, w, strides, output_shape, pads) -> None:
    """On the forward graph: onnxruntime ignores the pads beside an output_shape, so the rewrite keeps its split,
    and onnx's shape inference then gets every axis."""
    model = _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up", strides=strides, pads=pads,
                                     output_shape=output_shape)], [("x", x), ("w", w)])
    assert _agrees(model, lambda m: explicit_transposed_conv_pads(m, adjoints=False), _feeds(x=x, w=w)) == 1
    explicit_transposed_conv_pads(model, adjoints=False)
    inferred = onnx.shape_inference.infer_shapes(model).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in inferred] == [x[0], w[1], *output_shape]


def test_on_a_differentiated_graph_the_pads_onnx_ad_wrote_are_kept() -> None:
    """The adjoint of a Conv padded (0, 1): onnx-ad's ConvTranspose says pads (0, 1) and the input's size; the
    rewrite keeps that head, where onnxruntime, reading output_shape, would drop one more row at the head."""
    node = helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", strides=[2, 2], pads=[0, 0, 1, 1],
                            output_shape=[8, 8])
    model = _model([node], [("g", (2, 2, 4, 4)), ("w", (2, 3, 3, 3))])
    feeds = _feeds(g=(2, 2, 4, 4), w=(2, 3, 3, 3))
    meant = _model([helper.make_node("ConvTranspose", ["g", "w"], ["y"], name="adjoint", strides=[2, 2],
                                     pads=[0, 0, 1, 1])], [("g", (2, 2, 4, 4)), ("w", (2, 3, 3, 3))])
    wanted = _run(meant, feeds)[0]
    assert wanted.shape == (2, 3, 8, 8)
    assert not np.allclose(_run(model, feeds)[0], wanted), "onnxruntime now honours the pads: see conv.py"
    assert explicit_transposed_conv_pads(model, adjoints=True) == 1
    np.testing.assert_allclose(_run(model, feeds)[0], wanted, rtol=1e-6, atol=1e-6)


# --- ceil-mode pools ----------------------------------------------------------------------------------

def test_a_ceil_mode_pool_whose_windows_fit_loses_the_flag_and_one_that_overhangs_keeps_it() -> None:
    fits = _model([helper.make_node("AveragePool", ["x"], ["y"], name="pool", kernel_shape=[2, 2],
                                    strides=[2, 2], ceil_mode=1)], [("x", (1, 2, 6, 4))])
    assert _agrees(fits, drop_idle_ceil_modes, _feeds(x=(1, 2, 6, 4))) == 1
    overhangs = _model([helper.make_node("AveragePool", ["x"], ["y"], name="pool", kernel_shape=[2, 2],
                                         strides=[2, 2], ceil_mode=1)], [("x", (1, 2, 5, 4))])
    assert drop_idle_ceil_modes(overhangs) == 0


@pytest.mark.parametrize("x, attributes", [
    ((2, 3, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2]}),                              # 5 -> 3
    ((2, 3, 7, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 3, 7, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ((1, 2, 9), {"kernel_shape": [4], "strides": [3], "pads": [2, 1]}),                        # 1-D
])
def test_an_overhanging_ceil_mode_average_pool_becomes_a_padded_pool_times_its_counts(x, attributes) -> None:
    model = _model([helper.make_node("AveragePool", ["x"], ["y"], name="pool", ceil_mode=1, **attributes)],
                   [("x", x)])
    assert drop_idle_ceil_modes(model) == 0
    assert _agrees(model, pad_overhanging_average_pools, _feeds(x=x)) == 1


def test_an_overhanging_pool_trains_as_torchs_does(tmp_path: Path) -> None:
    """torch's AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False) on 8x8 (windows overhang: 5x5 out, 4x4 without ceil_mode), after a Conv that
    trains: the engine's gradient of the Conv's weight against central differences of its own float32 loss."""
    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((3, 2, 3, 3)) * 0.4).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("AveragePool", ["t"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1], ceil_mode=1),
             helper.make_node("Flatten", ["p"], ["y"], name="flat")]
    graph = helper.make_graph(nodes, "ceil",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 75])],
                              initializer=[numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    path = tmp_path / "ceil.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    assert engine.predict(engine.parameters(), {"x": np.zeros((2, 2, 8, 8), np.float32)})["y"].shape == (2, 75)
    batch = {"x": rng.standard_normal((2, 2, 8, 8)).astype(np.float32),
             "labels": rng.standard_normal((2, 75)).astype(np.float32)}
    assert _finite_difference_error(engine, "w", batch) < 1e-2


def _finite_difference_error(engine: GradientEngine, name: str, batch: dict[str, np.ndarray],
                             step: float = 1e-2) -> float:
    """|engine gradient - central differences of the engine's loss| / |differences|, for parameter `name`."""
    parameters = engine.parameters()
    _, grads = engine.gradients(parameters, batch)
    numeric = np.zeros(parameters[name].shape, np.float64)
    for index in np.ndindex(numeric.shape):
        shifted = {k: v.copy() for k, v in parameters.items()}
        shifted[name][index] += step
        above, _ = engine.gradients(shifted, batch)
        shifted[name][index] -= 2 * step
        below, _ = engine.gradients(shifted, batch)
        numeric[index] = (above - below) / (2 * step)
    return float(np.linalg.norm(grads[name] - numeric) / np.linalg.norm(numeric))


# --- a gradient through a Conv padded more at its end ----------------------------------------------------

def test_a_gradient_through_a_conv_padded_more_at_its_end_matches_finite_differences(tmp_path: Path) -> None:
    """TensorFlow's "same" padding at stride 2 on an even map pads (0, 1). onnx-ad's adjoint of such a Conv is a
    ConvTranspose with pads (0, 1) and an output_shape, and onnxruntime, ignoring the pads, cropped the other row:
    the gradient of every layer before it was shifted by one row and column (rel. error ~1)."""
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((4, 2, 3, 3)) * 0.4).astype(np.float32)
    w2 = (rng.standard_normal((3, 4, 3, 3)) * 0.4).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], name="first", pads=[1, 1, 1, 1]),
             helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("Conv", ["t", "w2"], ["c"], name="same_stride_2", strides=[2, 2], pads=[0, 0, 1, 1]),
             helper.make_node("Flatten", ["c"], ["y"], name="flat")]
    graph = helper.make_graph(nodes, "same",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 27])],
                              initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    path = tmp_path / "same.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    batch = {"x": rng.standard_normal((2, 2, 6, 6)).astype(np.float32),
             "labels": rng.standard_normal((2, 27)).astype(np.float32)}
    error = _finite_difference_error(engine, "w1", batch)
    assert error < 1e-2, f"w1's gradient is off by {error:.3g} of its norm"


# --- declared shapes an exporter got wrong ----------------------------------------------------------------

def test_an_output_axis_the_exporter_named_like_the_batch_is_left_to_inference(tmp_path: Path) -> None:
    """torch declared a UNet's output height 'batch' (after a Concat and a Pad): fixing every 'batch' to the batch
    size contradicted the computed 8 and the loss's Sub refused the shapes."""
    rng = np.random.default_rng(2)
    ones = numpy_helper.from_array(np.ones(2, np.float32))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         # scales from a Concat of Constants, as torch writes them: onnx's inference gives the output no shape
         helper.make_node("Constant", [], ["half"], value=ones),
         helper.make_node("Concat", ["half", "half"], ["scales"], axis=0),
         helper.make_node("Resize", ["c", "", "scales"], ["y"], name="resize", mode="nearest")], "mislabeled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, "batch", "width"])],
        initializer=[numpy_helper.from_array(rng.standard_normal((1, 2, 3, 3)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    path = tmp_path / "mislabeled.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path)
    x = rng.standard_normal((4, 2, 8, 8)).astype(np.float32)
    loss, grads = engine.gradients(engine.parameters(), {"x": x, "labels": np.zeros((4, 1, 8, 8), np.float32)})
    assert grads["w"].shape == (1, 2, 3, 3) and np.isfinite(loss)


# --- torch's chunk and split as sequences (the dynamo exporter, optimize=False) --------------------------------

@pytest.mark.parametrize("split, keepdims, positions", [
    (np.array(3, np.int64), 1, [0, 1, 2]),        # chunk(3): pieces of 3, 3 and a shorter 2
    (np.array([2, 5, 1], np.int64), 1, [2, 0]),   # split([2, 5, 1]), read out of order, one piece unread
    (None, 1, [0, -1]),                           # single slices, the axis kept; a negative position
    (None, 0, [3, 7]),                            # single slices, the axis dropped
])
def test_a_sequence_read_at_constant_positions_becomes_a_split_with_the_same_values(split, keepdims,
                                                                                    positions) -> None:
    inputs = ["x"] + (["split"] if split is not None else [])
    nodes = [helper.make_node("SplitToSequence", inputs, ["seq"], axis=-1, keepdims=keepdims)]
    nodes += [helper.make_node("SequenceAt", ["seq", f"p{i}"], [f"y{i}"]) for i in range(len(positions))]
    initializers = [_ints(f"p{i}", p) for i, p in enumerate(positions)]
    if split is not None:
        initializers.append(numpy_helper.from_array(split, "split"))
    model = _model(nodes, [("x", (2, 3, 8))], initializers, outputs=[f"y{i}" for i in range(len(positions))])
    assert _agrees(model, split_constant_sequences, _feeds(x=(2, 3, 8)),
                   ops_left=("SplitToSequence", "SequenceAt")) == 1


def test_a_piece_split_again_is_rewritten_once_its_length_is_known() -> None:
    nodes = [helper.make_node("SplitToSequence", ["x", "six"], ["seq"], axis=-1),
             helper.make_node("SequenceAt", ["seq", "zero"], ["first"]),
             helper.make_node("SplitToSequence", ["first", "sizes"], ["again"], axis=-1),
             helper.make_node("SequenceAt", ["again", "one"], ["y"])]
    model = _model(nodes, [("x", (2, 12))], [_ints("six", 6), _ints("zero", 0), _ints("one", 1),
                                              _ints("sizes", [2, 4])])
    assert _agrees(model, split_constant_sequences, _feeds(x=(2, 12)), ops_left=("SplitToSequence",)) == 2


@pytest.mark.parametrize("case", ["position fed", "sequence is an output", "length unknown"])
def test_a_sequence_not_read_at_constant_positions_is_left_alone(case: str) -> None:
    nodes = [helper.make_node("SplitToSequence", ["x", "three"], ["seq"], axis=1),
             helper.make_node("SequenceAt", ["seq", "p" if case == "position fed" else "zero"], ["y"])]
    inputs = [("x", (2, "n" if case == "length unknown" else 6))]
    graph = helper.make_graph(
        nodes, "rewrite",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(inputs[0][1]))] +
        ([helper.make_tensor_value_info("p", TensorProto.INT64, [])] if case == "position fed" else []),
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)] +
        ([helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)]
         if case == "sequence is an output" else []),
        initializer=[_ints("three", 3), _ints("zero", 0)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    before = model.SerializeToString()
    assert split_constant_sequences(model) == 0
    assert model.SerializeToString() == before


def test_a_model_that_chunks_trains_with_the_gradient_of_the_same_model_written_with_split(tmp_path: Path) -> None:
    """Before the rewrite such a model was refused: onnx-ad has no rule for SequenceAt."""
    weight = numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32), "w")

    def write(name: str, chunk: list[onnx.NodeProto]) -> Path:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), *chunk,
                 helper.make_node("Mul", ["a", "b"], ["y"])]
        path = tmp_path / f"{name}.onnx"
        onnx.save(_model(nodes, [("x", (3, 4))], [weight, _ints("two", [3, 3]), _ints("zero", 0),
                                                   _ints("one", 1)]), path)
        return path

    sequence = write("sequence", [helper.make_node("SplitToSequence", ["h", "two"], ["seq"], axis=1),
                                  helper.make_node("SequenceAt", ["seq", "zero"], ["a"]),
                                  helper.make_node("SequenceAt", ["seq", "one"], ["b"])])
    split = write("split", [helper.make_node("Split", ["h", "two"], ["a", "b"], axis=1)])
    x, target = _feeds(x=(3, 4))["x"], np.ones((3, 3), np.float32)
    grads = [GradientEngine(path, batch_size=3, loss="mse", cache_dir=tmp_path / "cache").gradients(
        {"w": numpy_helper.to_array(weight)}, {"x": x, "labels": target}) for path in (sequence, split)]
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    np.testing.assert_allclose(grads[0][1]["w"], grads[1][1]["w"], rtol=1e-6)
