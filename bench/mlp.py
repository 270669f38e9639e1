"""The training benchmark's model and data, the same for both systems: MLP 784-256-10, synthetic batches.

The model is the bundled MLP (`ps_models.builders.build_mlp`) built with input 784, one
hidden layer of 256 and 10 classes: Gemm + Relu + Gemm, parameters ``fc1.weight``
(784, 256), ``fc1.bias`` (256), ``fc2.weight`` (256, 10), ``fc2.bias`` (10), with the
weights laid out (fan_in, fan_out): logits = relu(x @ W1 + b1) @ W2 + b2. The torch side
computes exactly that with autograd, from the same initial values.

The data is random: features from a standard normal, labels uniform in [0, 10), from a
seed. What is measured is the speed of a step, not learning.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ps_models.builders import write_model
from ps_models.datasets import Dataset

INPUT_DIM = 784
HIDDEN = 256
CLASSES = 10
#: The parameters in the order the torch side computes with them.
PARAMETERS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
BATCH = 64


def write_mlp(path: str | Path) -> Path:
    """The 784-256-10 MLP as an ONNX file at `path`."""
    return write_model("mlp", path, input_dim=INPUT_DIM, hidden=[HIDDEN], num_classes=CLASSES)


def initial_values(path: str | Path) -> dict[str, np.ndarray]:
    """The model's initializers (the initial parameters), by name."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def batches_per_epoch(total: int, *, most: int = 32) -> int:
    """A number of batches per epoch that divides `total` (at most `most`): whole epochs make exactly `total` steps."""
    return max(k for k in range(1, min(most, total) + 1) if total % k == 0)


def synthetic_dataset(*, workers: int, steps_per_worker: int, batch: int = BATCH, seed: int = 0) -> Dataset:
    """A random classification dataset whose every worker's share is a whole number of batches.

    Each worker's share (`ps_models.datasets.worker_shard`) holds `batches_per_epoch(steps_per_worker)`
    batches, so `steps_per_worker / that` epochs are exactly `steps_per_worker` steps.
    """
    per_epoch = batches_per_epoch(steps_per_worker)
    rows = per_epoch * batch * workers
    rng = np.random.default_rng(seed)
    return Dataset.of(f"synthetic-{INPUT_DIM}", rng.standard_normal((rows, INPUT_DIM), dtype=np.float32),
                      rng.integers(0, CLASSES, rows, dtype=np.int64),
                      rng.standard_normal((batch, INPUT_DIM), dtype=np.float32),
                      rng.integers(0, CLASSES, batch, dtype=np.int64), input_name="x", num_classes=CLASSES)


def epochs_for(steps_per_worker: int) -> int:
    """The epochs of `synthetic_dataset`'s shares that make exactly `steps_per_worker` steps."""
    return math.ceil(steps_per_worker / batches_per_epoch(steps_per_worker))
