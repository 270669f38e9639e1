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

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ps_common.errors import DatasetError, JobConfigError
from ps_models.builders import BUILDERS, write_model
from ps_models.datasets import Dataset, load_dataset
from worker_client.engine import GradientEngine
from worker_client.engine.load import read_model

__all__ = ["Prepared", "check_fit", "prepare", "resolve_model", "smallest_share"]

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


def check_fit(engine: GradientEngine, dataset: Dataset, *, model: str, data: str, loss: str, batch_size: int,
              workers: int) -> None:
    """Raises DatasetError (the data does not fit the model) or JobConfigError (a setting does not fit the data).

    `model` and `data` are the names the user gave (path or bundled name, data spec),
    used in the messages. Checks, in order: the input the data feeds, its feature
    shape, the labels against the loss (class labels for cross_entropy, in range of the
    model's classes; targets of the model's output width for mse), and the batch size
    against the smallest worker share.
    """
    dims = dict(engine.feed_dims())
    # a sparse table's Gathers read positions inputs shaped like the model's own index input (engine/sparse.py):
    # the data feeds that index input, which the session may not take at all (sparse.dropped_inputs)
    for table in engine.sparse.tables.values():
        for index, positions in table.positions.items():
            if positions in dims:
                dims.setdefault(index, dims.pop(positions))
    inputs = [n for n in [*engine.input_names, *engine.sparse.dropped_inputs] if n in dims]
    name = inputs[0] if len(inputs) == 1 else dataset.input_name
    if name not in dims:
        raise DatasetError(f"data {data} feeds the model input {dataset.input_name!r}, but model {model} takes "
                           f"{', '.join(repr(n) for n in inputs)}: store input_name in the .npz (docs/data-format.md) "
                           f"or rename the model's input")
    unfed = [n for n in inputs if n != name and n != "labels"]
    if unfed:
        raise DatasetError(f"model {model} takes {len(unfed) + 1} data inputs ({', '.join(repr(n) for n in inputs if n != 'labels')}), "
                           f"but data {data} provides only {name!r} (its features): input(s) "
                           f"{', '.join(repr(n) for n in unfed)} would be missing; give the model one data input, or "
                           f"data with an array for each input")
    expected = dims.get(name)
    features = dataset.feature_shape
    if expected is not None and not _fits(expected[1:], features):
        raise DatasetError(f"data {data} has examples of shape {_shape(features)}, but model {model} takes input "
                           f"{name!r} of shape {_shape(expected[1:])} per example: reshape x_train and "
                           f"x_test to that, or use a model built for this data")
    _check_labels(engine, dataset, dims, model=model, data=data, loss=loss)
    share = smallest_share(dataset.num_train, workers)
    if batch_size > share:
        raise JobConfigError(
            f"Invalid [worker] batch_size (--batch-size): {batch_size}: larger than a worker's share of the training "
            f"data ({data} has {dataset.num_train} training examples, {share} per worker with {workers} worker(s)), "
            f"so every batch would repeat examples: use --batch-size {share} or less, or fewer workers")


def _check_labels(engine: GradientEngine, dataset: Dataset,
                  dims: Mapping[str, tuple[int | str | None, ...] | None], *, model: str, data: str, loss: str) -> None:
    if loss == "cross_entropy":
        if not dataset.is_classification:
            raise DatasetError(f"data {data} holds floating-point targets (y_train is {dataset.y_train.dtype}: "
                               f"regression), but --loss cross_entropy needs integer class labels: store y_train and "
                               f"y_test as integers 0..C-1, or use --loss mse")
        classes = engine.num_classes
        largest = int(max(dataset.y_train.max(), dataset.y_test.max()))
        if classes is not None and largest >= classes:
            split = "y_train" if int(dataset.y_train.max()) == largest else "y_test"
            output = engine.output_names[0]
            raise DatasetError(f"data {data} has labels up to {largest} ({split}), but model {model} outputs "
                               f"{classes} classes (output {output!r} has width {classes}): labels must lie in "
                               f"0..{classes - 1}; relabel the data, or use a model with {largest + 1} outputs")
        return
    expected = dims.get("labels")
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
    dataset: Dataset


def prepare(model_path: Path, kind: str | None, *, model: str, data: str, loss: str, batch_size: int, workers: int,
            seed: int, device: str = "cpu", include: list[str] | None = None, exclude: list[str] | None = None,
            expect_parameters: int | None = None, worker_index: int = 0,
            intra_op_threads: int | None = None, sparse_tables: list[str] | None = None,
            sparse_min_rows: int | None = None, dynamic_tables: list[str] | None = None) -> Prepared:
    """Loads the data and builds the engine (its gradient graph is cached on disk), then `check_fit`.

    Raises ModelLoadError, UnsupportedModelError, DeviceUnavailableError, DatasetError or
    JobConfigError, each naming what to fix.
    """
    dataset = load_dataset(data, seed=seed, model=kind)
    engine = GradientEngine(model_path, batch_size=batch_size, loss=loss, device=device, include=include or [],
                            exclude=exclude or [], expect_parameters=expect_parameters,
                            seed=(seed, worker_index),   # this worker's Dropout masks
                            intra_op_threads=intra_op_threads, sparse_tables=sparse_tables or [],
                            sparse_min_rows=sparse_min_rows, dynamic_tables=dynamic_tables or [])
    check_fit(engine, dataset, model=model, data=data, loss=loss, batch_size=batch_size, workers=workers)
    return Prepared(model_path, kind, engine, dataset)


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
