"""Which initializers train: the rule (selection.py), its overrides, scalars end to end."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client import GradientEngine, UnsupportedModelError
from worker_client.engine.selection import classify

OPSET = 18


def _model(nodes, inputs, outputs, initializers, *, producer: str = "") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    model.producer_name = producer
    onnx.checker.check_model(model)
    return model


def _array(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _layer_norm_mlp(producer: str = "") -> onnx.ModelProto:
    """Dense + a LayerNorm spelled out as tf2onnx spells it (epsilon a 0-d initializer),
    then logits scaled by a learned 0-d temperature exp(log_temp) and a Clip with float
    bounds."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="dense"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="dense_bias"),
        helper.make_node("ReduceMean", ["hb", "axes"], ["mean"], name="mean"),
        helper.make_node("Sub", ["hb", "mean"], ["centred"], name="centre"),
        helper.make_node("Mul", ["centred", "centred"], ["squared"], name="square"),
        helper.make_node("ReduceMean", ["squared", "axes"], ["variance"], name="variance"),
        helper.make_node("Add", ["variance", "epsilon"], ["stabilized"], name="add_eps"),
        helper.make_node("Sqrt", ["stabilized"], ["std"], name="std"),
        helper.make_node("Div", ["centred", "std"], ["normed"], name="normalize"),
        helper.make_node("Mul", ["normed", "gamma"], ["scaled"], name="gamma_mul"),
        helper.make_node("Exp", ["log_temp"], ["temperature"], name="temperature"),
        helper.make_node("Mul", ["scaled", "temperature"], ["tempered"], name="temper"),
        helper.make_node("Clip", ["tempered", "low", "high"], ["y"], name="clip"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                   [_array("W", rng.standard_normal((4, 3))), _array("b", [0.1, -0.2, 0.3]),
                    _array("epsilon", 1e-3), _array("gamma", [1.0, 0.5, 2.0]),
                    _array("log_temp", 0.25), _array("low", -6.0), _array("high", 6.0),
                    numpy_helper.from_array(np.array([-1], np.int64), "axes")],
                   producer=producer)
    return onnx.shape_inference.infer_shapes(model)


def test_the_rule_trains_weights_and_scalars_but_not_epsilons_or_clip_bounds() -> None:
    roles = classify(_layer_norm_mlp())
    assert {name for name, role in roles.items() if role.kind == "parameter"} == \
        {"W", "b", "gamma", "log_temp"}
    assert roles["epsilon"].kind == "constant" and "epsilon" in roles["epsilon"].reason
    assert roles["low"].kind == roles["high"].kind == "constant"
    assert "configuration" in roles["low"].reason


