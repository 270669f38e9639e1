"""Training with a label per position or per logit, through the training loop and one in-process shard: a
segmentation map's pixels (--loss cross_entropy on (batch, classes, H, W) logits) and a multi-label output
(--loss bce on (batch, K) logits) learn a rule a 1 x 1 Conv (a linear layer) can express, and the preflight
refuses labels whose shape does not fit the model's output, naming both shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

from ps_common.errors import DatasetError
from ps_models.datasets import Dataset
from ps_server.config import ServerConfig
from ps_server.server import create_server
from worker_client.client import PSClient
from tests.helpers.one_input_models import save_model
from worker_client.engine import GradientEngine
from worker_client.training import Trainer, TrainingPlan
from worker_client.training.preflight import check_fit

CLASSES, H, W = 3, 4, 5


def _segmenter(path: Path) -> Path:
    return save_model(path, [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 1])],
                  ["batch", 2, H, W], ["batch", CLASSES, H, W],
                  [numpy_helper.from_array(np.zeros((CLASSES, 2, 1, 1), np.float32), "w"),
                   numpy_helper.from_array(np.zeros(CLASSES, np.float32), "b")])


def _segmentation_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel's class: which of three fixed directions its two channels point along most."""
    x = np.random.default_rng(seed).normal(size=(rows, 2, H, W)).astype(np.float32)
    directions = np.array([[1.0, 0.0], [-0.5, 0.87], [-0.5, -0.87]])
    return x, np.einsum("kc,nchw->nkhw", directions, x).argmax(axis=1).astype(np.int64)


def _train(model: Path, dataset: Dataset, loss: str, steps: int) -> dict:
    server, _ = create_server(ServerConfig(mode="sync", optimizer="momentum", optimizer_params={"lr": 0.5}))
    client = PSClient([server.address], worker_id="dense", wait_timeout=60)
    try:
        engine = GradientEngine(model, batch_size=32, loss=loss, intra_op_threads=1)
        fitted = check_fit(engine, dataset, model=str(model), data=dataset.name, loss=loss, batch_size=32,
                           workers=1)
        plan = TrainingPlan(worker_index=0, num_workers=1, batch_size=32, steps=steps, eval_every=0,
                            start_timeout=30, wait_timeout=60)
        result = Trainer(client, engine, fitted, plan=plan).run()
    finally:
        client.close()
        server.stop()
    assert result["steps"] == steps
    return result


def test_a_segmentation_map_trains_a_label_per_pixel(tmp_path: Path) -> None:
    (x_train, y_train), (x_test, y_test) = _segmentation_data(512, 1), _segmentation_data(128, 2)
    dataset = Dataset.of("pixels", x_train, y_train, x_test, y_test, num_classes=CLASSES)
    result = _train(_segmenter(tmp_path / "seg.onnx"), dataset, "cross_entropy", 150)
    assert result["test_accuracy"] >= 0.95, result   # a third at the start: the weights are zeros


def test_a_multi_label_output_trains_a_label_per_logit(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    mixing = rng.normal(size=(6, 4))

    def data(rows: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(rows, 6)).astype(np.float32)
        return x, (x @ mixing > 0).astype(np.int64)      # four independent yes/no labels an example

    (x_train, y_train), (x_test, y_test) = data(512), data(128)
    model = save_model(tmp_path / "tags.onnx", [helper.make_node("Gemm", ["x", "w", "b"], ["y"])], ["batch", 6],
                   ["batch", 4], [numpy_helper.from_array(np.zeros((6, 4), np.float32), "w"),
                                  numpy_helper.from_array(np.zeros(4, np.float32), "b")])
    result = _train(model, Dataset.of("tags", x_train, y_train, x_test, y_test, num_classes=2), "bce", 150)
    assert result["test_accuracy"] >= 0.95, result   # over every (example, label) pair


def test_labels_that_do_not_fit_the_output_are_refused_naming_both_shapes(tmp_path: Path) -> None:
    x, y = _segmentation_data(64, 4)
    per_example = Dataset.of("one label each", x, y[:, 0, 0], x, y[:, 0, 0], num_classes=CLASSES)
    engine = GradientEngine(_segmenter(tmp_path / "seg.onnx"), batch_size=32, loss="cross_entropy",
                            intra_op_threads=1)
    with pytest.raises(DatasetError, match=r"data one label each has labels of shape \(\) per example, but model "
                                           r"seg\.onnx with --loss cross_entropy takes \(4, 5\) per example \(one "
                                           r"label per position of its output 'y'\)"):
        check_fit(engine, per_example, model="seg.onnx", data="one label each", loss="cross_entropy",
                  batch_size=32, workers=1)
