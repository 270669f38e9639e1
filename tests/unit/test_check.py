"""ps-check: every fixture reported correctly, a wrong gradient caught, unsupported nodes named.

The ResNet fixture (torch/resnet_bn_train: ResNet-14, training-mode BatchNorm, batch 4) is the
hard case: its loss has a ReLU kink so close to any point that no central difference taken in
float32 is within a few percent of its correct gradients, which is what made the check cry
wolf; check.py's module docstring says how the check copes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import check
from worker_client.engine import coverage
from worker_client.engine import GradientEngine
from worker_client.engine.load import load_model
from worker_client.engine.opset import upgrade_opset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
#: fixture -> (loss, trainable parameters, state tensors, Dropout masks, constants)
EXPECTED = {
    "torch/mlp": ("cross_entropy", 6, 0, 0, 0),
    "torch/cnn": ("cross_entropy", 8, 0, 0, 0),
    "torch/embedding_bag": ("mse", 5, 0, 0, 0),
    "torch/transformer": ("cross_entropy", 18, 0, 0, 0),
    "torch/conv_bn_eval": ("cross_entropy", 8, 0, 0, 2),   # frozen statistics
    "torch/gru_reader": ("cross_entropy", 6, 0, 0, 0),
    "torch/lstm_reader": ("cross_entropy", 6, 0, 0, 0),
    "torch/depthwise_separable": ("cross_entropy", 8, 0, 0, 0),
    "torch/scalar_temperature": ("cross_entropy", 5, 0, 0, 0),
    "torch/bn_dropout_train": ("cross_entropy", 6, 2, 1, 0),
    "torch/resnet_bn_train": ("cross_entropy", 47, 30, 0, 0),   # at batch 4: the hard case
    "torch/conv_decoder": ("mse", 7, 0, 0, 0),                  # ConvTransposes that train
    "torch/padded_strided": ("cross_entropy", 12, 0, 0, 0),     # copying pads, steps, strided depthwise
    "keras/keras_cnn": ("cross_entropy", 6, 0, 0, 0),
    "keras/keras_layernorm_mlp": ("cross_entropy", 6, 0, 0, 1),
    "jax/jax_mlp": ("cross_entropy", 4, 0, 0, 2),   # jax2onnx's 0-d Gemm biases
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_every_fixture_is_reported_as_it_trains(fixture: str, tmp_path: Path) -> None:
    loss, parameters, state, masks, constants = EXPECTED[fixture]
    report = check.check_model(FIXTURES / f"{fixture}.onnx", loss=loss, cache_dir=tmp_path)
    assert report.error is None and not report.unsupported and not report.warnings
    with np.load(FIXTURES / f"{fixture}.npz") as reference:   # closed: no ResourceWarning
        graded = sorted(k[len("grad:"):] for k in reference.files if k.startswith("grad:"))
    assert sorted(n for n, _, _ in report.parameters) == graded
    assert (len(report.parameters), len(report.state), len(report.masks),
            len(report.constants)) == (parameters, state, masks, constants)
    assert len(report.gradients) == parameters and all(g.ok for g in report.gradients)
    assert report.ok
    assert report.differences.startswith("central differences of a float64 copy")


def test_the_state_of_a_training_mode_model_and_the_epsilon_of_a_keras_one_are_named(
        tmp_path: Path) -> None:
    bn = check.check_model(FIXTURES / "torch" / "bn_dropout_train.onnx", cache_dir=tmp_path)
    assert [name for name, _ in bn.state] == ["bn.running_mean", "bn.running_var"]
    assert bn.masks == ["dropout_mask:/drop/Dropout"]
    keras = check.check_model(FIXTURES / "keras" / "keras_layernorm_mlp.onnx",
                              cache_dir=tmp_path)
    (name, shape, why), = keras.constants
    assert name.endswith("layer_normalization_1/add/y:0") and shape == () and "epsilon" in why
    assert keras.opset == (15, 16)


def test_a_plain_tf2onnx_export_is_reported_with_its_folded_variables(tmp_path: Path) -> None:
    report = check.check_model(FIXTURES / "keras" / "keras_layernorm_mlp_plain.onnx",
                               cache_dir=tmp_path)
    assert len(report.parameters) == 3
    assert any("no bias" in w and "folded" in w for w in report.warnings)
    expected = check.check_model(FIXTURES / "keras" / "keras_layernorm_mlp_plain.onnx",
                                 expect_parameters=6, cache_dir=tmp_path)
    assert not expected.ok and "expected 6 trainable parameters, but the model has 3" in \
        expected.error


def test_a_wrong_gradient_is_reported_as_a_mismatch(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    class Doubled(GradientEngine):
        def step(self, parameters, inputs):
            result = super().step(parameters, inputs)
            wrong = dict(result.gradients, **{"fc2.bias": 2 * result.gradients["fc2.bias"]})
            return type(result)(result.loss, wrong, result.state)

    monkeypatch.setattr(check, "GradientEngine", Doubled)
    report = check.check_model(FIXTURES / "torch" / "mlp.onnx", cache_dir=tmp_path)
    verdicts = {g.name: g.ok for g in report.gradients}
    assert verdicts.pop("fc2.bias") is False and all(verdicts.values())
    assert not report.ok
    assert "gradient fc2.bias: MISMATCH" in check.format_report(report)


RESNET = FIXTURES / "torch" / "resnet_bn_train.onnx"


def test_the_engines_resnet_gradients_are_torchs_so_the_check_has_to_pass_them(
        tmp_path: Path) -> None:
    with np.load(FIXTURES / "torch" / "resnet_bn_train.npz") as data:
        reference = {key: data[key] for key in data.files}
    engine = GradientEngine(RESNET, batch_size=4, cache_dir=tmp_path)
    values = {**engine.parameters(), **engine.state()}
    result = engine.step(values, {"image": reference["input:image"],
                                  "labels": reference["labels"]})
    assert abs(result.loss - float(reference["loss"])) <= 1e-5 * float(reference["loss"])
    for name in engine.trainable_names:
        expected = reference[f"grad:{name}"]
        error = np.linalg.norm(result.gradients[name] - expected) / np.linalg.norm(expected)
        assert error <= 1e-5, name


def test_on_the_resnet_no_float32_difference_is_right_and_a_short_float64_one_is(
        tmp_path: Path) -> None:
    """Why the check used to cry wolf, and why it no longer does: along conv1.weight a step
    of 1e-3 crosses ReLU kinks (float64 is as far off as float32), and a step short enough
    to cross none drowns in the float32 loss's rounding; float64 at that step agrees."""
    engine = GradientEngine(RESNET, batch_size=4, cache_dir=tmp_path)
    values = {**engine.parameters(), **engine.state()}
    batch = check._random_batch(engine, np.random.default_rng(0))
    result = engine.step(values, batch)
    loss = check._loss_function(upgrade_opset(load_model(RESNET), RESNET), engine,
                                "cross_entropy", batch, values, result.loss)
    assert loss.precision == "float64"
    value = values["conv1.weight"].astype(np.float64)
    short = check.FD_STEP["float64"] * max(float(np.linalg.norm(value)), 1.0)

    def float32(moved) -> float:
        return engine.step({k: v.astype(np.float32) for k, v in moved.items()}, batch).loss

    for seed in range(3):
        direction = np.random.default_rng(seed).standard_normal(value.shape)
        direction /= np.linalg.norm(direction)
        analytic = float(np.sum(result.gradients["conv1.weight"] * direction))

        def error(step: float, at, direction=direction, analytic=analytic) -> float:
            above, below = (at(dict(values, **{"conv1.weight": value + sign * step * direction}))
                            for sign in (1, -1))
            return abs((above - below) / (2 * step) - analytic) / abs(analytic)

        assert error(1e-3, float32) > 0.05 and error(1e-3, loss.at) > 0.05   # kinks
        assert error(short, float32) > 0.05                                   # rounding
        assert error(short, loss.at) < 1e-4


