"""Checks that a model, its data and the job's settings fit together, before any process starts or connects.

`check_fit` compares what the gradient engine will take (its inputs and labels, at the
job's batch size) with what the dataset holds and with each worker's share of it, and
raises a catalog error whose one-line message names the file, the value and the fix.
`ps-launch` runs it before it starts a shard (`prepare`), `ps-worker` before it joins the
shards, so a job that cannot train never starts a process or reaches a shard.

Without these checks the same mistakes surfaced late and differently on each worker: a
label the model has no class for ended one worker with "labels must lie in [0, 10)" and
worker 0 with a raw IndexError from its evaluation; float targets with cross_entropy gave
"cannot reshape array of size 359 into shape (359,10)"; a batch larger than a worker's
share trained on repeated examples and exited 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ps_common.errors import DatasetError, JobConfigError
from ps_models.builders import BUILDERS, write_model
from ps_models.datasets import Dataset, load_dataset
from ps_models.parquet import DEFAULT_SHUFFLE_ROWS, LABEL_COLUMN, ParquetDataset, is_parquet_folder
from worker_client.engine import GradientEngine
from worker_client.engine.load import read_model

__all__ = ["Prepared", "check_fit", "prepare", "resolve_model", "smallest_share", "sparse_summary"]

#: Models whose data layout ps_models.datasets.reshape_for knows.
_LAYOUTS = frozenset(BUILDERS)


def smallest_share(num_train: int, workers: int) -> int:
    """Training examples of the smallest worker share (the split is strided: shares differ by at most one)."""
    return num_train // max(1, workers)


def _shape(dims: tuple[int | str | None, ...]) -> str:
    shown = [str(d) if isinstance(d, int) else (d or "?") for d in dims]
    return "(" + ", ".join(shown) + ("," if len(shown) == 1 else "") + ")"


def _fits(declared: tuple[int | str | None, ...], actual: tuple[int, ...]) -> bool:
    """True when `actual` matches `declared` (an axis of any length, a name or None, matches every length)."""
    return len(declared) == len(actual) and all(not isinstance(d, int) or d == a for d, a in zip(declared, actual))


def check_fit(engine: GradientEngine, dataset: Dataset | ParquetDataset, *, model: str, data: str, loss: str,
              batch_size: int, workers: int) -> Dataset | ParquetDataset:
    """The data as the model takes it (a one-input dataset's input renamed to a one-input model's), after checking
    they fit; DatasetError (the data does not fit the model) or JobConfigError (a setting does not fit the data).

    `model` and `data` are the names the user gave (path or bundled name, data spec), used
    in the messages. Checks, in order: every model input is fed (by name; a one-input model
    takes a one-input dataset whatever the names), each input's dtype and shape per example,
    the labels against the loss (class labels in range of the model's classes for
    cross_entropy, 0 or 1 and one logit for bce, targets of the model's output width for
    mse), and the batch size against the smallest worker share. A Parquet dataset is checked
    by its schema and the first rows of every file (ps_models.parquet).
    """
    wanted = dict(engine.data_inputs)
    if isinstance(dataset, ParquetDataset):
        _bind_parquet(engine, dataset, wanted, model=model, data=data, loss=loss)
    else:
        dataset = _fit_arrays(engine, dataset, wanted, model=model, data=data)
        _check_labels(engine, dataset, model=model, data=data, loss=loss)
    share = smallest_share(dataset.num_train, workers)
    if batch_size > share:
        raise JobConfigError(
            f"Invalid [worker] batch_size (--batch-size): {batch_size}: larger than a worker's share of the training "
            f"data ({data} has {dataset.num_train} training examples, {share} per worker with {workers} worker(s)), "
            f"so every batch would repeat examples: use --batch-size {share} or less, or fewer workers")
    return dataset


def _fit_arrays(engine: GradientEngine, dataset: Dataset, wanted: dict, *, model: str, data: str) -> Dataset:
    have = dataset.input_specs()
    if len(wanted) == 1 and len(have) == 1 and set(wanted) != set(have):   # one input each: fed whatever its name
        (name,), (old,) = wanted, have
        dataset = dataclasses.replace(dataset, train={name: dataset.train[old]}, test={name: dataset.test[old]})
        have = dataset.input_specs()
    missing = [n for n in wanted if n not in have]
    if missing:
        raise DatasetError(
            f"model {model} takes {len(wanted)} data input{'s' * (len(wanted) > 1)} "
            f"({', '.join(repr(n) for n in wanted)}), but data {data} provides only "
            f"{', '.join(repr(n) for n in have)}: input(s) {', '.join(repr(n) for n in missing)} would be missing; "
            f"store each input as NAME_train and NAME_test in the .npz (docs/data-format.md), or use a model "
            f"with those inputs")
    for name, (dtype, dims) in wanted.items():
        have_dtype, shape = have[name]
        if np.dtype(dtype).kind in "iu" and have_dtype.kind == "f":
            raise DatasetError(f"data {data} feeds input {name!r} floating-point values ({have_dtype}), but model "
                               f"{model} takes {np.dtype(dtype)} ids there: store integers")
        if dims is not None and not _fits(tuple(dims[1:]), shape):
            one = len(wanted) == 1
            raise DatasetError(f"data {data} has examples of shape {_shape(shape)}"
                               f"{'' if one else f' for input {name!r}'}, but model {model} takes input {name!r} "
                               f"of shape {_shape(tuple(dims[1:]))} per example: reshape "
                               f"{'x_train and x_test' if one else f'{name}_train and {name}_test'} to that, or use "
                               f"a model built for this data")
    return dataset


def _bind_parquet(engine: GradientEngine, dataset: ParquetDataset, wanted: dict, *, model: str, data: str,
                  loss: str) -> None:
    if loss == "cross_entropy":
        classes = engine.num_classes
        if classes is None:
            raise DatasetError(f"model {model}: cross_entropy on Parquet data needs logits of a known width")
        kind, count = "classes", classes
    elif loss == "bce":
        kind, count = "binary", 2
    else:
        kind, count = "targets", 0
    dataset.bind({n: (dtype, tuple(dims[1:]) if dims is not None else ()) for n, (dtype, dims) in wanted.items()},
                 label_kind=kind, num_classes=count)


def _check_labels(engine: GradientEngine, dataset: Dataset, *, model: str, data: str, loss: str) -> None:
    expected = dict(engine.feed_dims()).get("labels")
    if loss in ("bce", "cross_entropy") and expected is not None:
        # a label per example, or one per position (a segmentation map) or per logit (a multi-label output)
        wanted, have = tuple(expected[1:]), tuple(dataset.y_train.shape[1:])
        if not _fits(wanted, have) and not (not wanted and int(np.prod(have)) == 1):
            output = engine.output_names[0]
            each = "example" if not wanted else f"position of its output {output!r}" if loss == "cross_entropy" \
                else f"logit of its output {output!r}"
            raise DatasetError(f"data {data} has labels of shape {_shape(have)} per example, but model {model} with "
                               f"--loss {loss} takes {_shape(wanted) if wanted else 'one label'} per example (one "
                               f"label per {each}): store y_train and y_test with that shape, or use a model "
                               f"whose output fits the labels")
    low, high = dataset.label_range()
    if loss == "bce":
        if not ({low, high} <= {0.0, 1.0}) or not np.isin(np.unique(dataset.y_train), [0, 1]).all() or \
                not np.isin(np.unique(dataset.y_test), [0, 1]).all():
            bad = next(float(v) for v in np.concatenate([dataset.y_train.ravel(), dataset.y_test.ravel()])
                       if v not in (0, 1))
            raise DatasetError(f"data {data} has label {bad:g}, but --loss bce needs labels 0 or 1")
        return
    if loss == "cross_entropy":
        if not dataset.is_classification:
            raise DatasetError(f"data {data} holds floating-point targets (y_train is {dataset.y_train.dtype}: "
                               f"regression), but --loss cross_entropy needs integer class labels: store y_train and "
                               f"y_test as integers 0..C-1, or use --loss mse")
        classes = engine.num_classes
        largest = int(high)
        if classes is not None and largest >= classes:
            split = "y_train" if int(dataset.y_train.max()) == largest else "y_test"
            output = engine.output_names[0]
            raise DatasetError(f"data {data} has labels up to {largest} ({split}), but model {model} outputs "
                               f"{classes} classes (output {output!r} has width {classes}): labels must lie in "
                               f"0..{classes - 1}; relabel the data, or use a model with {largest + 1} outputs")
        return
    if loss == "mse" and expected is not None:
        wanted = expected[1:]
        width = tuple(dataset.y_train.shape[1:]) or (1,)
        if dataset.is_classification:
            raise DatasetError(f"data {data} holds integer class labels, but --loss mse needs floating-point "
                               f"targets of the model's output shape {_shape(wanted)}: use --loss "
                               f"cross_entropy, or store y_train and y_test as floats")
        if not _fits(wanted, width):
            raise DatasetError(f"data {data} has targets of shape {_shape(tuple(width))} per example, but model "
                               f"{model} outputs {_shape(wanted)} ({engine.output_names[0]!r}): store y_train and "
                               f"y_test with {_shape(wanted)} per example, or use a model with that many outputs")


@dataclass
class Prepared:
    """What a worker (or the launcher's check) built from the settings: the model file, engine and data."""

    model_path: Path
    kind: str | None
    engine: GradientEngine
    dataset: Dataset | ParquetDataset


def prepare(model_path: Path, kind: str | None, *, model: str, data: str, loss: str, batch_size: int, workers: int,
            seed: int, device: str = "cpu", include: list[str] | None = None, exclude: list[str] | None = None,
            expect_parameters: int | None = None, worker_index: int = 0,
            intra_op_threads: int | None = None, sparse_tables: list[str] | None = None,
            sparse_min_rows: int | None = None, sparse_min_bytes: int | None = None,
            dense_tables: list[str] | None = None, dynamic_tables: list[str] | None = None,
            label_column: str = LABEL_COLUMN, shuffle_rows: int = DEFAULT_SHUFFLE_ROWS) -> Prepared:
    """Loads the data and builds the engine (its gradient graph is cached on disk), then `check_fit`.

    Raises ModelLoadError, UnsupportedModelError, DeviceUnavailableError, DatasetError or
    JobConfigError, each naming what to fix.
    """
    if is_parquet_folder(data):
        dataset = ParquetDataset(data, label_column=label_column, shuffle_rows=shuffle_rows)
    else:
        dataset = load_dataset(data, seed=seed, model=kind)   # first: a missing file is named as such
        # settings of a Parquet stream, which other data would silently ignore
        for flag, value, default in (("--label-column", label_column, LABEL_COLUMN),
                                     ("--shuffle-rows", shuffle_rows, DEFAULT_SHUFFLE_ROWS)):
            if value != default:
                raise JobConfigError(f"Invalid {flag} {value!r}: it applies only to a folder of Parquet files, and "
                                     f"--data {data!r} is not one (an .npz holds its labels in y_train and y_test; "
                                     "digits and synthetic data have theirs built in): drop it")
    engine = GradientEngine(model_path, batch_size=batch_size, loss=loss, device=device, include=include or [],
                            exclude=exclude or [], expect_parameters=expect_parameters,
                            seed=(seed, worker_index),   # this worker's Dropout masks
                            intra_op_threads=intra_op_threads, sparse_tables=sparse_tables or [],
                            sparse_min_rows=sparse_min_rows, sparse_min_bytes=sparse_min_bytes or None,
                            dense_tables=dense_tables or [], dynamic_tables=dynamic_tables or [])
    dataset = check_fit(engine, dataset, model=model, data=data, loss=loss, batch_size=batch_size, workers=workers)
    return Prepared(model_path, kind, engine, dataset)


def sparse_summary(engine: GradientEngine) -> str | None:
    """The one line that says which tables train sparsely (None: none), e.g. for a worker's log and the launcher."""
    tables = engine.sparse.tables
    if not tables:
        return None
    shown = []
    for name, table in tables.items():
        nbytes = int(np.prod(table.shape)) * table.initial.dtype.itemsize
        shown.append(f"{name} {' x '.join(str(d) for d in table.shape)} ({nbytes / 1e6:.1f} MB"
                     f"{', dynamic' if table.dynamic else ''})")
    return (f"training {len(tables)} table(s) sparsely, each step moving only the rows its batch touches: "
            f"{', '.join(shown)}; --dense-tables NAME,... trains them whole")


def resolve_model(spec: str, workdir: Path) -> tuple[Path, str | None]:
    """(ONNX file, bundled model kind or None) for a path or a bundled model's name (written into workdir)."""
    path = Path(spec).expanduser()
    if path.is_file():
        model = read_model(path, external_data=False)
        kind = next((p.value for p in model.metadata_props if p.key == "model"), None)
        return path, kind if kind in _LAYOUTS else None
    if spec in BUILDERS:
        return write_model(spec, workdir / f"{spec}.onnx"), spec
    raise JobConfigError(f"Invalid [worker] model (--model): {spec!r}: no such file ({path.resolve()}) and not a "
                         f"bundled model ({', '.join(sorted(BUILDERS))})")
