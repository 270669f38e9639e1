"""End to end: the trained model comes out. ps-launch --record writes model.onnx, the user's graph with the trained
values; onnxruntime alone, fed the job's test split, reproduces the test accuracy, loss and AUC the job reported, for
the bundled models (one trained as a 2-stage pipeline), a PyTorch model with BatchNorm and Dropout in training mode, the factorization machine with
sparse tables and with dynamic tables (LabelEncoder), and from the checkpoint folders after the shards are gone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ps_common import jobconfig
from ps_common.process import python_module_argv
from ps_models.recsys import FM_PATH
from ps_tools.launch.cli import build_parser
from tests.helpers.launch import REPO_ROOT, run_launch
from worker_client.cli import prepare_worker
from worker_client.training.evaluate import metrics_of

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 180
#: How close the exported model's figures are to the job's: the same float32 graph on the same inputs, run by
#: onnxruntime in another batching (the job evaluates in batches of 4096, or the training batch with sparse tables).
TOLERANCE = 1e-5
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "torch" / "bn_dropout_train.onnx"

CASES = {
    "mlp-sync": ["--model", "mlp", "--data", "digits", "--mode", "sync", "--shards", "2", "--workers", "2",
                 "--steps", "120"],
    "mlp-pipeline": ["--model", "mlp", "--data", "digits", "--stages", "2", "--workers", "1", "--shards", "1",
                     "--steps", "60"],
    "lenet-async": ["--model", "lenet", "--data", "digits", "--mode", "async", "--shards", "2", "--workers", "2",
                    "--steps", "120", "--optimizer", "momentum", "--lr", "0.05"],
    "transformer-ssp": ["--model", "transformer", "--data", "synthetic:ids?n=1500&vocab=1000&bag=8&classes=2&signal=0.3",
                        "--mode", "ssp", "--shards", "2", "--workers", "2", "--steps", "60", "--optimizer", "adam",
                        "--lr", "0.01"],
    "embedding-sparse": ["--model", "embedding", "--data",
                         "synthetic:ids?n=2000&vocab=1000&bag=8&classes=2&signal=0.3", "--sparse-tables",
                         "embedding.weight", "--mode", "sync", "--shards", "2", "--workers", "2", "--steps", "80",
                         "--optimizer", "adam", "--lr", "0.02", "--partition-min-bytes", "4096"],
    "torch-batchnorm-dropout": ["--model", str(FIXTURE), "--data", "DIGITS_IMAGES", "--mode", "sync", "--shards", "1",
                                "--workers", "2", "--steps", "80", "--optimizer", "momentum", "--lr", "0.05"],
    "fm-dynamic": ["--model", str(FM_PATH), "--data", "synthetic:clicks?hashed=1&n=6000", "--dynamic-tables",
                   "factors.weight,linear.weight", "--mode", "sync", "--shards", "2", "--workers", "2",
                   "--steps", "100", "--batch-size", "64", "--optimizer", "adagrad", "--lr", "0.05"],
}


def exported_figures(model_path: Path, flags: list[str], workdir: Path) -> dict[str, Any]:
    """The test metrics of the exported model on the job's test split, run by onnxruntime alone."""
    config = jobconfig.load_config(build_parser().parse_args(flags), scope="launch")
    prepared = prepare_worker(config, workdir, device="cpu")
    dataset, engine = prepared.dataset, prepared.engine
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    first = session.get_outputs()[0].name
    declared = {i.name: i for i in session.get_inputs()}
    outputs = []
    for name, value in dataset.test.items():
        assert name in declared, f"the exported model lost input {name!r}: it has {sorted(declared)}"
    batch = 256
    for start in range(0, dataset.num_test, batch):
        feeds = {n: v[start:start + batch] for n, v in dataset.test.items()}
        feeds = {n: v.astype(np.float32) if v.dtype.kind == "f" else v for n, v in feeds.items()}
        outputs.append(session.run([first], feeds)[0])
    kind = "binary" if engine.loss_kind == "bce" else None
    return metrics_of(np.concatenate(outputs), dataset.y_test, dataset.num_classes, kind=kind)


