"""GradientEngine: torch-autograd and finite-difference agreement, losses, cache, and errors."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import (DeviceUnavailableError, GradientEngine, ModelLoadError,
                           UnsupportedModelError)
from worker_client.engine.rewrites.conv import gemm_large_kernel_convs, resize_window_spreads
from worker_client.engine.rewrites.layout import canonicalize_layout_ops
from worker_client.engine.rewrites.matmul import flatten_weight_matmuls
from worker_client.engine.rewrites.toolkit import static_shapes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torch"
TORCH_MODELS = ["mlp", "cnn", "embedding_bag", "transformer", "conv_bn_eval", "conv_decoder", "padded_strided"]
OPSET = 18


# --- helpers --------------------------------------------------------------------------------

def _fixture(name: str) -> tuple[Path, dict[str, np.ndarray], str, float, dict[str, np.ndarray]]:
    """(model path, inputs incl. labels, loss kind, torch loss, torch gradients)."""
    data = np.load(FIXTURES / f"{name}.npz")
    inputs = {key[len("input:"):]: data[key] for key in data.files if key.startswith("input:")}
    inputs["labels"] = data["labels"]
    grads = {key[len("grad:"):]: data[key] for key in data.files if key.startswith("grad:")}
    return FIXTURES / f"{name}.onnx", inputs, str(data["loss_kind"]), float(data["loss"]), grads


def _relative_error(value: np.ndarray, reference: np.ndarray) -> float:
    """||value - reference|| / ||reference||: the error measured against the gradient's own
    scale. Element-wise rtol is meaningless for entries that are ~0 through cancellation
    (their float32 rounding error is the size of the larger terms that cancelled)."""
    scale = max(float(np.linalg.norm(reference)), 1e-30)
    return float(np.linalg.norm(value.astype(np.float64) - reference)) / scale


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
           outputs: Sequence[onnx.ValueInfoProto], initializers: Sequence[onnx.TensorProto],
           *, ir_version: int = 9) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs),
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = ir_version
    return model


def _linear_model(path: Path, *, dtype: int = TensorProto.FLOAT, features: int = 3,
                  outputs: int = 2, seed: int = 0, ir_version: int = 9) -> Path:
    """y = x @ W + b with a symbolic batch axis."""
    rng = np.random.default_rng(seed)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    weight = rng.standard_normal((features, outputs)).astype(np_type)
    bias = rng.standard_normal(outputs).astype(np_type)
    return _save(_model(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="linear")],
        [helper.make_tensor_value_info("x", dtype, ["batch", features])],
        [helper.make_tensor_value_info("y", dtype, ["batch", outputs])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")],
        ir_version=ir_version), path)


def _smooth_float64_model(path: Path) -> Path:
    """A float64 model of smooth ops: embedding gather + mean, MatMul, LayerNorm, Tanh, Gemm."""
    rng = np.random.default_rng(1)
    double = TensorProto.DOUBLE
    values = {
        "table": rng.standard_normal((7, 4)),
        "W1": rng.standard_normal((4, 5)) * 0.7,
        "b1": rng.standard_normal(5) * 0.1,
        "gamma": 1.0 + 0.1 * rng.standard_normal(5),
        "beta": 0.1 * rng.standard_normal(5),
        "W2": rng.standard_normal((5, 3)) * 0.7,
        "b2": rng.standard_normal(3) * 0.1,
    }
    axes = helper.make_node("Constant", [], ["axes"], name="axes",
                            value=numpy_helper.from_array(np.array([1], np.int64), "axes"))
    nodes = [
        axes,
        helper.make_node("Gather", ["table", "ids"], ["embedded"], name="embed"),
        helper.make_node("ReduceMean", ["embedded", "axes"], ["bag"], name="bag", keepdims=0),
        helper.make_node("MatMul", ["bag", "W1"], ["projected"], name="project"),
        helper.make_node("Add", ["projected", "b1"], ["hidden"], name="project_bias"),
        helper.make_node("LayerNormalization", ["hidden", "gamma", "beta"], ["normed"],
                         name="norm", axis=-1),
        helper.make_node("Tanh", ["normed"], ["activated"], name="tanh"),
        helper.make_node("Gemm", ["activated", "W2", "b2"], ["logits"], name="head"),
    ]
    return _save(_model(
        nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3])],
        [helper.make_tensor_value_info("logits", double, ["batch", 3])],
        [numpy_helper.from_array(v.astype(np.float64), k) for k, v in values.items()]), path)


# --- agreement with torch and with finite differences -------------------------------------

@pytest.mark.parametrize("name", TORCH_MODELS)
def test_loss_and_gradients_match_torch_autograd_for_each_torch_fixture(
        name: str, tmp_path: Path) -> None:
    path, inputs, kind, torch_loss, torch_grads = _fixture(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither export recipe ties parameters
        engine = GradientEngine(path, batch_size=len(inputs["labels"]), loss=kind,
                                cache_dir=tmp_path)
    assert sorted(engine.trainable_names) == sorted(torch_grads)
    loss, grads = engine.gradients(engine.parameters(), inputs)
    assert abs(loss - torch_loss) <= 1e-5 * abs(torch_loss)
    for key, reference in torch_grads.items():
        assert grads[key].shape == reference.shape
        assert grads[key].dtype == np.float32
        assert _relative_error(grads[key], reference) <= 1e-5, key


def test_gradients_match_central_finite_differences_on_a_float64_model(
        tmp_path: Path) -> None:
    path = _smooth_float64_model(tmp_path / "smooth64.onnx")
    rng = np.random.default_rng(2)
    inputs = {"ids": rng.integers(0, 7, (6, 3)), "labels": rng.integers(0, 3, 6)}
    inputs["ids"][0] = [2, 2, 5]  # a repeated id: its rows' contributions must add up
    engine = GradientEngine(path, batch_size=6, cache_dir=tmp_path)
    parameters = engine.parameters()
    _, grads = engine.gradients(parameters, inputs)
    step = 1e-6
    for name, value in parameters.items():
        assert grads[name].dtype == np.float64
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            shifted = {k: v.copy() for k, v in parameters.items()}
            shifted[name][index] = value[index] + step
            above, _ = engine.gradients(shifted, inputs)
            shifted[name][index] = value[index] - step
            below, _ = engine.gradients(shifted, inputs)
            numeric[index] = (above - below) / (2 * step)
        # central differences in float64: truncation ~ step**2, rounding ~ 1e-16 / step
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-8, err_msg=name)


def test_mse_loss_and_gradients_match_the_closed_form_for_a_linear_model(
        tmp_path: Path) -> None:
    path = _linear_model(tmp_path / "linear.onnx")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    target = rng.standard_normal((5, 2)).astype(np.float32)
    engine = GradientEngine(path, batch_size=5, loss="mse", cache_dir=tmp_path)
    parameters = engine.parameters()
    loss, grads = engine.gradients(parameters, {"x": x, "labels": target})
    residual = (x @ parameters["W"] + parameters["b"] - target).astype(np.float64)
    assert loss == pytest.approx(float(np.mean(residual ** 2)), rel=1e-6)
    np.testing.assert_allclose(grads["W"], 2 * x.T @ residual / residual.size, rtol=1e-5)
    np.testing.assert_allclose(grads["b"], 2 * residual.sum(axis=0) / residual.size,
                               rtol=1e-5)


def test_output_loss_differentiates_the_models_own_scalar_output(tmp_path: Path) -> None:
    """loss="output:NAME": no labels are added, and an input the graph itself calls
    "labels" is fed like any other input."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((3, 2)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"], name="linear"),
        helper.make_node("Sub", ["y", "labels"], ["residual"], name="residual"),
        helper.make_node("Mul", ["residual", "residual"], ["squared"], name="square"),
        helper.make_node("ReduceMean", ["squared"], ["objective"], name="mean", keepdims=0),
    ]
    path = _save(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
                helper.make_tensor_value_info("labels", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2]),
         helper.make_tensor_value_info("objective", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(weight, "W")]), tmp_path / "own_loss.onnx")
    x = rng.standard_normal((4, 3)).astype(np.float32)
    target = rng.standard_normal((4, 2)).astype(np.float32)
    engine = GradientEngine(path, batch_size=4, loss="output:objective", cache_dir=tmp_path)
    assert engine.input_names == ["x", "labels"]
    assert engine.takes_labels   # the graph's own input of that name: the data's labels feed it
    loss, grads = engine.gradients(engine.parameters(), {"x": x, "labels": target})
    residual = (x @ weight - target).astype(np.float64)
    assert loss == pytest.approx(float(np.mean(residual ** 2)), rel=1e-6)
    np.testing.assert_allclose(grads["W"], 2 * x.T @ residual / residual.size, rtol=1e-5)


