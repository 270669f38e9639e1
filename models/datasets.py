"""Dataset readers: the shipped digits, seeded synthetic generators, and user .npz files.

Dataset specs accepted by `load_dataset`:

* ``"digits"`` -- scikit-learn's 8x8 digits (1797 images, 10 classes), shipped as
  ``models/data/digits.npz``: pixels scaled to [0, 1] float32, rows of 64, with a fixed
  stratified 80/20 split (1438 train, 359 test). Nothing is downloaded.
* ``"synthetic:<kind>[?key=value&...]"`` -- generated from ``seed``; kinds and keys:
  ``classification`` (n, features, classes, noise, test), ``regression`` (n, features,
  outputs, noise, test), ``ids`` (n, vocab, bag, classes, signal, test) and ``clicks``
  (n, fields, vocab, rank, signal, skew, test, hashed: click labels from a factorization machine,
  see `click_logits`; ``hashed=1`` turns each id into an int64 key by `hash_ids`).
  E.g. ``"synthetic:classification?n=2000&features=64&classes=10"``. Sizes that would take
  more than the machine's memory to generate (`_synthetic_bytes`) are refused before anything
  is allocated.
* a path to a ``.npz`` file in the format below. (A folder of Parquet files is opened with
  ``ps_models.parquet.ParquetDataset``.)

The .npz format (also in docs/data-format.md):

* required arrays ``x_train``, ``y_train``, ``x_test``, ``y_test``; ``x_*`` have one row per
  example on axis 0 and the same trailing shape in train and test (float features, finite and
  within float32's range, cast to float32, or integer ids, cast to int64); ``y_*`` have as many
  rows as their ``x_*``;
* integer ``y`` means classification: labels in ``[0, num_classes)``, int64, one per example
  (1-D) or one per position of each example (``(n, H, W)`` for a segmentation map: the model's
  logits are then ``(batch, classes, H, W)``; for ``--loss bce``, ``(n, K)`` labels 0 or 1 for
  K logits an example);
  floating ``y`` means regression: targets (1-D is read as one output column), finite and
  within float32's range, float32, and ``num_classes`` is 0;
* optional ``input_name``: a 0-d string array, the model input the features feed
  (default ``"x"`` for float features, ``"ids"`` for integer ones);
* optional ``num_classes``: a 0-d integer array (default: largest label + 1).

Layouts: datasets come as stored (digits: (n, 64)). `reshape_for(ds, model)` (or
``load_dataset(..., model=name)``) gives each bundled model its input: ``mlp`` (n, features)
flattened, ``lenet`` (n, C, H, W) (digits: (n, 1, 8, 8)), ``embedding``/``transformer``
int64 ids (n, bag) fed to ``"ids"``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ps_common.errors import DatasetError  # noqa: F401 - raised here, and imported from here by callers

__all__ = [
    "DIGITS_PATH",
    "Dataset",
    "DatasetError",
    "iterate_batches",
    "load_dataset",
    "click_logits",
    "hash_ids",
    "load_npz",
    "num_batches",
    "reshape_for",
    "worker_shard",
]

#: The shipped digits file.
DIGITS_PATH = Path(__file__).resolve().parent / "data" / "digits.npz"
#: Arrays every dataset file must hold.
REQUIRED_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
#: Arrays a dataset file may also hold.
OPTIONAL_ARRAYS = ("input_name", "num_classes")
#: How a .npz (a zip archive: a local file header, or the end record of an empty one) and a .npy file start.
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
#: How a Parquet file starts.
_PARQUET_MAGIC = b"PAR1"
#: The largest magnitude a float32 holds; float features and targets are cast to float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The bound on a synthetic dataset's generation when the machine's memory cannot be read.
SYNTHETIC_FALLBACK_MAX_BYTES = 16 << 30

Remainder = Literal["wrap", "drop"]


@dataclass(eq=False, repr=False)
class Dataset:
    """Train and test arrays of every model input, the labels, and what a model needs to know about them.

    `train` and `test` map each model input's name to its arrays (one row per example on
    axis 0). `num_classes` is 0 for regression targets. `image_shape` is the (C, H, W) of one
    example when the single input is images (digits: (1, 8, 8)), else None. Build a
    one-input dataset with `Dataset.of(...)`.
    """

    name: str
    train: dict[str, np.ndarray]
    y_train: np.ndarray
    test: dict[str, np.ndarray]
    y_test: np.ndarray
    num_classes: int = 0
    image_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.train or set(self.train) != set(self.test):
            raise DatasetError(f"dataset {self.name!r}: train inputs {sorted(self.train)} and test inputs "
                               f"{sorted(self.test)} differ (or there are none)")
        for split, arrays, y in (("train", self.train, self.y_train), ("test", self.test, self.y_test)):
            for name, x in arrays.items():
                if len(x) != len(y):
                    raise DatasetError(f"dataset {self.name!r}: input {name!r} has {len(x)} {split} rows "
                                       f"but y_{split} has {len(y)}")
        for name in self.train:
            if self.train[name].shape[1:] != self.test[name].shape[1:]:
                raise DatasetError(f"dataset {self.name!r}: input {name!r} has train shape {self.train[name].shape} "
                                   f"and test shape {self.test[name].shape}: they differ after the first axis")

    @classmethod
    def of(cls, name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, *,
           input_name: str = "x", num_classes: int = 0, image_shape: tuple[int, ...] | None = None) -> "Dataset":
        """A dataset of one model input, `input_name`."""
        return cls(name, {input_name: x_train}, y_train, {input_name: x_test}, y_test, num_classes=num_classes,
                   image_shape=image_shape)

    @property
    def input_names(self) -> list[str]:
        return list(self.train)

    def _single(self, what: str) -> str:
        if len(self.train) != 1:
            raise DatasetError(f"dataset {self.name!r} feeds {len(self.train)} inputs {self.input_names}; "
                               f"{what} is for a one-input dataset")
        return next(iter(self.train))

    @property
    def input_name(self) -> str:
        """The model input a one-input dataset feeds."""
        return self._single("input_name")

    @property
    def x_train(self) -> np.ndarray:
        return self.train[self._single("x_train")]

    @property
    def x_test(self) -> np.ndarray:
        return self.test[self._single("x_test")]

    @property
    def num_train(self) -> int:
        return int(len(self.y_train))

    @property
    def num_test(self) -> int:
        return int(len(self.y_test))

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """The shape of one example's features (a one-input dataset)."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    def input_specs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Each input's dtype and the shape of one example."""
        return {name: (x.dtype, tuple(int(d) for d in x.shape[1:])) for name, x in self.train.items()}

    @property
    def is_classification(self) -> bool:
        return self.num_classes > 0

    def label_range(self) -> tuple[float, float]:
        """The smallest and largest label or target of both splits."""
        return (float(min(self.y_train.min(), self.y_test.min())), float(max(self.y_train.max(), self.y_test.max())))

    def describe(self) -> str:
        """A one-line summary: sizes, inputs, classes."""
        outputs = self.y_train.shape[1] if self.y_train.ndim > 1 else 1
        task = f"{self.num_classes} classes" if self.is_classification else \
            f"regression, {outputs} target{'s' if outputs > 1 else ''}"
        inputs = ", ".join(f"{name!r} {tuple(x.shape[1:])} {x.dtype}" for name, x in self.train.items())
        return f"{self.name}: train {self.num_train}, test {self.num_test}, {task}, input{'s' * (len(self.train) > 1)} {inputs}"

    def __repr__(self) -> str:
        return f"Dataset({self.describe()})"

    # --- the training loop's view (the same as a streamed Parquet dataset's, ps_models.parquet) ---

    def part(self, index: int, workers: int) -> "ArrayPart":
        """The training share of worker `index` of `workers` (worker_shard), as the loop reads it."""
        return ArrayPart(worker_shard(self, index, workers))

    def test_batches(self, size: int) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
        """The test split in order, in batches of at most `size` rows: (inputs, labels)."""
        for start in range(0, self.num_test, size):
            yield {n: x[start:start + size] for n, x in self.test.items()}, self.y_test[start:start + size]


@dataclass
class ArrayPart:
    """One worker's share of an in-memory dataset: its rows and its batches, epoch after epoch."""

    share: Dataset

    @property
    def num_rows(self) -> int:
        return self.share.num_train

    def batches(self, batch_size: int, *, start: int, seed: int
                ) -> Iterator[tuple[int, dict[str, np.ndarray], np.ndarray]]:
        """(epoch, inputs, labels) from batch `start` on (a restarted worker's clock): epoch start // per epoch,
        that epoch's first batches skipped; shuffled by (seed, epoch) (`iterate_batches`)."""
        per_epoch = num_batches(self.num_rows, batch_size)
        epoch, skip = divmod(start, per_epoch)
        while True:
            for i, (x, y) in enumerate(iterate_batches(self.share.train, self.share.y_train, batch_size, seed=seed,
                                                       epoch=epoch)):
                if i >= skip:
                    yield epoch, x, y
            skip, epoch = 0, epoch + 1


