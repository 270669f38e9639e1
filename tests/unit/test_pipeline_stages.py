"""Pipeline stages: the cut, each stage's model, and gradients equal to the whole model's.

The reference is the whole model's GradientEngine on the same batch and, for the exported
fixtures, the framework's own autograd (the gradients saved beside the ONNX file).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from ps_models.builders import build_embedding_model, build_lenet, build_mlp, build_tiny_transformer
from worker_client.engine import GradientEngine
from worker_client.pipeline.cut import CutError, StagePlan, plan_stages, stage_model, write_stages
from worker_client.pipeline.stage import LocalPipeline, split_batch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
#: The agreement the issue asks for: relative to the gradient's norm.
TOLERANCE = 1e-5
BATCH = 8


#: A gradient below this share of the whole gradient's norm is zero in theory (a bias that a
#: softmax cancels): what is left is float rounding, compared against the whole gradient.
ZERO_IN_THEORY = 1e-3


def assert_gradients_match(gradients: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert sorted(gradients) == sorted(reference)
    whole = float(np.sqrt(sum(np.sum(np.square(r.astype(np.float64))) for r in reference.values())))
    for key, expected in reference.items():
        assert gradients[key].shape == expected.shape, key
        scale = max(float(np.linalg.norm(expected)), ZERO_IN_THEORY * whole)
        error = float(np.linalg.norm(gradients[key].astype(np.float64) - expected)) / scale
        assert error <= TOLERANCE, (key, error)


def _batch(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if name == "mlp":
        return {"x": rng.normal(size=(BATCH, 64)).astype(np.float32), "labels": rng.integers(0, 10, BATCH)}
    if name == "lenet":
        return {"x": rng.normal(size=(BATCH, 1, 8, 8)).astype(np.float32), "labels": rng.integers(0, 10, BATCH)}
    return {"ids": rng.integers(0, 1000, (BATCH, 8)), "labels": rng.integers(0, 2, BATCH)}


BUILDERS = {"mlp": build_mlp, "lenet": build_lenet, "transformer": build_tiny_transformer,
            "embedding": build_embedding_model}


def _saved(model: onnx.ModelProto, folder: Path) -> Path:
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("name,stages,micro", [
    ("mlp", 2, 1), ("mlp", 2, 4), ("mlp", 3, 2), ("lenet", 2, 2), ("transformer", 2, 2),
    ("transformer", 4, 2), ("embedding", 2, 1)])
def test_a_k_stage_pipeline_gives_the_whole_models_gradients(name: str, stages: int, micro: int,
                                                              tmp_path: Path) -> None:
    model = BUILDERS[name]()
    path = _saved(model, tmp_path)
    plan = plan_stages(model, stages)
    paths = write_stages(model, plan, tmp_path / "stages")
    whole = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path)
    parameters = whole.parameters()
    feeds = _batch(name, np.random.default_rng(stages * 10 + micro))
    loss, reference = whole.gradients(parameters, feeds)
    pipeline = LocalPipeline(plan, paths, batch_size=BATCH, micro_batches=micro, cache_dir=tmp_path)
    assert sorted(pipeline.parameters()) == sorted(parameters)
    pipe_loss, gradients = pipeline.gradients(parameters, feeds)
    assert abs(pipe_loss - loss) <= TOLERANCE * abs(loss)
    assert_gradients_match(gradients, reference)


EXPORTED = [("torch", "mlp"), ("torch", "cnn"), ("torch", "transformer"), ("torch", "gru_reader"),
            ("torch", "depthwise_separable"), ("torch", "embedding_bag"), ("keras", "keras_cnn"),
            ("jax", "jax_mlp")]


@pytest.mark.parametrize("folder,name", EXPORTED, ids=[n for _, n in EXPORTED])
def test_an_exported_model_cut_in_two_matches_its_frameworks_autograd(folder: str, name: str,
                                                                       tmp_path: Path) -> None:
    data = np.load(FIXTURES / folder / f"{name}.npz")
    feeds = {k[len("input:"):]: data[k] for k in data.files if k.startswith("input:")}
    feeds["labels"] = data["labels"]
    reference = {k[len("grad:"):]: data[k] for k in data.files if k.startswith("grad:")}
    model = onnx.load(str(FIXTURES / folder / f"{name}.onnx"))
    plan = plan_stages(model, 2, loss=str(data["loss_kind"]))
    paths = write_stages(model, plan, tmp_path)
    batch = len(feeds["labels"])
    pipeline = LocalPipeline(plan, paths, batch_size=batch, micro_batches=2, cache_dir=tmp_path,
                             loss=str(data["loss_kind"]))
    loss, gradients = pipeline.gradients(pipeline.parameters(), feeds)
    assert abs(loss - float(data["loss"])) <= TOLERANCE * abs(float(data["loss"]))
    assert_gradients_match(gradients, reference)


def test_each_stage_model_holds_only_its_own_parameters(tmp_path: Path) -> None:
    model = build_mlp(hidden=(128, 64, 32))
    plan = plan_stages(model, 2)
    owned = [set(s.parameters) for s in plan.stages]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    everything = {t.name for t in model.graph.initializer}
    for k, stage in enumerate(plan.stages):
        held = {t.name for t in stage_model(model, plan, k).graph.initializer}
        assert held & everything == owned[k] | (held - set().union(*owned)), k
        assert not held & owned[1 - k]
    sizes = [sum(t.ByteSize() for t in stage_model(model, plan, k).graph.initializer) for k in range(2)]
    whole = sum(t.ByteSize() for t in model.graph.initializer)
    assert max(sizes) < whole


def test_the_automatic_cut_balances_a_deep_mlp(tmp_path: Path) -> None:
    model = build_mlp(hidden=(256,) * 6)
    plan = plan_stages(model, 4)
    assert len(plan.costs) == 4 and abs(sum(plan.costs) - 1.0) < 1e-9
    assert max(plan.costs) < 0.4, plan.costs
    assert all(len(s.sends) == 1 for s in plan.stages)   # one activation crosses each cut


def test_a_cut_given_by_tensor_name_is_taken_and_the_plan_round_trips(tmp_path: Path) -> None:
    model = build_mlp()
    first_relu = next(n.output[0] for n in model.graph.node if n.op_type == "Relu")
    plan = plan_stages(model, 2, cuts=[first_relu])
    assert plan.stages[0].sends == [first_relu]
    assert plan.stages[1].differentiable == [first_relu]
    assert StagePlan.from_json(plan.to_json()) == plan


def test_cuts_that_cannot_be_taken_say_why() -> None:
    model = build_mlp()
    with pytest.raises(CutError, match="neither a tensor"):
        plan_stages(model, 2, cuts=["no-such-tensor"])
    with pytest.raises(CutError, match="need 1 cuts"):
        plan_stages(model, 2, cuts=["a", "b"])
    with pytest.raises(CutError, match="at least 9 layers with parameters"):
        plan_stages(model, 9)
    with pytest.raises(ValueError, match="positive integer"):
        plan_stages(model, 0)


def test_a_cut_inside_a_shared_parameters_readers_is_refused() -> None:
    from onnx import TensorProto, helper, numpy_helper
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w"], ["y"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
                              initializer=[weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match="feeds 2 layers"), \
            pytest.raises(CutError, match="splits the readers of parameter 'w'"):
        plan_stages(model, 2, cuts=["r"])


def test_split_batch_needs_equal_micro_batches() -> None:
    parts = split_batch({"x": np.arange(8), "labels": np.arange(8)}, 4)
    assert [list(p["x"]) for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(Exception, match="does not split into 3"):
        split_batch({"x": np.arange(8)}, 3)


def test_a_cut_that_hands_on_a_tensor_without_a_batch_axis_is_refused() -> None:
    # the GRU's initial state is (layers, batch, hidden): axis 0 is not the batch
    model = onnx.load(str(FIXTURES / "torch" / "gru_reader.onnx"))
    h0 = next(n.output[0] for n in model.graph.node if n.op_type == "ConstantOfShape")
    with pytest.raises(CutError, match="axis 0 is not the batch"):
        plan_stages(model, 2, cuts=[h0])