# --- parameters, predict, selection ---------------------------------------------------------

def test_an_engine_says_whether_its_step_takes_the_datas_labels(tmp_path: Path) -> None:
    path, _, kind, _, _ = _fixture("mlp")
    assert GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path).takes_labels
    assert not GradientEngine(path, batch_size=16, loss=None, cache_dir=tmp_path).takes_labels
    assert not GradientEngine(path, batch_size=16, loss="vjp", cache_dir=tmp_path).takes_labels


def test_parameters_returns_copies_of_the_initial_initializer_values(tmp_path: Path) -> None:
    path, _, kind, _, _ = _fixture("mlp")
    engine = GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path)
    initial = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    parameters = engine.parameters()
    assert list(parameters) == engine.trainable_names == list(initial)
    for name, value in parameters.items():
        np.testing.assert_array_equal(value, initial[name])
    parameters["fc1.weight"][:] = 0.0
    assert np.array_equal(engine.parameters()["fc1.weight"], initial["fc1.weight"])


def test_predict_accepts_smaller_batches_and_agrees_with_the_gradient_loss(
        tmp_path: Path) -> None:
    path, inputs, kind, torch_loss, _ = _fixture("transformer")
    engine = GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path)
    parameters = engine.parameters()
    full = engine.predict(parameters, {"ids": inputs["ids"]})["output"]
    part = engine.predict(parameters, {"ids": inputs["ids"][:5]})["output"]
    assert full.shape == (16, 5) and part.shape == (5, 5)
    np.testing.assert_allclose(part, full[:5], rtol=1e-5, atol=1e-6)
    shifted = full - full.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    cross_entropy = -log_probs[np.arange(16), inputs["labels"]].mean()
    assert cross_entropy == pytest.approx(torch_loss, rel=1e-5)


def test_predict_runs_a_fixed_batch_model_on_padded_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((3, 2)).astype(np.float32)
    path = _save(_model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="linear")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [numpy_helper.from_array(weight, "W")]), tmp_path / "fixed.onnx")
    engine = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path)
    x = rng.standard_normal((7, 3)).astype(np.float32)
    for rows in (3, 7):
        y = engine.predict(engine.parameters(), {"x": x[:rows]})["y"]
        np.testing.assert_allclose(y, x[:rows] @ weight, rtol=1e-5)


def test_include_and_exclude_patterns_select_the_trainable_initializers(
        tmp_path: Path) -> None:
    path, inputs, kind, _, torch_grads = _fixture("mlp")
    engine = GradientEngine(path, batch_size=16, loss=kind, include=["fc*"],
                            exclude=["fc1.*"], cache_dir=tmp_path)
    assert engine.trainable_names == ["fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    _, grads = engine.gradients(engine.parameters(), inputs)
    assert sorted(grads) == sorted(engine.trainable_names)
    for key, value in grads.items():  # fc1 stays at its initial, now constant, value
        assert _relative_error(value, torch_grads[key]) <= 1e-5


def test_float64_data_is_cast_to_the_float32_inputs_the_model_declares(
        tmp_path: Path) -> None:
    path, inputs, kind, torch_loss, _ = _fixture("mlp")
    engine = GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path)
    loss, _ = engine.gradients(engine.parameters(), {
        "x": inputs["x"].astype(np.float64), "labels": inputs["labels"].astype(np.int32)})
    assert loss == pytest.approx(torch_loss, rel=1e-5)


def test_a_model_written_with_onnxs_newest_ir_version_still_loads(tmp_path: Path) -> None:
    path = _linear_model(tmp_path / "newest_ir.onnx", ir_version=onnx.IR_VERSION)
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    loss, grads = engine.gradients(engine.parameters(), {
        "x": np.ones((2, 3), np.float32), "labels": np.zeros((2, 2), np.float32)})
    assert np.isfinite(loss) and grads["W"].shape == (3, 2)


# --- the on-disk cache -----------------------------------------------------------------------

def test_a_second_engine_reuses_the_cached_gradient_model(tmp_path: Path) -> None:
    path, inputs, kind, _, _ = _fixture("cnn")
    first = GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path / "cache")
    assert not first.cache_hit and first.cache_path is not None and first.cache_path.is_file()
    written = first.cache_path.stat().st_mtime_ns
    second = GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path / "cache")
    assert second.cache_hit and second.cache_path == first.cache_path
    assert first.cache_path.stat().st_mtime_ns == written
    assert list((tmp_path / "cache").iterdir()) == [first.cache_path]  # no temporary left
    loss_first, grads_first = first.gradients(first.parameters(), inputs)
    loss_second, grads_second = second.gradients(second.parameters(), inputs)
    assert loss_first == loss_second
    for key, value in grads_first.items():
        np.testing.assert_array_equal(value, grads_second[key])


