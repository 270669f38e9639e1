"""Real data in, through the real commands: a model with two inputs trained from an .npz and from a Parquet folder
(streamed), its large table sparse without a flag; bad Parquet data refused before anything starts, naming the file,
the column, the row and the value."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ps_common.process import child_env, python_module_argv
from tests.helpers import tabular

pytestmark = pytest.mark.timeout(240)
TRAIN = ["--loss", "bce", "--shards", "2", "--workers", "2", "--steps", "300", "--batch-size", "32",
         "--optimizer", "adam", "--lr", "0.01", "--eval-every", "0", "--mode", "sync"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data_in")
    return {"model": tabular.write_model(root / "model.onnx"), "npz": tabular.write_npz(root / "data.npz"),
            "parquet": tabular.write_parquet(root / "parquet"),
            "clicked": tabular.write_parquet(root / "clicked", label="clicked")}


def launch(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(python_module_argv("ps_tools.launch", *args), capture_output=True, text=True,
                          env=child_env(), timeout=timeout)


@pytest.mark.parametrize("data, extra", [("npz", []), ("parquet", []), ("clicked", ["--label-column", "clicked"])])
def test_a_two_input_model_trains_by_input_name_with_its_large_table_sparse_by_default(files, data, extra):
    done = launch("--model", str(files["model"]), "--data", str(files[data]), *TRAIN, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["test_auc"] >= 0.72, summary
    assert summary["test_accuracy"] >= 0.65, summary
    said = [line for line in done.stderr.splitlines() if "sparsely" in line]
    assert len(said) == 1 and "emb1.weight 8192 x 32" in said[0] and "--dense-tables" in said[0], done.stderr
    # the sparse table's rows travel, not the table: far below its 1 MB a step
    assert summary["bytes_pulled_per_step"] < 100_000, summary


def test_dense_tables_trains_the_table_whole(files):
    done = launch("--model", str(files["model"]), "--data", str(files["npz"]), *TRAIN, "--steps", "50",
                  "--dense-tables", "emb1.weight")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sparsely" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["bytes_pulled_per_step"] > 1_000_000


def test_bad_parquet_data_is_refused_in_one_line_before_anything_starts(files, tmp_path, monkeypatch, capsys):
    from ps_tools.launch import supervise

    folder = tabular.write_parquet(tmp_path / "bad", train=1500, test=300, files=2)
    path = folder / "train" / "part-1.parquet"
    table = pq.read_table(path)
    label = np.asarray(table.column("label")).copy()
    label[6] = 3
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(label)), path)
    monkeypatch.setattr(supervise, "ChildProcess", lambda *a, **k: pytest.fail("a process was started"))
    from ps_tools.launch import main

    status = main(["--model", str(files["model"]), "--data", str(folder), *TRAIN])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    for text in ["ps-launch: ", str(path), "column 'label'", "row 6", "label 3 is not 0 or 1"]:
        assert text in err[0], err[0]


def test_a_model_input_the_parquet_data_lacks_is_named(files, tmp_path, monkeypatch, capsys):
    from ps_tools.launch import main, supervise

    folder = tmp_path / "nocat"
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True)
        for p in (files["parquet"] / split).glob("*.parquet"):
            pq.write_table(pq.read_table(p).drop(["cat"]), folder / split / p.name)
    monkeypatch.setattr(supervise, "ChildProcess", lambda *a, **k: pytest.fail("a process was started"))
    status = main(["--model", str(files["model"]), "--data", str(folder), *TRAIN])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "no column 'cat'" in err and "\n" not in err, err
