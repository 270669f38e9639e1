"""Masked adjoints, Where(mask, g, 0), as g times the cast mask (rewrites/masks.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
from worker_client.engine.rewrites import rewrite_adjoints
from worker_client.engine.rewrites.masks import masks_as_products, selects_as_products
from worker_client.engine.rewrites.toolkit import static_shapes

SHAPE = [4, 6]


def _model() -> onnx.ModelProto:
    """loss = sum(Clip(x * w, 0, 6) * R) + sum(Where(x > 0, Log(x), 0) * w): a ReLU6, and a forward Where that
    hides the non-finite branch Log(x) of x <= 0."""
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.standard_normal(SHAPE).astype(np.float32) * 3, "R"),
                    numpy_helper.from_array(np.array(0, np.float32), "zero"),
                    numpy_helper.from_array(np.array(6, np.float32), "six")]
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Clip", ["xw", "zero", "six"], ["relu6"]),
             helper.make_node("Mul", ["relu6", "R"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["first"], keepdims=0),
             helper.make_node("Greater", ["x", "zero"], ["positive"]),
             helper.make_node("Log", ["x"], ["log"]),
             helper.make_node("Where", ["positive", "log", "zero"], ["masked"], name="forward_where"),
             helper.make_node("Mul", ["masked", "w"], ["scaled"]),
             helper.make_node("ReduceSum", ["scaled"], ["second"], keepdims=0),
             helper.make_node("Add", ["first", "second"], ["loss"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in "xw"],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_the_adjoints_masked_by_where_become_products_and_give_the_same_gradient() -> None:
    derived = differentiate(_model(), ["w"], "loss")
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(derived)
    wheres = sum(n.op_type == "Where" for n in derived.graph.node)
    changed = masks_as_products(rewritten, GRAD_PREFIX)
    assert changed >= 1   # the Clip's adjoints
    assert sum(n.op_type == "Where" for n in rewritten.graph.node) == wheres - changed
    # the forward Where, whose other branch is -inf and NaN at x <= 0, is kept: the loss stays finite
    assert [n.name for n in rewritten.graph.node if n.op_type == "Where" and n.output[0] == "masked"] == \
        ["forward_where"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(SHAPE).astype(np.float32) * 4
    x[0, :3] = 0.0   # Log(0) = -inf in the branch the forward Where drops
    feed = {"x": x, "w": rng.standard_normal(SHAPE).astype(np.float32)}
    outputs = ["loss", GRAD_PREFIX + "w"]
    expected = ort.InferenceSession(derived.SerializeToString()).run(outputs, feed)
    got = ort.InferenceSession(rewritten.SerializeToString()).run(outputs, feed)
    assert np.isfinite(got[0]) and got[0] == expected[0]
    clipped = (x * feed["w"] <= 0) | (x * feed["w"] >= 6)
    assert clipped.any() and (~clipped).any()   # both sides of the ReLU6 are exercised
    np.testing.assert_array_equal(got[1], expected[1])
    assert np.isfinite(got[1]).all()


def test_a_graph_without_seeded_wheres_is_left_alone() -> None:
    model = _model()   # the forward graph alone: no input or initializer carries the gradient prefix
    assert masks_as_products(model, GRAD_PREFIX) == 0
    assert sum(n.op_type == "Where" for n in model.graph.node) == 1


def _select(chosen: float | int, other: float | int, dtype=np.float32) -> onnx.ModelProto:
    initializers = [numpy_helper.from_array(np.array(chosen, dtype), "a"),
                    numpy_helper.from_array(np.array(other, dtype), "b")]
    nodes = [helper.make_node("Greater", ["x", "y"], ["mask"]),
             helper.make_node("Where", ["mask", "a", "b"], ["selected"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in "xy"],
                              [helper.make_tensor_value_info("selected", helper.np_dtype_to_tensor_dtype(
                                  np.dtype(dtype)), SHAPE)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_a_where_between_a_constant_and_zero_is_the_cast_mask_anywhere() -> None:
    """Clip's adjoint builds its mask as Where(in_range, 1, 0), HardSigmoid's as Where(in_range, 1/6, 0): exact as
    a Cast (of Not, for 0 and k) times k, forward graph or not, since both branches are constants."""
    rng = np.random.default_rng(2)
    feed = {"x": rng.standard_normal(SHAPE).astype(np.float32), "y": rng.standard_normal(SHAPE).astype(np.float32)}
    for chosen, other in ((1.0, 0.0), (0.0, 1.0), (1 / 6, 0.0), (0.0, -2.5)):
        model = _select(chosen, other)
        expected = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
        assert masks_as_products(model, GRAD_PREFIX) == 1
        assert "Where" not in {n.op_type for n in model.graph.node}
        got = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
    for chosen, other, dtype in ((2.0, 3.0, np.float32), (1, 0, np.int64), (0.0, 0.0, np.float32),
                                 (np.inf, 0.0, np.float32)):
        assert masks_as_products(_select(chosen, other, dtype), GRAD_PREFIX) == 0


def _activations(shape: list[int]) -> onnx.ModelProto:
    """loss = sum(Elu(PRelu(x, slope) masked by Where(pad, -inf, .) and a Max) * R): an ELU's and a PReLU's
    slopes, which onnx-ad writes as Wheres of forward values only the gradients read, beside a forward Where of a
    -inf constant (an attention mask's) that the loss reads."""
    rng = np.random.default_rng(3)
    initializers = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "R"),
                    numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf"),
                    numpy_helper.from_array(np.array(-1e4, np.float32), "floor")]
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["p"]),
             helper.make_node("Elu", ["p"], ["e"], alpha=1.0),
             helper.make_node("Where", ["pad", "minus_inf", "e"], ["masked"], name="attention_mask"),
             helper.make_node("Max", ["masked", "floor"], ["kept"]),
             helper.make_node("Mul", ["kept", "R"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                     helper.make_tensor_value_info("slope", TensorProto.FLOAT, [shape[1], 1, 1]),
                     helper.make_tensor_value_info("pad", TensorProto.BOOL, shape)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_whole_tensor_wheres_only_the_gradients_read_become_products() -> None:
    """onnxruntime's Where with a whole-tensor branch takes 4-7 ns an element; those the gradients alone read (the
    ELU's and PReLU's slopes) become casts, products and a sum with the same values, the forward's mask stays."""
    shape = [4, 8, 32, 32]      # 32,768 elements: at the rewrite's floor
    model = _activations(shape)
    derived = rewrite_adjoints(differentiate(model, ["x", "slope"], "loss"))   # as the engine builds it
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(derived)
    assert selects_as_products(rewritten, GRAD_PREFIX) >= 2       # the ELU's slope, the PReLU's slopes, ...
    shapes = static_shapes(rewritten)
    whole = [n.name for n in rewritten.graph.node if n.op_type == "Where"
             and any(shapes.get(name) == tuple(shape) for name in n.input[1:])]
    assert whole == ["attention_mask"]                           # the forward's, with its -inf: kept
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    x[0, 0, 0, :4] = 0.0                                         # on the PReLU's and ELU's edges
    feeds = {"x": x, "slope": rng.uniform(0.1, 0.3, (shape[1], 1, 1)).astype(np.float32),
             "pad": rng.random(shape) < 0.1}
    names = ["loss", GRAD_PREFIX + "x", GRAD_PREFIX + "slope"]
    want = ort.InferenceSession(derived.SerializeToString()).run(names, feeds)
    got = ort.InferenceSession(rewritten.SerializeToString()).run(names, feeds)
    for new, old in zip(got, want, strict=True):
        np.testing.assert_array_equal(new, old)
    small = rewrite_adjoints(differentiate(_activations([2, 8, 4, 4]), ["x", "slope"], "loss"))
    assert selects_as_products(small, GRAD_PREFIX) == 0           # under the floor: Where is quick there