def test_a_changed_model_or_batch_size_gets_a_new_cache_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    original = GradientEngine(_linear_model(tmp_path / "a.onnx"), batch_size=2, loss="mse",
                              cache_dir=cache)
    changed = onnx.load(tmp_path / "a.onnx")
    changed.graph.node[0].attribute.append(helper.make_attribute("alpha", 2.0))
    edited = GradientEngine(_save(changed, tmp_path / "b.onnx"), batch_size=2, loss="mse",
                            cache_dir=cache)
    rebatched = GradientEngine(tmp_path / "a.onnx", batch_size=3, loss="mse", cache_dir=cache)
    assert not edited.cache_hit and not rebatched.cache_hit
    paths = {original.cache_path, edited.cache_path, rebatched.cache_path}
    assert len(paths) == 3 and all(p is not None and p.is_file() for p in paths)


def test_a_changed_engine_source_gets_a_new_cache_entry(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph cached by other engine code (a rewrite changed, GRAPH_FORMAT not bumped) is never served."""
    from worker_client.engine import cache

    path = _linear_model(tmp_path / "a.onnx")
    first = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    assert GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache").cache_hit
    monkeypatch.setattr(cache, "code_digest", lambda: "another engine")
    other = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    assert not other.cache_hit and other.cache_path != first.cache_path


def test_the_cache_directory_defaults_to_the_environment_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNX_PS_CACHE", str(tmp_path / "from_env"))
    engine = GradientEngine(_linear_model(tmp_path / "a.onnx"), batch_size=2, loss="mse")
    assert engine.cache_path is not None
    assert engine.cache_path.parent == tmp_path / "from_env"


def test_an_unwritable_cache_only_warns(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not cache the gradient model"):
        engine = GradientEngine(_linear_model(tmp_path / "a.onnx"), batch_size=2, loss="mse",
                                cache_dir=blocker / "cache")
    loss, _ = engine.gradients(engine.parameters(), {
        "x": np.ones((2, 3), np.float32), "labels": np.zeros((2, 2), np.float32)})
    assert np.isfinite(loss)


# --- refused models and warnings ------------------------------------------------------------

def _dropout_model(path: Path, *, flag_input: bool = False) -> Path:
    """Gemm then a training-mode Dropout (ratio 0.5); with `flag_input` its training flag
    is a graph input, computed at run time, instead of a constant."""
    constants = [
        helper.make_node("Constant", [], ["ratio"], name="ratio",
                         value=numpy_helper.from_array(np.array(0.5, np.float32), "ratio")),
    ]
    if not flag_input:
        constants.append(helper.make_node(
            "Constant", [], ["training"], name="training",
            value=numpy_helper.from_array(np.array(True), "training")))
    nodes = constants + [
        helper.make_node("Gemm", ["x", "W", "b"], ["hidden"], name="linear"),
        helper.make_node("Dropout", ["hidden", "ratio", "training"], ["y"], name="dropout_1"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])]
    if flag_input:
        inputs.append(helper.make_tensor_value_info("training", TensorProto.BOOL, []))
    return _save(_model(
        nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(np.ones((3, 2), np.float32), "W"),
         numpy_helper.from_array(np.zeros(2, np.float32), "b")]), path)


def test_a_training_mode_dropout_multiplies_by_the_fed_mask_over_the_keep_rate(
        tmp_path: Path) -> None:
    engine = GradientEngine(_dropout_model(tmp_path / "dropout.onnx"), batch_size=2,
                            loss="mse", cache_dir=tmp_path)
    mask_name = "dropout_mask:dropout_1"
    assert engine.mask_names == [mask_name]
    x = np.array([[1.0, 2.0, 3.0], [0.5, 0.0, -1.0]], np.float32)
    mask = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    target = np.zeros((2, 2), np.float32)
    loss, grads = engine.gradients(engine.parameters(),
                                   {"x": x, "labels": target, mask_name: mask})
    hidden = x @ np.ones((3, 2), np.float32)
    output = hidden * mask / 0.5
    assert loss == pytest.approx(float((output ** 2).mean()), rel=1e-6)
    np.testing.assert_allclose(grads["b"], (2 * output / output.size * mask / 0.5).sum(0),
                               rtol=1e-6)


def test_a_dropout_whose_training_flag_is_computed_is_refused_naming_it(
        tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError,
                       match=r"'dropout_1' \(Dropout\): its training_mode input 'training' "
                             r"is computed at run time"):
        GradientEngine(_dropout_model(tmp_path / "dropout.onnx", flag_input=True),
                       batch_size=2, cache_dir=tmp_path)


def test_batch_norm_running_statistics_are_not_trainable(tmp_path: Path) -> None:
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "shift", "mean", "var"],
                              ["y"], name="bn")]
    path = _save(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.full(3, v, np.float32), n)
         for n, v in (("scale", 2.0), ("shift", 0.5), ("mean", 0.1), ("var", 4.0))]),
        tmp_path / "bn_eval.onnx")
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    assert engine.trainable_names == ["scale", "shift"]


def _unflattened_batch_norm(path: Path, how: str) -> Path:
    """x [batch, 12] -> Reshape to [batch, 3, 2, 2] -> training-mode BatchNormalization -> Flatten. `how` writes
    the Reshape's target shape as torch's nn.Unflatten exports it ("unflatten": a Slice of Shape(x) whose end is
    integer arithmetic on constants, concatenated with the new axes), as a constant ("constant"), or as a
    graph input of unknown length ("fed")."""
    ints = {"start": [0], "one": [1], "zero": [0], "axes": [3, 2, 2]}
    nodes = []
    if how == "unflatten":
        nodes += [helper.make_node("Shape", ["x"], ["shape"]),
                  helper.make_node("Add", ["zero", "one"], ["end"]),
                  helper.make_node("Mod", ["end", "two"], ["bounded"]),
                  helper.make_node("Slice", ["shape", "start", "bounded"], ["batch"]),
                  helper.make_node("Concat", ["batch", "axes"], ["target"], axis=0)]
        ints["two"] = [2]
    elif how == "constant":
        ints["target"] = [-1, 3, 2, 2]
    nodes += [helper.make_node("Reshape", ["x", "target"], ["grid"]),
              helper.make_node("BatchNormalization", ["grid", "scale", "shift", "mean", "var"],
                               ["normed", "new_mean", "new_var"], name="bn", training_mode=1),
              helper.make_node("Flatten", ["normed"], ["y"])]
    fed = [helper.make_tensor_value_info("target", TensorProto.INT64, ["n"])] if how == "fed" else []
    rng = np.random.default_rng(3)
    return _save(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 12]), *fed],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 12])],
        [*(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in ints.items()),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "scale"),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "shift"),
         numpy_helper.from_array(np.zeros(3, np.float32), "mean"),
         numpy_helper.from_array(np.ones(3, np.float32), "var")]), path)


def test_a_batch_norm_after_an_unflatten_trains_as_after_a_constant_reshape(tmp_path: Path) -> None:
    """torch's nn.Unflatten computes its target shape with integer arithmetic onnx's shape inference does not
    evaluate, so the BatchNormalization's input rank was unknown and the model refused: the arithmetic is folded
    first, and the step is the one of the same model with a constant shape."""
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((4, 12)).astype(np.float32),
             "labels": rng.standard_normal((4, 12)).astype(np.float32)}
    results = []
    for how in ("unflatten", "constant"):
        engine = GradientEngine(_unflattened_batch_norm(tmp_path / f"{how}.onnx", how), batch_size=4, loss="mse",
                                cache_dir=tmp_path / how)
        results.append(engine.step({**engine.parameters(), **engine.state()}, feeds))
    unflattened, constant = results
    assert unflattened.loss == pytest.approx(constant.loss, rel=1e-6)
    assert set(unflattened.gradients) == set(constant.gradients) == {"scale", "shift"}
    for name, gradient in constant.gradients.items():
        np.testing.assert_allclose(unflattened.gradients[name], gradient, rtol=1e-6, atol=1e-7)
    for name, value in constant.state.items():
        np.testing.assert_allclose(unflattened.state[name], value, rtol=1e-6, atol=1e-7)


def test_a_batch_norm_whose_input_rank_cannot_be_known_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"'bn' \(BatchNormalization, training mode\): the rank of "
                                                    r"its input 'grid' is unknown"):
        GradientEngine(_unflattened_batch_norm(tmp_path / "fed.onnx", "fed"), batch_size=4, loss="mse",
                       cache_dir=tmp_path)


def test_an_integer_grid_that_onnxs_data_propagation_refuses_still_trains(tmp_path: Path) -> None:
    """y = (x @ W) * mean(grid) with grid = Unsqueeze(Range(0, 3), -1) + Range(0, 6), a [3, 6] broadcast as torch's
    dynamo exporter writes adaptive_avg_pool2d to a size that does not divide its input. onnx's data propagation
    reads the Add as a broadcast of two shapes of lengths 3 and 6 and refuses the valid model; the engine infers
    again without it."""
    ints = {"zero": 0, "three": 3, "six": 6, "one": 1}
    nodes = [helper.make_node("Range", ["zero", "three", "one"], ["rows"]),
             helper.make_node("Unsqueeze", ["rows", "last"], ["column"]),
             helper.make_node("Range", ["zero", "six", "one"], ["row"]),
             helper.make_node("Add", ["column", "row"], ["grid"]),
             helper.make_node("Cast", ["grid"], ["grid_float"], to=TensorProto.FLOAT),
             helper.make_node("ReduceMean", ["grid_float"], ["scale"], keepdims=0),
             helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Mul", ["h", "scale"], ["y"])]
    weight = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
                   [*(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in ints.items()),
                    numpy_helper.from_array(np.array([-1], np.int64), "last"), numpy_helper.from_array(weight, "W")])
    with pytest.raises(onnx.shape_inference.InferenceError, match="Invalid rank for Add broadcasting"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    engine = GradientEngine(_save(model, tmp_path / "grid.onnx"), batch_size=4, loss="mse", cache_dir=tmp_path)
    rng = np.random.default_rng(7)
    x, labels = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    result = engine.step(engine.parameters(), {"x": x, "labels": labels})
    scale = float(np.mean(np.arange(3)[:, None] + np.arange(6)))   # 3.5
    y = x @ weight * scale
    assert result.loss == pytest.approx(float(((y - labels) ** 2).mean()), rel=1e-5)
    np.testing.assert_allclose(result.gradients["W"], x.T @ (2 * (y - labels) / labels.size) * scale, rtol=1e-5)


def test_a_model_onnxs_shape_inference_refuses_is_refused_saying_so(tmp_path: Path) -> None:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "x"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                   [numpy_helper.from_array(np.ones((3, 4), np.float32), "W")])
    path = tmp_path / "mismatch.onnx"
    onnx.save(model, path)
    with pytest.raises(UnsupportedModelError, match=r"mismatch\.onnx: ONNX shape inference failed: "):
        GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path)


def test_an_op_without_a_reverse_rule_is_refused_naming_the_node_and_op(
        tmp_path: Path) -> None:
    rois = np.array([[0, 0, 0, 1, 1], [0, 1, 1, 3, 3]], np.float32)
    nodes = [
        helper.make_node("Constant", [], ["rois"], name="rois",
                         value=numpy_helper.from_array(rois, "rois")),
        helper.make_node("Mul", ["x", "w"], ["scaled"], name="scale"),
        helper.make_node("MaxRoiPool", ["scaled", "rois"], ["pooled"], name="roi_pool_1",
                         pooled_shape=[1, 1]),
        helper.make_node("ReduceSum", ["pooled"], ["total"], name="total", keepdims=0),
    ]
    path = _save(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.ones((1, 1, 4, 4), np.float32), "w")]),
        tmp_path / "roi.onnx")
    with pytest.raises(UnsupportedModelError, match=r"'roi_pool_1' \(MaxRoiPool\)"):
        GradientEngine(path, batch_size=1, loss="output:total", cache_dir=tmp_path)


def test_one_initializer_feeding_several_layers_warns_about_eval_mode_tying(
        tmp_path: Path) -> None:
    """What torch.onnx.export's eval-mode de-duplication produces from two fresh LayerNorms."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["h"],
                         name="ln1"),
        helper.make_node("Identity", ["ln.weight"], ["ln2.weight"], name="tie"),
        helper.make_node("LayerNormalization", ["h", "ln2.weight", "ln.bias"], ["y"],
                         name="ln2"),
    ]
    path = _save(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "ln.weight"),
         numpy_helper.from_array(np.zeros(4, np.float32), "ln.bias")]), tmp_path / "tied.onnx")
    with pytest.warns(UserWarning) as caught:
        GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    messages = [str(w.message) for w in caught]
    for name in ("ln.weight", "ln.bias"):
        assert any(f"'{name}' feeds 2 layers: ln1 (LayerNormalization), ln2 "
                   f"(LayerNormalization)" in m and "TrainingMode.TRAINING" in m
                   for m in messages), messages