def _learned_exponent_and_clip(producer: str) -> onnx.ModelProto:
    """A generalized-mean pool's learned exponent and a learned clipping level, as torch's legacy exporter writes
    them: (|x| + 1) ** p, clipped above at Cast(alpha), then a Linear."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Abs", ["x"], ["magnitude"]),
             helper.make_node("Add", ["magnitude", "one"], ["shifted"]),
             helper.make_node("Pow", ["shifted", "p"], ["powered"]),
             helper.make_node("Cast", ["alpha"], ["level"], to=TensorProto.FLOAT),
             helper.make_node("Clip", ["powered", "", "level"], ["clipped"]),
             helper.make_node("MatMul", ["clipped", "W"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
                  [_array("p", [1.5, 2.0, 2.5, 3.0]), _array("alpha", 4.0), _array("W", rng.standard_normal((4, 2))),
                   numpy_helper.from_array(np.ones((1, 4), np.float32), "one")], producer=producer)


def test_a_torch_model_trains_its_learned_exponent_and_clipping_level(tmp_path: Path) -> None:
    """torch's exporters never write a literal exponent or bound as an initializer of its own (the legacy one writes
    a Constant node): in a torch model an initializer there is a parameter, and its gradient is the derivative's.
    From another producer it stays configuration, as a literal."""
    assert {n: r.kind for n, r in classify(_learned_exponent_and_clip("")).items()} == \
        {"p": "constant", "alpha": "constant", "W": "parameter", "one": "parameter"}
    roles = classify(_learned_exponent_and_clip("pytorch"))
    assert {n: r.kind for n, r in roles.items()} == \
        {"p": "parameter", "alpha": "parameter", "W": "parameter", "one": "parameter"}
    path = tmp_path / "gem.onnx"
    onnx.save(_learned_exponent_and_clip("pytorch"), path)
    engine = GradientEngine(path, batch_size=3, loss="mse", exclude=["one"], cache_dir=tmp_path)
    parameters = engine.parameters()
    rng = np.random.default_rng(3)
    inputs = {"x": rng.uniform(0.2, 1.5, (3, 4)), "labels": rng.standard_normal((3, 2))}
    _, grads = engine.gradients(parameters, inputs)
    assert np.abs(grads["p"]).min() > 0 and float(grads["alpha"]) != 0   # (2.5 ** 3 > 4: alpha clips one column)
    for name, index in (("p", 1), ("p", 3), ("alpha", ())):
        step = np.zeros_like(parameters[name])
        step[index] = 1e-3
        above, below = {**parameters, name: parameters[name] + step}, {**parameters, name: parameters[name] - step}
        numeric = (engine.gradients(above, inputs)[0] - engine.gradients(below, inputs)[0]) / 2e-3
        assert float(grads[name][index]) == pytest.approx(numeric, rel=2e-2), (name, index)


def test_a_mask_with_infinite_entries_is_a_constant_and_its_attention_trains_without_it(tmp_path: Path) -> None:
    """A causal mask torch exports from a registered buffer (-inf above the diagonal) is an initializer like the
    weights: it is a constant, not trained into a learned bias, while a finite table beside it still trains."""
    rng = np.random.default_rng(2)
    mask = np.triu(np.full((4, 4), -np.inf, np.float32), 1)
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="query"),
             helper.make_node("Add", ["q", "table"], ["qt"], name="position"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="keys"),
             helper.make_node("MatMul", ["qt", "xt"], ["scores"], name="scores"),
             helper.make_node("Add", ["scores", "causal"], ["masked"], name="mask"),
             helper.make_node("Softmax", ["masked"], ["weights"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["weights", "x"], ["y"], name="attend")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 3])],
                   [_array("Wq", rng.standard_normal((3, 3))), _array("table", rng.standard_normal((4, 3))),
                    numpy_helper.from_array(mask, "causal")])
    roles = classify(model)
    assert roles["causal"].kind == "constant" and "infinite" in roles["causal"].reason
    assert roles["Wq"].kind == roles["table"].kind == "parameter"
    path = tmp_path / "masked.onnx"
    onnx.save(model, path)
    engine = GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)
    assert engine.trainable_names == ["Wq", "table"]
    result = engine.step(engine.parameters(), {"x": rng.standard_normal((2, 4, 3)).astype(np.float32),
                                               "labels": rng.standard_normal((2, 4, 3)).astype(np.float32)})
    assert set(result.gradients) == {"Wq", "table"}
    assert all(np.isfinite(g).all() for g in result.gradients.values())


def test_one_element_initializers_of_a_tf2onnx_model_are_constants() -> None:
    roles = classify(_layer_norm_mlp(producer="tf2onnx"))
    assert roles["log_temp"].kind == "constant" and "tf2onnx" in roles["log_temp"].reason
    assert roles["b"].kind == "parameter"


def test_the_one_element_bias_of_a_tf2onnx_dense_1_or_conv_with_one_filter_trains() -> None:
    """A binary classifier's head: Dense(1) writes MatMul + Add of a [1] bias (through a Reshape here), and
    Conv2D(filters=1) a Conv with a [1] bias input. A one-element constant added to anything else stays one."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "K", "kb"], ["c"], name="conv"),
        helper.make_node("Flatten", ["c"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "W"], ["h"], name="dense"),
        helper.make_node("Reshape", ["h", "shape"], ["h2"], name="view"),
        helper.make_node("Add", ["h2", "b"], ["logit"], name="dense_bias"),
        helper.make_node("Add", ["logit", "offset"], ["y"], name="shift"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
                   [_array("K", rng.standard_normal((1, 2, 3, 3))), _array("kb", [0.1]),
                    _array("W", rng.standard_normal((4, 1))), _array("b", [0.2]), _array("offset", [0.5]),
                    numpy_helper.from_array(np.array([-1, 1], np.int64), "shape")], producer="tf2onnx")
    roles = classify(model)
    assert {name for name, role in roles.items() if role.kind == "parameter"} == {"K", "kb", "W", "b"}
    assert roles["offset"].kind == "constant" and "tf2onnx" in roles["offset"].reason


def test_running_statistics_are_state() -> None:
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], ["y"])]
    roles = classify(_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [_array(n, [1.0, 1.0]) for n in "stmv"]))
    assert [roles[n].kind for n in "stmv"] == ["parameter", "parameter", "state", "state"]


