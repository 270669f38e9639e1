"""--loss cross_entropy over (batch, classes, d1, ...) logits, as torch's F.cross_entropy takes them: a label per
position (a segmentation map's pixel, a token's tag), the mean over every label; the loss and gradients against
numpy's closed form, with static and run-time positions, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

from ps_common.errors import UnsupportedModelError
from tests.helpers.one_input_models import save_model
from worker_client.engine import GradientEngine

CLASSES = 6


def _segmenter(path: Path) -> Path:
    """A 1 x 1 Conv from 3 channels to CLASSES: logits (batch, CLASSES, 4, 5)."""
    rng = np.random.default_rng(0)
    return save_model(path, [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 1])],
                 ["batch", 3, 4, 5], ["batch", CLASSES, 4, 5],
                 [numpy_helper.from_array(rng.normal(size=(CLASSES, 3, 1, 1)).astype(np.float32), "w"),
                  numpy_helper.from_array(rng.normal(size=CLASSES).astype(np.float32), "b")])


def _tagger(path: Path) -> Path:
    """Per position of a sequence of run-time length: (batch, 5, len) -> (batch, CLASSES, len)."""
    rng = np.random.default_rng(1)
    return save_model(path, [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
                        helper.make_node("MatMul", ["t", "w"], ["m"]),
                        helper.make_node("Transpose", ["m"], ["y"], perm=[0, 2, 1])],
                 ["batch", 5, "len"], ["batch", CLASSES, "len"],
                 [numpy_helper.from_array(rng.normal(size=(5, CLASSES)).astype(np.float32), "w")])


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """torch's F.cross_entropy (mean) over axis 1, and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    onehot = np.moveaxis(np.eye(logits.shape[1])[labels], -1, 1)
    return float(-(onehot * log_probs).sum() / labels.size), (np.exp(log_probs) - onehot) / labels.size


def test_a_label_per_pixel_gives_torchs_mean_cross_entropy_and_its_gradients(tmp_path: Path) -> None:
    engine = GradientEngine(_segmenter(tmp_path / "seg.onnx"), batch_size=2, loss="cross_entropy",
                            cache_dir=tmp_path)
    assert tuple(engine.feed_dims()["labels"]) == (2, 4, 5) and engine.num_classes == CLASSES
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    labels = rng.integers(0, CLASSES, (2, 4, 5))
    params = engine.parameters()
    loss, grads = engine.gradients(params, {"x": x, "labels": labels})
    w, b = params["w"].reshape(CLASSES, 3).astype(np.float64), params["b"].astype(np.float64)
    logits = np.einsum("oc,nchw->nohw", w, x) + b[None, :, None, None]
    want, dlogits = _cross_entropy(logits, labels)
    assert loss == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(grads["w"].reshape(CLASSES, 3), np.einsum("nohw,nchw->oc", dlogits, x),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["b"], dlogits.sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-6)


def test_a_label_per_position_of_a_run_time_length_is_averaged_over_the_fed_labels(tmp_path: Path) -> None:
    engine = GradientEngine(_tagger(tmp_path / "tag.onnx"), batch_size=3, loss="cross_entropy", cache_dir=tmp_path)
    rng = np.random.default_rng(3)
    params = engine.parameters()
    for length in (7, 2):   # the mean's count is read at run time: each length its own
        x = rng.normal(size=(3, 5, length)).astype(np.float32)
        labels = rng.integers(0, CLASSES, (3, length))
        loss, grads = engine.gradients(params, {"x": x, "labels": labels})
        logits = np.einsum("ncl,co->nol", x.astype(np.float64), params["w"])
        want, dlogits = _cross_entropy(logits, labels)
        assert loss == pytest.approx(want, rel=1e-5)
        np.testing.assert_allclose(grads["w"], np.einsum("ncl,nol->co", x, dlogits), rtol=1e-4, atol=1e-6)


def test_a_label_past_the_classes_is_refused_naming_the_range(tmp_path: Path) -> None:
    engine = GradientEngine(_segmenter(tmp_path / "seg.onnx"), batch_size=2, loss="cross_entropy",
                            cache_dir=tmp_path)
    labels = np.zeros((2, 4, 5), np.int64)
    labels[1, 3, 4] = CLASSES
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, {CLASSES}\), got values in \[0, {CLASSES}\]"):
        engine.gradients(engine.parameters(), {"x": np.zeros((2, 3, 4, 5), np.float32), "labels": labels})


def test_logits_without_a_class_axis_are_refused(tmp_path: Path) -> None:
    path = save_model(tmp_path / "flat.onnx", [helper.make_node("MatMul", ["x", "w"], ["m"]),
                                          helper.make_node("Flatten", ["m"], ["f"], axis=0),
                                          helper.make_node("Squeeze", ["f", "zero"], ["y"])],
                 ["batch", 3], ["batch"],
                 [numpy_helper.from_array(np.ones((3, 1), np.float32), "w"),
                  numpy_helper.from_array(np.array([0], np.int64), "zero")])
    with pytest.raises(UnsupportedModelError, match=r"cross_entropy needs logits shaped \(batch, classes\) or "
                                                    r"\(batch, classes, d1, \.\.\.\), but the first output 'y' has "
                                                    r"shape \[4\]"):
        GradientEngine(path, batch_size=4, loss="cross_entropy", cache_dir=tmp_path)
