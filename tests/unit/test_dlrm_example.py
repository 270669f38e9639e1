"""The DLRM example: models/recsys/dlrm.onnx (exported from PyTorch by export_dlrm.py) and its synthetic Criteo-like
Parquet data (ps_models.recsys.criteo_synthetic): the model's inputs, tables and graph as documented, the engine's
gradients equal to torch autograd's, and a generator that writes the documented schema, deterministically, with a
signal, in bounded memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import ps_models.recsys
from ps_models.recsys import criteo_synthetic as data
from worker_client import GradientEngine

RECSYS = Path(ps_models.recsys.__file__).resolve().parent
DLRM_PATH = RECSYS / "dlrm.onnx"
REFERENCE_PATH = RECSYS / "dlrm.npz"
#: float32 engine against float64 torch autograd.
TOL = 1e-5
SMALL = [f"emb.small.{i}.weight" for i in range(13)]
HASHED = [f"emb.hashed.{i}.weight" for i in range(8)]
DYNAMIC = [f"emb.dynamic.{i}.weight" for i in range(5)]
MLP = {"bottom.0.weight": [64, 13], "bottom.0.bias": [64], "bottom.2.weight": [16, 64], "bottom.2.bias": [16],
       "top.0.weight": [64, 16 + 27 * 26 // 2], "top.0.bias": [64], "top.2.weight": [1, 64], "top.2.bias": [1]}
#: The bound on the generator's peak resident memory (VmHWM) while it writes 2M rows; it measures about 190 MB, the
#: same as for 200k rows: about 100 MB are the interpreter, numpy and pyarrow, 45 MB the seed's tables, and the rest a
#: block of rows being made and a row group being written.
PEAK_MEMORY_BOUND_MB = 300


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return onnx.load(str(DLRM_PATH))


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(REFERENCE_PATH) as npz:
        return {k: npz[k] for k in npz.files}


def dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    found = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name]
    if not found:
        node = producer(model, name)
        assert node.op_type == "Constant", f"{name} is made by {node.op_type}, not a constant"
        found = [numpy_helper.to_array(node.attribute[0].t)]
    return found[0]


def column_read(model: onnx.ModelProto, name: str) -> int:
    """c, where `name` is cat[:, c]: a Gather on axis 1 of the cat input at a constant index."""
    node = producer(model, name)
    assert node.op_type == "Gather" and node.input[0] == "cat", f"{name} is {node.op_type}({list(node.input)})"
    assert next(a.i for a in node.attribute if a.name == "axis") == 1
    return int(constant(model, node.input[1]))


def table_indices(model: onnx.ModelProto, table: str) -> str:
    """What the one Gather reading `table` looks it up at."""
    uses = [n for n in model.graph.node if table in n.input]
    assert [(n.op_type, n.input[0]) for n in uses] == [("Gather", table)], f"{table} is read by {uses}"
    assert next((a.i for a in uses[0].attribute if a.name == "axis"), 0) == 0
    return uses[0].input[1]


# --- the model -------------------------------------------------------------------------------------------------

def test_the_model_takes_dense_floats_and_int64_ids_and_outputs_one_logit_per_example(model: onnx.ModelProto) -> None:
    inputs = {v.name: (v.type.tensor_type.elem_type, dims(v)) for v in model.graph.input}
    assert inputs == {"dense": (onnx.TensorProto.FLOAT, ["batch", 13]), "cat": (onnx.TensorProto.INT64, ["batch", 26])}
    (output,) = model.graph.output
    assert (output.name, output.type.tensor_type.elem_type, dims(output)) == ("logit", onnx.TensorProto.FLOAT,
                                                                            ["batch", 1])
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [18]


def test_the_tables_are_named_by_kind_with_the_documented_shapes_and_the_file_stays_small(
        model: onnx.ModelProto) -> None:
    shapes = {t.name: list(t.dims) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    expected = {**MLP, **{name: [vocab, 16] for name, vocab in zip(SMALL, data.SMALL_VOCABS)},
                **{name: [16384, 16] for name in HASHED}, **{name: [1, 16] for name in DYNAMIC}}
    assert shapes == expected
    assert 16384 * 16 * 4 == 1 << 20, "a hashed table is exactly the default sparse threshold"
    assert DLRM_PATH.stat().st_size < 9_000_000


def test_each_table_reads_its_cat_column_the_hashed_ones_modulo_16384_and_the_dynamic_ones_the_raw_key(
        model: onnx.ModelProto) -> None:
    for column, table in zip(data.SMALL, SMALL):
        assert column_read(model, table_indices(model, table)) == column, table
    for column, table in zip(data.HASHED, HASHED):
        mod = producer(model, table_indices(model, table))
        assert mod.op_type == "Mod", f"{table} is read at {mod.op_type}, not Mod"
        assert column_read(model, mod.input[0]) == column and int(constant(model, mod.input[1])) == 16384
    for column, table in zip(data.DYNAMIC, DYNAMIC):
        assert column_read(model, table_indices(model, table)) == column, table
    assert sum(n.op_type == "Mod" for n in model.graph.node) == 8
    assert not [n for n in model.graph.node if n.op_type == "Mul"], "the dynamic keys' '* 0' must be edited away"


def test_the_dynamic_tables_are_declared_and_the_engine_trains_hashed_tables_sparsely_and_dynamic_ones_by_key(
        model: onnx.ModelProto, tmp_path: Path) -> None:
    declared = {p.key: p.value for p in model.metadata_props}
    assert declared["onnx_ps.dynamic_tables"] == ",".join(DYNAMIC)
    # the product's default: a table of at least 1 MiB trains sparsely; declared dynamic tables are held by key
    engine = GradientEngine(DLRM_PATH, batch_size=16, loss="bce", cache_dir=tmp_path, sparse_min_bytes=1 << 20)
    assert {name: table.dynamic for name, table in engine.sparse.tables.items()} == {
        **dict.fromkeys(HASHED, False), **dict.fromkeys(DYNAMIC, True)}
    assert engine.dynamic_tables() == dict.fromkeys(DYNAMIC, ((16,), np.dtype(np.float32)))
    assert set(SMALL) <= set(engine.server_parameters()), "the small tables train densely"
    assert not set(DYNAMIC) & set(engine.server_parameters()), "the shards create the dynamic tables' rows"


def test_the_engine_matches_torch_float64_logits_loss_and_gradients_on_the_reference_batch(
        reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    """The reference batch has the dynamic columns set to 0 (torch's placeholder has one row)."""
    assert np.all(reference["input:cat"][:, data.DYNAMIC.start:] == 0)
    engine = GradientEngine(DLRM_PATH, batch_size=len(reference["labels"]), loss="bce", cache_dir=tmp_path)
    params = engine.parameters()
    batch = {"dense": reference["input:dense"], "cat": reference["input:cat"]}
    logits = engine.predict(params, batch)["logit"]
    np.testing.assert_allclose(logits, reference["output:logit"], rtol=TOL, atol=TOL)
    loss, grads = engine.gradients(params, {**batch, "labels": reference["labels"]})
    assert loss == pytest.approx(float(reference["loss"]), abs=TOL)
    assert set(grads) == {k.removeprefix("grad:") for k in reference if k.startswith("grad:")}
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, reference[f"grad:{name}"], rtol=TOL, atol=TOL, err_msg=name)
    for name in [*MLP, *SMALL, *HASHED, *DYNAMIC]:
        assert np.abs(reference[f"grad:{name}"]).max() > 0, f"{name} gets no gradient: the check would be empty"