# --- validation -------------------------------------------------------------------------------

@pytest.fixture()
def mlp_engine(tmp_path: Path) -> GradientEngine:
    path, _, kind, _, _ = _fixture("mlp")
    return GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path)


def test_a_missing_input_is_named(mlp_engine: GradientEngine) -> None:
    with pytest.raises(ValueError, match=r"input 'x' is missing; expected shape \(16, 64\)"):
        mlp_engine.gradients(mlp_engine.parameters(), {"labels": np.zeros(16, np.int64)})


def test_missing_labels_are_named(mlp_engine: GradientEngine) -> None:
    with pytest.raises(ValueError, match=r"input 'labels' is missing; expected shape \(16,\)"):
        mlp_engine.gradients(mlp_engine.parameters(), {"x": np.zeros((16, 64), np.float32)})


def test_a_wrong_batch_size_names_the_input_and_both_shapes(
        mlp_engine: GradientEngine) -> None:
    inputs: dict[str, np.ndarray] = {"x": np.zeros((8, 64), np.float32),
                                     "labels": np.zeros(16, np.int64)}
    with pytest.raises(ValueError,
                       match=r"input 'x': expected shape \(16, 64\), got \(8, 64\)"):
        mlp_engine.gradients(mlp_engine.parameters(), inputs)


