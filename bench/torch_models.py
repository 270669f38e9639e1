"""Torch definitions of the models users train, and their ONNX exports, for the benchmarks.

Benchmark-only: it needs torch, which the project never does; nothing in the product or in its
tests imports it. Installed as ``ps_bench.torch_models``.

The API (kept small and stable; other benchmarks import it):

``MODELS``
    ``{name: ModelSpec}`` for ``"resnet18"`` and ``"transformer"``; a ``ModelSpec`` says the
    graph input's name, one example's shape and dtype, the number of classes, and what the
    model is.
``build(name, seed=0) -> torch.nn.Module``
    A fresh module in training mode. Its initial weights depend only on ``seed`` (torch's
    global generator is left as it was), so ``build(name)`` holds exactly the values that
    ``export(name, ...)`` writes into the ONNX file.
``example_batch(name, batch_size, seed=0) -> (inputs, labels)``
    ``inputs`` is ``{input name: numpy array}`` (batch axis 0), ``labels`` an int64 array of
    ``batch_size`` class indices. The labels depend on the inputs (each class has its own
    prototype image / its own preferred tokens), so a model trained on these batches learns.
``export(name, folder) -> Path``
    The model exported to ONNX with the project's recipe (docs/models.md, "Exporter
    recipes": ``dynamo=False``, opset 18, training mode, no constant folding, a dynamic batch
    axis), written atomically as ``folder/<name>.v<VERSION>.onnx`` and returned. Idempotent:
    an existing file is returned as it is. ``folder`` may also be a path ending in ``.onnx``,
    which is then the file.
``torch_inputs(name, inputs) -> torch.Tensor``
    The graph input of ``example_batch``'s ``inputs`` as the tensor ``build(name)`` takes.

The models:

``resnet18``
    ResNet-18 for 32x32 images as trained on CIFAR-10: a 3x3 stem convolution (no 7x7, no
    max-pool), four stages of two basic blocks (64, 128, 256, 512 channels), BatchNorm in
    training mode after every convolution, global average pool, 10 classes; 11.17 M parameters.
    Input ``"image"``: float32 (N, 3, 32, 32).
``transformer``
    A text classifier: token embedding (vocabulary 8000) plus a learned position embedding
    (sequence length 64), four post-norm ``nn.TransformerEncoderLayer`` (d_model 384, 6 heads,
    feed-forward 1536, ReLU, Dropout 0.1, batch first), mean over the sequence, a linear layer
    to 4 classes; 10.2 M parameters. Input ``"ids"``: int64 (N, 64).

Both have one output, ``"logits"`` (N, classes); the loss is cross-entropy.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the models' sizes, shared with ps_bench.tf_ps, which builds the same models in Keras
from ps_bench.model_sizes import (D_MODEL, DROPOUT, FEED_FORWARD, HEADS, IMAGE_CLASSES, IMAGE_SHAPE, LAYERS,
                                  SEQ_LEN, STAGES, TEXT_CLASSES, VOCAB)

try:
    import torch
    from torch import nn
except ImportError as exc:  # torch is a benchmark-only dependency
    raise SystemExit("ps_bench.torch_models needs torch, which is not installed here; use an environment "
                     "of its own with torch and the project (docs/benchmarks.md, \"The torch environment\")"
                     ) from exc

__all__ = ["MODELS", "VERSION", "ModelSpec", "build", "example_batch", "export", "torch_inputs"]

#: Part of every exported file's name: bumped whenever a model's definition or its export changes,
#: so a file cached by an older definition is never taken for the current one.
VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: its graph input (name, one example's shape, numpy dtype), its classes,
    a line saying what it is, and the function that builds its torch module."""

    input_name: str
    input_shape: tuple[int, ...]
    input_dtype: str
    classes: int
    description: str
    factory: Callable[[], nn.Module]