def test_a_scalar_parameter_keeps_its_shape_through_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "scalar.onnx"
    onnx.save(_layer_norm_mlp(), path)
    engine = GradientEngine(path, batch_size=5, loss="mse", cache_dir=tmp_path)
    assert engine.trainable_names == ["W", "b", "gamma", "log_temp"]
    parameters = engine.parameters()
    assert parameters["log_temp"].shape == ()
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((5, 4)), "labels": rng.standard_normal((5, 3))}
    _, grads = engine.gradients(parameters, inputs)
    assert grads["log_temp"].shape == ()
    step = 1e-3
    above, below = dict(parameters), dict(parameters)
    above["log_temp"] = np.asarray(parameters["log_temp"] + step, np.float32)
    below["log_temp"] = np.asarray(parameters["log_temp"] - step, np.float32)
    numeric = (engine.gradients(above, inputs)[0] - engine.gradients(below, inputs)[0]) / (2 * step)
    assert float(grads["log_temp"]) == pytest.approx(numeric, rel=1e-2)


def test_an_exact_include_trains_a_constant_and_a_wildcard_does_not(tmp_path: Path) -> None:
    path = tmp_path / "tf.onnx"
    onnx.save(_layer_norm_mlp(producer="tf2onnx"), path)
    engine = GradientEngine(path, batch_size=2, loss="mse", include=["*", "log_temp"],
                            exclude=["gamma"], cache_dir=tmp_path)
    assert engine.trainable_names == ["W", "b", "log_temp"]


def test_an_include_pattern_that_matches_nothing_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_layer_norm_mlp(), path)
    with pytest.raises(UnsupportedModelError, match=r"include pattern 'dense\*' matches no"):
        GradientEngine(path, batch_size=2, loss="mse", include=["dense*"], cache_dir=tmp_path)


def test_expect_parameters_names_the_count_and_the_parameters(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_layer_norm_mlp(), path)
    with pytest.raises(UnsupportedModelError,
                       match=r"expected 6 trainable parameters, but the model has 4: W \(4, 3\)"):
        GradientEngine(path, batch_size=2, loss="mse", expect_parameters=6, cache_dir=tmp_path)
    GradientEngine(path, batch_size=2, loss="mse", expect_parameters=4, cache_dir=tmp_path)


def test_a_tf2onnx_dense_layer_without_a_bias_warns_about_folded_variables(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="dense/MatMul"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["z"], name="dense_1/MatMul"),
             helper.make_node("Add", ["z", "b2"], ["y"], name="dense_1/BiasAdd")]
    path = tmp_path / "folded.onnx"
    onnx.save(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
                     [_array("W1", rng.standard_normal((3, 4))),
                      _array("W2", rng.standard_normal((4, 2))), _array("b2", [0.5, 0.5])],
                     producer="tf2onnx"), path)
    with pytest.warns(UserWarning, match=r"1 weight layer\(s\) .* no bias: dense/MatMul "
                                         r"\(MatMul\)\. .*folded"):
        GradientEngine(path, batch_size=2, loss="mse", cache_dir=tmp_path)


def _conv_model(weight: str, producer: str) -> onnx.ModelProto:
    rng = np.random.default_rng(4)
    return _model([helper.make_node("Conv", ["x", weight, "bias"], ["y"], pads=[1, 1, 1, 1])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 4, 4])],
                  [_array(weight, rng.standard_normal((2, 3, 3, 3))), _array("bias", [0.1, -0.1])], producer=producer)


def test_a_weight_the_legacy_exporter_folded_from_parameters_is_named_in_a_warning(tmp_path: Path) -> None:
    """Exported in eval mode with constant folding (torch.onnx.export's defaults), a BatchNorm is fused into the
    Conv before it, whose weight then carries the name of the graph value it replaced."""
    onnx.save(_conv_model("onnx::Conv_32", "pytorch"), tmp_path / "fused.onnx")
    with pytest.warns(UserWarning, match=r"fused\.onnx: 1 initializer\(s\) were computed by torch\.onnx\.export's "
                                         r"constant folding from the module's parameters \(onnx::Conv_32\): each "
                                         r"trains as a parameter of its own"):
        engine = GradientEngine(tmp_path / "fused.onnx", batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
    assert "onnx::Conv_32" in engine.trainable_names   # it still trains, as a plain Conv's weight
    for weight, producer in (("conv.weight", "pytorch"), ("onnx::Conv_32", "tf2onnx")):
        onnx.save(_conv_model(weight, producer), tmp_path / "plain.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            GradientEngine(tmp_path / "plain.onnx", batch_size=2, loss="mse", cache_dir=tmp_path / "cache")
