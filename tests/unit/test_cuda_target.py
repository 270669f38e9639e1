"""The gradient graph built for onnxruntime's CUDA provider, checked where no GPU is: its rewrites are exact, so
the graph computes on the CPU what the CPU's own graph computes, without the CPU-only conv rewrites and without a
ConvTranspose the CUDA provider would hand back to the CPU (unequal pads); the cache keeps the two apart; and a
CUDA placement turns TF32 off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine
from worker_client.engine import session as session_module
from worker_client.engine.cache import entry_path
from worker_client.engine.differentiate import GradientGraph
from worker_client.engine.loss import parse_loss
from worker_client.engine.rewrites import rewrite_adjoints
from worker_client.engine.rewrites.conv import equal_transposed_conv_pads
from worker_client.engine.rewrites.toolkit import attribute
from worker_client.engine.session import CPU_PROVIDER, CUDA_PROVIDER, Placement, placement

OPSET = 18


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=[CPU_PROVIDER]).run(None, feeds)


def _transposed_conv(x_shape: list[int], w_shape: list[int], **attributes: object) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", **attributes)], "up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.linspace(-1, 1, w_shape[1] * attributes.get("group", 1), dtype=np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    return model


def _pads(node: onnx.NodeProto) -> tuple[list[int], list[int]]:
    pads = list(attribute(node, "pads"))
    return pads[:len(pads) // 2], pads[len(pads) // 2:]


@pytest.mark.parametrize("x_shape, w_shape, attributes", [
    ([2, 8, 5, 5], [8, 4, 3, 3], {"strides": [2, 2], "pads": [1, 1, 0, 0]}),     # a ResNet downsampling's adjoint
    ([2, 8, 5, 5], [8, 4, 3, 3], {"strides": [2, 2], "pads": [0, 1, 1, 0], "output_padding": [1, 1]}),
    ([2, 6, 7], [6, 3, 5], {"strides": [3], "pads": [3, 1], "dilations": [2]}),                   # 1-D, dilated
    ([1, 4, 3, 4, 5], [4, 2, 3, 3, 3], {"strides": [2, 1, 2], "pads": [1, 0, 2, 0, 1, 1]}),       # 3-D
    ([2, 6, 5, 5], [6, 2, 3, 3], {"strides": [2, 2], "pads": [2, 0, 1, 1], "group": 3}),          # grouped
])
def test_a_transposed_conv_with_unequal_pads_gets_equal_ones_and_a_slice_that_computes_the_same(
        x_shape: list[int], w_shape: list[int], attributes: dict) -> None:
    rng = np.random.default_rng(4)
    model = _transposed_conv(x_shape, w_shape, **attributes)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "w": rng.standard_normal(w_shape).astype(np.float32)}
    (before,) = _run(model, feeds)
    assert equal_transposed_conv_pads(model) == 1
    (node,) = [n for n in model.graph.node if n.op_type == "ConvTranspose"]
    head, tail = _pads(node)
    assert head == tail
    assert [n.op_type for n in model.graph.node] == ["ConvTranspose", "Slice"]
    (after,) = _run(model, feeds)
    assert after.shape == before.shape
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attributes", [
    {"strides": [2, 2], "pads": [1, 1, 1, 1]},                     # equal already
    {"strides": [2, 2]},                                           # no pads
    {"strides": [2, 2], "output_shape": [10, 10]},                 # onnxruntime computes its pads
    {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
])
def test_transposed_convs_the_equal_pads_pass_does_not_cover_are_left_alone(attributes: dict) -> None:
    model = _transposed_conv([1, 4, 5, 5], [4, 2, 3, 3], **attributes)
    assert equal_transposed_conv_pads(model) == 0
    assert [n.op_type for n in model.graph.node] == ["ConvTranspose"]


def _downsampling_cnn(path: Path) -> Path:
    """Two 3x3 Convs, the second strided (pads 1 at both ends: its input adjoint is padded (1, 0)), then a 1x1."""
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["d"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["d"], ["s"]),
             helper.make_node("Conv", ["s", "w3"], ["y"])]
    weights = {"w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "w2": rng.standard_normal((16, 8, 3, 3)) * 0.2,
               "w3": rng.standard_normal((4, 16, 1, 1)) * 0.2}
    return _saved(path, nodes, ["batch", 3, 16, 16], ["batch", 4, 8, 8], weights)


def _saved(path: Path, nodes: list[onnx.NodeProto], x: list, y: list, weights: dict[str, np.ndarray]) -> Path:
    """A model of `nodes` from input x to output y, with float32 `weights`, written to `path`."""
    graph = helper.make_graph(nodes, path.stem, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
                              [numpy_helper.from_array(w.astype(np.float32), k) for k, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _cuda_graph(engine: GradientEngine) -> GradientGraph:
    """The gradient graph an engine on a GPU builds (built here without one: the target is all that differs)."""
    engine._placement = Placement("cuda:0", [CPU_PROVIDER], 0)
    return engine._gradient_graph(parse_loss("mse"))


def test_the_gradient_graph_built_for_cuda_computes_the_cpu_graphs_gradients_with_plain_convs(tmp_path: Path) -> None:
    engine = GradientEngine(_downsampling_cnn(tmp_path / "down.onnx"), batch_size=4, loss="mse", cache_dir=tmp_path)
    cpu_graph = engine._graph
    cuda_graph = _cuda_graph(engine)

    cpu_ops = [n.op_type for n in cpu_graph.model.graph.node]
    cuda_nodes = cuda_graph.model.graph.node
    assert "Gemm" in cpu_ops, "the CPU graph writes the Conv weight adjoints as GEMMs (the test's premise)"
    assert "Gemm" not in {n.op_type for n in cuda_nodes}
    transposed = [n for n in cuda_nodes if n.op_type == "ConvTranspose"]
    assert transposed and all(head == tail for head, tail in map(_pads, transposed))

    rng = np.random.default_rng(9)
    feeds = {**engine.parameters(), "x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32),
             "labels": rng.standard_normal((4, 4, 8, 8)).astype(np.float32)}
    results = {}
    for label, graph in (("cpu", cpu_graph), ("cuda", cuda_graph)):
        session = ort.InferenceSession(graph.model.SerializeToString(), providers=[CPU_PROVIDER])
        outputs = session.run([graph.loss_output, *graph.gradient_outputs.values()],
                              {i.name: feeds[i.name] for i in session.get_inputs()})
        results[label] = dict(zip(["loss", *graph.gradient_outputs], outputs))
    assert set(results["cuda"]) == set(results["cpu"]) == {"loss", "w1", "w2", "w3"}
    for name, value in results["cpu"].items():
        np.testing.assert_allclose(results["cuda"][name].reshape(value.shape), value, rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def _conv1d(path: Path) -> Path:
    """Two 1-D Convs over 400 samples, the first strided: weight adjoints with kernels of 200 and 196 taps."""
    rng = np.random.default_rng(12)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], pads=[4, 4], strides=[2]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], dilations=[2])]
    weights = {"w1": rng.standard_normal((8, 1, 9)) * 0.3, "w2": rng.standard_normal((4, 8, 5)) * 0.2}
    return _saved(path, nodes, ["batch", 1, 400], ["batch", 4, 192], weights)


def test_the_gradient_graph_built_for_cuda_keeps_the_gemm_weight_adjoints_of_1d_convs(tmp_path: Path) -> None:
    """cuDNN is slow on a 1-D kernel of hundreds of taps (onnx-ad's weight adjoint): those stay GEMMs on CUDA."""
    engine = GradientEngine(_conv1d(tmp_path / "audio.onnx"), batch_size=4, loss="mse", cache_dir=tmp_path)
    cpu_gemms = sum(n.op_type == "Gemm" for n in engine._graph.model.graph.node)
    cuda_graph = _cuda_graph(engine)
    assert cpu_gemms > 0 and sum(n.op_type == "Gemm" for n in cuda_graph.model.graph.node) == cpu_gemms
    rng = np.random.default_rng(13)
    feeds = {**engine.parameters(), "x": rng.standard_normal((4, 1, 400)).astype(np.float32),
             "labels": rng.standard_normal((4, 4, 192)).astype(np.float32)}
    session = ort.InferenceSession(cuda_graph.model.SerializeToString(), providers=[CPU_PROVIDER])
    got = session.run(list(cuda_graph.gradient_outputs.values()), {i.name: feeds[i.name] for i in session.get_inputs()})
    expected = engine.gradients(engine.parameters(), {"x": feeds["x"], "labels": feeds["labels"]})[1]
    for name, value in zip(cuda_graph.gradient_outputs, got):
        np.testing.assert_allclose(value.reshape(expected[name].shape), expected[name], rtol=1e-4, atol=1e-6)


def test_the_cache_keeps_each_targets_gradient_graph_apart(tmp_path: Path) -> None:
    engine = GradientEngine(_downsampling_cnn(tmp_path / "down.onnx"), batch_size=4, loss="mse", cache_dir=tmp_path)
    key = {"batch_size": 4, "loss": parse_loss("mse"), "trainable": engine.trainable_names}
    assert entry_path(tmp_path, engine._lifted, **key) == engine.cache_path
    assert entry_path(tmp_path, engine._lifted, **key, target="cuda") != engine.cache_path


def test_rewrite_adjoints_names_the_targets_it_knows() -> None:
    with pytest.raises(ValueError, match=r"target must be one of \('cpu', 'cuda'\), got 'tpu'"):
        rewrite_adjoints(onnx.ModelProto(), "tpu")


def test_a_cuda_placement_asks_for_full_float32_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module.ort, "get_available_providers", lambda: [CUDA_PROVIDER, CPU_PROVIDER])
    where = placement("cuda:1")
    assert where.providers == [(CUDA_PROVIDER, {"device_id": "1", "use_tf32": "0"}), CPU_PROVIDER]
    assert (where.cuda_index, where.target) == (1, "cuda")
    assert placement("cpu").target == "cpu"
