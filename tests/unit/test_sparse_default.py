"""Sparse by default: a large table used only through Gather(axis 0) trains sparsely without a flag, also when its
ids are computed from the inputs (a column of an ids input, a hash, an offset), with the gradients of the dense model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine import GradientEngine
from worker_client.engine.sparse import DEFAULT_SPARSE_MIN_BYTES, DYNAMIC_TABLES_KEY, find_sparse_tables
from tests.helpers import tabular

BATCH = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tabular.write_model(tmp_path_factory.mktemp("tabular") / "model.onnx")


def batch(seed: int = 0) -> dict[str, np.ndarray]:
    dense, cat, label = tabular.make_rows(BATCH, seed=seed)
    return {"dense": dense, "cat": cat, "labels": label}


def test_only_the_table_over_the_size_threshold_is_chosen_and_computed_ids_qualify(model_path):
    model = onnx.load(model_path)
    assert find_sparse_tables(model, min_bytes=DEFAULT_SPARSE_MIN_BYTES) == ["emb1.weight"]   # ids = cat[:, 1] % B
    assert sorted(find_sparse_tables(model, min_rows=1)) == ["emb0.weight", "emb1.weight", "emb2.weight"]
    assert find_sparse_tables(model, min_rows=1, exclude=["emb1.weight", "emb0.weight"]) == ["emb2.weight"]


def test_sparse_rows_with_computed_ids_give_the_dense_models_loss_and_gradients(model_path, tmp_path):
    dense = GradientEngine(model_path, batch_size=BATCH, loss="bce", cache_dir=tmp_path)
    sparse = GradientEngine(model_path, batch_size=BATCH, loss="bce", cache_dir=tmp_path, sparse_min_rows=1)
    plan = sparse.sparse
    assert sorted(plan.tables) == ["emb0.weight", "emb1.weight", "emb2.weight"]
    assert plan.dropped_inputs == ["cat"]          # only the ids read it: the step's graph does not take it
    data = batch()
    loss, grads = dense.gradients(dense.parameters(), data)
    ids = plan.unique_ids(data)
    assert set(ids["emb1.weight"]) == set(data["cat"][:, 1] % tabular.BUCKETS)
    assert set(ids["emb2.weight"]) == set(data["cat"][:, 2] - 100)
    tables = dense.parameters()
    params = {k: v for k, v in sparse.parameters().items() if not k.endswith(".rows")}
    for name, table in plan.tables.items():
        params[table.rows_name] = plan.rows_parameter(name, tables[name][ids[name]])
    sparse_loss, sparse_grads = sparse.gradients(params, plan.feeds(data, ids))
    assert sparse_loss == pytest.approx(loss, rel=1e-6)
    for name, (row_ids, rows) in plan.row_gradients(sparse_grads, ids).items():
        scattered = np.zeros_like(tables[name])
        np.add.at(scattered, row_ids, rows)
        np.testing.assert_allclose(scattered, grads[name], atol=1e-6)
    np.testing.assert_allclose(sparse_grads["dense.weight"], grads["dense.weight"], atol=1e-6)


def test_dense_tables_opt_out_and_a_threshold_of_none_keeps_every_table_whole(model_path, tmp_path):
    engine = GradientEngine(model_path, batch_size=BATCH, loss="bce", cache_dir=tmp_path,
                            sparse_min_bytes=DEFAULT_SPARSE_MIN_BYTES, dense_tables=["emb1.weight"])
    assert engine.sparse.tables == {}
    assert GradientEngine(model_path, batch_size=BATCH, loss="bce", cache_dir=tmp_path).sparse.tables == {}


def test_a_table_whose_ids_depend_on_a_trained_parameter_stays_dense(tmp_path):
    # ids = Cast(Floor(x @ w)): computed, but through a float initializer that trains
    w = numpy_helper.from_array(np.ones((3, 1), np.float32), "w")
    table = numpy_helper.from_array(np.zeros((100000, 4), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Floor", ["m"], ["f"]),
         helper.make_node("Cast", ["f"], ["ids"], to=TensorProto.INT64),
         helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
         helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0, axes=[1, 2])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])], [w, table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    assert find_sparse_tables(model, min_rows=1) == []
    with pytest.raises(ValueError, match="cannot train sparsely"):
        find_sparse_tables(model, named=["table"])


def test_a_model_may_declare_its_dynamic_tables_in_its_metadata(model_path, tmp_path):
    model = onnx.load(model_path)
    model.metadata_props.add(key=DYNAMIC_TABLES_KEY, value="emb2.weight")
    path = tmp_path / "declared.onnx"
    onnx.save(model, str(path))
    engine = GradientEngine(path, batch_size=BATCH, loss="bce", cache_dir=tmp_path,
                            sparse_min_bytes=DEFAULT_SPARSE_MIN_BYTES)
    assert sorted(engine.sparse.tables) == ["emb1.weight", "emb2.weight"]
    assert list(engine.dynamic_tables()) == ["emb2.weight"]
