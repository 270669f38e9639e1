"""Per-channel scales and shifts run as onnxruntime's BatchNormalization on the CPU (rewrites/affine.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine.rewrites import affine
from worker_client.engine.rewrites.affine import MAX_SPAN, MIN_ELEMENTS, channel_affines

OPSET = 17


def _model(nodes: Sequence[onnx.NodeProto], inputs: dict[str, Sequence[int]], outputs: Sequence[str],
           initializers: Sequence[onnx.TensorProto] = (), element=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "affine",
                              [helper.make_tensor_value_info(n, element, list(s)) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(n, element, None) for n in outputs], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(inputs: dict[str, Sequence[int]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in inputs.items()}


def _rewritten(model: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int | None = 1
               ) -> tuple[int, onnx.ModelProto]:
    """The count rewritten in a copy of `model` and the copy, whose outputs must equal the original's."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    count = channel_affines(changed, threads)
    for old, new in zip(_run(model, feeds), _run(changed, feeds), strict=True):
        assert new.shape == old.shape
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-6)
    return count, changed


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


X = [128, 8, 4, 4]      # a span of 16 elements per channel and row
VECTOR = [1, 8, 1, 1]


@pytest.mark.parametrize("order", ["x first", "vector first"])
def test_a_scale_then_a_shift_per_channel_is_one_batch_normalization(order: str) -> None:
    assert np.prod(X) >= MIN_ELEMENTS
    inputs = {"x": X, "a": VECTOR, "c": [8, 1, 1]}      # a vector of lower rank broadcasts the same way
    operands = ["x", "a"] if order == "x first" else ["a", "x"]
    model = _model([helper.make_node("Mul", operands, ["m"]), helper.make_node("Add", ["m", "c"] if order == "x first"
                                                                                else ["c", "m"], ["y"])],
                   inputs, ["y"])
    count, changed = _rewritten(model, _feeds(inputs))
    assert count == 1
    assert [op for op in _ops(changed) if op != "Reshape"] == ["BatchNormalization"]
    (norm,) = [n for n in changed.graph.node if n.op_type == "BatchNormalization"]
    assert norm.output[0] == "y" and norm.input[0] == "x"


