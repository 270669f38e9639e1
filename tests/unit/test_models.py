"""Unit tests of the bundled ONNX model builders and the ps_models.build command line."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ad
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ps_models import build as build_cli
from ps_models.builders import (BATCH_DIM, BUILDERS, IR_VERSION, OPSET, build_lenet, build_mlp,
                             build_tiny_transformer, input_name_of, write_model)

NAMES = sorted(BUILDERS)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _input_batch(model: onnx.ModelProto, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random input of `batch` examples for the model's single graph input."""
    rng = np.random.default_rng(seed)
    value = model.graph.input[0]
    dims = [d.dim_value for d in value.type.tensor_type.shape.dim[1:]]
    if value.type.tensor_type.elem_type == TensorProto.INT64:
        vocab = numpy_helper.to_array(model.graph.initializer[0]).shape[0]
        return {value.name: rng.integers(0, vocab, size=(batch, *dims), dtype=np.int64)}
    return {value.name: rng.random((batch, *dims), dtype=np.float32)}


def _num_classes(model: onnx.ModelProto) -> int:
    return model.graph.output[0].type.tensor_type.shape.dim[1].dim_value


def _trainable(model: onnx.ModelProto, batch: int) -> tuple[onnx.ModelProto,
                                                            dict[str, np.ndarray]]:
    """A copy with every initializer lifted to a graph input and the batch pinned to `batch`.

    This is what the gradient engine does. The batch must be static because onnx-ad's Conv
    rule needs the full input shape of every convolution it differentiates through.
    """
    lifted = onnx.ModelProto()
    lifted.CopyFrom(model)
    params = {t.name: numpy_helper.to_array(t) for t in lifted.graph.initializer}
    for tensor in lifted.graph.initializer:
        lifted.graph.input.append(
            helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    del lifted.graph.initializer[:]
    for value in (lifted.graph.input[0], lifted.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_value = batch
    return lifted, params


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 7])
def test_each_model_runs_in_onnxruntime_and_gives_logits_of_shape_batch_by_classes(
        name: str, batch: int) -> None:
    model = BUILDERS[name]()
    logits, = _session(model).run(["logits"], _input_batch(model, batch))
    assert logits.shape == (batch, _num_classes(model))
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_each_model_passes_the_onnx_checker_at_the_opset_and_ir_version_onnxruntime_loads(
        name: str) -> None:
    model = BUILDERS[name]()
    onnx.checker.check_model(model, full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    assert OPSET in (17, 18)
    assert model.ir_version == IR_VERSION <= 9


@pytest.mark.parametrize("name", NAMES)
def test_each_model_has_its_documented_input_a_symbolic_batch_and_logits_first(
        name: str) -> None:
    model = BUILDERS[name]()
    graph_input, = model.graph.input
    assert graph_input.name == input_name_of(name)
    assert graph_input.type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
    assert model.graph.output[0].name == "logits"
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
    expected_type = TensorProto.INT64 if name in ("embedding", "transformer") \
        else TensorProto.FLOAT
    assert graph_input.type.tensor_type.elem_type == expected_type


@pytest.mark.parametrize("name", NAMES)
def test_every_initializer_is_a_float32_parameter_and_fixed_numbers_are_constant_nodes(
        name: str) -> None:
    model = BUILDERS[name]()
    names = [t.name for t in model.graph.initializer]
    assert len(names) == len(set(names))
    assert all(t.data_type == TensorProto.FLOAT for t in model.graph.initializer)
    # every initializer is a weight, bias, scale or embedding, never a shape or a scalar
    assert all(n.rsplit(".", 1)[-1] in ("weight", "bias") for n in names), names


@pytest.mark.parametrize("name", NAMES)
def test_the_same_seed_gives_a_byte_identical_model(name: str) -> None:
    assert BUILDERS[name](seed=5).SerializeToString() == \
        BUILDERS[name](seed=5).SerializeToString()


@pytest.mark.parametrize("name", NAMES)
def test_different_seeds_give_different_weights(name: str) -> None:
    first = {t.name: numpy_helper.to_array(t) for t in BUILDERS[name](seed=0).graph.initializer}
    second = {t.name: numpy_helper.to_array(t) for t in BUILDERS[name](seed=1).graph.initializer}
    assert first.keys() == second.keys()
    weights = [n for n in first if n.endswith(".weight") and np.std(first[n]) > 0]
    assert weights
    assert all(not np.array_equal(first[n], second[n]) for n in weights)


class Erf(OpRun):
    """Erf in the input's precision; onnx's reference Erf rounds through float32."""

    op_domain = ""

    def _run(self, x: np.ndarray) -> tuple[np.ndarray]:
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


def _in_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose float inputs, outputs and Constant nodes are float64, for exact checks."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    for value in list(wide.graph.input) + list(wide.graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in wide.graph.node:
        for attribute in node.attribute:
            if node.op_type == "Constant" and attribute.t.data_type == TensorProto.FLOAT:
                array = numpy_helper.to_array(attribute.t).astype(np.float64)
                attribute.t.CopyFrom(numpy_helper.from_array(array, attribute.t.name))
    return wide


@pytest.mark.parametrize("name", NAMES)
def test_each_model_is_differentiable_by_onnx_ad_and_its_gradients_match_finite_differences(
        name: str) -> None:
    batch = 4
    model = BUILDERS[name]()
    lifted, params = _trainable(model, batch)
    gradient_model = onnx_ad.reverse(lifted, inputs=list(params), layout="onnx")
    session = _session(gradient_model)
    inputs = _input_batch(model, batch)
    rng = np.random.default_rng(1)
    seed = rng.normal(size=(batch, _num_classes(model))).astype(np.float32)
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, {**inputs, **params,
                                                  "adj_logits": seed[..., None]})))
    assert set(names) == {"logits"} | {f"adj_{p}" for p in params}

    # central differences in float64 (onnx's reference evaluator), so that a step of 1e-6
    # neither drowns in float32 rounding nor crosses a Relu or MaxPool kink
    reference = ReferenceEvaluator(_in_float64(lifted), new_ops=[Erf])
    wide_inputs = {k: v.astype(np.float64) if v.dtype == np.float32 else v
                   for k, v in inputs.items()}
    wide_params = {k: v.astype(np.float64) for k, v in params.items()}
    eps = 1e-6
    for param, value in wide_params.items():
        gradient = results[f"adj_{param}"][..., 0]
        assert gradient.shape == value.shape
        assert np.isfinite(gradient).all()
        direction = rng.normal(size=value.shape)
        plus, = reference.run(None, {**wide_inputs, **wide_params, param: value + eps * direction})
        minus, = reference.run(None, {**wide_inputs, **wide_params,
                                      param: value - eps * direction})
        numeric = float(np.sum((plus - minus) * seed) / (2 * eps))
        analytic = float(np.sum(gradient.astype(np.float64) * direction))
        assert math.isclose(analytic, numeric, rel_tol=1e-3, abs_tol=1e-4), \
            f"{name} {param}: reverse mode {analytic} vs finite differences {numeric}"


