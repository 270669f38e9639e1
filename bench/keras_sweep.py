"""The engine's gradients against Keras' GradientTape on Keras models exported with tf2onnx.

Each model below (18) is a small Keras 3 model around a layer family: convolutions with BatchNormalization,
depthwise and separable convolutions, transposed convolutions and resampling, cropping and padding, LSTMs, GRUs
and SimpleRNNs, a bidirectional LSTM, causal and dilated 1-D convolutions, multi-head and dot-product attention,
LayerNormalization and GroupNormalization, activations, merge layers, 3-D convolutions, embeddings, a softmax
output, grouped convolutions. Each is exported with tf2onnx's ``from_keras`` at its default opset by the marker
recipe (docs/models.md: every variable holds distinct marker values for the export, so that nothing folds, and
the markers say where each variable landed), built into a GradientEngine, and one step is compared with
GradientTape's on a float64 twin of the model in inference mode (tf2onnx exports the inference graph).

JSON lines (ps_bench.harness.emit), one per model: ``keras_sweep_error_NAME``, in millionths, the largest over the
initializers of ||engine - exact|| / max(||exact||, 1e-2 x the largest ||exact||) over the elements that hold a
variable's marker (tf2onnx pads an LSTM's bias with zeros for the recurrence's, which are not Keras'), with
``status``: "ok", "differs" (above ``--tolerance``, not finite, or an initializer without a gradient), "refused"
(the engine raised, the message kept), "export_failed" (tf2onnx could not export it, or folded variables away: not
the engine's) or "known_limit" (refused, or folded by tf2onnx, where docs/models.md says so: `KNOWN_LIMITS`,
the reason kept). A summary goes to
stderr; the exit status is 1 when a model differs or is refused.

Needs tensorflow (or tensorflow-cpu) and tf2onnx beside the project: neither is a project dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
try:
    import tensorflow as tf
    import tf2onnx
except ImportError as exc:  # benchmark-only dependencies
    raise SystemExit("ps_bench.keras_sweep compares against TensorFlow, which is not installed here; run it where "
                     "tensorflow (or tensorflow-cpu) and tf2onnx are installed beside the project") from exc

from ps_bench import harness
from worker_client import GradientEngine

keras = tf.keras
layers = keras.layers
#: The largest error that passes (as ps_bench.grad_sweep).
TOLERANCE = 1e-4
PPM = "ppm of the gradient's scale"
BATCH = 8
ZERO_FLOOR = 1e-2
#: Marker k is (k + 1) * MARKER_STEP: distinct and exact in float32 (tests/fixtures/markers.py).
MARKER_STEP = 2.0 ** -20
#: Classes of every model's output.
CLASSES = 5
#: Ids of the models that read integer tokens.
VOCABULARY = 50

Builder = Callable[[str], keras.Model]


def _head(x: keras.KerasTensor, h: keras.KerasTensor, d: str, activation: str | None = None) -> keras.Model:
    return keras.Model(x, layers.Dense(CLASSES, activation=activation, dtype=d)(h))


def cnn_batch_norm(d: str) -> keras.Model:
    x = keras.Input((12, 12, 3), name="x", dtype=d)
    h = layers.ReLU(dtype=d)(layers.BatchNormalization(dtype=d)(layers.Conv2D(8, 3, padding="same", use_bias=False,
                                                                               dtype=d)(x)))
    h = layers.DepthwiseConv2D(3, strides=2, padding="same", dtype=d)(h)
    h = layers.Activation("relu6", dtype=d)(layers.BatchNormalization(dtype=d)(h))
    h = layers.SeparableConv2D(16, 3, dtype=d)(h)
    return _head(x, layers.GlobalAveragePooling2D(dtype=d)(h), d)


def decoder(d: str) -> keras.Model:
    x = keras.Input((6, 6, 3), name="x", dtype=d)
    h = layers.Conv2DTranspose(8, 3, strides=2, padding="same", activation="relu", dtype=d)(x)
    h = layers.Concatenate(dtype=d)([h, layers.UpSampling2D(2, dtype=d)(x),
                                     layers.UpSampling2D(2, interpolation="bilinear", dtype=d)(x)])
    h = layers.Cropping2D(((0, 1), (1, 1)), dtype=d)(layers.ZeroPadding2D(((1, 0), (0, 2)), dtype=d)(h))
    h = layers.AveragePooling2D(2, dtype=d)(layers.Conv2D(8, 3, strides=2, activation="elu", dtype=d)(h))
    return _head(x, layers.Flatten(dtype=d)(h), d)


def tokens_input() -> keras.KerasTensor:
    return keras.Input((10,), name="x", dtype="int32")


def lstm_gru(d: str) -> keras.Model:
    x = tokens_input()
    h = layers.LSTM(12, return_sequences=True, dtype=d)(layers.Embedding(VOCABULARY, 16, dtype=d)(x))
    return _head(x, layers.GRU(8, dtype=d)(h), d)


def lstm_bidirectional(d: str) -> keras.Model:
    x = tokens_input()
    h = layers.Embedding(VOCABULARY, 16, dtype=d)(x)
    h = layers.Bidirectional(layers.LSTM(8, return_sequences=True, dtype=d), dtype=d)(h)
    return _head(x, layers.GlobalMaxPooling1D(dtype=d)(h), d)


def simple_rnn(d: str) -> keras.Model:
    x = keras.Input((10, 6), name="x", dtype=d)
    h = layers.SimpleRNN(8, return_sequences=True, dtype=d)(x)
    return _head(x, layers.LSTM(8, go_backwards=True, dtype=d)(h), d)


def conv1d(d: str) -> keras.Model:
    x = keras.Input((20, 4), name="x", dtype=d)
    h = layers.Conv1D(8, 3, padding="causal", dilation_rate=2, activation="relu", dtype=d)(x)
    h = layers.Conv1D(8, 3, strides=2, padding="same", activation="gelu", dtype=d)(layers.MaxPooling1D(2, dtype=d)(h))
    return _head(x, layers.GlobalAveragePooling1D(dtype=d)(h), d)


def attention(d: str) -> keras.Model:
    x = keras.Input((8, 16), name="x", dtype=d)
    h = layers.LayerNormalization(dtype=d)(layers.Add(dtype=d)([x, layers.MultiHeadAttention(2, 8, dtype=d)(x, x)]))
    f = layers.Dense(16, dtype=d)(layers.Dense(32, activation="gelu", dtype=d)(h))
    h = layers.LayerNormalization(dtype=d)(layers.Add(dtype=d)([h, f]))
    return _head(x, layers.GlobalAveragePooling1D(dtype=d)(h), d)


def activations(d: str) -> keras.Model:
    x = keras.Input((12,), name="x", dtype=d)
    h = layers.LeakyReLU(0.2, dtype=d)(layers.Dense(16, dtype=d)(x))
    for activation in ("elu", "softplus", "swish", "selu", "hard_sigmoid", "tanh", "softsign"):
        h = layers.Dense(16, activation=activation, dtype=d)(h)
    return _head(x, h, d)


def merges(d: str) -> keras.Model:
    x = keras.Input((12,), name="x", dtype=d)
    a = layers.Dense(16, activation="relu", dtype=d)(x)
    b = layers.Dense(16, activation="sigmoid", dtype=d)(x)
    c = layers.Dense(16, dtype=d)(x)
    h = layers.Concatenate(dtype=d)([layers.Add(dtype=d)([a, b]), layers.Multiply(dtype=d)([a, c]),
                                     layers.Subtract(dtype=d)([b, c]), layers.Average(dtype=d)([a, b, c]),
                                     layers.Maximum(dtype=d)([a, c]), layers.Minimum(dtype=d)([b, c])])
    h = layers.Permute((2, 1), dtype=d)(layers.Reshape((6, 16), dtype=d)(h))
    return _head(x, layers.Flatten(dtype=d)(h), d)


def group_norm(d: str) -> keras.Model:
    x = keras.Input((8, 8, 4), name="x", dtype=d)
    h = layers.Activation("silu", dtype=d)(layers.GroupNormalization(4, dtype=d)(layers.Conv2D(8, 3, padding="same",
                                                                                               dtype=d)(x)))
    h = layers.UnitNormalization(dtype=d)(layers.Conv2D(8, 3, padding="same", dtype=d)(h))
    h = layers.MaxPooling2D(3, strides=2, padding="same", dtype=d)(h)
    return _head(x, layers.Flatten(dtype=d)(h), d)


def conv3d(d: str) -> keras.Model:
    x = keras.Input((6, 6, 6, 2), name="x", dtype=d)
    h = layers.MaxPooling3D(2, dtype=d)(layers.Conv3D(4, 3, padding="same", activation="relu", dtype=d)(x))
    h = layers.Conv3DTranspose(4, 2, strides=2, dtype=d)(h)
    return _head(x, layers.GlobalAveragePooling3D(dtype=d)(h), d)


def embedding_mean(d: str) -> keras.Model:
    x = tokens_input()
    h = layers.GlobalAveragePooling1D(dtype=d)(layers.Embedding(VOCABULARY, 16, dtype=d)(x))
    return _head(x, layers.Dropout(0.3, dtype=d)(layers.Dense(16, activation="relu", dtype=d)(h)), d)


def softmax_output(d: str) -> keras.Model:
    x = keras.Input((8, 8, 1), name="x", dtype=d)
    h = layers.Flatten(dtype=d)(layers.Conv2D(8, 3, activation="relu", dtype=d)(x))
    return _head(x, h, d, activation="softmax")


def gru_without_reset_after(d: str) -> keras.Model:
    x = keras.Input((10, 6), name="x", dtype=d)
    h = layers.GRU(8, reset_after=False, return_sequences=True, dtype=d)(x)
    return _head(x, layers.GRU(8, reset_after=False, dtype=d)(h), d)


def text_cnn(d: str) -> keras.Model:
    x = tokens_input()
    h = layers.Embedding(VOCABULARY, 16, dtype=d)(x)
    pooled = [layers.GlobalMaxPooling1D(dtype=d)(layers.Conv1D(8, k, activation="relu", dtype=d)(h)) for k in (3, 5)]
    return _head(x, layers.Concatenate(dtype=d)(pooled), d)


def time_distributed(d: str) -> keras.Model:
    x = keras.Input((6, 8), name="x", dtype=d)
    h = layers.TimeDistributed(layers.Dense(12, activation="relu", dtype=d), dtype=d)(x)
    q = layers.Dense(12, dtype=d)(h)
    h = layers.Concatenate(dtype=d)([layers.Attention(dtype=d)([q, h]), layers.AdditiveAttention(dtype=d)([q, h])])
    return _head(x, layers.GlobalAveragePooling1D(dtype=d)(h), d)


def dense_batch_norm(d: str) -> keras.Model:
    x = keras.Input((12,), name="x", dtype=d)
    h = layers.Activation("relu", dtype=d)(layers.BatchNormalization(dtype=d)(layers.Dense(16, dtype=d)(x)))
    return _head(x, layers.Dropout(0.3, dtype=d)(h), d)


def grouped(d: str) -> keras.Model:
    x = keras.Input((8, 8, 4), name="x", dtype=d)
    h = layers.Conv2D(8, 3, groups=2, padding="same", activation="relu", dtype=d)(x)
    h = layers.LayerNormalization(axis=[1, 2, 3], dtype=d)(layers.Conv2D(8, 3, strides=2, padding="same", dtype=d)(h))
    return _head(x, layers.GlobalMaxPooling2D(dtype=d)(h), d)


MODELS: dict[str, Builder] = {
    "cnn_batch_norm": cnn_batch_norm, "decoder": decoder, "lstm_gru": lstm_gru, "lstm_bidirectional":
    lstm_bidirectional, "simple_rnn": simple_rnn, "conv1d": conv1d, "attention": attention, "activations": activations,
    "merges": merges, "group_norm": group_norm, "conv3d": conv3d, "embedding_mean": embedding_mean,
    "softmax_output": softmax_output, "gru_without_reset_after": gru_without_reset_after, "text_cnn": text_cnn,
    "time_distributed": time_distributed, "dense_batch_norm": dense_batch_norm, "grouped": grouped,
}
#: model -> why the engine cannot match Keras there: a limit docs/models.md states ("Keras / TensorFlow").
KNOWN_LIMITS = {
    "cnn_batch_norm": "tf2onnx folds a Keras BatchNormalization into the layer beside it (the engine warns)",
    "dense_batch_norm": "tf2onnx folds a Keras BatchNormalization into the layer beside it (the engine warns)",
    "lstm_gru": "tf2onnx writes a Keras GRU as a Loop whose outputs have no inferable shape",
    "simple_rnn": "tf2onnx writes a Keras SimpleRNN as a Loop whose outputs have no inferable shape",
    "gru_without_reset_after": "tf2onnx writes a Keras GRU as a Loop whose outputs have no inferable shape",
    "grouped": "tf2onnx leaves a grouped Conv2D as a TensorFlow StatefulPartitionedCall",
}
#: Models whose reference is float32: TensorFlow has no float64 MaxPool3D kernel.
FLOAT32_REFERENCE = {"conv3d"}


class Markers:
    """Distinct marker values for every variable, and where the export put each (tests/fixtures/markers.py's
    recipe, which also lets an initializer hold exact zeros beside markers: an LSTM bias's recurrence half)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.names = list(shapes)
        sizes = [int(np.prod(shapes[n], dtype=np.int64)) for n in self.names]
        self.pool = (np.arange(sum(sizes)) + 1) * MARKER_STEP
        self.owner = np.repeat(np.arange(len(sizes)), sizes)
        self.element = np.concatenate([np.arange(s) for s in sizes]) if sizes else np.zeros(0, np.int64)
        starts = np.cumsum([0, *sizes])
        self.values = {n: self.pool[starts[i]:starts[i + 1]].astype(np.float32).reshape(shapes[n])
                       for i, n in enumerate(self.names)}
        self.found: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]] = {}

    def locate(self, model: onnx.ModelProto) -> list[str]:
        """Finds the markers in `model`'s float initializers; the variables some of whose elements are nowhere
        (tf2onnx folded or computed them), or ValueError for an initializer mixing markers and computed values."""
        seen = np.zeros(len(self.pool), bool)
        for tensor in model.graph.initializer:
            if tensor.data_type != onnx.TensorProto.FLOAT:
                continue
            values = numpy_helper.to_array(tensor).astype(np.float64).reshape(-1)
            slots = np.clip(np.searchsorted(self.pool, values), 0, len(self.pool) - 1)
            hit = self.pool[slots] == values
            if not hit.any():
                continue
            if not (hit | (values == 0)).all():
                raise ValueError(f"initializer {tensor.name!r} holds values that are no variable's marker")
            self.found[tensor.name] = (slots, hit, values, tuple(tensor.dims))
            seen[slots[hit]] = True
        return sorted({self.names[o] for o in self.owner[~seen]})

    def laid_out(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per located initializer, `arrays` (by variable) laid out as the initializer is; zeros where it holds no
        marker."""
        out = {}
        flat = {n: np.asarray(arrays[n], np.float64).reshape(-1) for n in self.names}
        for name, (slots, hit, _, dims) in self.found.items():
            laid = np.zeros(len(slots))
            laid[hit] = [flat[self.names[self.owner[s]]][self.element[s]] for s in slots[hit]]
            out[name] = laid.reshape(dims)
        return out


def _draw(model: keras.Model, rng: np.random.Generator) -> np.ndarray:
    shape, dtype = tuple(model.inputs[0].shape[1:]), str(model.inputs[0].dtype)
    if "int" in dtype:
        return rng.integers(0, VOCABULARY, (BATCH, *shape)).astype(np.int32)
    return rng.standard_normal((BATCH, *shape)).astype(np.float32)


def _reference(build: Builder, model: keras.Model, values: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray,
               dtype: str, from_logits: bool) -> tuple[float, dict[str, np.ndarray]]:
    """GradientTape's loss and gradients (by variable path) on a twin of `model` in `dtype`, inference mode."""
    twin = build(dtype)
    for variable, original in zip(twin.trainable_variables, model.trainable_variables, strict=True):
        variable.assign(values[original.path].astype(dtype))
    for variable, original in zip(twin.non_trainable_variables, model.non_trainable_variables, strict=True):
        variable.assign(original.numpy().astype(dtype))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, twin(x if x.dtype.kind == "i" else x.astype(dtype), training=False))
    gradients = tape.gradient(loss, twin.trainable_variables)
    return float(loss), {original.path: tf.convert_to_tensor(g).numpy()
                         for original, g in zip(model.trainable_variables, gradients, strict=True)}