def test_the_sparse_engine_on_raw_keys_matches_torch_when_every_key_holds_the_placeholder_row(
        reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    """The same batch with its dynamic keys: each key's row starts as the placeholder row, so the loss is torch's
    and the keys' row gradients sum to torch's gradient of the one-row table; the hashed tables' row gradients,
    scattered, are torch's table gradients."""
    keys = reference["input:cat_keys"]
    assert keys[:, data.DYNAMIC.start:].min() < 0 and len(np.unique(keys[:, data.DYNAMIC.start:])) > 16
    engine = GradientEngine(DLRM_PATH, batch_size=len(keys), loss="bce", cache_dir=tmp_path,
                            sparse_min_bytes=1 << 20)
    plan = engine.sparse
    params = engine.parameters()
    inputs = {"dense": reference["input:dense"], "cat": keys, "labels": reference["labels"]}
    ids = plan.unique_ids(inputs)
    assert all(np.array_equal(ids[t], np.unique(keys[:, c])) for c, t in zip(data.DYNAMIC, DYNAMIC))
    assert all(np.array_equal(ids[t], np.unique(keys[:, c] % 16384)) for c, t in zip(data.HASHED, HASHED))
    tables = {name: numpy_helper.to_array(t) for t in onnx.load(str(DLRM_PATH)).graph.initializer
              for name in [t.name] if name in plan.tables}
    feed = {k: v for k, v in params.items() if not k.endswith(".rows")}
    for name, table in plan.tables.items():
        rows = np.repeat(tables[name], len(ids[name]), axis=0) if table.dynamic else tables[name][ids[name]]
        feed[table.rows_name] = plan.rows_parameter(name, rows)
    loss, grads = engine.gradients(feed, plan.feeds(inputs, ids))
    assert loss == pytest.approx(float(reference["loss"]), abs=TOL)
    for name, (row_ids, rows) in plan.row_gradients(grads, ids).items():
        expected = reference[f"grad:{name}"]
        if plan.tables[name].dynamic:
            np.testing.assert_allclose(rows.sum(axis=0, keepdims=True), expected, rtol=TOL, atol=TOL, err_msg=name)
        else:
            np.testing.assert_allclose(rows, expected[row_ids], rtol=TOL, atol=TOL, err_msg=name)
            untouched = np.setdiff1d(np.arange(len(expected)), row_ids)
            assert not np.any(expected[untouched]), f"{name}: torch has gradient on rows the batch does not read"
    for name in [*MLP, *SMALL]:
        np.testing.assert_allclose(grads[name], reference[f"grad:{name}"], rtol=TOL, atol=TOL, err_msg=name)


# --- the data --------------------------------------------------------------------------------------------------

def read_split(folder: Path) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    tables = [pq.read_table(p) for p in sorted(folder.glob("part-*.parquet"))]
    return {"dense": np.concatenate([t.column("dense").combine_chunks().flatten().to_numpy() for t in tables]
                                    ).reshape(-1, 13),
            "cat": np.concatenate([t.column("cat").combine_chunks().flatten().to_numpy() for t in tables]
                                  ).reshape(-1, 26),
            "label": np.concatenate([t.column("label").to_numpy() for t in tables])}


def test_the_generator_writes_the_documented_files_schema_row_groups_and_meta(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = data.write_dataset(tmp_path, rows=20_000, test_rows=5_000, files=3, row_group_rows=4096, seed=1)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "meta.json", "test/part-00000.parquet", "train/part-00000.parquet", "train/part-00001.parquet",
        "train/part-00002.parquet"]
    schema = pa.schema([("dense", pa.list_(pa.float32(), 13)), ("cat", pa.list_(pa.int64(), 26)),
                        ("label", pa.int8())])
    for path in sorted(tmp_path.rglob("*.parquet")):
        file = pq.ParquetFile(path)
        assert file.schema_arrow == schema, path
        groups = [file.metadata.row_group(i).num_rows for i in range(file.metadata.num_row_groups)]
        assert max(groups) <= 4096 and all(g == 4096 for g in groups[:-1]), (path, groups)
    assert [pq.ParquetFile(p).metadata.num_rows for p in sorted((tmp_path / "train").glob("*.parquet"))] == [
        6667, 6667, 6666]
    train = read_split(tmp_path / "train")
    assert set(np.unique(train["label"])) == {0, 1}
    small, hashed, dynamic = (train["cat"][:, k.start:k.stop] for k in (data.SMALL, data.HASHED, data.DYNAMIC))
    assert np.all((small >= 0) & (small < np.array(data.SMALL_VOCABS)))
    assert hashed.min() >= 0 and hashed.max() > 1 << 40, "hashed ids are large and non-negative"
    assert dynamic.min() < -(1 << 40) and dynamic.max() > 1 << 40, "dynamic keys are any int64"
    assert np.all(np.isfinite(train["dense"])) and train["dense"].min() >= 0
    # Zipf popularity: within a field a few ids are most of the rows, and the tail is long
    for column in (data.HASHED.start, data.DYNAMIC.start):
        _, counts = np.unique(train["cat"][:, column], return_counts=True)
        counts = np.sort(counts)[::-1]
        assert counts[:100].sum() > 0.4 * len(train["label"]) and len(counts) > 2000
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    assert meta["train"]["rows"] == 20_000 and meta["test"]["rows"] == 5_000
    assert meta["params"]["seed"] == 1 and 0.2 < meta["train"]["ctr"] < 0.3


def test_the_same_seed_writes_the_same_rows_whatever_the_files_and_row_groups_and_another_seed_others(
        tmp_path: Path) -> None:
    data.write_dataset(tmp_path / "a", rows=20_000, test_rows=2_000, files=1, row_group_rows=65536, seed=7)
    data.write_dataset(tmp_path / "b", rows=20_000, test_rows=2_000, files=4, row_group_rows=3000, seed=7)
    data.write_dataset(tmp_path / "c", rows=20_000, test_rows=2_000, files=1, row_group_rows=65536, seed=8)
    for split in ("train", "test"):
        a, b, c = (read_split(tmp_path / run / split) for run in "abc")
        for column in a:
            np.testing.assert_array_equal(a[column], b[column], err_msg=f"{split}.{column}")
        assert not np.array_equal(a["cat"], c["cat"]) and not np.array_equal(a["dense"], c["dense"])
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["bayes_auc_test"] == \
        json.loads((tmp_path / "b" / "meta.json").read_text())["bayes_auc_test"]


def test_the_labels_carry_the_known_signal_and_the_meta_reports_its_bayes_auc(tmp_path: Path) -> None:
    meta = data.write_dataset(tmp_path, rows=20_000, test_rows=20_000, seed=2)
    test = read_split(tmp_path / "test")
    logits = data.true_logits(test["dense"], test["cat"], data.Generator(seed=2))
    bayes = data.auc(logits, test["label"])
    assert bayes == pytest.approx(meta["bayes_auc_test"], abs=1e-6)
    assert 0.78 < bayes < 0.88
    # every part of the signal carries some of it: alone it ranks better than chance, and without it worse than all
    parts = data.logit_parts(test["dense"], test["cat"], data.Generator(seed=2))
    np.testing.assert_allclose(sum(parts.values()), logits, atol=1e-5)
    assert set(parts) == {"bias", "dense", "small", "hashed", "dynamic", "pairs", "dense_pair"}
    for name in ("dense", "small", "hashed", "dynamic", "pairs", "dense_pair"):
        assert 0.53 < data.auc(parts[name], test["label"]) < bayes - 0.1, name
        assert data.auc(logits - parts[name], test["label"]) < bayes - 0.005, name
    # calibrated: the labels are Bernoulli(sigmoid(logit)), not just ranked by it
    p = 1.0 / (1.0 + np.exp(-logits))
    for low, high in ((0.0, 0.1), (0.1, 0.3), (0.3, 0.6), (0.6, 1.0)):
        inside = (p >= low) & (p < high)
        rate, expected = test["label"][inside].mean(), p[inside].mean()
        assert inside.sum() > 500 and abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / inside.sum())


def test_the_command_writes_two_million_rows_in_bounded_memory(tmp_path: Path) -> None:
    """Peak resident memory (VmHWM) of the whole process, in a subprocess, with the command's own arguments."""
    code = ("from ps_models.recsys.criteo_synthetic import main\n"
            f"rc = main([{str(tmp_path)!r}, '--rows', '2000000', '--test-rows', '10000', '--files', '2', "
            "'--row-group-rows', '16384', '--seed', '3'])\n"
            "peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
            "print('PEAK_KB', peak)\n"
            "raise SystemExit(rc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.splitlines()[-2])
    peak_mb = int(run.stdout.split("PEAK_KB")[1].split()[0]) / 1024
    meta = json.loads((tmp_path / "meta.json").read_text())
    shutil.rmtree(tmp_path / "train")      # 280 MB of Parquet
    assert summary["rows"] == meta["train"]["rows"] + meta["test"]["rows"] == 2_010_000
    assert peak_mb < PEAK_MEMORY_BOUND_MB, f"peak memory {peak_mb:.0f} MB writing 2M rows"