# --- ResNet-18 for 32x32 images ------------------------------------------------------------


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, and the shortcut (a strided 1x1 convolution with
    BatchNorm where the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR style: 3x3 stem, no max-pool."""

    def __init__(self, classes: int = IMAGE_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages, inputs = [], 64
        for outputs, stride in STAGES:
            stages.append(nn.Sequential(BasicBlock(inputs, outputs, stride),
                                        BasicBlock(outputs, outputs, 1)))
            inputs = outputs
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(image)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.fc(out.mean(dim=(2, 3)))


# --- the transformer classifier ---------------------------------------------------------------


class TransformerClassifier(nn.Module):
    """Token and position embeddings, post-norm encoder layers, mean pool, a linear classifier."""

    def __init__(self, vocab: int = VOCAB, seq_len: int = SEQ_LEN, d_model: int = D_MODEL,
                 heads: int = HEADS, feed_forward: int = FEED_FORWARD, layers: int = LAYERS,
                 classes: int = TEXT_CLASSES, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(1, seq_len, d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, feed_forward, dropout, batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


MODELS: dict[str, ModelSpec] = {
    "resnet18": ModelSpec("image", IMAGE_SHAPE, "float32", IMAGE_CLASSES,
                          "ResNet-18 for 32x32 images (CIFAR style), training-mode BatchNorm, 11.2 M parameters",
                          ResNet18),
    "transformer": ModelSpec("ids", (SEQ_LEN,), "int64", TEXT_CLASSES,
                             f"transformer classifier: {LAYERS} encoder layers, d_model {D_MODEL}, {HEADS} heads, "
                             f"ff {FEED_FORWARD}, seq {SEQ_LEN}, vocab {VOCAB}, 10.2 M parameters",
                             TransformerClassifier),
}


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; the models are {sorted(MODELS)}") from None


def build(name: str, seed: int = 0) -> nn.Module:
    """A fresh `name` module in training mode, its initial weights drawn from `seed` alone."""
    spec = _spec(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = spec.factory()
    return module.train()


def example_batch(name: str, batch_size: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({input name: array}, int64 labels) for one batch of `batch_size`, drawn from `seed`.

    Images: each class's fixed prototype (the same for every seed) plus unit Gaussian noise.
    Token ids: half the positions from the class's own slice of the vocabulary, half uniform.
    """
    spec = _spec(name)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, spec.classes, size=batch_size, dtype=np.int64)
    if name == "resnet18":
        prototypes = np.random.default_rng(12345).standard_normal((spec.classes, *spec.input_shape))
        data = prototypes[labels] + rng.standard_normal((batch_size, *spec.input_shape))
        return {spec.input_name: data.astype(np.float32)}, labels
    width = VOCAB // spec.classes
    uniform = rng.integers(0, VOCAB, size=(batch_size, SEQ_LEN), dtype=np.int64)
    own = labels[:, None] * width + rng.integers(0, width, size=(batch_size, SEQ_LEN), dtype=np.int64)
    ids = np.where(rng.random((batch_size, SEQ_LEN)) < 0.5, own, uniform)
    return {spec.input_name: ids.astype(np.int64)}, labels


def torch_inputs(name: str, inputs: dict[str, np.ndarray]) -> torch.Tensor:
    """The tensor `build(name)`'s forward takes, from `example_batch`'s inputs (shares memory)."""
    return torch.from_numpy(inputs[_spec(name).input_name])


def export(name: str, folder: str | os.PathLike[str]) -> Path:
    """`name` exported to ONNX (the documented recipe), cached under `folder`; returns the file.

    The file is `folder/<name>.v<VERSION>.onnx` (or `folder` itself when it ends in .onnx). An
    existing file is returned unread; a new one is written to a temporary name and renamed, so
    concurrent callers race harmlessly and a reader never sees a partial file.
    """
    spec = _spec(name)
    target = Path(folder)
    if target.suffix != ".onnx":
        target = target / f"{name}.v{VERSION}.onnx"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    module = build(name)
    inputs, _ = example_batch(name, 2)
    example = torch_inputs(name, inputs)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the exporter's notes on training mode and on the fast path
            torch.onnx.export(module, (example,), str(temporary), dynamo=False, opset_version=18,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              input_names=[spec.input_name], output_names=["logits"],
                              dynamic_axes={spec.input_name: {0: "batch"}, "logits": {0: "batch"}})
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target