def test_a_subtracted_shift_is_negated() -> None:
    inputs = {"x": X, "a": VECTOR, "c": VECTOR}
    model = _model([helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Sub", ["m", "c"], ["y"])], inputs, ["y"])
    count, changed = _rewritten(model, _feeds(inputs))
    assert count == 1 and "Neg" in _ops(changed) and "Sub" not in _ops(changed)


@pytest.mark.parametrize("swap", [False, True])
def test_a_scaled_term_and_a_shift_summed_with_a_full_tensor_leave_one_add(swap: bool) -> None:
    """The BatchNorm adjoint's g * k1 + x_c * k2 + k3, with shape-keeping Reshapes between the nodes; a span of
    256 elements, where the lone Mul stays."""
    big = [8, 8, 16, 16]
    inputs = {"g": big, "x": big, "k1": VECTOR, "k2": VECTOR, "k3": VECTOR}
    same = numpy_helper.from_array(np.array(big, np.int64), "same")
    nodes = [helper.make_node("Mul", ["g", "k1"], ["u"]), helper.make_node("Mul", ["k2", "x"], ["v"]),
             helper.make_node("Reshape", ["v", "same"], ["v2"]),
             helper.make_node("Add", ["v2", "u"] if swap else ["u", "v2"], ["s"]),
             helper.make_node("Reshape", ["s", "same"], ["s2"]), helper.make_node("Add", ["s2", "k3"], ["y"])]
    model = _model(nodes, inputs, ["y"], [same])
    count, changed = _rewritten(model, _feeds(inputs))
    ops = _ops(changed)
    assert count == 1 and ops.count("Add") == 1 and ops.count("Mul") == 1 and ops.count("BatchNormalization") == 1
    (norm,) = [n for n in changed.graph.node if n.op_type == "BatchNormalization"]
    assert norm.input[0] in ("g", "x")   # either scaled term may take the shift


@pytest.mark.parametrize("op", ["Mul", "Add", "Sub"])
def test_a_lone_per_channel_op_moves_on_small_spans_only(op: str) -> None:
    small = {"x": X, "v": VECTOR}
    model = _model([helper.make_node(op, ["x", "v"], ["y"])], small, ["y"])
    count, changed = _rewritten(model, _feeds(small))
    assert count == 1 and [o for o in _ops(changed) if o not in ("Reshape", "Neg")] == ["BatchNormalization"]
    side = int(np.sqrt(MAX_SPAN)) * 2                   # a span past MAX_SPAN
    large = {"x": [16, 8, side, side], "v": VECTOR}
    model = _model([helper.make_node(op, ["x", "v"], ["y"])], large, ["y"])
    assert _rewritten(model, _feeds(large))[0] == 0


@pytest.mark.parametrize("threads, fused", [(1, True), (2, True), (None, None), (8, False)])
def test_a_pair_on_large_spans_is_fused_only_on_few_threads(threads: int | None, fused: bool | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affine.os, "cpu_count", lambda: 4)   # onnxruntime's default on a 4-core machine
    inputs = {"x": [8, 8, 16, 16], "a": VECTOR, "c": VECTOR}
    model = _model([helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"])], inputs, ["y"])
    count, _ = _rewritten(model, _feeds(inputs), threads=threads)
    assert count == (1 if fused else 0)


def test_a_vector_along_another_axis_runs_on_a_three_axis_view() -> None:
    inputs = {"x": [48, 16, 6, 4], "a": [6, 1], "c": [1, 1, 6, 1]}      # axis 2, a span of 4
    model = _model([helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"])], inputs, ["y"])
    count, changed = _rewritten(model, _feeds(inputs))
    assert count == 1
    (norm,) = [n for n in changed.graph.node if n.op_type == "BatchNormalization"]
    assert norm.input[0] != "x"     # the [768, 6, 4] view
    assert changed.graph.node[-1].op_type == "Reshape" and changed.graph.node[-1].output[0] == "y"


@pytest.mark.parametrize("case", ["two varying axes", "span of one", "read twice", "broadcast operand", "dynamic shape",
                                  "too small"])
def test_what_is_not_one_per_channel_affine_is_left_alone(case: str) -> None:
    inputs: dict[str, list] = {"x": [8, 8, 16, 16], "a": VECTOR, "c": VECTOR}   # a span of 256
    outputs = ["y"]
    nodes = [helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"])]
    if case == "two varying axes":
        inputs["a"] = [8, 8, 1, 1]
    elif case == "span of one":      # a LayerNorm's affine: one element per channel and row
        inputs = {"x": [256, 16, 8], "a": [8], "c": [8]}
    elif case == "read twice":
        outputs = ["y", "m"]
    elif case == "broadcast operand":   # the other operand is broadcast too: [128, 1, 4, 4] + [1, 8, 1, 1]
        inputs = {"x": [128, 1, 4, 4], "c": VECTOR}
        nodes = [helper.make_node("Add", ["x", "c"], ["y"])]
    elif case == "too small":     # a lone op on a small span, but fewer than MIN_ELEMENTS
        inputs = {"x": [2, 8, 4, 4], "c": VECTOR}
        nodes = [helper.make_node("Add", ["x", "c"], ["y"])]
    else:
        inputs["x"] = ["N", 8, 16, 16]
    model = _model(nodes, inputs, outputs)
    feeds = _feeds({k: [2 if d == "N" else d for d in v] for k, v in inputs.items()})
    assert _rewritten(model, feeds, threads=1)[0] == 0


def test_integer_arithmetic_and_old_opsets_are_left_alone() -> None:
    inputs = {"x": X, "a": VECTOR, "c": VECTOR}
    nodes = [helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"])]
    integers = _model(nodes, inputs, ["y"], element=TensorProto.INT32)
    assert channel_affines(integers, 1) == 0
    old = _model(nodes, inputs, ["y"])
    old.opset_import[0].version = 7
    assert channel_affines(old, 1) == 0 and _ops(old) == ["Mul", "Add"]


def _bn_engine(tmp_path: Path, threads: int) -> GradientEngine:
    """conv 3 -> 8 on 8 x 8, a training-mode BatchNormalization, ReLU, global average, a linear head (batch 32:
    [32, 8, 8, 8] is MIN_ELEMENTS, with a span of 64)."""
    rng = np.random.default_rng(5)
    weights = {"conv.w": (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32),
               "bn.scale": (1 + 0.1 * rng.standard_normal(8)).astype(np.float32),
               "bn.bias": (0.1 * rng.standard_normal(8)).astype(np.float32),
               "bn.mean": np.zeros(8, np.float32), "bn.var": np.ones(8, np.float32),
               "head.w": (rng.standard_normal((8, 5)) * 0.3).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "conv.w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["b"]),
         helper.make_node("Relu", ["b"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["g"]),
         helper.make_node("Flatten", ["g"], ["f"]), helper.make_node("MatMul", ["f", "head.w"], ["logits"])],
        "bn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    tmp_path.mkdir(parents=True, exist_ok=True)
    onnx.save(model, tmp_path / "bn.onnx")
    return GradientEngine(tmp_path / "bn.onnx", batch_size=32, intra_op_threads=threads, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_training_batch_norm_steps_on_the_fused_kernels_with_the_same_gradients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    rng = np.random.default_rng(6)
    batch = {"image": rng.standard_normal((32, 3, 8, 8)).astype(np.float32), "labels": np.arange(32) % 5}
    counts: list[int] = []

    def counted(model: onnx.ModelProto, given: int | None) -> int:
        counts.append(channel_affines(model, given))
        return counts[-1]

    monkeypatch.setattr("worker_client.engine.engine.channel_affines", counted)
    fused = _bn_engine(tmp_path / "fused", threads)
    assert counts and counts[0] > 0     # the gradient session's graph had per-channel arithmetic moved

    def norms(model: onnx.ModelProto) -> int:
        return sum(n.op_type == "BatchNormalization" for n in model.graph.node)

    cached = fused._graph.model
    assert norms(fused._for_placement(cached)) == norms(cached) + counts[-1]   # the cached graph is left as it was
    monkeypatch.setattr("worker_client.engine.engine.channel_affines", lambda model, given: 0)
    plain = _bn_engine(tmp_path / "plain", threads)
    got, want = fused.step(fused.parameters(), batch), plain.step(plain.parameters(), batch)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    largest = max(float(np.abs(g).max()) for g in want.gradients.values())
    for name, gradient in want.gradients.items():
        np.testing.assert_allclose(got.gradients[name], gradient, rtol=0, atol=1e-5 * largest, err_msg=name)


@pytest.mark.parametrize("inputs", [{"x": [48, 16, 6, 4], "a": [6, 1], "c": [1, 1, 6, 1]},   # a three-axis view
                                    {"x": X, "a": VECTOR, "c": VECTOR}])                   # on the channel axis
def test_node_names_stay_unique_where_nodes_are_named_after_their_outputs(inputs: dict) -> None:
    """Exporters name a node after its output; the rewrite's Reshape back to that output must not take the name
    a second time (onnxruntime refuses a graph with two nodes of one name)."""
    nodes = [helper.make_node("Mul", ["x", "a"], ["m"], name="m"), helper.make_node("Add", ["m", "c"], ["y"], name="y"),
             helper.make_node("Relu", ["y"], ["r"], name="r")]
    model = _model(nodes, inputs, ["r"])
    count, changed = _rewritten(model, _feeds(inputs))
    names = [n.name for n in changed.graph.node]
    assert count == 1 and len(set(names)) == len(names) and "y" in names


def test_an_infinite_scale_still_gives_a_non_finite_result() -> None:
    """onnxruntime folds the scale into the shift (shift - 0 * scale): an infinite scale makes the channel NaN
    where the unfused arithmetic gives an infinity -- non-finite either way, as a shard's check needs."""
    inputs = {"x": X, "a": VECTOR, "c": VECTOR}
    model = _model([helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"])], inputs, ["y"])
    feeds = _feeds(inputs)
    feeds["a"][0, 3] = np.inf
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    assert channel_affines(changed, 1) == 1
    (before,), (after,) = _run(model, feeds), _run(changed, feeds)
    assert not np.isfinite(before[:, 3]).any() and not np.isfinite(after[:, 3]).any()
    np.testing.assert_allclose(np.delete(after, 3, axis=1), np.delete(before, 3, axis=1), rtol=1e-6, atol=1e-6)