def test_the_resnet_with_training_mode_batch_norm_passes_at_batch_2_too(tmp_path: Path) -> None:
    report = check.check_model(RESNET, batch_size=2, cache_dir=tmp_path)
    assert report.error is None and len(report.gradients) == 47
    assert [g.name for g in report.gradients if not g.ok] == []
    assert report.ok


def test_a_gradient_scaled_by_1_3_and_one_with_part_of_its_sign_flipped_are_caught_on_the_resnet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    class Planted(GradientEngine):
        def step(self, parameters, inputs):
            result = super().step(parameters, inputs)
            flipped = result.gradients["layers.2.conv1.weight"].copy()
            flipped[: len(flipped) // 2] *= -1        # half of its output channels
            wrong = dict(result.gradients, **{
                "conv1.weight": 1.3 * result.gradients["conv1.weight"],
                "layers.2.conv1.weight": flipped})
            return type(result)(result.loss, wrong, result.state)

    monkeypatch.setattr(check, "GradientEngine", Planted)
    monkeypatch.setenv("ONNX_PS_CACHE", str(tmp_path))
    assert check.main([str(RESNET)]) == 1
    out = capsys.readouterr().out
    mismatched = [line.split(":")[0] for line in out.splitlines() if ": MISMATCH" in line]
    assert mismatched == ["gradient conv1.weight", "gradient layers.2.conv1.weight"]
    assert "result: the model does not train as it is" in out


def test_without_a_float64_copy_the_check_says_it_differenced_the_float32_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_copy(*args, **kwargs):
        raise RuntimeError("no float64 kernel for MadeUpOp")

    monkeypatch.setattr(check, "_float64_loss", no_copy)
    report = check.check_model(FIXTURES / "torch" / "mlp.onnx", cache_dir=tmp_path)
    assert report.ok and len(report.gradients) == 6
    assert "float32 loss" in report.differences and "MadeUpOp" in report.differences
    parameters = GradientEngine(FIXTURES / "torch" / "mlp.onnx", batch_size=4,
                                cache_dir=tmp_path).parameters()
    for gradient in report.gradients:   # steps scaled to each tensor's norm
        step = check.FD_STEP["float32"] * max(float(np.linalg.norm(parameters[gradient.name])),
                                              1.0)
        assert all(d.step == pytest.approx(step) for d in gradient.directions)
    assert "gradient check: central differences of the engine's float32 loss" in \
        check.format_report(report)


def test_the_float64_copy_computes_a_gelus_erf_in_float64(tmp_path: Path) -> None:
    """onnx's reference evaluator rounds Erf to float32; the check's own Erf does not, so a
    GELU network's differences are as smooth as its loss (the spread of the one-sided
    differences stays near 1e-6 of the derivative, not 1e-1)."""
    report = check.check_model(FIXTURES / "torch" / "transformer.onnx", seed=1,
                               cache_dir=tmp_path)
    assert "reference evaluator" in report.differences and report.ok
    assert max(d.spread / max(abs(d.analytic), 1e-3) for g in report.gradients
               for d in g.directions) < 1e-4


def test_an_op_without_a_gradient_is_named_with_what_to_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rois = np.array([[0, 0, 0, 1, 1]], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["scaled"], name="scale"),
         helper.make_node("MaxRoiPool", ["scaled", "rois"], ["pooled"], name="roi_pool_1",
                          pooled_shape=[1, 1]),
         helper.make_node("Flatten", ["pooled"], ["y"], name="flatten")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(np.ones((1, 2, 4, 4), np.float32), "w"),
         numpy_helper.from_array(rois, "rois")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = tmp_path / "roi.onnx"
    onnx.save(model, path)
    assert check.main([str(path), "--batch-size", "1"]) == 1
    out = capsys.readouterr().out
    assert "unsupported: node 'roi_pool_1' (MaxRoiPool) has no gradient rule" in out
    assert "--exclude" in out and "result: the model does not train as it is" in out


def test_a_refused_model_still_lists_the_parameters_that_would_train(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A strided and dilated ConvTranspose's weight has no adjoint: the report names the error and every
    parameter, so the user sees what to --exclude."""
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "up.weight"], ["up"], name="dilated_up", strides=[2, 2],
                          dilations=[2, 2]),
         helper.make_node("Flatten", ["up"], ["y"], name="flatten")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 81])],
        [numpy_helper.from_array(np.full((2, 1, 3, 3), 0.3, np.float32), "up.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = tmp_path / "dilated_up.onnx"
    onnx.save(model, path)
    report = check.check_model(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    assert report.error is not None and "ConvTranspose" in report.error and "dilated_up" in report.error
    assert report.parameters == [("up.weight", (2, 1, 3, 3), "float32")]
    assert check.main([str(path), "--loss", "mse", "--batch-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "parameters that would train: 1 (18 values)" in out and "  up.weight (2, 1, 3, 3) float32" in out


def test_a_grid_sample_model_is_checked_on_its_float32_loss_since_the_float64_copy_would_be_float32_inside(
        tmp_path: Path) -> None:
    """onnx's reference kernels for AffineGrid and GridSample compute in float32, and the reference evaluator runs
    the float64 copy where onnxruntime has no float64 kernel (Conv): differences of such a copy over a 1e-6 step
    called the engine's right gradients a mismatch. The check differences the float32 loss instead."""
    rng = np.random.default_rng(4)
    theta = np.tile(np.array([[0.9, 0.1, 0.05], [-0.1, 0.8, -0.05]], np.float32), (2, 1, 1))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["h"], name="conv", pads=[1, 1, 1, 1]),   # no float64 kernel
         helper.make_node("AffineGrid", ["theta", "size"], ["grid"], name="grid", align_corners=0),
         helper.make_node("GridSample", ["h", "grid"], ["sampled"], name="sample", align_corners=0),
         helper.make_node("Flatten", ["sampled"], ["y"], name="flatten")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 9])],
        [numpy_helper.from_array(theta, "theta"),
         numpy_helper.from_array(rng.standard_normal((1, 1, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(np.array([2, 1, 3, 3], np.int64), "size")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    path = tmp_path / "grid_sample.onnx"
    onnx.save(model, path)
    report = check.check_model(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    assert report.error is None and sorted(g.name for g in report.gradients) == ["theta", "w"]
    assert "computes AffineGrid, GridSample in float32" in report.differences
    assert all(g.ok for g in report.gradients)


def test_the_op_coverage_table_in_the_docs_is_up_to_date() -> None:
    doc = FIXTURES.parents[1] / "docs" / "models.md"
    assert coverage.documented_block(doc) == coverage.coverage_markdown(), \
        "docs/models.md is stale: run python -m worker_client.engine.coverage " \
        "--write-docs docs/models.md"


def test_the_coverage_lists_the_engines_own_forms_and_onnx_ads_rules() -> None:
    table = coverage.coverage()
    assert "grouped" in table["Conv"] and "training mode" in table["BatchNormalization"]
    assert table["GRU"].startswith("expanded") and table["MatMul"] == "reverse rule"
    assert "MaxRoiPool" not in table


def test_a_long_check_says_on_stderr_which_parameter_it_is_at_and_stdout_keeps_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model = FIXTURES / "torch/mlp.onnx"
    monkeypatch.setattr(check, "PROGRESS_EVERY", 0.0)   # every parameter is "long" here
    monkeypatch.setenv("ONNX_PS_CACHE", str(tmp_path))
    assert check.main([str(model)]) == 0
    out, err = capsys.readouterr()
    report = check.check_model(model, cache_dir=tmp_path)
    names = [name for name, _, _ in report.parameters]
    lines = err.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"ps-check: differencing the gradient of {n}" for n in names]
    assert lines[-1].split(" (")[1].startswith(f"{len(names)} of {len(names)} parameters")
    assert "ps-check:" not in out and out.rstrip().endswith("result: the model trains as reported")
    monkeypatch.setattr(check, "PROGRESS_EVERY", 3600.0)   # a check shorter than that says nothing
    assert check.main([str(model)]) == 0
    assert capsys.readouterr().err == ""