def check_reproduced(summary: dict[str, Any], figures: dict[str, Any]) -> None:
    for key in ("test_accuracy", "test_loss", "test_auc"):
        if summary[key] is None:
            assert figures[key] is None, (key, figures)
        else:
            assert figures[key] == pytest.approx(summary[key], abs=TOLERANCE), (key, summary[key], figures[key])


def check_same_graph(exported: Path, given: Path | None) -> onnx.ModelProto:
    """The exported model keeps the given model's inputs, outputs and default-domain opset, has the step in its
    metadata, and holds no training node (no loss, no gradient)."""
    model = onnx.load(exported)
    if given is not None:
        original = onnx.load(given)
        assert [i.name for i in model.graph.input] == [i.name for i in original.graph.input]
        assert [o.name for o in model.graph.output] == [o.name for o in original.graph.output]
        opset = {o.domain or "": o.version for o in model.opset_import}
        assert opset[""] == {o.domain or "": o.version for o in original.opset_import}[""]
    metadata = {p.key: p.value for p in model.metadata_props}
    assert int(metadata["onnx_ps.step"]) > 0 and json.loads(metadata["onnx_ps.job"])
    assert not any("grad" in n.name.lower() or "loss" in n.name.lower() for n in model.graph.node)
    return model


def digits_images(folder: Path) -> Path:
    """The digits as (n, 1, 8, 8) images for the model input "image" (the PyTorch fixture's)."""
    from ps_models.datasets import load_dataset

    digits = load_dataset("digits")
    path = folder / "digits_images.npz"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=digits.x_train.reshape(-1, 1, 8, 8), y_train=digits.y_train,
             x_test=digits.x_test.reshape(-1, 1, 8, 8), y_test=digits.y_test, input_name=np.array("image"))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_exported_model_reproduces_the_jobs_test_figures(case: str, tmp_path: Path) -> None:
    flags = [str(digits_images(tmp_path / "data")) if f == "DIGITS_IMAGES" else f for f in CASES[case]]
    flags += ["--eval-every", "0", "--seed", "0"]
    summary, _ = run_launch(tmp_path / "record", *flags, timeout=JOB_TIMEOUT)
    exported = tmp_path / "record" / "model.onnx"
    given = Path(flags[flags.index("--model") + 1])
    model = check_same_graph(exported, given if given.suffix == ".onnx" else None)
    if case == "fm-dynamic":   # hashed keys read their rows through a LabelEncoder; the tables hold the live rows
        assert sum(n.op_type == "LabelEncoder" for n in model.graph.node) == 2
        tables = json.loads({p.key: p.value for p in model.metadata_props}["onnx_ps.exported_dynamic_tables"])
        assert set(tables) == {"factors.weight", "linear.weight"} and tables["factors.weight"]["rows"] > 1000
    check_reproduced(summary, exported_figures(exported, flags, tmp_path / "prepare"))


def test_an_export_from_checkpoint_folders_after_the_job_reproduces_its_figures(tmp_path: Path) -> None:
    flags = CASES["fm-dynamic"] + ["--eval-every", "0", "--seed", "0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    summary, _ = run_launch(tmp_path / "record", *flags, timeout=JOB_TIMEOUT)
    out = tmp_path / "from-checkpoints.onnx"
    done = subprocess.run(python_module_argv("ps_tools.ctl", "export", "--model", str(FM_PATH), "--out", str(out),
                                             "--checkpoint-dir", str(tmp_path / "ckpt")),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["exported"] == str(out) and line["step"] == summary["steps"] and line["mode"] == "sync"
    check_same_graph(out, FM_PATH)
    check_reproduced(summary, exported_figures(out, flags, tmp_path / "prepare"))