# --- loading ------------------------------------------------------------------------------

def load_dataset(spec: str, *, seed: int = 0, model: str | None = None) -> Dataset:
    """Load `spec` ("digits", "synthetic:<kind>[?k=v&...]", or a .npz path).

    `seed` drives the synthetic generators (digits and files have fixed splits). With
    `model`, the features are laid out for that bundled model (see `reshape_for`).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"dataset spec must be a non-empty string, got {spec!r}")
    if spec == "digits":
        dataset = dataclasses.replace(load_npz(DIGITS_PATH), name="digits", image_shape=(1, 8, 8))
    elif spec.startswith("synthetic:"):
        dataset = _synthetic(spec, seed=seed)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            found = (f"{path.resolve()} is a folder: a Parquet folder is opened with "
                     f"ps_models.parquet.ParquetDataset, not load_dataset" if path.is_dir()
                     else f"no file at {path.resolve()}, nor a Parquet folder")
            raise DatasetError(
                f"unknown dataset spec {spec!r}: expected 'digits', "
                f"'synthetic:<{'|'.join(_SYNTHETIC)}>[?key=value&...]', the path of an "
                f"existing .npz file, or a Parquet folder holding train/ and test/ ({found})")
        dataset = load_npz(path)
    return dataset if model is None else reshape_for(dataset, model)


def load_npz(path: str | Path) -> Dataset:
    """Read and validate a dataset file in the documented .npz format."""
    path = Path(path)
    where = str(path)
    _check_npz_header(path, where)
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DatasetError(f"{where}: no such file") from None
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{where}: not a readable .npz archive ({exc})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetError(f"{where}: holds a single array, not an .npz archive of "
                           f"{', '.join(REQUIRED_ARRAYS)}")
    with archive:
        found = sorted(archive.files)
        inputs = _input_arrays(archive.files)
        unpaired = [f for f in archive.files if f.endswith(("_train", "_test")) and f not in ("y_train", "y_test")
                    and f.rsplit("_", 1)[0] not in inputs]
        partners = [f[:-len("_train")] + "_test" if f.endswith("_train") else f[:-len("_test")] + "_train"
                    for f in unpaired]
        missing = sorted({*(n for n in ("y_train", "y_test") if n not in archive.files), *partners,
                          *([] if inputs or unpaired else ["x_train", "x_test"])})
        if missing:
            raise DatasetError(
                f"{where}: missing array{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)} "
                f"(required: y_train, y_test, and x_train and x_test for the model's input, or NAME_train and "
                f"NAME_test for each input NAME; found: {', '.join(found) or 'none'})")
        try:
            arrays = {name: archive[name] for name in archive.files
                      if name in ("y_train", "y_test", *OPTIONAL_ARRAYS) or name.rsplit("_", 1)[0] in inputs}
        except ValueError as exc:  # object arrays need pickle, which is refused
            raise DatasetError(f"{where}: an array could not be read without pickle "
                               f"({exc}); store plain numeric arrays") from exc
    return _validated(where, path.stem, arrays, inputs)


def _check_npz_header(path: Path, where: str) -> None:
    """DatasetError unless `path` starts like a .npz (a zip) or a .npy: an empty file, or any other (text, Parquet,
    a pickle), is refused by name before numpy would try it as a pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise DatasetError(f"{where}: no such file") from None
    except OSError as exc:
        raise DatasetError(f"{where}: not a readable .npz archive ({exc})") from exc
    if not head:
        raise DatasetError(f"{where}: empty file (0 bytes), not a .npz archive")
    if head.startswith(_ZIP_MAGIC) or head.startswith(_NPY_MAGIC):
        return   # np.load reads it, or says what is wrong with it
    message = (f"{where} is not a .npz (zip) archive (it starts with {head!r}; a .npz is written by "
               f"numpy.savez or numpy.savez_compressed)")
    if path.suffix.lower() == ".parquet" or head.startswith(_PARQUET_MAGIC):
        message += (f"; {path.name} is a Parquet file: pass the folder holding train/ and test/ "
                    f"(docs/data-format.md)")
    raise DatasetError(message)


