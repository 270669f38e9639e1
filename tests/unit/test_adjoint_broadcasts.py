"""An Expand left to the broadcasting ops that read it (rewrites/broadcasts.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine.rewrites.broadcasts import _follow_reshape, broadcast_in_readers
from worker_client.engine.rewrites.prune import prune

FULL = [4, 3, 5, 6]


def _model(nodes: list[onnx.NodeProto], outputs: list[str], small: list[int] | None = None) -> onnx.ModelProto:
    """Inputs: `s` (small, [1, 3, 1, 1] unless given), `f` and `g` (full); int64 constants named by their values."""
    initializers = [numpy_helper.from_array(np.array(FULL, np.int64), "full_shape"),
                    numpy_helper.from_array(np.array([4, 3, 30], np.int64), "rows"),
                    numpy_helper.from_array(np.array([12, 30], np.int64), "mixed"),
                    numpy_helper.from_array(np.array(120.0, np.float32), "count"),
                    numpy_helper.from_array(np.array([0.5], np.float32), "half")]
    inputs = [helper.make_tensor_value_info("s", TensorProto.FLOAT, small or [1, 3, 1, 1]),
              helper.make_tensor_value_info("f", TensorProto.FLOAT, FULL),
              helper.make_tensor_value_info("g", TensorProto.FLOAT, FULL)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                   for o in outputs], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


def _agrees(model: onnx.ModelProto, small: list[int] | None = None) -> tuple[int, onnx.ModelProto]:
    rng = np.random.default_rng(0)
    feed = {"s": rng.standard_normal(small or [1, 3, 1, 1]).astype(np.float32),
            "f": rng.standard_normal(FULL).astype(np.float32), "g": rng.standard_normal(FULL).astype(np.float32)}
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    count = broadcast_in_readers(changed)
    prune(changed)
    got = ort.InferenceSession(changed.SerializeToString()).run(None, feed)
    for new, old in zip(got, expected, strict=True):
        np.testing.assert_array_equal(new, old)   # the same operations on the same values
    return count, changed


def test_a_reduction_adjoint_expand_and_its_division_by_the_count_go_to_the_small_tensor() -> None:
    """Expand -> Reshape -> Div by the count -> Reshape -> read by a Mul and an Add (a BatchNorm's ReduceMean
    adjoint): no full-size Expand or Div is left, the readers broadcast."""
    nodes = [helper.make_node("Expand", ["s", "full_shape"], ["e"]),
             helper.make_node("Reshape", ["e", "rows"], ["r"]),
             helper.make_node("Div", ["r", "count"], ["d"]),
             helper.make_node("Neg", ["d"], ["n"]),
             helper.make_node("Mul", ["n", "half"], ["h"]),
             helper.make_node("Reshape", ["h", "full_shape"], ["back"]),
             helper.make_node("Mul", ["f", "back"], ["y1"]),
             helper.make_node("Reshape", ["h", "full_shape"], ["again"]),
             helper.make_node("Add", ["again", "g"], ["y2"])]
    count, changed = _agrees(_model(nodes, ["y1", "y2"]))
    assert count == 1
    ops = [n.op_type for n in changed.graph.node]
    assert "Expand" not in ops
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in onnx.shape_inference.infer_shapes(changed).graph.value_info}
    for node in changed.graph.node:
        if node.op_type in ("Div", "Neg") or (node.op_type == "Mul" and "half" in node.input):
            assert np.prod(shapes[node.output[0]]) == 3   # on the small tensor


@pytest.mark.parametrize("case", ["graph_output", "reduction_reader", "mixed_reshape", "both_operands",
                                  "no_full_operand"])
def test_expands_whose_readers_would_not_broadcast_them_the_same_are_kept(case: str) -> None:
    expand = helper.make_node("Expand", ["s", "full_shape"], ["e"])
    nodes, outputs = {
        "graph_output": ([expand, helper.make_node("Mul", ["e", "f"], ["y"])], ["y", "e"]),
        "reduction_reader": ([expand, helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0)], ["y"]),
        # [4, 3, 5, 6] -> [12, 30]: the broadcast batch axis and the full channel axis merge into one
        "mixed_reshape": ([expand, helper.make_node("Reshape", ["e", "mixed"], ["r"]),
                           helper.make_node("Reshape", ["f", "mixed"], ["fr"]),
                           helper.make_node("Mul", ["r", "fr"], ["y"])], ["y"]),
        # Mul(Expand(s), Expand(s)): each needs the other to stay full, or the product would shrink
        "both_operands": ([expand, helper.make_node("Expand", ["s", "full_shape"], ["e2"]),
                           helper.make_node("Mul", ["e", "e2"], ["y"])], ["y"]),
        "no_full_operand": ([expand, helper.make_node("Mul", ["e", "half"], ["y"])], ["y"]),
    }[case]
    count, changed = _agrees(_model(nodes, outputs))
    assert count == 0
    assert [n.op_type for n in changed.graph.node].count("Expand") == (2 if case == "both_operands" else 1)


@pytest.mark.parametrize("full, small, target, expected", [
    ([4, 3, 5, 6, 1], [1, 3, 1, 1, 1], [4, 3, 30], [1, 3, 1]),       # the seed axis dropped, the map flattened
    ([4, 3, 30], [4, 3, 1], [4, 3, 5, 6], [4, 3, 1, 1]),
    ([4, 3, 5, 6], [1, 1, 5, 6], [12, 30], [1, 30]),
    ([4, 3, 5, 6], [1, 3, 1, 1], [12, 30], None),                     # batch (broadcast) and channel (full) merged
    ([4, 3, 5, 6], [4, 3, 1, 1], [4, 15, 6], None),                   # channel and a spatial axis merged
])
def test_the_small_shape_follows_a_reshape_where_it_can(full, small, target, expected) -> None:
    assert _follow_reshape(full, small, target) == expected