def test_wrong_label_shapes_and_values_are_refused(mlp_engine: GradientEngine) -> None:
    x = np.zeros((16, 64), np.float32)
    with pytest.raises(ValueError, match=r"labels: expected shape \(16,\), got \(16, 1\)"):
        mlp_engine.gradients(mlp_engine.parameters(),
                             {"x": x, "labels": np.zeros((16, 1), np.int64)})
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\), got values in \[0, 10\]"):
        mlp_engine.gradients(mlp_engine.parameters(),
                             {"x": x, "labels": np.arange(16) % 11})
    with pytest.raises(ValueError, match=r"labels: expected dtype int64, got float32"):
        mlp_engine.gradients(mlp_engine.parameters(),
                             {"x": x, "labels": np.zeros(16, np.float32)})


def test_a_wrong_or_missing_parameter_is_named(mlp_engine: GradientEngine) -> None:
    inputs: dict[str, np.ndarray] = {"x": np.zeros((16, 64), np.float32),
                                     "labels": np.zeros(16, np.int64)}
    parameters = mlp_engine.parameters()
    parameters["fc2.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError,
                       match=r"parameter 'fc2.bias': expected shape \(128,\), got \(3,\)"):
        mlp_engine.gradients(parameters, inputs)
    del parameters["fc2.bias"]
    with pytest.raises(ValueError, match=r"parameters are missing \['fc2.bias'\]"):
        mlp_engine.gradients(parameters, inputs)


@pytest.mark.parametrize("damage, problem", [
    ("missing", r"cannot read the model file .*: No such file or directory"),
    ("empty", r"\(0 bytes\) holds no graph: it is empty, truncated"),
    ("truncated", r"does not parse as an ONNX model .*: it is empty, truncated, corrupt"),
    ("not_onnx", r"does not parse as an ONNX model .*: it is empty, truncated, corrupt"),
])
def test_an_unreadable_model_file_is_refused_naming_the_file_and_the_problem(
        damage: str, problem: str, tmp_path: Path) -> None:
    whole = _linear_model(tmp_path / "whole.onnx").read_bytes()
    path = tmp_path / "damaged.onnx"
    if damage != "missing":
        path.write_bytes({"empty": b"", "truncated": whole[:len(whole) * 2 // 3],
                          "not_onnx": b"name,value\nW,1.5\n"}[damage])
    with pytest.raises(ModelLoadError, match=problem) as caught:
        GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, ValueError) and caught.value.reason == "MODEL_UNREADABLE"
    assert not (tmp_path / "cache").exists()


def test_bad_options_are_refused_with_their_values(tmp_path: Path) -> None:
    path = _linear_model(tmp_path / "a.onnx")
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 0"):
        GradientEngine(path, batch_size=0)
    with pytest.raises(ValueError, match=r"loss must be .*, got 'hinge'"):
        GradientEngine(path, batch_size=2, loss="hinge")
    with pytest.raises(ValueError, match=r"device must be .*, got 'tpu'"):
        GradientEngine(path, batch_size=2, device="tpu")
    with pytest.raises(UnsupportedModelError, match=r"'output:nope' names no graph output"):
        GradientEngine(path, batch_size=2, loss="output:nope", cache_dir=tmp_path)


def test_loss_none_builds_a_predict_only_engine(tmp_path: Path) -> None:
    engine = GradientEngine(_linear_model(tmp_path / "a.onnx"), batch_size=2, loss=None,
                            cache_dir=tmp_path / "cache")
    assert engine.cache_path is None and not (tmp_path / "cache").exists()
    y = engine.predict(engine.parameters(), {"x": np.ones((3, 3), np.float32)})["y"]
    assert y.shape == (3, 2)
    with pytest.raises(RuntimeError, match="loss=None"):
        engine.gradients(engine.parameters(), {"x": np.ones((2, 3), np.float32)})


def test_the_io_binding_path_used_on_cuda_gives_the_same_results_on_cpu(
        tmp_path: Path) -> None:
    """CUDA runs bind inputs and preallocated host outputs; this exercises that code on CPU
    (by flipping the engine's private switch), since no GPU is needed to check it."""
    path, inputs, kind, _, _ = _fixture("cnn")
    engine = GradientEngine(path, batch_size=16, loss=kind, cache_dir=tmp_path)
    plain_loss, plain = engine.gradients(engine.parameters(), inputs)
    engine._bind_outputs = True
    bound_loss, bound = engine.gradients(engine.parameters(), inputs)
    assert bound_loss == plain_loss
    for key, value in plain.items():
        np.testing.assert_array_equal(bound[key], value)


