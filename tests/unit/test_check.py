"""ps-check: every fixture reported correctly, a wrong gradient caught, unsupported nodes named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import check
from worker_client.engine import coverage
from worker_client.engine import GradientEngine

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
    "keras/keras_cnn": ("cross_entropy", 6, 0, 0, 0),
    "keras/keras_layernorm_mlp": ("cross_entropy", 6, 0, 0, 1),
    "jax/jax_mlp": ("cross_entropy", 4, 0, 0, 2),   # jax2onnx's 0-d Gemm biases
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_every_fixture_is_reported_as_it_trains(fixture: str, tmp_path: Path) -> None:
    loss, parameters, state, masks, constants = EXPECTED[fixture]
    report = check.check_model(FIXTURES / f"{fixture}.onnx", loss=loss, cache_dir=tmp_path)
    assert report.error is None and not report.unsupported and not report.warnings
    reference = np.load(FIXTURES / f"{fixture}.npz")
    assert sorted(n for n, _, _ in report.parameters) == sorted(
        k[len("grad:"):] for k in reference.files if k.startswith("grad:"))
    assert (len(report.parameters), len(report.state), len(report.masks),
            len(report.constants)) == (parameters, state, masks, constants)
    assert len(report.gradients) == parameters and all(g.ok for g in report.gradients)
    assert report.ok


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
