"""Evaluating a model's predictions: test loss, accuracy and AUC from its first output and the labels."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from worker_client.engine import GradientEngine

__all__ = ["binary_auc", "evaluate", "finite", "logits_of", "metrics_of"]


def finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def evaluate(engine: GradientEngine, parameters: Mapping[str, np.ndarray], x: np.ndarray | Mapping[str, np.ndarray],
             y: np.ndarray, *, input_name: str = "x", num_classes: int, kind: str | None = None
             ) -> dict[str, float | None]:
    """Test loss, accuracy and AUC of the first output on `x` (an array for `input_name`, or arrays by input name);
    see metrics_of."""
    inputs = dict(x) if isinstance(x, Mapping) else {input_name: x}
    outputs = engine.predict(parameters, inputs)
    return metrics_of(outputs[engine.output_names[0]], y, num_classes, kind=kind, activation=engine.output_activation)


def logits_of(probabilities: np.ndarray, activation: str) -> np.ndarray:
    """Logits that give `probabilities` back through `activation` ("softmax": log p, up to the constant a softmax
    ignores; "sigmoid": log p - log(1 - p)), float64, clipped where a probability rounded to 0 or 1."""
    tiny = np.finfo(np.float64).tiny
    p = np.asarray(probabilities, dtype=np.float64)
    if activation == "softmax":
        return np.log(np.maximum(p, tiny))
    p = np.clip(p, tiny, 1 - np.finfo(np.float64).epsneg)
    return np.log(p) - np.log1p(-p)


def metrics_of(output: np.ndarray, y: np.ndarray, num_classes: int, *, kind: str | None = None,
               activation: str | None = None) -> dict[str, float | None]:
    """Test loss, accuracy and AUC of a model's first output against the labels.

    `kind`: "classes" (logits of num_classes classes on axis 1, a label per example or per position:
    cross-entropy, accuracy, AUC for two), "binary" (a logit per label: binary cross-entropy, accuracy
    at 0.5, AUC) or "targets" (regression: mean squared error); default: classes when num_classes > 0.
    `activation`: "softmax" or "sigmoid" when the output is probabilities rather than logits
    (GradientEngine.output_activation): a softmax's for classes, a sigmoid's for binary labels are taken back to
    logits first.
    """
    prediction = np.asarray(output, dtype=np.float64)
    kind = kind or ("classes" if num_classes > 0 else "targets")
    if (activation, kind) in (("softmax", "classes"), ("sigmoid", "binary")):
        prediction = logits_of(prediction, activation)
    if kind == "binary":
        z = prediction.reshape(-1)
        labels = np.asarray(y, dtype=np.float64).reshape(-1)
        loss = float(np.mean(np.maximum(z, 0) - z * labels + np.log1p(np.exp(-np.abs(z)))))
        accuracy = float(((z > 0) == (labels > 0.5)).mean())
        return {"test_loss": finite(loss), "test_accuracy": accuracy,
                "test_auc": binary_auc(z, labels.astype(np.int64))}
    if kind == "classes":
        # (batch, classes) or (batch, classes, d1, ...) with a label per position: one row of logits per label
        logits = np.moveaxis(prediction, 1, -1).reshape(-1, prediction.shape[1]) if prediction.ndim > 2 \
            else prediction.reshape(len(y), -1)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        labels = np.asarray(y, dtype=np.int64).reshape(-1)
        loss = float(-log_probs[np.arange(len(labels)), labels].mean())
        accuracy = float((logits.argmax(axis=1) == labels).mean())
        auc = binary_auc(log_probs[:, 1] - log_probs[:, 0], labels) if logits.shape[1] == 2 else None
        return {"test_loss": finite(loss), "test_accuracy": accuracy, "test_auc": auc}
    target = np.asarray(y, dtype=np.float64).reshape(prediction.shape)
    return {"test_loss": finite(float(((prediction - target) ** 2).mean())), "test_accuracy": None, "test_auc": None}


def binary_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC AUC of scores for labels 0/1 (the rank statistic; ties count half); None without both classes."""
    positives, negatives = int((labels == 1).sum()), int((labels == 0).sum())
    if not positives or not negatives:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), np.float64)
    ranks[order] = np.arange(1, len(scores) + 1)
    sorted_scores = scores[order]
    for value in np.unique(sorted_scores[np.r_[False, np.diff(sorted_scores) == 0]]):   # average tied ranks
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