def _as_float32(where: str, name: str, x: np.ndarray) -> np.ndarray:
    """Floating array `name` cast to float32; DatasetError naming the first row holding NaN or infinity, or a
    finite value too large for float32 (which the cast would turn into infinity)."""
    bad = ~np.isfinite(x)
    if bad.any():
        raise DatasetError(f"{where}: {name} holds NaN or infinite values (row {int(np.argwhere(bad)[0][0])})")
    del bad
    if x.size and np.finfo(x.dtype).max > _FLOAT32_MAX:
        largest = max(abs(x.max()), abs(x.min()))   # no temporary as large as x
        if largest > _FLOAT32_MAX:
            row = int(np.argwhere(np.abs(x) > _FLOAT32_MAX)[0][0])
            raise DatasetError(
                f"{where}: {name} row {row} has values beyond float32's range (largest magnitude "
                f"{np.format_float_scientific(largest, precision=6, trim='-')}); float32 holds magnitudes up to "
                f"{_FLOAT32_MAX:.6g}: rescale them")
    return x.astype(np.float32)


def _input_arrays(files: Iterable[str]) -> list[str]:
    """The input prefixes of an archive: every NAME with both NAME_train and NAME_test (NAME not y)."""
    files = set(files)
    return sorted(f[:-len("_train")] for f in files if f.endswith("_train") and f != "y_train"
                  and f[:-len("_train")] + "_test" in files)