def test_an_engine_names_its_device_and_the_providers_its_session_runs_on(tmp_path: Path) -> None:
    path = _linear_model(tmp_path / "a.onnx")
    engine = GradientEngine(path, batch_size=2, cache_dir=tmp_path)
    assert (engine.device, engine.providers) == ("cpu", ["CPUExecutionProvider"])
    predict_only = GradientEngine(path, batch_size=2, loss=None, cache_dir=tmp_path)
    assert predict_only.providers == ["CPUExecutionProvider"]      # before its predict session opens
    predict_only.predict(predict_only.parameters(), {"x": np.ones((2, 3), np.float32)})
    assert predict_only.providers == ["CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match="loss=None and has no training form"):
        predict_only.forward(predict_only.parameters(), {"x": np.ones((2, 3), np.float32)})


# --- CUDA -------------------------------------------------------------------------------------

CUDA_AVAILABLE = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.skipif(CUDA_AVAILABLE, reason="CUDAExecutionProvider is installed here")
def test_cuda_without_the_cuda_provider_names_the_available_providers(
        tmp_path: Path) -> None:
    with pytest.raises(DeviceUnavailableError, match=r"CUDAExecutionProvider.*CPUExecution"):
        GradientEngine(_linear_model(tmp_path / "a.onnx"), batch_size=2, device="cuda:0",
                       cache_dir=tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_AVAILABLE,
                    reason="needs onnxruntime-gpu with CUDAExecutionProvider, which this "
                           f"onnxruntime lacks (providers: {ort.get_available_providers()})")
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_cuda_gradients_match_torch_autograd(name: str, tmp_path: Path) -> None:
    path, inputs, kind, torch_loss, torch_grads = _fixture(name)
    engine = GradientEngine(path, batch_size=len(inputs["labels"]), loss=kind, device="cuda",
                            cache_dir=tmp_path)
    assert (engine.device, engine.providers[0]) == ("cuda", "CUDAExecutionProvider")
    loss, grads = engine.gradients(engine.parameters(), inputs)
    assert abs(loss - torch_loss) <= 1e-4 * abs(torch_loss)
    for key, reference in torch_grads.items():  # full float32 (TF32 off), sums reordered: 2e-7 on an H200
        assert _relative_error(grads[key], reference) <= 1e-4, key


# --- the graph rewrites are exact -----------------------------------------------------------

def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _rewritten_agrees(model: onnx.ModelProto, rewrite: Callable[[onnx.ModelProto], int],
                      feeds: dict[str, np.ndarray]) -> int:
    """Apply `rewrite` to a copy of `model`; assert the outputs are unchanged."""
    before = _run(model, feeds)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    count = rewrite(changed)
    for old, new in zip(before, _run(changed, feeds)):
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)
    return count


@pytest.mark.parametrize("x_shape, w_shape, strides, dilations, gemms", [
    ([12, 5, 10, 10], [4, 5, 7, 5], [1, 1], [1, 1], 24),        # 12 rows a window: a GEMM per window
    ([3, 5, 10, 10], [4, 5, 7, 5], [1, 1], [1, 1], 1),          # 3 rows (an RGB first layer): one GEMM
    ([3, 5, 10, 10], [4, 5, 7, 5], [2, 1], [1, 2], 1),
    ([9, 5, 40], [4, 5, 17], [2], [2], 4),                      # 1-D (audio): strided and dilated
    ([3, 5, 40], [4, 5, 17], [2], [2], 1),
    ([2, 3, 6, 7, 6], [4, 3, 5, 6, 4], [1, 1, 1], [1, 1, 1], 1),   # 3-D
    ([10, 3, 6, 7, 6], [4, 3, 5, 6, 4], [1, 1, 1], [1, 1, 1], 12),
])
def test_a_large_kernel_conv_rewritten_as_a_gemm_per_output_position_computes_the_same(
        x_shape: list[int], w_shape: list[int], strides: list[int], dilations: list[int], gemms: int) -> None:
    """The shape of onnx-ad's Conv weight adjoint: a kernel spanning most of the feature
    map, in one, two or three spatial dimensions; the strided, dilated cases also leave a remainder. Windows
    of at most eight rows (the Conv's batch: the weight's input channels) are stacked into one GEMM."""
    model = _correlation_as_gemms(x_shape, w_shape, seed=6, strides=strides, dilations=dilations)
    assert [n.op_type for n in model.graph.node].count("Gemm") == gemms


def _correlation_as_gemms(x_shape: list[int], w_shape: list[int], seed: int, **attributes) -> onnx.ModelProto:
    """A Conv of x with w (onnx-ad's weight-adjoint shape), checked to compute the same once
    gemm_large_kernel_convs rewrote it; the rewritten model."""
    rng = np.random.default_rng(seed)
    model = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="correlate", **attributes)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [])
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "w": rng.standard_normal(w_shape).astype(np.float32)}
    assert _rewritten_agrees(model, gemm_large_kernel_convs, feeds) == 1
    gemm_large_kernel_convs(model)
    return model


