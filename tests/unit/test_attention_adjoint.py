"""An attention's softmax adjoint takes its row sums from the output (rewrites/attention.py): sum_d dO O for
sum_j P dP, equal to rounding; and where dP has other terms, the sum is left as onnx-ad wrote it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
from worker_client.engine.rewrites.attention import softmax_sums_from_outputs
from worker_client.engine.rewrites.fold import fold_shape_queries
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.toolkit import static_shapes

BATCH, TOKENS, WIDTH = 2, 8, 4


def _attention(after_softmax: list[onnx.NodeProto] | None = None, probabilities: str = "p",
               width: int = WIDTH) -> onnx.ModelProto:
    """Single-head self-attention on x [B, T, D] and a loss: the sum of its output times a fixed R.
    `after_softmax` nodes run between Softmax (output p) and the attention MatMul (which reads `probabilities`)."""
    rng = np.random.default_rng(7)
    weights = [numpy_helper.from_array((rng.standard_normal((width, width)) * 0.6).astype(np.float32), name)
               for name in ("wq", "wk", "wv")]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             *(after_softmax or []),
             helper.make_node("MatMul", [probabilities, "v"], ["o"]),
             helper.make_node("Mul", ["o", "R"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    r = numpy_helper.from_array(rng.standard_normal((BATCH, TOKENS, width)).astype(np.float32), "R")
    graph = helper.make_graph(nodes, "attention",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, TOKENS, width])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [*weights, r])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _differentiated(model: onnx.ModelProto) -> onnx.ModelProto:
    lifted = onnx.ModelProto()
    lifted.CopyFrom(model)
    for name in ("wq", "wk", "wv"):   # the weights as inputs, as the engine feeds them
        tensor = next(t for t in lifted.graph.initializer if t.name == name)
        lifted.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(tensor.dims)))
    kept = [t for t in lifted.graph.initializer if t.name not in ("wq", "wk", "wv")]
    del lifted.graph.initializer[:]
    lifted.graph.initializer.extend(kept)
    derived = differentiate(lifted, ["wq", "wk", "wv", "x"], "loss")
    fold_shape_queries(derived, floats=True)   # as rewrite_adjoints does first
    return derived


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal((BATCH, TOKENS, WIDTH)).astype(np.float32)}
    feeds.update({name: (rng.standard_normal((WIDTH, WIDTH)) * 0.6).astype(np.float32)
                  for name in ("wq", "wk", "wv")})
    return feeds


def _gradients(model: onnx.ModelProto) -> list[np.ndarray]:
    names = [GRAD_PREFIX + n for n in ("wq", "wk", "wv", "x")]
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, _feeds())


def _full_size_products(model: onnx.ModelProto) -> int:
    """Muls over the [B, T, T] probabilities (and the seed axis) that a ReduceSum reads."""
    shapes = static_shapes(model)
    sums = {n.input[0] for n in model.graph.node if n.op_type == "ReduceSum"}
    return sum(1 for n in model.graph.node if n.op_type == "Mul" and n.output[0] in sums
               and shapes.get(n.output[0], ())[:3] == (BATCH, TOKENS, TOKENS))


def _inference_dropout() -> onnx.ModelProto:
    """P through a Dropout without a training flag (the identity), as the legacy exporter writes torch's
    MultiheadAttention, before the MatMul."""
    model = _attention([helper.make_node("Dropout", ["p", "ratio"], ["dropped"])], "dropped")
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.1, np.float32), "ratio"))
    return model


@pytest.mark.parametrize("build", [_attention, _inference_dropout], ids=["direct", "inference_dropout"])
def test_the_row_sums_come_from_the_output_and_the_gradients_agree(build) -> None:
    derived = _differentiated(build())
    assert _full_size_products(derived) == 1   # onnx-ad's sum_j P dP
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(derived)
    assert softmax_sums_from_outputs(rewritten) == 1
    prune(rewritten)
    assert _full_size_products(rewritten) == 0
    for got, expected in zip(_gradients(rewritten), _gradients(derived), strict=True):
        # the same sums in another order: equal to float32 rounding, of the largest gradient's size
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert softmax_sums_from_outputs(rewritten) == 0


def test_heads_wider_than_half_the_tokens_keep_onnx_ads_sum() -> None:
    """d > T / 2: the sum over [.., T, d] would cost about what it saves; 8 tokens of 5 features are left alone."""
    derived = _differentiated(_attention(width=5))
    assert _full_size_products(derived) == 1
    assert softmax_sums_from_outputs(derived) == 0


@pytest.mark.parametrize("case", ["scaled", "reshaped", "read_twice", "other_axis", "training_dropout"])
def test_probabilities_that_reach_the_matmul_otherwise_keep_onnx_ads_sum(case: str) -> None:
    """A scale between Softmax and MatMul (as a Dropout's mask is), a Reshape there, P read by a second
    product, a softmax over another axis, or a training-mode Dropout: dP is not the MatMul's adjoint alone (or
    the sum is another one)."""
    if case == "scaled":
        model = _attention([helper.make_node("Mul", ["p", "half"], ["dropped"])], "dropped")
        model.graph.initializer.append(numpy_helper.from_array(np.full((1, TOKENS, TOKENS), 0.5, np.float32),
                                                               "half"))
    elif case == "reshaped":
        model = _attention([helper.make_node("Reshape", ["p", "same"], ["viewed"])], "viewed")
        model.graph.initializer.append(numpy_helper.from_array(np.array([BATCH, TOKENS, TOKENS]), "same"))
    elif case == "read_twice":
        model = _attention([helper.make_node("MatMul", ["p", "q"], ["po"]),
                            helper.make_node("Add", ["po", "v"], ["vv"])], "p")
        model.graph.node[-3].input[1] = "vv"   # o = p @ (p @ q + v): P read by two MatMuls
    elif case == "training_dropout":   # a Dropout that draws a mask is no identity (onnx-ad refuses to
        derived = _differentiated(_inference_dropout())   # differentiate one: its flag is set afterwards)
        derived.graph.initializer.append(numpy_helper.from_array(np.array(True), "training"))
        next(n for n in derived.graph.node if n.op_type == "Dropout").input.append("training")
        assert softmax_sums_from_outputs(derived) == 0
        return
    else:
        model = _attention()
        next(n for n in model.graph.node if n.op_type == "Softmax").attribute[0].i = 1
    derived = _differentiated(model)
    assert softmax_sums_from_outputs(derived) == 0


def test_an_engine_trains_an_attention_model_with_the_rewrite_to_numpys_gradient(tmp_path) -> None:
    """Through GradientEngine (cache and all) with the mean squared error on the attention's output: the cached
    gradient graph has no full-size product for the row sums, and the weights' gradients are numpy's."""
    model = _attention()
    del model.graph.node[-2:]   # the output o itself, under the engine's loss
    model.graph.initializer.pop()   # R
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("o", TensorProto.FLOAT, ["batch", TOKENS, WIDTH]))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TOKENS, WIDTH]))
    path = tmp_path / "attention.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=BATCH, loss="mse", cache_dir=tmp_path / "cache")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((BATCH, TOKENS, WIDTH)).astype(np.float32)
    target = rng.standard_normal((BATCH, TOKENS, WIDTH)).astype(np.float32)
    parameters = engine.parameters()
    _, grads = engine.gradients(parameters, {"x": x, "labels": target})
    cached, = (tmp_path / "cache").glob("*.onnx")
    assert _full_size_products(onnx.load(cached, load_external_data=False)) == 0
    # numpy, float64
    wq, wk, wv = (parameters[n].astype(np.float64) for n in ("wq", "wk", "wv"))
    x64 = x.astype(np.float64)
    q, k, v = x64 @ wq, x64 @ wk, x64 @ wv
    s = q @ k.transpose(0, 2, 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    d_o = 2 * (o - target) / o.size
    d_v = p.transpose(0, 2, 1) @ d_o
    d_p = d_o @ v.transpose(0, 2, 1)
    d_s = p * (d_p - (p * d_p).sum(-1, keepdims=True))
    d_q, d_k = d_s @ k, d_s.transpose(0, 2, 1) @ q
    flat = x64.reshape(-1, WIDTH)
    for name, d in (("wq", d_q), ("wk", d_k), ("wv", d_v)):
        np.testing.assert_allclose(grads[name], flat.T @ d.reshape(-1, WIDTH), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