def _checked_input(where: str, prefix: str, train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One input's arrays: one row per example, the same trailing shape, float32 finite features, int64 ids or
    bool masks."""
    for split, x in (("train", train), ("test", test)):
        if x.ndim < 1:
            raise DatasetError(f"{where}: {prefix}_{split} has shape {x.shape}; it needs one row per example on "
                               "axis 0")
    if prefix == "x" and (train.ndim < 2 or test.ndim < 2):
        bad = "train" if train.ndim < 2 else "test"
        raise DatasetError(f"{where}: x_{bad} has shape {(train if bad == 'train' else test).shape}; it needs one "
                           f"row per example on axis 0 and features after it (ndim >= 2)")
    for split, x in (("train", train), ("test", test)):
        if len(x) == 0:
            raise DatasetError(f"{where}: {prefix}_{split} has no rows (shape {x.shape})")
    if train.shape[1:] != test.shape[1:]:
        raise DatasetError(f"{where}: {prefix}_train has shape {train.shape} and {prefix}_test {test.shape}; they "
                           f"must agree after the first axis")
    kinds = {train.dtype.kind, test.dtype.kind}
    if kinds <= {"f"}:
        train, test = _as_float32(where, f"{prefix}_train", train), _as_float32(where, f"{prefix}_test", test)
    elif kinds <= {"i", "u"}:
        train, test = train.astype(np.int64), test.astype(np.int64)
        if prefix == "x" and min(train.min(), test.min()) < 0:
            raise DatasetError(f"{where}: integer ids in x_train/x_test must be >= 0")
    elif kinds == {"b"}:
        pass   # masks
    else:
        raise DatasetError(f"{where}: {prefix}_train is {train.dtype} and {prefix}_test {test.dtype}; both must be "
                           f"floating (features), both integer (ids) or both bool (masks)")
    return train, test


def _validated(where: str, name: str, arrays: dict[str, np.ndarray], inputs: Sequence[str] = ("x",)) -> Dataset:
    y_train, y_test = arrays["y_train"], arrays["y_test"]
    train, test = {}, {}
    for prefix in inputs:
        x_train, x_test = _checked_input(where, prefix, arrays[f"{prefix}_train"], arrays[f"{prefix}_test"])
        for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            if y.ndim == 0 or len(y) != len(x):
                raise DatasetError(f"{where}: {prefix}_{split} has shape {x.shape} but y_{split} has "
                                   f"shape {y.shape}; they need the same number of rows")
        train[prefix], test[prefix] = x_train, x_test

    y_kinds = {y_train.dtype.kind, y_test.dtype.kind}
    if y_kinds <= {"i", "u"}:
        if y_train.shape[1:] != y_test.shape[1:]:   # a label per example, or per position (a segmentation map)
            raise DatasetError(f"{where}: integer labels y_train have shape {y_train.shape} and y_test "
                               f"{y_test.shape}: they must agree after the first axis (a label per example, or "
                               f"one per position of each example)")
        for split, y in (("train", y_train), ("test", y_test)):
            if y.min() < 0:
                raise DatasetError(f"{where}: y_{split} has a negative label {int(y.min())}")
        y_train, y_test = y_train.astype(np.int64), y_test.astype(np.int64)
        largest = int(max(y_train.max(), y_test.max()))
        num_classes = largest + 1
        if "num_classes" in arrays:
            declared = arrays["num_classes"]
            if declared.shape != () or declared.dtype.kind not in "iu":
                raise DatasetError(f"{where}: num_classes must be a 0-d integer array, got "
                                   f"shape {declared.shape} dtype {declared.dtype}")
            if int(declared) <= largest:
                raise DatasetError(f"{where}: num_classes is {int(declared)} but a label is "
                                   f"{largest}")
            num_classes = int(declared)
        if num_classes < 2:
            raise DatasetError(f"{where}: labels hold a single class ({largest}); "
                               f"classification needs at least 2")
    elif y_kinds <= {"f"}:
        y_train = _as_float32(where, "y_train", y_train).reshape(len(y_train), -1)
        y_test = _as_float32(where, "y_test", y_test).reshape(len(y_test), -1)
        if y_train.shape[1:] != y_test.shape[1:]:
            raise DatasetError(f"{where}: y_train has shape {y_train.shape} and y_test "
                               f"{y_test.shape}; regression targets must agree in width")
        num_classes = 0
    else:
        raise DatasetError(f"{where}: y_train is {y_train.dtype} and y_test {y_test.dtype}; "
                           f"use integers (class labels) or floats (regression targets)")

    if "x" in train:   # the one-input form: x_train and x_test feed the input input_name names
        default_input = "ids" if train["x"].dtype == np.int64 else "x"
        input_name = default_input
        if "input_name" in arrays:
            raw = arrays["input_name"]
            if raw.shape != () or raw.dtype.kind not in "US":
                raise DatasetError(f"{where}: input_name must be a 0-d string array, got shape "
                                   f"{raw.shape} dtype {raw.dtype}")
            value = raw.item()
            input_name = value.decode() if isinstance(value, bytes) else str(value)
            if not input_name:
                raise DatasetError(f"{where}: input_name is empty")
        if input_name != "x" and input_name in train:
            raise DatasetError(f"{where}: x_train feeds input {input_name!r}, and {input_name}_train does too")
        train[input_name], test[input_name] = train.pop("x"), test.pop("x")
    image_shape = None
    if len(train) == 1:
        x_train = next(iter(train.values()))
        if x_train.ndim == 4:
            image_shape = tuple(int(d) for d in x_train.shape[1:])
        elif x_train.ndim == 3:
            image_shape = (1, *(int(d) for d in x_train.shape[1:]))
    return Dataset(name, train, y_train, test, y_test, num_classes=num_classes, image_shape=image_shape)


# --- synthetic generators -----------------------------------------------------------------

# kind -> {parameter: (type, default)}
_SYNTHETIC: dict[str, dict[str, tuple[type, float | int]]] = {
    "classification": {"n": (int, 2000), "features": (int, 64), "classes": (int, 10),
                       "noise": (float, 1.0), "test": (float, 0.2)},
    "regression": {"n": (int, 2000), "features": (int, 16), "outputs": (int, 1),
                   "noise": (float, 0.1), "test": (float, 0.2)},
    "ids": {"n": (int, 2000), "vocab": (int, 1000), "bag": (int, 8), "classes": (int, 2),
            "signal": (float, 0.7), "test": (float, 0.2), "hot": (int, 0)},
    "clicks": {"n": (int, 50000), "fields": (int, 10), "vocab": (int, 1000), "rank": (int, 4),
               "signal": (float, 2.0), "skew": (float, 1.3), "test": (float, 0.2), "hashed": (int, 0)},
}


def _parse_synthetic(spec: str) -> tuple[str, dict[str, float | int]]:
    body = spec[len("synthetic:"):]
    kind, _, query = body.partition("?")
    if kind not in _SYNTHETIC:
        raise DatasetError(f"dataset spec {spec!r}: unknown synthetic kind {kind!r}; "
                           f"expected one of {', '.join(_SYNTHETIC)}")
    schema = _SYNTHETIC[kind]
    params: dict[str, float | int] = {key: default for key, (_, default) in schema.items()}
    seen: set[str] = set()
    for item in filter(None, query.split("&")):
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise DatasetError(f"dataset spec {spec!r}: {item!r} is not key=value")
        if key not in schema:
            raise DatasetError(f"dataset spec {spec!r}: unknown parameter {key!r} for "
                               f"synthetic:{kind}; expected {', '.join(schema)}")
        if key in seen:
            raise DatasetError(f"dataset spec {spec!r}: parameter {key!r} given twice")
        seen.add(key)
        kind_of = schema[key][0]
        try:
            value = kind_of(text)
        except ValueError:
            raise DatasetError(f"dataset spec {spec!r}: {key}={text!r} is not "
                               f"{'an integer' if kind_of is int else 'a number'}") from None
        if kind_of is float and not math.isfinite(value):
            raise DatasetError(f"dataset spec {spec!r}: {key}={text!r} is not finite")
        params[key] = value
    _check_synthetic(spec, kind, params)
    return kind, params


def _check_synthetic(spec: str, kind: str, p: dict[str, float | int]) -> None:
    def fail(reason: str) -> DatasetError:
        return DatasetError(f"dataset spec {spec!r}: {reason}")

    if not 0.0 < p["test"] < 1.0:
        raise fail(f"test={p['test']} must be a fraction strictly between 0 and 1")
    need, limit = _synthetic_bytes(kind, p), _memory_limit()
    if need > limit[0]:
        sizes = ", ".join(f"{key}={p[key]}" for key in _SYNTHETIC_SIZES[kind])
        raise fail(f"{sizes} would take about {_bytes_text(need)} ({need:,} bytes) to generate, more than "
                   f"{limit[1]} ({_bytes_text(limit[0])}); use a smaller n or sizes (a Parquet folder is "
                   f"streamed, for data that does not fit in memory)")
    n_test = round(p["n"] * p["test"])
    if p["n"] < 2 or n_test < 1 or n_test >= p["n"]:
        raise fail(f"n={p['n']} with test={p['test']} leaves an empty train or test split")
    for key in ("features", "outputs", "vocab", "bag", "fields", "rank"):
        if key in p and p[key] < 1:
            raise fail(f"{key}={p[key]} must be at least 1")
    if "classes" in p and p["classes"] < 2:
        raise fail(f"classes={p['classes']} must be at least 2")
    if "noise" in p and p["noise"] < 0:
        raise fail(f"noise={p['noise']} must be >= 0")
    if kind == "ids":
        if not 0.0 <= p["signal"] <= 1.0:
            raise fail(f"signal={p['signal']} must lie in [0, 1]")
        if p["hot"] < 0 or p["hot"] > p["vocab"] or (p["hot"] and p["hot"] < p["classes"]):
            raise fail(f"hot={p['hot']} must be 0 (every id) or in [classes={p['classes']}, vocab={p['vocab']}]")
        if p["vocab"] < p["classes"]:
            raise fail(f"vocab={p['vocab']} is smaller than classes={p['classes']}")
    if kind == "clicks":
        if p["fields"] < 2:
            raise fail(f"fields={p['fields']} must be at least 2 (the signal is pairwise)")
        if p["signal"] < 0 or p["skew"] < 0:
            raise fail(f"signal={p['signal']} and skew={p['skew']} must be >= 0")
        if p["hashed"] not in (0, 1):
            raise fail(f"hashed={p['hashed']} must be 0 (row ids) or 1 (hashed int64 keys)")


#: The parameters a synthetic kind's memory grows with (`_synthetic_bytes`).
_SYNTHETIC_SIZES = {"classification": ("n", "features"), "regression": ("n", "features", "outputs"),
                    "ids": ("n", "vocab", "bag"), "clicks": ("n", "fields", "vocab", "rank")}


def _synthetic_bytes(kind: str, p: Mapping[str, float | int]) -> int:
    """About the peak bytes `_synthetic` allocates for these parameters (the arrays it keeps and its float64
    working copies), computed before anything is allocated."""
    n = max(int(p["n"]), 0)
    size = {key: max(int(p[key]), 0) for key in _SYNTHETIC_SIZES[kind]}
    if kind == "classification":
        return n * (size["features"] * 18 + 32)
    if kind == "regression":
        return n * (size["features"] * 12 + size["outputs"] * 24 + 16)
    if kind == "ids":   # hot=K draws K of the vocab (a permutation of it when K is a large share), else maps all
        return n * (size["bag"] * 24 + 32) + (size["vocab"] * 8 + int(p["hot"]) * 32 if p["hot"] else
                                              size["vocab"] * 20)
    fields, rank, vocab = size["fields"], size["rank"], size["vocab"]
    return n * fields * (rank * 16 + 32) + n * (rank * 24 + 64) + fields * vocab * (rank * 8 + 24) + vocab * 24


def _memory_limit() -> tuple[int, str]:
    """(bytes, what they are): the memory of this machine, or of this process's cgroup when less; a fixed
    bound when neither can be read."""
    found: list[tuple[int, str]] = []
    try:
        found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"))
    except (AttributeError, ValueError, OSError):
        pass
    for cgroup in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(cgroup).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            found.append((int(text), f"this process's memory limit ({cgroup})"))
    found = [(size, what) for size, what in found if size > 0]
    return min(found) if found else (SYNTHETIC_FALLBACK_MAX_BYTES, "the bound on synthetic data")


def _bytes_text(count: int) -> str:
    """`count` bytes in the largest binary unit below it, one decimal cut ("1.5 GiB"); integer arithmetic, so a
    count too large for a float is still written."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    step = min(max(count.bit_length() - 1, 0) // 10, len(units) - 1)
    if step == 0:
        return f"{count} bytes"
    whole, part = divmod(count * 10 // (1 << (10 * step)), 10)
    return f"{whole}.{part} {units[step]}"


def _synthetic(spec: str, *, seed: int) -> Dataset:
    kind, p = _parse_synthetic(spec)
    rng = np.random.default_rng(seed)
    n = int(p["n"])
    n_test = round(n * p["test"])
    input_name, num_classes = "x", 0
    if kind == "classification":
        classes, features = int(p["classes"]), int(p["features"])
        centers = rng.normal(0.0, 1.0, size=(classes, features))
        y = rng.permutation(np.arange(n) % classes).astype(np.int64)
        x = (centers[y] + p["noise"] * rng.normal(size=(n, features))).astype(np.float32)
        num_classes = classes
    elif kind == "regression":
        features, outputs = int(p["features"]), int(p["outputs"])
        weights = rng.normal(0.0, 1.0 / math.sqrt(features), size=(features, outputs))
        x64 = rng.normal(size=(n, features))
        y = (x64 @ weights + p["noise"] * rng.normal(size=(n, outputs))).astype(np.float32)
        x = x64.astype(np.float32)
    elif kind == "clicks":
        x, y, _ = _clicks(p, rng)
        if p["hashed"]:
            x = hash_ids(x)
        input_name, num_classes = "ids", 2
    elif p["hot"]:  # ids drawn from `hot` ids spread over [0, vocab): a huge table, a learnable signal
        vocab, bag, classes, hot = int(p["vocab"]), int(p["bag"]), int(p["classes"]), int(p["hot"])
        pool = np.sort(rng.choice(vocab, size=hot, replace=False)).astype(np.int64)
        token_class = rng.permutation(np.arange(hot) % classes)
        by_class = [pool[token_class == c] for c in range(classes)]
        y = rng.permutation(np.arange(n) % classes).astype(np.int64)
        x = pool[rng.integers(0, hot, size=(n, bag))]
        informative = rng.random(size=(n, bag)) < p["signal"]
        for c in range(classes):
            rows, cols = np.nonzero(informative & (y == c)[:, None])
            x[rows, cols] = rng.choice(by_class[c], size=len(rows))
        input_name, num_classes = "ids", classes
    else:  # ids: each token leans to one class; a bag mixes its class's tokens with noise
        vocab, bag, classes = int(p["vocab"]), int(p["bag"]), int(p["classes"])
        token_class = rng.permutation(np.arange(vocab) % classes)
        by_class = [np.flatnonzero(token_class == c) for c in range(classes)]
        y = rng.permutation(np.arange(n) % classes).astype(np.int64)
        x = rng.integers(0, vocab, size=(n, bag), dtype=np.int64)
        informative = rng.random(size=(n, bag)) < p["signal"]
        for c in range(classes):
            rows, cols = np.nonzero(informative & (y == c)[:, None])
            x[rows, cols] = rng.choice(by_class[c], size=len(rows))
        input_name, num_classes = "ids", classes
    cut = n - n_test
    return Dataset.of(spec, x[:cut], y[:cut], x[cut:], y[cut:], input_name=input_name, num_classes=num_classes)


def _clicks(p: dict[str, float | int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, labels, true logits) of synthetic:clicks; the draws `click_logits` documents, in that order."""
    n, fields, vocab, rank = int(p["n"]), int(p["fields"]), int(p["vocab"]), int(p["rank"])
    signal, pairs = float(p["signal"]), fields * (fields - 1) // 2
    popularity = np.arange(1, vocab + 1, dtype=np.float64) ** -float(p["skew"])
    popularity /= popularity.sum()
    # field f's id of popularity rank r is f * vocab + order[f, r]: the popular ids spread over the field's range
    order = np.stack([rng.permutation(vocab) for _ in range(fields)])
    x = np.stack([f * vocab + order[f, rng.choice(vocab, size=n, p=popularity)] for f in range(fields)],
                 axis=1).astype(np.int64)
    linear = rng.normal(0.0, signal / 2 / math.sqrt(fields), size=fields * vocab)
    factors = rng.normal(0.0, (signal ** 2 / (pairs * rank)) ** 0.25, size=(fields * vocab, rank))
    v = factors[x]                                           # (n, fields, rank)
    pairwise = 0.5 * ((v.sum(axis=1) ** 2) - (v ** 2).sum(axis=1)).sum(axis=1)
    logits = linear[x].sum(axis=1) + pairwise
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    return x, y, logits


#: The mix of `hash_ids`: splitmix64's finalizer (Steele, Lea and Flood 2014) after adding this salt.
HASH_SALT = 0x5DEECE66D2B7E151
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def hash_ids(ids: np.ndarray) -> np.ndarray:
    """Each id mapped to an int64 key spread over the whole int64 range, as a recommender's hashed feature ids.

    ``splitmix64(id + HASH_SALT)`` viewed as int64: a bijection of 64-bit values (distinct ids stay
    distinct), fixed (no seed), so train and test, and every worker, map an id alike. Used by
    ``synthetic:clicks?hashed=1``; the keys are far beyond any table's rows, so only a dynamic
    table (docs/protocol.md, "Dynamic tables") can hold them.
    """
    z = np.asarray(ids, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(HASH_SALT) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    return z.view(np.int64)


def click_logits(spec: str, *, seed: int = 0) -> np.ndarray:
    """The true logits of every example of a ``synthetic:clicks`` spec, train rows then test rows.

    The data: ``fields`` categorical fields, each with its own ``vocab`` ids; field f's ids
    are the global ids ``[f * vocab, (f + 1) * vocab)``, so one table of ``fields * vocab``
    rows serves every field and the model input is the (n, fields) int64 ``ids`` with no
    offsets computed in the graph. Each field's ids are drawn with Zipf popularity
    ``rank ** -skew`` (the popular ids scattered over the field's range). The label is 1 with
    probability ``sigmoid(logit)``, where the logit is a factorization machine's:
    ``sum_f w[id_f] + sum_{f<g} <v[id_f], v[id_g]>``, with ``w ~ N(0, signal^2 / (4 fields))``
    (the first-order part has standard deviation ``signal / 2``) and ``v`` of width
    ``rank`` with entries ``N(0, s^2)``, ``s^4 = signal^2 / (rank * fields (fields - 1) / 2)``
    (the pairwise part has standard deviation ``signal``). No bias: about half the labels
    are 1. These logits rank the examples as well as anything can: their AUC against the
    labels is the data's Bayes AUC (docs/models.md, "Recommendation example").
    """
    kind, p = _parse_synthetic(spec)
    if kind != "clicks":
        raise DatasetError(f"dataset spec {spec!r}: click_logits needs synthetic:clicks, got synthetic:{kind}")
    return _clicks(p, np.random.default_rng(seed))[2]


# --- layouts ------------------------------------------------------------------------------

def reshape_for(dataset: Dataset, model: str) -> Dataset:
    """`dataset` laid out for the bundled model `model` (input name and feature shape).

    mlp: float (n, features), image axes flattened. lenet: float (n, C, H, W), needing
    images (an `image_shape`). embedding/transformer: int64 ids (n, bag) fed to "ids".
    """
    ds = dataset
    if len(ds.train) != 1:
        raise DatasetError(f"dataset {ds.name!r} feeds {len(ds.train)} inputs {ds.input_names}; the bundled model "
                           f"{model!r} takes one")
    if model in ("mlp", "deep_mlp"):
        if ds.x_train.dtype.kind != "f":
            raise DatasetError(f"dataset {ds.name!r} holds integer ids; model {model!r} needs "
                               f"float features")
        return Dataset.of(ds.name, ds.x_train.reshape(ds.num_train, -1), ds.y_train,
                          ds.x_test.reshape(ds.num_test, -1), ds.y_test, input_name="x",
                          num_classes=ds.num_classes, image_shape=ds.image_shape)
    if model == "lenet":
        if ds.x_train.dtype.kind != "f" or ds.image_shape is None:
            raise DatasetError(
                f"dataset {ds.name!r} (features {ds.feature_shape}, {ds.x_train.dtype}) has "
                f"no image shape; model 'lenet' needs float images: store x as "
                f"(n, C, H, W) or (n, H, W)")
        shape = ds.image_shape
        return Dataset.of(ds.name, ds.x_train.reshape(ds.num_train, *shape), ds.y_train,
                          ds.x_test.reshape(ds.num_test, *shape), ds.y_test, input_name="x",
                          num_classes=ds.num_classes, image_shape=ds.image_shape)
    if model in ("embedding", "transformer"):
        if ds.x_train.dtype != np.int64 or ds.x_train.ndim != 2:
            raise DatasetError(f"dataset {ds.name!r} (features {ds.feature_shape}, "
                               f"{ds.x_train.dtype}) is not int64 ids of shape (n, bag); "
                               f"model {model!r} needs those")
        return Dataset.of(ds.name, ds.x_train, ds.y_train, ds.x_test, ds.y_test, input_name="ids",
                          num_classes=ds.num_classes, image_shape=ds.image_shape)
    raise DatasetError(f"unknown model {model!r}; expected one of mlp, deep_mlp, lenet, embedding, "
                       f"transformer")


# --- sharding and batching ----------------------------------------------------------------

def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def worker_shard(dataset: Dataset, worker_index: int, num_workers: int) -> Dataset:
    """The training share of worker `worker_index` of `num_workers`.

    Strided: worker i gets train rows i, i + k, i + 2k, ... (k = num_workers), so shards are
    disjoint, cover the train split, differ in size by at most one, and keep the split's
    class mix. The test split is left whole (every worker evaluates on all of it).
    """
    k = _check_int("num_workers", num_workers, minimum=1)
    i = _check_int("worker_index", worker_index, minimum=0)
    if i >= k:
        raise ValueError(f"worker_index {i} is out of range for num_workers {k} "
                         f"(valid: 0..{k - 1})")
    if k > dataset.num_train:
        raise ValueError(f"num_workers {k} exceeds the {dataset.num_train} training examples "
                         f"of dataset {dataset.name!r}; a worker would get none")
    rows = np.arange(i, dataset.num_train, k)
    return dataclasses.replace(dataset, name=f"{dataset.name}[worker {i} of {k}]",
                               train={n: x[rows] for n, x in dataset.train.items()}, y_train=dataset.y_train[rows])


def num_batches(num_examples: int, batch_size: int, *, remainder: Remainder = "wrap") -> int:
    """How many batches `iterate_batches` yields per epoch for these sizes."""
    n = _check_int("num_examples", num_examples, minimum=1)
    b = _check_int("batch_size", batch_size, minimum=1)
    if remainder == "wrap":
        return -(-n // b)
    if remainder == "drop":
        return n // b
    raise ValueError(f"remainder must be 'wrap' or 'drop', got {remainder!r}")


def iterate_batches(x: np.ndarray | Mapping[str, np.ndarray], y: np.ndarray, batch_size: int, *, seed: int,
                    epoch: int, remainder: Remainder = "wrap") -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Fixed-size (x, y) batches over one epoch, shuffled by (seed, epoch); `x` an array, or arrays by input name
    (then each batch's x is such a dict).

    Every batch has exactly `batch_size` rows, since the gradient graph has a fixed batch
    size. The order is a permutation drawn from (seed, epoch), so a run is reproducible and
    each epoch differs. With remainder="wrap" (the default) the last, short batch is filled
    up with the first examples of the same epoch's permutation, so every example is seen at
    least once per epoch (ceil(n / batch_size) batches; if n < batch_size, examples repeat
    within the one batch). With remainder="drop" the short batch is left out (n // batch_size
    batches), and ValueError is raised if that leaves none.
    """
    rows_of = {n: len(a) for n, a in x.items()} if isinstance(x, Mapping) else {"x": len(x)}
    if any(n != len(y) for n in rows_of.values()):
        counts = sorted(set(rows_of.values()))
        raise ValueError(f"x has {counts[0] if len(counts) == 1 else counts} rows but y has {len(y)}")
    if len(y) == 0:
        raise ValueError("cannot batch an empty dataset (0 rows)")
    s = _check_int("seed", seed, minimum=0)
    e = _check_int("epoch", epoch, minimum=0)
    count = num_batches(len(y), batch_size, remainder=remainder)
    if count == 0:
        raise ValueError(f"remainder='drop' with batch_size {batch_size} leaves no batch of "
                         f"{len(y)} examples; use remainder='wrap' or a smaller batch")
    order = np.random.default_rng([s, e]).permutation(len(y))
    if remainder == "wrap":
        order = np.resize(order, count * batch_size)
    return _batches(x, y, order[:count * batch_size].reshape(count, batch_size))


def _batches(x: np.ndarray | Mapping[str, np.ndarray], y: np.ndarray,
             rows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    # a separate generator so that iterate_batches validates when called, not when iterated
    for batch in rows:
        yield ({n: a[batch] for n, a in x.items()} if isinstance(x, Mapping) else x[batch]), y[batch]