def test_the_embedding_table_gradient_is_nonzero_only_on_the_gathered_rows() -> None:
    batch = 3
    model = BUILDERS["embedding"](vocab_size=50, dim=4, bag_size=2)
    lifted, params = _trainable(model, batch)
    session = _session(onnx_ad.reverse(lifted, inputs=list(params), layout="onnx"))
    ids = np.array([[1, 2], [2, 7], [40, 1]], dtype=np.int64)
    seed = np.ones((batch, 2, 1), np.float32)
    gradient, = session.run(["adj_embedding.weight"], {"ids": ids, **params, "adj_logits": seed})
    touched = np.flatnonzero(np.abs(gradient[..., 0]).sum(axis=1))
    assert touched.tolist() == [1, 2, 7, 40]


def test_mlp_hidden_layers_are_he_scaled_and_biases_start_at_zero() -> None:
    params = {t.name: numpy_helper.to_array(t)
              for t in build_mlp(input_dim=64, hidden=(512,), seed=0).graph.initializer}
    assert params["fc1.weight"].shape == (64, 512)
    assert params["fc1.weight"].std() == pytest.approx(math.sqrt(2 / 64), rel=0.05)
    assert not params["fc1.bias"].any() and not params["fc2.bias"].any()


def test_mlp_default_sizes_fit_the_digits() -> None:
    model = build_mlp()
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    assert shapes["fc1.weight"] == (64, 128)
    assert shapes[f"fc{len(shapes) // 2}.weight"][1] == 10


def test_lenet_takes_other_image_sizes_and_channel_counts() -> None:
    model = build_lenet(input_shape=(3, 12, 10), num_classes=4)
    logits, = _session(model).run(None, {"x": np.zeros((2, 3, 12, 10), np.float32)})
    assert logits.shape == (2, 4)


@pytest.mark.parametrize("call, words", [
    (lambda: build_tiny_transformer(d_model=30, heads=4), ["d_model=30", "heads=4"]),
    (lambda: build_mlp(hidden=(16, 0)), ["hidden[1]", "0"]),
    (lambda: build_lenet(input_shape=(1, 3, 8)), ["(1, 3, 8)", "at least 4"]),
    (lambda: build_lenet(input_shape=(8, 8)), ["(8, 8)"]),
    (lambda: build_mlp(num_classes=-2), ["num_classes", "-2"]),
])
def test_builders_reject_bad_sizes_with_a_value_error_naming_them(
        call: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        call()
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_write_model_saves_a_file_onnxruntime_loads(tmp_path: Path) -> None:
    path = write_model("transformer", tmp_path / "nested" / "t.onnx", seed=2, heads=4)
    assert path.is_file()
    model = onnx.load_model(str(path))
    assert model.SerializeToString() == build_tiny_transformer(seed=2, heads=4).SerializeToString()
    _session(model)


def test_write_model_and_input_name_of_reject_an_unknown_model_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'resnet'"):
        write_model("resnet", tmp_path / "r.onnx")
    with pytest.raises(ValueError, match="'resnet'"):
        input_name_of("resnet")


def test_the_cli_writes_every_model_with_all(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert build_cli.main(["--all", str(tmp_path), "--seed", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.onnx" for n in BUILDERS)
    assert (tmp_path / "mlp.onnx").read_bytes() == build_mlp(seed=3).SerializeToString()
    assert "parameters" in capsys.readouterr().out


def test_the_cli_writes_one_model_to_out(tmp_path: Path) -> None:
    assert build_cli.main(["--model", "lenet", "--out", str(tmp_path / "l.onnx")]) == 0
    assert (tmp_path / "l.onnx").read_bytes() == build_lenet().SerializeToString()


@pytest.mark.parametrize("argv", [["--model", "mlp"], ["--all", "d", "--out", "x.onnx"], [],
                                  ["--model", "resnet", "--out", "r.onnx"]])
def test_the_cli_refuses_incomplete_or_conflicting_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_cli.main(argv)
    assert caught.value.code == 2