@pytest.mark.parametrize("x_shape, w_shape, strides, sliding", [
    ([16, 3, 12, 12], [2, 3, 9, 9], [1, 1], True),    # 2 filters (outputs) against 16 rows (inputs): filters slide
    ([16, 3, 40], [2, 3, 33], [1], True),             # 1-D
    ([16, 3, 8, 8], [2, 3, 8, 8], [1, 1], True),      # one position (a 1 x 1 Conv's weight adjoint): no copy at all
    ([16, 3, 12, 12], [2, 3, 9, 9], [2, 1], False),   # strided: the input's windows
    ([16, 3, 12, 12], [12, 3, 9, 9], [1, 1], False),  # as many filters as rows: the input's windows
])
def test_few_filters_slide_over_the_whole_input(x_shape: list[int], w_shape: list[int], strides: list[int],
                                               sliding: bool) -> None:
    """Where the filters' copies are at most half the windows' (a weight adjoint of a Conv with fewer outputs than
    inputs), the input is multiplied whole and the zero-padded filters are cut at each position."""
    model = _correlation_as_gemms(x_shape, w_shape, seed=18, strides=strides)
    ops = [n.op_type for n in model.graph.node]
    reads_x = [n for n in model.graph.node if n.op_type == "Slice" and n.input[0] == "x"]
    positions = math.prod((n - k) // s + 1 for n, k, s in zip(x_shape[2:], w_shape[2:], strides))
    assert (not reads_x) == sliding
    assert ops.count("Pad") == (1 if sliding and positions > 1 else 0)
    assert ops.count("Slice") == (positions if positions > 1 else 0)


@pytest.mark.parametrize("x_shape, w_shape, dilations, phased", [
    ([12, 4, 18, 18], [5, 4, 8, 8], [2, 2], True),      # a stride-2 Conv's weight adjoint over 18 x 18 (padded 16 x 16)
    ([6, 4, 18, 18], [5, 4, 8, 8], [2, 2], True),       # the same, its windows stacked into one GEMM
    ([12, 4, 18, 18], [5, 4, 6, 6], [3, 3], True),      # stride 3
    ([12, 4, 17, 17], [5, 4, 8, 8], [2, 2], False),     # maps that do not divide by the step: stepped Slices
    ([12, 4, 18, 18], [5, 4, 8, 6], [2, 3], False),     # steps that differ between the axes
    ([12, 4, 10, 10], [5, 4, 5, 5], [2, 2], False),     # small maps: stepped Slices are as fast
])
def test_strided_windows_are_cut_from_phase_planes(x_shape: list[int], w_shape: list[int], dilations: list[int],
                                                   phased: bool) -> None:
    """Windows read at step s (a strided Conv's weight adjoint) over maps of 16 x 16 or more that divide by s come
    from the s x s phase planes of one SpaceToDepth, cut with unit steps."""
    model = _correlation_as_gemms(x_shape, w_shape, seed=15, dilations=dilations)
    ops = [n.op_type for n in model.graph.node]
    assert ("SpaceToDepth" in ops) == phased
    stepped = [n for n in model.graph.node if n.op_type == "Slice" and len(n.input) > 4]
    assert (not stepped) == phased


@pytest.mark.parametrize("x_shape, w_shape, dilations, keep, products", [
    ([12, 4, 10, 10], [5, 4, 4, 4], [2, 2], [3, 3], 9),  # a 3 x 3 stride-2 Conv's weight adjoint: 4 x 4 reached
    ([6, 4, 10, 10], [5, 4, 4, 4], [2, 2], [3, 3], 9),   # the same over 6 channels: windows stacked
    ([12, 4, 10, 10], [5, 4, 5, 5], [2, 2], [1, 1], 1),  # a 1 x 1 stride-2 shortcut's: 2 x 2 reached
    ([12, 4, 40], [5, 4, 17], [2], [4], 4),              # 1-D
])
def test_a_cropped_large_kernel_conv_computes_only_the_positions_kept(
        x_shape: list[int], w_shape: list[int], dilations: list[int], keep: list[int], products: int) -> None:
    """onnx-ad's weight adjoint of a strided Conv reaches past the kernel and crops with a Slice; the GEMMs are
    written for the kept positions alone, and they write the Slice's output."""
    rng = np.random.default_rng(13)
    spatial = len(x_shape) - 2
    model = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="correlate", dilations=dilations),
         helper.make_node("Slice", ["y", "starts", "ends", "axes"], ["kernel"], name="crop")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
        [helper.make_tensor_value_info("kernel", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros(spatial, np.int64), "starts"),
         numpy_helper.from_array(np.array(keep, np.int64), "ends"),
         numpy_helper.from_array(np.arange(2, 2 + spatial, dtype=np.int64), "axes")])
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "w": rng.standard_normal(w_shape).astype(np.float32)}
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    assert _rewritten_agrees(model, gemm_large_kernel_convs, feeds) == 1
    gemm_large_kernel_convs(changed)
    ops = [n.op_type for n in changed.graph.node]
    assert ops.count("Gemm") == (products if x_shape[0] > 8 else 1)
    assert "Conv" not in ops and ops.count("Slice") == products


@pytest.mark.parametrize("crop, perm, batch", [
    (False, [1, 0, 3, 4, 2], 12),    # onnx-ad's move of a weight adjoint into the weight's layout, seed axis last
    (True, [1, 0, 3, 4, 2], 12),     # the same after its crop of a strided Conv's overhang
    (False, [0, 1, 3, 4, 2], 12),    # a Transpose that keeps the order: left as it is
    (False, [1, 0, 3, 4, 2], 6),     # windows of six rows, stacked: the one GEMM writes the layout wanted
    (True, [1, 0, 3, 4, 2], 6),
    (False, [1, 0, 3, 4, 2], 20),    # 20 rows against 5 filters: the filters slide
])
def test_a_large_kernel_conv_read_swapped_is_written_in_the_swapped_layout(crop: bool, perm: list[int],
                                                                           batch: int) -> None:
    """[batch, filters, k, k] read by a Reshape adding the seed axis and a Transpose to [filters, batch, k, k, 1]:
    the GEMMs compute [filters, batch] per position and one 2-D transpose of their stack writes the Transpose's
    output; onnxruntime's Transposes of three axes or more go element by element."""
    rng = np.random.default_rng(14)
    x_shape, w_shape = [batch, 4, 10, 10], [5, 4, 8 if not crop else 4, 8 if not crop else 4]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="correlate", dilations=[1, 1] if not crop else [2, 2])]
    source = "y"
    if crop:
        nodes.append(helper.make_node("Slice", ["y", "starts", "ends", "axes"], ["kernel"], name="crop"))
        source = "kernel"
    nodes += [helper.make_node("Reshape", [source, "seeded"], ["with_seed"]),
              helper.make_node("Transpose", ["with_seed"], ["grad"], perm=perm)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
                   [helper.make_tensor_value_info("grad", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(np.array([batch, 5, 1, 3, 3], np.int64), "seeded"),
                    numpy_helper.from_array(np.zeros(2, np.int64), "starts"),
                    numpy_helper.from_array(np.array([3, 3], np.int64), "ends"),
                    numpy_helper.from_array(np.arange(2, 4, dtype=np.int64), "axes")])
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "w": rng.standard_normal(w_shape).astype(np.float32)}
    assert _rewritten_agrees(model, gemm_large_kernel_convs, feeds) == 1
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    gemm_large_kernel_convs(changed)
    producers = {n.output[0]: n for n in changed.graph.node}
    ranks = {name: len(shape) for name, shape in static_shapes(changed).items()}
    big_transposes = [n for n in changed.graph.node if n.op_type == "Transpose" and ranks.get(n.input[0], 0) > 2]
    if perm[0] == 1:
        assert producers["grad"].op_type == "Reshape" and not big_transposes
        assert producers[producers["grad"].input[0]].op_type == ("Transpose" if batch > 8 else "Gemm")
    else:
        assert big_transposes


def test_an_all_ones_window_spread_rewritten_as_a_resize_computes_the_same() -> None:
    """The shape of onnx-ad's AveragePool adjoint: a per-channel ConvTranspose of ones."""
    model = _model(
        [helper.make_node("ConvTranspose", ["g", "ones"], ["y"], name="spread", group=3,
                          strides=[2, 3])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((3, 1, 2, 3), np.float32), "ones")])
    feeds = {"g": np.random.default_rng(7).standard_normal((2, 3, 4, 5)).astype(np.float32)}
    assert _rewritten_agrees(model, resize_window_spreads, feeds) == 1


