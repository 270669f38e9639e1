"""Models from torch.onnx's dynamo exporter (the default since torch 2.9): a BatchNorm that trained in torch.

The exporter records on every node the torch.fx node it came from. It writes a training-mode
BatchNorm as an inference BatchNormalization; with its default optimize=True, onnxscript then
folds it into the Conv or Gemm before it, or merges its running statistics with equal-valued
parameters. The graphs here are written by hand with that metadata, as torch 2.13 writes it
(tests/fixtures/torch/bn_dropout_dynamo.onnx is a real export, trained against torch).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine import GradientEngine
from worker_client.engine.exporters import (from_torch_dynamo, restore_torch_training_batch_norms, torch_origin,
                                             torch_padding_rows, torch_parameters_renamed_or_dropped)
from worker_client.engine.selection import classify
from worker_client.engine.trainables import trainable_parameters

TRAINING = ("%_native_batch_norm_legit_functional : [num_users=3] = call_function[target=torch.ops.aten."
            "_native_batch_norm_legit_functional.default](args = (%conv2d, %p_bn_weight, %p_bn_bias, %b_bn_running_mean, "
            "%b_bn_running_var, True, 0.1, 1e-05), kwargs = {})")
EVAL = ("%_native_batch_norm_legit_no_training : [num_users=1] = call_function[target=torch.ops.aten."
        "_native_batch_norm_legit_no_training.default](args = (%conv2d, %p_bn_weight, %p_bn_bias, %b_bn_running_mean, "
        "%b_bn_running_var, 0.1, 1e-05), kwargs = {})")


def _flagged(training: bool) -> str:
    return (f"%batch_norm : [num_users=1] = call_function[target=torch.ops.aten.batch_norm.default](args = (%x, "
            f"%p_bn_weight, %p_bn_bias, %b_bn_running_mean, %b_bn_running_var, {training}, 0.1, 1e-05, True), "
            "kwargs = {})")


def _record(node: onnx.NodeProto, fx_node: str, *, rule: str | None = None, scope: str = "bn") -> onnx.NodeProto:
    outer = [scope[:i] for i, c in enumerate(scope) if c == "."]   # as the exporter writes them: cumulative
    entries = {"pkg.torch.onnx.fx_node": fx_node,
               "pkg.torch.onnx.name_scopes": str(["", *outer, scope, "batch_norm"])}
    if rule:
        entries["pkg.onnxscript.rewriter.rule_name"] = rule
    for key, value in entries.items():
        node.metadata_props.add(key=key, value=value)
    return node


def _model(nodes: list[onnx.NodeProto], initializers: dict[str, np.ndarray], *,
           producer: str = "pytorch") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name=producer)
    return model


def _batch_norm(fx_node: str, statistics: tuple[str, str] = ("bn.running_mean", "bn.running_var")) -> onnx.ModelProto:
    node = _record(helper.make_node("BatchNormalization", ["x", "bn.weight", "bn.bias", *statistics], ["y"],
                                    name="node_batch_norm"), fx_node)
    return _model([node], {"bn.weight": np.ones(3, np.float32), "bn.bias": np.zeros(3, np.float32),
                           "bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)})


@pytest.mark.parametrize("fx_node", [TRAINING, _flagged(True)])
def test_a_training_batch_norm_written_as_inference_is_put_back_in_training_mode(fx_node: str) -> None:
    model = _batch_norm(fx_node)
    assert from_torch_dynamo(model)
    assert restore_torch_training_batch_norms(model, "m.onnx") == 1
    node = model.graph.node[0]
    assert helper.get_node_attr_value(node, "training_mode") == 1
    assert list(node.output) == ["y", "y__running_mean", "y__running_var"]   # as onnx's shape inference insists
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True))
    assert restore_torch_training_batch_norms(model, "m.onnx") == 0          # once is enough


@pytest.mark.parametrize("fx_node", [EVAL, _flagged(False), "%relu : call_function[target=torch.ops.aten.relu.default]"])
def test_an_eval_mode_batch_norm_and_other_nodes_are_left_alone(fx_node: str) -> None:
    model = _batch_norm(fx_node)
    before = model.SerializeToString()
    assert restore_torch_training_batch_norms(model, "m.onnx") == 0
    assert model.SerializeToString() == before


def test_another_producers_metadata_is_not_read() -> None:
    model = _batch_norm(TRAINING)
    model.producer_name = "someone"
    assert not from_torch_dynamo(model)
    assert restore_torch_training_batch_norms(model, "m.onnx") == 0


def test_a_batch_norm_folded_into_its_conv_is_refused_naming_the_module_and_the_remedy() -> None:
    conv = _record(helper.make_node("Conv", ["x", "c.weight", "c.bias"], ["y"], name="node_Conv_19"), TRAINING,
                   rule="FuseBatchNormIntoConv", scope="layer1.bn")
    model = _model([conv], {"c.weight": np.ones((3, 3, 1, 1), np.float32), "c.bias": np.zeros(3, np.float32)})
    with pytest.raises(UnsupportedModelError) as refused:
        restore_torch_training_batch_norms(model, "m.onnx")
    assert str(refused.value) == (
        "m.onnx: torch.onnx.export's dynamo exporter (the default since torch 2.9) wrote 1 training-mode "
        "BatchNorm(s) as inference ones, and its optimizer then folded or merged them: layer1.bn (folded into "
        "'node_Conv_19', a Conv, by FuseBatchNormIntoConv). Trained as it is, the model would not normalize with "
        "batch statistics there: export with dynamo=False as docs/models.md (\"Exporter recipes\") says, or with "
        "dynamo=True and optimize=False")


def test_an_eval_mode_batch_norm_folded_into_its_conv_is_an_ordinary_conv() -> None:
    conv = _record(helper.make_node("Conv", ["x", "c.weight"], ["y"], name="node_Conv_19"), EVAL,
                   rule="FuseBatchNormIntoConv")
    assert restore_torch_training_batch_norms(_model([conv], {"c.weight": np.ones((3, 3, 1, 1), np.float32)}),
                                              "m.onnx") == 0


def test_running_statistics_merged_with_the_weight_and_bias_are_refused() -> None:
    """optimize=True merges equal-valued initializers: a fresh BatchNorm's running mean (zeros) into its bias and
    its running variance (ones) into its weight."""
    with pytest.raises(UnsupportedModelError, match=r"bn \('node_batch_norm': its running statistics "
                                                    r"\['bn.bias', 'bn.weight'\] are merged with other values\)"):
        restore_torch_training_batch_norms(_batch_norm(TRAINING, ("bn.bias", "bn.weight")), "m.onnx")


def test_a_parameter_two_layer_norms_share_is_blamed_on_the_dynamo_exporters_merge() -> None:
    norms = [_record(helper.make_node("LayerNormalization", [source, "ln1.weight", "ln1.bias"], [out],
                                      name=f"node_layer_norm_{i}"),
                     f"%layer_norm_{i} : call_function[target=torch.ops.aten.layer_norm.default]", scope=f"ln{i + 1}")
             for i, (source, out) in enumerate((("x", "h"), ("h", "y")))]
    model = _model(norms, {"ln1.weight": np.ones(4, np.float32), "ln1.bias": np.zeros(4, np.float32)})
    with pytest.warns(UserWarning) as caught:
        assert trainable_parameters(model, include=(), exclude=(), source="m.onnx") == ["ln1.weight", "ln1.bias"]
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2 and all("feeds 2 layers: node_layer_norm_0 (LayerNormalization), node_layer_norm_1 "
                                   "(LayerNormalization)" in t for t in texts)
    assert all("torch.onnx.export's dynamo exporter (the default since torch 2.9) merges parameters that hold equal "
               "values" in t and "re-export with dynamo=False" in t and "eval mode" not in t for t in texts)


def _fx(node: onnx.NodeProto, record: str) -> onnx.NodeProto:
    node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=record)
    return node


def test_its_one_element_literals_are_constants_and_its_named_scalars_parameters() -> None:
    """The optimizer writes an attention's scale or a mask's -inf as one-element initializers; a 0-d torch
    parameter is named in the record of the op that reads it (torch.export calls it p_<name>)."""
    nodes = [_fx(helper.make_node("Mul", ["x", "val_51"], ["a"]), "%mul : call_function[target=torch.ops.aten."
                                                                   "mul.Tensor](args = (%x, 0.5), kwargs = {})"),
             _fx(helper.make_node("Add", ["a", "val_6"], ["b"]), "%masked_fill : call_function[...]"),
             _fx(helper.make_node("Div", ["b", "head.temp"], ["c"]), "%div : call_function[target=torch.ops.aten."
                                                                      "div.Tensor](args = (%b, %p_head_temp), ...)"),
             _fx(helper.make_node("Mul", ["c", "head.t"], ["y"]), "%mul_1 : (args = (%c, %p_head_temperature))")]
    model = _model(nodes, {"val_51": np.array(0.5, np.float32), "val_6": np.array([-np.inf], np.float32),
                           "head.temp": np.array(2.0, np.float32), "head.t": np.array(1.5, np.float32)})
    roles = classify(model)
    assert {n: r.kind for n, r in roles.items()} == {"val_51": "constant", "val_6": "constant",
                                                      "head.temp": "parameter", "head.t": "constant"}
    assert roles["val_51"].reason == ("a one-element literal that torch.onnx's dynamo exporter wrote as an "
                                      "initializer (no torch parameter of that name reads it)")
    model.producer_name = "someone"   # no record to read: every finite one-element initializer trains, as before
    assert {n: r.kind for n, r in classify(model).items()} == {"val_51": "parameter", "val_6": "constant",
                                                               "head.temp": "parameter", "head.t": "parameter"}


def test_a_buffer_or_tensor_constant_the_record_names_is_a_constant_of_any_size_and_a_parameter_beside_it_trains(
        ) -> None:
    """torch.export records a register_buffer tensor as %b_<name> (a positional table, a rotary embedding's cos)
    and a tensor forward() builds from literals as %c_<name> (an affine grid's identity transform): torch trains
    neither, so neither does the engine; without the record each is a weight like any other."""
    nodes = [_fx(helper.make_node("Add", ["x", "pos.table"], ["a"]), "%add : call_function[target=torch.ops.aten."
                                                                     "add.Tensor](args = (%x, %b_pos_table), ...)"),
             _fx(helper.make_node("Identity", ["lifted_tensor_0"], ["clone"]),
                 "%clone : call_function[target=torch.ops.aten.clone.default](args = (%c_lifted_tensor_0,), ...)"),
             helper.make_node("Add", ["a", "clone"], ["b"]),
             _fx(helper.make_node("Mul", ["b", "scale"], ["y"]), "%mul : call_function[target=torch.ops.aten."
                                                                 "mul.Tensor](args = (%add_1, %p_scale), ...)")]
    model = _model(nodes, {"pos.table": np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32),
                           "lifted_tensor_0": np.eye(4, dtype=np.float32), "scale": np.array(2.0, np.float32)})
    roles = classify(model)
    assert {n: r.kind for n, r in roles.items()} == {"pos.table": "constant", "lifted_tensor_0": "constant",
                                                      "scale": "parameter"}
    assert "torch buffer" in roles["pos.table"].reason
    model.producer_name = "someone"   # no record to read: the table trains, as a legacy export's does
    assert {r.kind for r in classify(model).values()} == {"parameter"}


def test_the_unit_scale_and_shift_of_a_group_norms_instance_norm_are_constants() -> None:
    group_norm = ("%group_norm : call_function[target=torch.ops.aten.group_norm.default](args = (%conv2d, 2, "
                  "%p_gn_weight, %p_gn_bias, 1e-05, False), kwargs = {})")
    instance_norm = ("%instance_norm : call_function[target=torch.ops.aten.instance_norm.default](args = (%x, "
                     "%p_in_weight, %p_in_bias, None, None, True, 0.1, 1e-05, False), kwargs = {})")
    nodes = [_fx(helper.make_node("InstanceNormalization", ["x", "val_9", "val_12"], ["a"]), group_norm),
             _fx(helper.make_node("Mul", ["a", "val_22"], ["b"]), group_norm),
             _fx(helper.make_node("InstanceNormalization", ["b", "in.weight", "in.bias"], ["y"]), instance_norm)]
    model = _model(nodes, {"val_9": np.ones(2, np.float32), "val_12": np.zeros(2, np.float32),
                           "val_22": np.ones((3, 1, 1), np.float32), "in.weight": np.ones(3, np.float32),
                           "in.bias": np.zeros(3, np.float32)})
    kinds = {n: r.kind for n, r in classify(model).items()}
    assert kinds == {"val_9": "constant", "val_12": "constant", "val_22": "parameter",   # GroupNorm's weight, reshaped
                     "in.weight": "parameter", "in.bias": "parameter"}


def _conv_batch_norm(norm: onnx.NodeProto, before: list[onnx.NodeProto], statistics: dict[str, np.ndarray]
                     ) -> onnx.ModelProto:
    """x -> Conv -> `before` and `norm` (reading "h") -> Relu -> y, as a dynamo export with its records."""
    rng = np.random.default_rng(3)
    conv = _fx(helper.make_node("Conv", ["x", "conv.weight"], ["h"], pads=[1, 1, 1, 1]),
               "%conv2d : call_function[target=torch.ops.aten.conv2d.default](args = (%x, %p_conv_weight), ...)")
    relu = helper.make_node("Relu", [norm.output[0]], ["y"])
    model = _model([conv, *before, norm, relu], {"conv.weight": rng.normal(size=(3, 3, 3, 3)).astype(np.float32),
                                                 "bn.weight": rng.uniform(0.5, 1.5, 3).astype(np.float32),
                                                 "bn.bias": rng.normal(size=3).astype(np.float32), **statistics,
                                                 "axes": np.array([0, 2, 3], np.int64)})
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    return model


def test_a_batch_norm_without_running_statistics_trains_through_its_batch_statistics(tmp_path) -> None:
    """track_running_stats=False: the exporter feeds the batch's own mean and variance (ReduceMeans in the graph) to
    an inference BatchNormalization, whose adjoint does not reach the layers before through them. Put in training
    mode it computes the same statistics itself: the step is that of a BatchNorm that keeps running statistics,
    and no state is added."""
    record = ("%_native_batch_norm_legit : call_function[target=torch.ops.aten._native_batch_norm_legit.no_stats]"
              "(args = (%conv2d, %p_bn_weight, %p_bn_bias, True, 0.1, 1e-05), kwargs = {})")
    statistics = [helper.make_node("ReduceMean", ["h", "axes"], ["mean"], keepdims=0),
                  helper.make_node("ReduceMean", ["h", "axes"], ["kept"], keepdims=1),
                  helper.make_node("Sub", ["h", "kept"], ["centred"]),
                  helper.make_node("Mul", ["centred", "centred"], ["squared"]),
                  helper.make_node("ReduceMean", ["squared", "axes"], ["var"], keepdims=0)]
    norm = _record(helper.make_node("BatchNormalization", ["h", "bn.weight", "bn.bias", "mean", "var"], ["n"]),
                   record)
    without = _conv_batch_norm(norm, statistics, {})
    tracked = _conv_batch_norm(_record(helper.make_node(
        "BatchNormalization", ["h", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"], ["n"]), TRAINING),
        [], {"bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)})
    restored = onnx.ModelProto()
    restored.CopyFrom(without)
    assert restore_torch_training_batch_norms(restored, "m.onnx") == 1
    assert helper.get_node_attr_value(restored.graph.node[-2], "training_mode") == 1
    rng = np.random.default_rng(4)
    batch = {"x": rng.normal(size=(4, 3, 4, 4)).astype(np.float32),
             "labels": rng.normal(size=(4, 3, 4, 4)).astype(np.float32)}
    steps = {}
    for name, model in (("without", without), ("tracked", tracked)):
        onnx.save(model, tmp_path / f"{name}.onnx")
        engine = GradientEngine(tmp_path / f"{name}.onnx", batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
        steps[name] = engine.step({**engine.parameters(), **engine.state()}, batch)
    assert sorted(steps["without"].gradients) == ["bn.bias", "bn.weight", "conv.weight"]
    assert steps["without"].state == {}
    assert steps["without"].loss == pytest.approx(steps["tracked"].loss, rel=1e-6)
    for name, gradient in steps["tracked"].gradients.items():
        assert np.abs(gradient).max() > 1e-3
        np.testing.assert_allclose(steps["without"].gradients[name], gradient, rtol=1e-4, atol=1e-6, err_msg=name)


def test_torch_parameters_the_optimizer_folded_or_renamed_are_named_when_the_engine_is_built(tmp_path) -> None:
    """A Linear whose zero bias the optimizer dropped (its Gemm has no bias input) and whose weight it stored
    transposed under a generated name: both are read by the op's record, neither is an initializer of its name."""
    record = ("%linear : call_function[target=torch.ops.aten.linear.default](args = (%x, %p_fc_weight, "
              "%p_fc_bias), kwargs = {})")
    gemm = _fx(helper.make_node("Gemm", ["x", "val_1"], ["y"], name="node_linear"), record)
    graph = helper.make_graph([gemm], "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
                              [numpy_helper.from_array(np.ones((3, 2), np.float32), "val_1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="pytorch")
    assert torch_parameters_renamed_or_dropped(model) == ["p_fc_bias", "p_fc_weight"]
    path = tmp_path / "linear.onnx"
    onnx.save(model, path)
    with pytest.warns(UserWarning, match=r"2 torch parameter\(s\) are not in the graph under their own names "
                                         r"\(p_fc_bias, p_fc_weight, as torch\.export names them\)"):
        engine = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
    assert engine.trainable_names == ["val_1"]
    model.graph.initializer[0].name = "fc.weight"   # held under its own name: only the dropped bias is named
    model.graph.node[0].input[1] = "fc.weight"
    assert torch_parameters_renamed_or_dropped(model) == ["p_fc_bias"]


def test_a_parameter_merged_into_another_layer_is_named_and_a_tie_torch_had_is_not() -> None:
    """The records say which torch parameter each op read: ln2's LayerNorm reading ln1.weight is the optimizer's
    merge; an output projection reading the embedding's weight that its own torch op read too is torch's tie."""
    norms = [_fx(helper.make_node("LayerNormalization", ["x", "ln1.weight", "ln1.bias"], ["h"], name="node_ln_0"),
                 "%layer_norm : (args = (%x, [4], %p_ln1_weight, %p_ln1_bias, 1e-05), kwargs = {})"),
             _fx(helper.make_node("LayerNormalization", ["h", "ln1.weight", "ln1.bias"], ["g"], name="node_ln_1"),
                 "%layer_norm_1 : (args = (%h, [4], %p_ln2_weight, %p_ln2_bias, 1e-05), kwargs = {})"),
             _fx(helper.make_node("Gather", ["emb.weight", "ids"], ["e"], name="node_embedding"),
                 "%embedding : (args = (%p_emb_weight, %ids), kwargs = {})"),
             _fx(helper.make_node("MatMul", ["g", "emb.weight"], ["m"], name="node_linear"),
                 "%linear : (args = (%g, %p_emb_weight), kwargs = {})"),
             helper.make_node("Add", ["m", "e"], ["y"])]
    model = _model(norms, {"ln1.weight": np.ones(4, np.float32), "ln1.bias": np.zeros(4, np.float32),
                           "emb.weight": np.ones((4, 4), np.float32)})
    with pytest.warns(UserWarning) as caught:
        trainable_parameters(model, include=(), exclude=(), source="m.onnx")
    texts = sorted(str(w.message) for w in caught)
    assert len(texts) == 2, texts
    assert texts[0].startswith("m.onnx: initializer 'ln1.bias' (torch parameter ln1.bias) is also read by node_ln_1 "
                               "(LayerNormalization), which came from torch ops that did not read it: the optimizer of "
                               "torch.onnx.export's dynamo exporter (optimize=True, the default) merged it")
    assert texts[1].startswith("m.onnx: initializer 'ln1.weight' (torch parameter ln1.weight) is also read by "
                               "node_ln_1 (LayerNormalization)")
    assert not any("emb.weight" in t for t in texts)


EMBEDDING = "%embedding : call_function[target=torch.ops.aten.embedding.default](args = (%p_e_weight, %ids{}), kwargs = {{}})"


def _embedding_model(record: str | None, *, tied: bool = False) -> onnx.ModelProto:
    gather = helper.make_node("Gather", ["e.weight", "ids"], ["rows"], name="node_embedding")
    if record is not None:
        _fx(gather, record)
    nodes = [gather, helper.make_node("ReduceMean", ["rows", "axis"], ["y"], keepdims=0)]
    if tied:
        nodes[-1] = helper.make_node("ReduceMean", ["rows", "axis"], ["pooled"], keepdims=0)
        nodes.append(_fx(helper.make_node("MatMul", ["pooled", "e.weight_t"], ["y"]), "%linear : (args = (%x, %p_o))"))
        nodes.insert(0, _fx(helper.make_node("Transpose", ["e.weight"], ["e.weight_t"]), "%linear : (%p_o)"))
    graph = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.random.default_rng(0).standard_normal((5, 5))
                                                       .astype(np.float32), "e.weight"),
                               numpy_helper.from_array(np.array([1], np.int64), "axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="pytorch")


def test_an_embeddings_padding_row_gets_no_gradient_as_in_torch(tmp_path) -> None:
    """The exporter writes a plain Gather and drops padding_idx; its record keeps it, and torch keeps that row's
    gradient at zero."""
    ids = np.array([[0, 1, 2], [3, 0, 0], [4, 4, 1], [2, 0, 3]], np.int64)
    target = np.ones((4, 5), np.float32)
    grads = {}
    for label, record in (("padded", EMBEDDING.format(", 0")), ("plain", EMBEDDING.format(""))):
        path = tmp_path / f"{label}.onnx"
        onnx.save(_embedding_model(record), path)
        engine = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
        grads[label] = engine.gradients(engine.parameters(), {"ids": ids, "labels": target})[1]["e.weight"]
    assert np.abs(grads["plain"][0]).max() > 0
    assert not grads["padded"][0].any()
    np.testing.assert_array_equal(grads["padded"][1:], grads["plain"][1:])


@pytest.mark.parametrize("record, tied, expected", [
    (EMBEDDING.format(", 0"), False, {"e.weight": 0}),
    (EMBEDDING.format(", -1"), False, {"e.weight": 4}),   # counted from the end, as torch does
    (EMBEDDING.format(""), False, {}),                    # no padding_idx
    (EMBEDDING.format(", 0"), True, {}),                  # tied: the other use gives that row gradient
])
def test_only_a_table_read_only_as_a_padded_embedding_has_a_padding_row(record, tied, expected) -> None:
    assert torch_padding_rows(_embedding_model(record, tied=tied)) == expected


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_padded_table_that_trains_by_rows_pushes_no_gradient_for_its_padding_row(tmp_path, dynamic) -> None:
    """By rows, the gradient is the batch's rows': the padding row's is zero in what the worker pushes, and the
    others are the dense gradient's rows, as in torch."""
    ids = np.array([[0, 1, 2], [3, 0, 0], [4, 4, 1], [2, 0, 3]], np.int64)
    target = np.ones((4, 5), np.float32)
    path = tmp_path / "padded.onnx"
    onnx.save(_embedding_model(EMBEDDING.format(", 0")), path)
    dense = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
    expected = dense.gradients(dense.parameters(), {"ids": ids, "labels": target})[1]["e.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing to warn about any more
        engine = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache",
                                sparse_tables=["e.weight"], dynamic_tables=["e.weight"] if dynamic else ())
    plan = engine.sparse
    assert plan.tables["e.weight"].padding_row == 0
    batch = {"ids": ids, "labels": target}
    unique = plan.unique_ids(batch)
    table = engine.server_parameters().get("e.weight", dense.parameters()["e.weight"])
    parameters = {**engine.parameters(),
                  "e.weight.rows": plan.rows_parameter("e.weight", table[unique["e.weight"]])}
    result = engine.step(parameters, plan.feeds(batch, unique))
    (pushed_ids, rows), = plan.row_gradients(result.gradients, unique).values()
    np.testing.assert_array_equal(pushed_ids, [0, 1, 2, 3, 4])
    assert not rows[0].any() and not expected[0].any()
    np.testing.assert_allclose(rows, expected[pushed_ids], rtol=1e-6)
    # a batch without the padding id: every row as computed
    other = {"ids": np.array([[1, 2, 3]] * 4, np.int64), "labels": target}
    unique = plan.unique_ids(other)
    result = engine.step({**parameters, "e.weight.rows": plan.rows_parameter("e.weight", table[unique["e.weight"]])},
                         plan.feeds(other, unique))
    (_, rows), = plan.row_gradients(result.gradients, unique).values()
    assert np.abs(rows).min(axis=1).all()


BAG_RECORD = ("%embedding_bag : call_function[target=torch.ops.aten.embedding_bag.padding_idx](args = (%p_e_weight, "
              "%view, %arange, False, 1, False, None, False, None), kwargs = {})")


def _bag_model(record: str | None) -> onnx.ModelProto:
    """A table read through a sequence, as the exporter's EmbeddingBag Loop ends (ConcatFromSequence has no rule)."""
    concat = helper.make_node("ConcatFromSequence", ["bags"], ["rows"], name="n20", axis=0)
    if record is not None:
        _fx(concat, record)
        concat.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'e', 'embedding_bag']")
    nodes = [helper.make_node("Gather", ["e.weight", "ids"], ["picked"]),
             helper.make_node("SequenceConstruct", ["picked"], ["bags"]), concat,
             helper.make_node("ReduceMean", ["rows", "axis"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((5, 5), np.float32), "e.weight"),
                               numpy_helper.from_array(np.array([1], np.int64), "axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="pytorch")


def test_a_refused_node_names_the_torch_op_and_module_it_came_from(tmp_path) -> None:
    path = tmp_path / "bag.onnx"
    onnx.save(_bag_model(BAG_RECORD), path)
    with pytest.raises(UnsupportedModelError) as refused:
        GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
    text = str(refused.value)
    assert "node 'n20' (ConcatFromSequence, from torch's aten.embedding_bag.padding_idx in module 'e'): " in text
    remedy = ("nn.EmbeddingBag exports as a Loop over its bags, through which no gradient can be built (from this "
              "exporter even for equal-length bags): write it as nn.Embedding followed by a sum or mean over the bag "
              "axis (masking the padded ids), which trains by rows too.")
    assert text.endswith(f"or replace the op. {remedy}")
    # refused at a node after the bag (whose rank the bag's sequences hid): the bag is named, with what to do
    assert torch_origin(_bag_model(BAG_RECORD), "absent")[1] == ""
    model = _bag_model(BAG_RECORD)
    _fx(model.graph.node[-1], "%mean : call_function[target=torch.ops.aten.mean.dim](args = (%embedding_bag,), ...)")
    model.graph.node[-1].name = "node_mean"
    assert torch_origin(model, "node_mean") == (", from torch's aten.mean.dim",
                                                f" The model has aten.embedding_bag (module 'e'): {remedy}")
    # a model without the exporter's record: the message as it was
    onnx.save(_bag_model(None), path)
    with pytest.raises(UnsupportedModelError) as refused:
        GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache2")
    assert "node 'n20' (ConcatFromSequence): " in str(refused.value) and "torch" not in str(refused.value)
    assert str(refused.value).endswith("or replace the op.")


def test_the_torch_origin_of_a_node_inside_a_loop_is_its_loops() -> None:
    inner = helper.make_node("Slice", ["a", "b", "c"], ["d"], name="n0_7")
    body = helper.make_graph([inner], "body", [], [helper.make_tensor_value_info("d", TensorProto.FLOAT, None)])
    loop = _fx(helper.make_node("Loop", ["", "cond"], ["out"], name="n19_2", body=body),
               BAG_RECORD.replace("padding_idx", "default"))
    model = helper.make_model(helper.make_graph([loop], "g", [], []))
    assert torch_origin(model, "n0_7")[0] == ", from torch's aten.embedding_bag.default"   # no module scope recorded
    assert torch_origin(model, "n19_2")[1].startswith(" nn.EmbeddingBag exports as a Loop")
    assert torch_origin(model, "elsewhere") == ("", "")
    other = _fx(helper.make_node("Relu", ["x"], ["y"], name="r"), "%relu : call_function[target=torch.ops.aten."
                                                                  "relu.default](args = (%x,), kwargs = {})")
    assert torch_origin(helper.make_model(helper.make_graph([other], "g", [], [])), "r") == \
        (", from torch's aten.relu.default", "")   # no known remedy: only where it came from


def test_constants_written_as_plain_attributes_are_read_as_constants(tmp_path) -> None:
    """The dynamo exporter writes shapes, Slice bounds and sequence positions as Constants with value_ints (or
    value_int, value_float(s)) where the legacy exporter writes `value` tensors. The rewrites read them as
    constants too: a view's shape written so left every shape after it unknown, so a flip after it (a Slice with
    step -1, which onnx-ad refuses) was not written as a Gather, and the model was refused (a ConvTranspose
    after a view was not written as Convs either). Here a flip of a view of x @ W trains, its gradient the
    closed form's."""
    ints = lambda name, values: helper.make_node("Constant", [], [name], value_ints=values)   # noqa: E731
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="n0"),
             # x.view(x.shape[0], 5) as the exporter writes it: the batch from Shape(x), the rest a value_ints
             helper.make_node("Shape", ["x"], ["dims"], start=0, end=1), helper.make_node("Squeeze", ["dims"], ["n"]),
             ints("one_axis", [-1]), helper.make_node("Reshape", ["n", "one_axis"], ["batch"]), ints("width", [5]),
             helper.make_node("Concat", ["batch", "width"], ["shape"], axis=0),
             helper.make_node("Reshape", ["h", "shape"], ["view"]),
             ints("last", [-1]), ints("ends", [-(2 ** 63)]),
             helper.make_node("Slice", ["view", "last", "ends", "last", "last"], ["y"], name="node_flip")]
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((3, 5)).astype(np.float32)
    graph = helper.make_graph(nodes, "flip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
                              [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = tmp_path / "flip.onnx"
    onnx.save(model, path)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    labels = rng.standard_normal((4, 5)).astype(np.float32)
    engine = GradientEngine(path, batch_size=4, loss="mse", cache_dir=tmp_path / "cache")
    result = engine.step(engine.parameters(), {"x": x, "labels": labels})
    flipped = (x @ weight)[:, ::-1]
    assert result.loss == pytest.approx(float(((flipped - labels) ** 2).mean()), rel=1e-5)
    expected = x.T @ (2 * (flipped - labels) / labels.size)[:, ::-1]
    np.testing.assert_allclose(result.gradients["W"], expected, rtol=1e-5, atol=1e-6)

    from worker_client.engine.rewrites.toolkit import constants
    plain = helper.make_model(helper.make_graph(
        [ints("a", [2, 3]), helper.make_node("Constant", [], ["b"], value_int=7),
         helper.make_node("Constant", [], ["c"], value_floats=[0.5, 1.5]),
         helper.make_node("Constant", [], ["d"], value_float=2.5)], "plain", [], []))
    values = constants(plain)
    assert values["a"].dtype == np.int64 and values["a"].tolist() == [2, 3]
    assert values["b"].dtype == np.int64 and values["b"].shape == () and int(values["b"]) == 7
    assert values["c"].dtype == np.float32 and values["c"].tolist() == [0.5, 1.5]
    assert values["d"].dtype == np.float32 and values["d"].shape == () and float(values["d"]) == 2.5


def _called_twice(*, also_read: bool = False) -> onnx.ModelProto:
    """One BatchNorm module called twice, as the dynamo exporter writes it: the second call reads the first's new
    statistics, Identities of the buffers (its inference form moves nothing). With `also_read`, another op reads
    the mean too, as when the optimizer merges it with an equal value."""
    second = TRAINING.replace("%_native_batch_norm_legit_functional :", "%_native_batch_norm_legit_functional_1 :")
    nodes = [_record(helper.make_node("BatchNormalization", ["x", "bn.weight", "bn.bias", "bn.running_mean",
                                                              "bn.running_var"], ["a"], name="node_bn_0"), TRAINING),
             _record(helper.make_node("Identity", ["bn.running_mean"], ["getitem_3"]), TRAINING),
             _record(helper.make_node("Identity", ["bn.running_var"], ["getitem_4"]), TRAINING),
             helper.make_node("Add", ["a", "getitem_3"], ["r"]) if also_read else
             helper.make_node("Relu", ["a"], ["r"]),
             _record(helper.make_node("BatchNormalization", ["r", "bn.weight", "bn.bias", "getitem_3", "getitem_4"],
                                      ["y"], name="node_bn_1"), second)]
    return _model(nodes, {"bn.weight": np.ones(3, np.float32), "bn.bias": np.zeros(3, np.float32),
                          "bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)})


def test_a_batch_norm_module_called_twice_reads_its_own_buffers_both_times() -> None:
    """A siamese network's second view through the same BatchNorm: both calls train, both read the buffers
    (training_form moves them once a call, in order), and nothing is reported merged."""
    model = _called_twice()
    assert restore_torch_training_batch_norms(model, "m.onnx") == 2
    norms = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert [list(n.input[3:5]) for n in norms] == [["bn.running_mean", "bn.running_var"]] * 2
    assert all(helper.get_node_attr_value(n, "training_mode") == 1 for n in norms)
    with pytest.raises(UnsupportedModelError, match=r"'node_bn_0': its running statistics \['bn.running_mean', "
                                                    r"'bn.running_var'\] are merged with other values"):
        restore_torch_training_batch_norms(_called_twice(also_read=True), "m.onnx")
