"""The factorization machine exported from PyTorch (models/recsys/fm.onnx): its tables train sparsely, and the
rewritten graph's row gradients, scattered into the tables, equal the dense engine's and torch autograd's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from ps_common.errors import DatasetError
from ps_models.datasets import load_dataset
from ps_models.recsys import FM_PATH, FM_REFERENCE_PATH
from worker_client.engine import GradientEngine
from worker_client.engine.sparse import find_sparse_tables
from worker_client.training.preflight import check_fit

#: The gradient-equality tolerance of the issue (float32 sums in different orders; torch's in float64).
TOL = 1e-5
#: fm.onnx as export_fm.py's defaults make it.
FIELDS, VOCAB, DIM = 10, 1000, 16
TABLES = ["factors.weight", "linear.weight"]
EMBEDDING_BAG = Path(__file__).resolve().parents[1] / "fixtures" / "torch" / "embedding_bag"


def test_the_exported_fm_has_both_tables_as_plain_gathers_on_its_ids_input() -> None:
    model = onnx.load(str(FM_PATH))
    assert [v.name for v in model.graph.input] == ["ids"]
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    assert shapes == {"factors.weight": [FIELDS * VOCAB, DIM], "linear.weight": [FIELDS * VOCAB, 1], "bias": [1]}
    assert find_sparse_tables(model, min_rows=1000) == TABLES
    assert find_sparse_tables(model, named=["linear.weight"]) == ["linear.weight"]
    with pytest.raises(ValueError, match="'bias' is used other than as the data of Gather"):
        find_sparse_tables(model, named=["bias"])
    assert FM_PATH.stat().st_size < 1_000_000


def scattered_sparse_gradients(engine: GradientEngine, params: dict[str, np.ndarray], inputs: dict[str, np.ndarray]
                               ) -> tuple[float, dict[str, np.ndarray]]:
    """The sparse engine's loss and gradients on the batch, each table's row gradient scattered into a zero table."""
    plan = engine.sparse
    ids = plan.unique_ids(inputs)
    sparse_params = {k: v for k, v in params.items() if k not in plan.tables}
    for name in plan.tables:
        sparse_params[plan.tables[name].rows_name] = plan.rows_parameter(name, params[name][ids[name]])
    loss, grads = engine.gradients(sparse_params, plan.feeds(inputs, ids))
    out = {k: v for k, v in grads.items() if not k.endswith(".rows")}
    for name, (row_ids, rows) in plan.row_gradients(grads, ids).items():
        assert len(row_ids) == len(np.unique(row_ids)) <= plan.tables[name].capacity
        out[name] = np.zeros(plan.tables[name].shape, np.float32)
        np.add.at(out[name], row_ids, rows)
    return loss, out


@pytest.mark.parametrize("fixture, loss, tables", [
    (FM_PATH.with_suffix(""), "cross_entropy", TABLES),
    (EMBEDDING_BAG, "mse", ["table.weight"]),     # its ids also feed a padding mask: the input stays
])
def test_sparse_gradients_equal_the_dense_engines_and_torch_autograds(fixture: Path, loss: str, tables: list[str],
                                                                      tmp_path: Path) -> None:
    data = np.load(str(fixture) + ".npz")
    ids, labels = data["input:ids"], data["labels"]
    path = str(fixture) + ".onnx"
    dense = GradientEngine(path, batch_size=len(ids), loss=loss, cache_dir=tmp_path)
    sparse = GradientEngine(path, batch_size=len(ids), loss=loss, cache_dir=tmp_path, sparse_tables=tables)
    assert list(sparse.sparse.tables) == tables
    params = dense.parameters()
    assert len(np.unique(ids)) < ids.size, "the batch should repeat ids (duplicates are summed)"

    # at the exported values: both engines give torch's loss and gradients (float64 autograd)
    dense_loss, dense_grads = dense.gradients(params, {"ids": ids, "labels": labels})
    sparse_loss, sparse_grads = scattered_sparse_gradients(sparse, params, {"ids": ids, "labels": labels})
    assert dense_loss == pytest.approx(float(data["loss"]), abs=TOL)
    assert sparse_loss == pytest.approx(float(data["loss"]), abs=TOL)
    assert set(sparse_grads) == set(dense_grads)
    for name, grad in dense_grads.items():
        np.testing.assert_allclose(grad, data[f"grad:{name}"], rtol=TOL, atol=TOL, err_msg=f"dense {name}")
        np.testing.assert_allclose(sparse_grads[name], data[f"grad:{name}"], rtol=TOL, atol=TOL,
                                   err_msg=f"sparse {name}")

    # at other values (trained a little: no row the rows parameter could hide): sparse equals dense
    rng = np.random.default_rng(1)
    moved = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
    dense_loss, dense_grads = dense.gradients(moved, {"ids": ids, "labels": labels})
    sparse_loss, sparse_grads = scattered_sparse_gradients(sparse, moved, {"ids": ids, "labels": labels})
    assert sparse_loss == pytest.approx(dense_loss, abs=TOL)
    for name, grad in dense_grads.items():
        assert np.abs(grad).max() > 0, name
        np.testing.assert_allclose(sparse_grads[name], grad, rtol=TOL, atol=TOL, err_msg=name)


def test_clicks_data_fits_the_fm_with_sparse_tables_and_the_wrong_width_is_refused(tmp_path: Path) -> None:
    """Both tables' positions inputs stand for the one ids input the data feeds (worker_client/training/preflight.py)."""
    engine = GradientEngine(FM_PATH, batch_size=32, cache_dir=tmp_path, sparse_min_rows=1000)
    assert engine.sparse.dropped_inputs == ["ids"]
    fits = load_dataset("synthetic:clicks?n=1000")
    check_fit(engine, fits, model="fm.onnx", data="clicks", loss="cross_entropy", batch_size=32, workers=2)
    narrow = load_dataset("synthetic:clicks?n=1000&fields=4")
    with pytest.raises(DatasetError, match=r"examples of shape \(4,\).*'ids' of shape \(10,\)"):
        check_fit(engine, narrow, model="fm.onnx", data="clicks", loss="cross_entropy", batch_size=32, workers=2)