def test_layout_ops_over_size_one_axes_are_rewritten_exactly() -> None:
    """Transposes, reductions and broadcasts on tensors with size-1 axes (the seed axis)."""
    axes = helper.make_node("Constant", [], ["axes"], name="axes",
                            value=numpy_helper.from_array(np.array([0, 2], np.int64), "axes"))
    nodes = [
        axes,
        helper.make_node("Transpose", ["x"], ["moved"], name="move", perm=[2, 0, 3, 1]),
        helper.make_node("Transpose", ["x"], ["seed_first"], name="seed", perm=[3, 0, 1, 2]),
        helper.make_node("ReduceSum", ["x", "axes"], ["summed"], name="sum", keepdims=1),
        helper.make_node("Mul", ["x", "scale"], ["scaled"], name="scale"),
        helper.make_node("Add", ["x", "row"], ["shifted"], name="shift"),
    ]
    model = _model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 8, 16, 1]),
                helper.make_tensor_value_info("row", TensorProto.FLOAT, [8, 1, 1])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
         for name in ("moved", "seed_first", "summed", "scaled", "shifted")],
        [numpy_helper.from_array(np.array([3.0], np.float32), "scale")])
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal((32, 8, 16, 1)).astype(np.float32),
             "row": rng.standard_normal((8, 1, 1)).astype(np.float32)}
    assert _rewritten_agrees(model, canonicalize_layout_ops, feeds) == 5


def test_tied_max_pool_windows_route_the_gradient_to_the_first_maximum(
        tmp_path: Path) -> None:
    """As torch does: windows of equal values (constant image regions, whose zero-padded
    borders give the tied elements different inputs) send it all to their first maximum."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["conv"], ["pooled"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Flatten", ["pooled"], ["y"], name="flatten"),
    ]
    path = _save(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(np.full((2, 1, 3, 3), 0.5, np.float32), "w"),
         numpy_helper.from_array(np.array([0.25, -1.0], np.float32), "b")]),
        tmp_path / "tied_pool.onnx")
    x = np.zeros((2, 1, 4, 4), np.float32)
    x[1, 0, :2, :2] = 1.0  # one bright corner; every other window is a tie
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    _, grads = engine.gradients(engine.parameters(), {"x": x, "labels": np.zeros((2, 8))})
    # by hand, routing each window to its first maximum (torch's choice)
    padded = np.pad(x[:, 0], ((0, 0), (1, 1), (1, 1)))
    patches = np.stack([padded[:, i:i + 4, j:j + 4] for i in range(3) for j in range(3)], -1)
    conv = patches @ np.full((9, 2), 0.5) + np.array([0.25, -1.0])      # (2, 4, 4, 2)
    windows = conv.reshape(2, 2, 2, 2, 2, 2).transpose(0, 5, 1, 3, 2, 4).reshape(2, 2, 4, 4)
    first = windows.argmax(-1)                                          # (2, 2, 4)
    pooled = np.take_along_axis(windows, first[..., None], -1)[..., 0]
    upstream = 2 * pooled / pooled.size                                 # d mse / d pooled
    expected_w, expected_b = np.zeros((2, 9)), np.zeros(2)
    for n, c, p in np.ndindex(2, 2, 4):
        k = first[n, c, p]
        row, col = 2 * (p // 2) + k // 2, 2 * (p % 2) + k % 2
        expected_w[c] += upstream[n, c, p] * patches[n, row, col]
        expected_b[c] += upstream[n, c, p]
    np.testing.assert_allclose(grads["w"].reshape(2, 9), expected_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads["b"], expected_b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape, kernel, ties", [([2, 3, 16], [4], False), ([2, 2, 4, 6, 4], [2, 3, 2], False),
                                                 ([2, 3, 16], [4], True), ([2, 2, 4, 6, 4], [2, 3, 2], True)])
def test_a_tiling_max_pool_of_any_rank_routes_its_adjoint_without_a_scatter(shape, kernel, ties) -> None:
    """1-D (audio) and 3-D pools: the adjoint built from masks gives what onnx-ad's argmax scatter gives; with
    `ties` (windows of equal values, as after a ReLU) the first element of a window takes its gradient."""
    from worker_client.engine.differentiate import GRAD_PREFIX, differentiate
    from worker_client.engine.rewrites.conv import route_max_pool_adjoints
    from worker_client.engine.rewrites.fold import fold_shape_queries
    from worker_client.engine.rewrites.prune import prune
    from worker_client.engine.rewrites.toolkit import static_shapes
    pooled = [shape[0], shape[1], *(n // k for n, k in zip(shape[2:], kernel))]
    rng = np.random.default_rng(12)
    nodes = [helper.make_node("Mul", ["x", "w"], ["scaled"], name="scale"),
             helper.make_node("MaxPool", ["scaled"], ["pooled"], name="pool", kernel_shape=kernel, strides=kernel),
             helper.make_node("Mul", ["pooled", "R"], ["weighted"], name="weigh"),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], name="loss", keepdims=0)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [1])],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                   [numpy_helper.from_array(rng.standard_normal(pooled).astype(np.float32), "R")])
    derived = differentiate(model, ["x", "w"], "loss")
    routed = onnx.ModelProto()
    routed.CopyFrom(derived)
    fold_shape_queries(routed)   # as rewrite_adjoints does first
    assert route_max_pool_adjoints(routed) == 1
    assert "ScatterND" not in {n.op_type for n in routed.graph.node}
    # the nearest upsamples on onnxruntime's fast 4-D Resize (a 5-D one took 15.7 ms where two 4-D ones take 1.2)
    resized = static_shapes(routed)
    assert all(len(resized[n.input[0]]) <= 4 for n in routed.graph.node if n.op_type == "Resize")
    prune(routed)   # the windows' maxima are the forward pool's: computed once
    assert [n.name for n in routed.graph.node if n.op_type == "MaxPool" and n.input[0] == "scaled"] == ["pool"]
    values = rng.integers(0, 2, shape) if ties else rng.standard_normal(shape)
    feeds = {"x": values.astype(np.float32), "w": np.array([1.5], np.float32)}
    names = [GRAD_PREFIX + "x", GRAD_PREFIX + "w"]
    expected = ort.InferenceSession(derived.SerializeToString()).run(names, feeds)
    got = ort.InferenceSession(routed.SerializeToString()).run(names, feeds)
    for new, old in zip(got, expected, strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-7)
    assert np.count_nonzero(got[0]) == np.prod(pooled)   # one element per window takes the gradient


def test_batched_weight_matmuls_are_flattened_exactly() -> None:
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 5]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [])
    rng = np.random.default_rng(9)
    feeds = {"x": rng.standard_normal((4, 3, 5)).astype(np.float32),
             "w": rng.standard_normal((5, 6)).astype(np.float32)}
    assert _rewritten_agrees(model, flatten_weight_matmuls, feeds) == 1
