"""The sparse stage of the gradient engine: which tables train sparsely, and that the rewritten graph's row
gradients, scattered into the table, equal the original model's dense gradient."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ps_models.builders import build_embedding_model, build_mlp
from worker_client.engine import GradientEngine
from worker_client.engine.sparse import find_sparse_tables

VOCAB, DIM, BAG, BATCH = 500, 8, 6, 16
#: The gradient-equality tolerance of the issue (float32 sums in different orders).
ATOL = 1e-5


@pytest.fixture(scope="module")
def embedding_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("sparse") / "embedding.onnx"
    onnx.save_model(build_embedding_model(vocab_size=VOCAB, dim=DIM, bag_size=BAG, seed=3), str(path))
    return path


def engines(path, tmp_path):
    dense = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path / "cache")
    sparse = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path / "cache", sparse_min_rows=VOCAB)
    return dense, sparse


def test_tables_used_only_through_gather_on_a_graph_input_are_found_by_size_or_name(embedding_path):
    model = onnx.load(str(embedding_path))
    assert find_sparse_tables(model, min_rows=VOCAB) == ["embedding.weight"]
    assert find_sparse_tables(model, min_rows=VOCAB + 1) == []
    assert find_sparse_tables(model, named=["embedding.weight"]) == ["embedding.weight"]
    with pytest.raises(ValueError, match="'fc.weight' is used other than as the data of Gather"):
        find_sparse_tables(model, named=["fc.weight"])
    assert find_sparse_tables(build_mlp(), min_rows=1) == []     # no Gather: nothing sparse


@pytest.mark.parametrize("asked, kind", [({"named": ["nope"]}, "sparse"), ({"exclude": ["nope"]}, "dense"),
                                         ({"named": ["nope"], "dynamic": ["nope"]}, "dynamic")])
def test_a_table_the_model_lacks_is_named_as_asked_with_the_tables_it_has(embedding_path, asked, kind):
    with pytest.raises(ValueError) as refused:
        find_sparse_tables(onnx.load(str(embedding_path)), **asked)
    assert str(refused.value) == (f"{kind} table 'nope' is not an initializer of the model; the tables it gathers "
                                  "rows of are ['embedding.weight']")
    with pytest.raises(ValueError, match="^dynamic table 'nope' is not an initializer of the model, which gathers "
                                         "rows of no table$"):
        find_sparse_tables(build_mlp(), named=["nope"], dynamic=["nope"])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_row_gradients_scattered_into_the_table_equal_the_dense_gradient(embedding_path, tmp_path, seed):
    dense, sparse = engines(embedding_path, tmp_path)
    plan = sparse.sparse
    assert list(plan.tables) == ["embedding.weight"]
    assert "embedding.weight.rows" in sparse.trainable_names and "embedding.weight" not in sparse.trainable_names
    rng = np.random.default_rng(seed)
    # repeated ids within and across rows, and a negative index (Gather counts it from the end)
    ids = rng.integers(0, 40, size=(BATCH, BAG)).astype(np.int64)
    ids[0, 0] = -1
    labels = rng.integers(0, 2, size=BATCH).astype(np.int64)
    params = dense.parameters()
    table = params["embedding.weight"]
    # trained a little, so the table is not the initial value the rows parameter could hide
    table += rng.standard_normal(table.shape).astype(np.float32) * 0.1
    loss, grads = dense.gradients(params, {"ids": ids, "labels": labels})

    unique = plan.unique_ids({"ids": ids})["embedding.weight"]
    assert unique.tolist() == sorted(set(np.where(ids < 0, ids + VOCAB, ids).ravel().tolist()))
    sparse_params = {k: v for k, v in params.items() if k != "embedding.weight"}
    sparse_params["embedding.weight.rows"] = plan.rows_parameter("embedding.weight", table[unique])
    feeds = plan.feeds({"ids": ids, "labels": labels}, {"embedding.weight": unique})
    sparse_loss, sparse_grads = sparse.gradients(sparse_params, feeds)
    assert sparse_loss == pytest.approx(loss, abs=ATOL)
    rows_ids, rows = plan.row_gradients(sparse_grads, {"embedding.weight": unique})["embedding.weight"]
    scattered = np.zeros_like(table)
    np.add.at(scattered, rows_ids, rows)
    np.testing.assert_allclose(scattered, grads["embedding.weight"], atol=ATOL, rtol=0)
    for name in ("fc.weight", "fc.bias"):
        np.testing.assert_allclose(sparse_grads[name], grads[name], atol=ATOL, rtol=0)


def test_the_shards_get_the_whole_table_and_the_engine_trains_only_its_rows_parameter(embedding_path, tmp_path):
    _, sparse = engines(embedding_path, tmp_path)
    held = sparse.server_parameters()
    assert held["embedding.weight"].shape == (VOCAB, DIM)
    assert "embedding.weight.rows" not in held
    assert sparse.parameters()["embedding.weight.rows"].shape == (BATCH * BAG, DIM)


FIXTURE = "tests/fixtures/torch/embedding_bag"


def test_the_rewritten_torch_export_gives_torchs_gradient_of_the_table(tmp_path):
    """The exported fixture (torch autograd in float64): its ids also feed a padding mask, so they stay an input."""
    data = np.load(FIXTURE + ".npz")
    ids, labels = data["input:ids"], data["labels"]
    engine = GradientEngine(FIXTURE + ".onnx", batch_size=len(ids), loss="mse", cache_dir=tmp_path,
                            sparse_tables=["table.weight"])
    plan = engine.sparse
    assert plan.dropped_inputs == []     # Equal(ids, 0) still reads them
    table = engine.server_parameters()["table.weight"]
    unique = plan.unique_ids({"ids": ids})
    params = {k: v for k, v in engine.parameters().items() if k != "table.weight.rows"}
    params["table.weight.rows"] = plan.rows_parameter("table.weight", table[unique["table.weight"]])
    loss, grads = engine.gradients(params, plan.feeds({"ids": ids, "labels": labels}, unique))
    assert loss == pytest.approx(float(data["loss"]), abs=ATOL)
    rows_ids, rows = plan.row_gradients(grads, unique)["table.weight"]
    scattered = np.zeros_like(table)
    np.add.at(scattered, rows_ids, rows)
    np.testing.assert_allclose(scattered, data["grad:table.weight"], atol=ATOL, rtol=0)
    for name in ("fc1.weight", "fc2.bias"):
        np.testing.assert_allclose(grads[name], data[f"grad:{name}"], atol=ATOL, rtol=0)


def test_a_table_in_external_data_is_mapped_not_read_and_gives_the_dense_gradient(tmp_path):
    from ps_models.large_table import write_large_embedding

    rows, dim, bag = 3000, 8, 4
    path = write_large_embedding(tmp_path / "big.onnx", rows=rows, dim=dim, bag=bag, seed=1)
    dense = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path / "cache")
    sparse = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path / "cache", sparse_min_rows=rows)
    table = sparse.server_parameters()["embedding.weight"]
    assert isinstance(table, np.memmap) and table.shape == (rows, dim)
    np.testing.assert_array_equal(table, dense.parameters()["embedding.weight"])
    ids = np.random.default_rng(0).integers(0, rows, size=(BATCH, bag)).astype(np.int64)
    labels = np.arange(BATCH, dtype=np.int64) % 2
    _, grads = dense.gradients(dense.parameters(), {"ids": ids, "labels": labels})
    plan = sparse.sparse
    unique = plan.unique_ids({"ids": ids})
    params = {k: v for k, v in sparse.parameters().items() if not k.endswith(".rows")}
    params["embedding.weight.rows"] = plan.rows_parameter("embedding.weight", table[unique["embedding.weight"]])
    _, sparse_grads = sparse.gradients(params, plan.feeds({"ids": ids, "labels": labels}, unique))
    rows_ids, values = plan.row_gradients(sparse_grads, unique)["embedding.weight"]
    scattered = np.zeros((rows, dim), np.float32)
    np.add.at(scattered, rows_ids, values)
    np.testing.assert_allclose(scattered, grads["embedding.weight"], atol=ATOL, rtol=0)


def test_a_dynamic_tables_huge_ids_pass_through_and_its_row_gradients_scattered_equal_the_dense_gradient(
        embedding_path, tmp_path):
    """Dynamic ids are keys: never range-checked or wrapped; remapped to rows they give the dense gradient."""
    from ps_models.datasets import hash_ids

    dense = GradientEngine(embedding_path, batch_size=BATCH, cache_dir=tmp_path / "cache")
    dynamic = GradientEngine(embedding_path, batch_size=BATCH, cache_dir=tmp_path / "cache",
                             dynamic_tables=["embedding.weight"])
    plan = dynamic.sparse
    assert plan.tables["embedding.weight"].dynamic
    assert plan.tables["embedding.weight"].capacity == BATCH * BAG
    assert "embedding.weight" not in dynamic.server_parameters()        # the shards create its rows
    assert dynamic.dynamic_tables() == {"embedding.weight": ((DIM,), np.dtype(np.float32))}
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 40, size=(BATCH, BAG)).astype(np.int64)     # rows of the dense model's table
    keys = hash_ids(rows)                                               # the same ids as int64 keys
    keys[0, 0] = np.iinfo(np.int64).min
    rows[0, 0] = VOCAB - 1                                              # the dense twin of that key
    assert np.abs(keys).max() > 1 << 60
    labels = rng.integers(0, 2, size=BATCH).astype(np.int64)
    params = dense.parameters()
    table = params["embedding.weight"] + rng.standard_normal((VOCAB, DIM)).astype(np.float32) * 0.1
    params["embedding.weight"] = table
    loss, grads = dense.gradients(params, {"ids": rows, "labels": labels})

    unique = plan.unique_ids({"ids": keys})["embedding.weight"]
    assert unique.tolist() == sorted(set(keys.ravel().tolist()))        # as given: not wrapped, not refused
    row_of = {int(k): int(r) for k, r in zip(keys.ravel(), rows.ravel())}
    as_rows = np.array([row_of[int(k)] for k in unique], dtype=np.int64)
    sparse_params = {k: v for k, v in params.items() if k != "embedding.weight"}
    sparse_params["embedding.weight.rows"] = plan.rows_parameter("embedding.weight", table[as_rows])
    sparse_loss, sparse_grads = dynamic.gradients(sparse_params, plan.feeds({"ids": keys, "labels": labels},
                                                                             {"embedding.weight": unique}))
    assert sparse_loss == pytest.approx(loss, abs=ATOL)
    ids, row_grads = plan.row_gradients(sparse_grads, {"embedding.weight": unique})["embedding.weight"]
    np.testing.assert_array_equal(ids, unique)
    scattered = np.zeros_like(table)
    np.add.at(scattered, [row_of[int(k)] for k in ids], row_grads)
    np.testing.assert_allclose(scattered, grads["embedding.weight"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(sparse_grads["fc.weight"], grads["fc.weight"], atol=ATOL, rtol=0)


def test_a_dynamic_tables_capacity_is_the_batchs_index_elements_even_beyond_the_models_rows(tmp_path):
    path = tmp_path / "small.onnx"
    onnx.save_model(build_embedding_model(vocab_size=10, dim=DIM, bag_size=BAG, seed=3), str(path))
    sparse = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path / "cache", sparse_tables=["embedding.weight"])
    dynamic = GradientEngine(path, batch_size=BATCH, cache_dir=tmp_path / "cache", dynamic_tables=["embedding.weight"])
    assert sparse.sparse.tables["embedding.weight"].capacity == 10
    assert dynamic.sparse.tables["embedding.weight"].capacity == BATCH * BAG
    with pytest.raises(ValueError, match="outside table 'embedding.weight'"):
        sparse.sparse.unique_ids({"ids": np.full((BATCH, BAG), 1 << 40, np.int64)})
    assert dynamic.sparse.unique_ids({"ids": np.full((BATCH, BAG), 1 << 40, np.int64)})["embedding.weight"].tolist() \
        == [1 << 40]