def sweep_one(name: str, folder: Path, tolerance: float) -> dict[str, object]:
    build = MODELS[name]
    keras.utils.set_random_seed(0)
    model = build("float32")
    rng = np.random.default_rng(1)
    x, y = _draw(model, rng), rng.integers(0, CLASSES, BATCH).astype(np.int64)
    true = {v.path: v.numpy() for v in model.trainable_variables}
    markers = Markers({n: v.shape for n, v in true.items()})
    for variable in model.trainable_variables:
        variable.assign(markers.values[variable.path])
    spec = (tf.TensorSpec((None, *x.shape[1:]), tf.int32 if x.dtype.kind == "i" else tf.float32, name="x"),)
    size_mb = round(sum(v.size * 4 for v in true.values()) / 1e6, 4)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            exported, _ = tf2onnx.convert.from_keras(model, input_signature=spec)
        lost = markers.locate(exported)
    except Exception as exc:  # noqa: BLE001 -- tf2onnx raises many kinds; the record keeps the message
        return harness.emit("onnx-ps", f"keras_sweep_error_{name}", size_mb, float("nan"), PPM,
                            status="export_failed", message=f"{type(exc).__name__}: {str(exc)[:300]}")
    if lost:   # a folded BatchNormalization (docs/models.md): the variables trained are not Keras'
        limit = KNOWN_LIMITS.get(name)
        return harness.emit("onnx-ps", f"keras_sweep_error_{name}", size_mb, float("nan"), PPM,
                            status="known_limit" if limit else "export_failed", **({"reason": limit} if limit else {}),
                            message=f"tf2onnx folded or computed variables {lost[:5]}")
    true_values = markers.laid_out(true)
    for tensor in exported.graph.initializer:
        if tensor.name in true_values:
            tensor.CopyFrom(numpy_helper.from_array(true_values[tensor.name].astype(np.float32), tensor.name))
    path = folder / f"{name}.onnx"
    onnx.save(exported, path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = GradientEngine(path, batch_size=BATCH, loss="cross_entropy", intra_op_threads=1,
                                    cache_dir=folder / "cache")
            result = engine.step({**engine.parameters(), **engine.state()}, {"x": x, "labels": y})
    except Exception as exc:  # noqa: BLE001 -- a refusal or a failure of the engine: the record says which
        limit = KNOWN_LIMITS.get(name)
        return harness.emit("onnx-ps", f"keras_sweep_error_{name}", size_mb, float("nan"), PPM,
                            status="known_limit" if limit else "refused", **({"reason": limit} if limit else {}),
                            message=f"{type(exc).__name__}: {str(exc)[:300]}")
    dtype = "float32" if name in FLOAT32_REFERENCE else "float64"
    loss, gradients = _reference(build, model, true, x, y, dtype, from_logits=name != "softmax_output")
    exact = markers.laid_out(gradients)
    norms = {n: float(np.linalg.norm(g)) for n, g in exact.items()}
    floor = ZERO_FLOOR * max(norms.values(), default=0.0)
    found = {}
    for initializer, expected in exact.items():
        if initializer in result.gradients:
            hit = markers.found[initializer][1].reshape(expected.shape)
            difference = (result.gradients[initializer].astype(np.float64) - expected)[hit]
            found[initializer] = float(np.linalg.norm(difference)) / max(norms[initializer], floor, 1e-300)
    worst = max(found, key=lambda n: found[n] if np.isfinite(found[n]) else np.inf, default="")
    differs = [n for n, error in found.items() if not error <= tolerance]
    missing = sorted(set(exact) - set(result.gradients))
    return harness.emit("onnx-ps", f"keras_sweep_error_{name}", size_mb, found.get(worst, 0.0) * 1e6, PPM,
                        status="differs" if differs or missing else "ok", parameter=worst, differing=differs[:5],
                        loss=round(float(result.loss), 6), keras_loss=round(loss, 6), missing=missing[:5])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps_bench.keras_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models [all]")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"the largest error that passes [{TOLERANCE:g}]")
    parser.add_argument("--export-dir", type=Path, default=None,
                        help="where the exports and the engine's cache go [a fresh temporary folder]")
    args = parser.parse_args(argv)
    folder = args.export_dir or Path(tempfile.mkdtemp(prefix="keras-sweep-"))
    folder.mkdir(parents=True, exist_ok=True)
    harness.log(f"keras_sweep: {len(args.models)} models, tensorflow {tf.__version__}, keras {keras.__version__}, "
                f"tf2onnx {tf2onnx.__version__}, into {folder}, {harness.machine()}")
    records = [sweep_one(name, folder, args.tolerance) for name in args.models]
    by_status: dict[str, list[str]] = {}
    for record in records:
        by_status.setdefault(str(record["status"]), []).append(str(record["metric"])[len("keras_sweep_error_"):])
    for status, names in sorted(by_status.items()):
        harness.log(f"keras_sweep: {status}: {len(names)}" + ("" if status == "ok" else f" ({', '.join(names)})"))
    return 1 if {"differs", "refused"} & set(by_status) else 0


if __name__ == "__main__":
    sys.exit(main())
