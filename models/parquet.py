"""Parquet datasets, streamed: a folder with ``train/`` and ``test/`` Parquet files, read with pyarrow.

Layout (docs/data-format.md, "Parquet"): one column per model input -- a number for a
scalar input, a fixed-size list (or a list whose rows all have the input's length) for a
vector input, nested for more axes -- and the label in a column named ``label`` unless told
otherwise. Every file of a folder has the same schema.

What a worker holds at once is bounded, whatever the dataset's size: its shuffle buffer
(`shuffle_rows` rows), one row group being read, and one batch. It never reads a file
whole: it reads the row groups of its part, one at a time.

- **Parts.** The training rows of every file (in path order, row groups in file order) are
  one sequence; worker i of W reads the i-th of W contiguous, equal slices of it, so parts
  are disjoint, cover the split and differ by at most one row. A part is made of pieces:
  (file, row group, first row, last row).
- **Order.** Epoch e reads the part's pieces in an order drawn from (seed, e), cuts the rows
  into blocks of `shuffle_rows` and shuffles each block by (seed, e, block): a shuffle buffer
  whose window is the block. Batches are consecutive rows of that stream, across epochs.
- **Resuming.** The stream is a function of (seed, part): a worker that restarts at clock c
  (its pushes so far) resumes exactly at row c x batch of it -- its epoch, block and place in
  the block -- reading only the pieces from there: it neither skips nor repeats a row.
  When the number of workers changes, the parts change: a worker then continues at the
  same row of its new part, so rows around the change may be read twice or not at all in
  that epoch; the next epochs are whole.
- **Bad data** (a missing column, a type that is not the input's, ragged lists, NaN or
  infinity in a float input, a label out of range) raises DatasetError naming the file, the
  column, the row and the value: found before training by `check`, which reads every
  file's footer and the first rows of each; found while streaming when it is further on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ps_common.errors import DatasetError

__all__ = ["DEFAULT_SHUFFLE_ROWS", "LABEL_COLUMN", "Column", "ParquetDataset", "ParquetPart", "is_parquet_folder"]

#: The label column's name unless the job says otherwise.
LABEL_COLUMN = "label"
#: Rows of a worker's shuffle buffer (one block of the stream, shuffled whole).
DEFAULT_SHUFFLE_ROWS = 16384
#: Rows of each file read by `check` before training, for values (NaN, labels, ragged lists).
CHECK_ROWS = 1024
#: Rows read at a time from the test split.
TEST_READ_ROWS = 65536


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:   # pragma: no cover - a dependency
        raise DatasetError(f"reading Parquet needs pyarrow ({exc}): pip install pyarrow") from exc
    return pa, pq


def is_parquet_folder(spec: str) -> bool:
    """Whether `spec` names a folder (a Parquet dataset) rather than a file or a built-in dataset."""
    return Path(spec).expanduser().is_dir()


@dataclass(frozen=True)
class Column:
    """What one column holds per example: numpy dtype and shape (fixed-size lists give axes)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]   # None: a list axis whose length is known only from the rows


def _column_of(field) -> Column:
    """A schema field as a Column; DatasetError for a type that is not numbers or lists of numbers."""
    pa, _ = _pyarrow()
    kind = field.type
    shape: list[int | None] = []
    while pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        shape.append(kind.list_size if pa.types.is_fixed_size_list(kind) else None)
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise DatasetError(f"column {field.name!r} is {field.type}, not numbers or lists of numbers")
    return Column(field.name, np.dtype(kind.to_pandas_dtype()), tuple(shape))


@dataclass(frozen=True)
class _File:
    path: Path
    rows: tuple[int, ...]   # rows of each row group


@dataclass(frozen=True)
class _Piece:
    """Rows [start, stop) of one row group of one file."""

    file: int
    group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class _Split:
    """The files of one split (train/ or test/), their schema and row groups, checked when opened."""

    def __init__(self, folder: Path, where: str) -> None:
        _, pq = _pyarrow()
        if not folder.is_dir():
            raise DatasetError(f"{where}: no folder {folder.name}/ (a Parquet dataset holds train/ and test/ folders "
                               "of .parquet files)")
        paths = sorted(p for p in folder.rglob("*.parquet") if p.is_file())
        if not paths:
            raise DatasetError(f"{where}: {folder} holds no .parquet file")
        self.folder = folder
        self.files: list[_File] = []
        self.schema = None
        for path in paths:
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as exc:  # noqa: BLE001 -- pyarrow's ArrowInvalid, OSError: a corrupt or cut file
                raise DatasetError(f"{where}: {path} is not a readable Parquet file (corrupt or truncated?): "
                                   f"{type(exc).__name__}: {exc}") from exc
            schema = meta.schema.to_arrow_schema()
            if self.schema is None:
                self.schema, self.first = schema, path
            elif not schema.equals(self.schema):
                raise DatasetError(f"{where}: {path} has another schema than {self.first}: "
                                   f"{_schema_difference(self.schema, schema)}")
            self.files.append(_File(path, tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))))
        self.rows = sum(sum(f.rows) for f in self.files)
        if self.rows == 0:
            raise DatasetError(f"{where}: the files of {folder} hold no rows")

    def pieces(self, start: int, stop: int) -> list[_Piece]:
        """The pieces of rows [start, stop) of the split's row sequence."""
        out, offset = [], 0
        for i, f in enumerate(self.files):
            for g, n in enumerate(f.rows):
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    out.append(_Piece(i, g, lo - offset, hi - offset))
                offset += n
        return out


def _schema_difference(a, b) -> str:
    names_a, names_b = set(a.names), set(b.names)
    if names_a != names_b:
        return f"columns {sorted(names_b - names_a)} added and {sorted(names_a - names_b)} missing"
    for name in a.names:
        if a.field(name).type != b.field(name).type:
            return f"column {name!r} is {b.field(name).type}, not {a.field(name).type}"
    return "the column order differs"


class ParquetDataset:
    """A Parquet dataset folder (module docstring): its splits, columns and label; the loop reads it in parts.

    `inputs` maps each model input to the column feeding it (set by `bind`, which checks the
    columns against the model); `label` is the label column. Opening reads every file's
    footer only.
    """

    def __init__(self, root: str | Path, *, label_column: str = LABEL_COLUMN,
                 shuffle_rows: int = DEFAULT_SHUFFLE_ROWS) -> None:
        self.root = Path(root).expanduser()
        self.name = str(root)
        if shuffle_rows < 1:
            raise DatasetError(f"Invalid shuffle_rows: {shuffle_rows} (must be >= 1)")
        self.shuffle_rows = shuffle_rows
        self.train = _Split(self.root / "train", self.name)
        self.test = _Split(self.root / "test", self.name)
        if not self.test.schema.equals(self.train.schema):
            raise DatasetError(f"{self.name}: test file {self.test.first} has another schema than train file "
                               f"{self.train.first}: {_schema_difference(self.train.schema, self.test.schema)}")
        self.label_column = label_column
        if label_column not in self.train.schema.names:
            raise DatasetError(f"{self.name}: file {self.train.first} has no label column {label_column!r} (its "
                               f"columns: {', '.join(self.train.schema.names)}); name it with --label-column")
        self.columns = {}
        for field in self.train.schema:
            try:
                self.columns[field.name] = _column_of(field)
            except DatasetError as exc:
                self.columns[field.name] = exc   # an error only if a model input or the label reads it
        self.label = self._column(label_column, self.train.first)
        if self.label.shape:
            raise DatasetError(f"{self.name}: label column {label_column!r} of {self.train.first} holds lists; "
                               "it needs one number per row")
        self.inputs: dict[str, Column] = {}
        self.num_classes = 0   # set by bind from the loss: classes or 2 for bce
        self.label_kind = ""   # "classes", "binary" or "targets", set by bind

    def _column(self, name: str, where: Path) -> Column:
        found = self.columns.get(name)
        if found is None:
            raise DatasetError(f"{self.name}: file {where} has no column {name!r} (its columns: "
                               f"{', '.join(self.train.schema.names)})")
        if isinstance(found, DatasetError):
            raise DatasetError(f"{self.name}: file {where}: {found}")
        return found

    # --- checked against the model -----------------------------------------------------------

    def bind(self, inputs: Mapping[str, tuple[np.dtype, tuple]], *, label_kind: str, num_classes: int = 0) -> None:
        """Maps each model input (name -> (dtype, per-example dims, a name or None for an axis of any length)) to
        its column, checking names, dtypes and shapes, then reads the first rows of every file (`check`).

        `label_kind`: "classes" (integer labels in [0, num_classes)), "binary" (0 or 1) or
        "targets" (floats).
        """
        bound = {}
        for name, (dtype, dims) in inputs.items():
            column = self._column(name, self.train.first)
            want = np.dtype(dtype)
            if not _castable(column.dtype, want):
                raise DatasetError(f"{self.name}: column {name!r} of {self.train.first} is {column.dtype}, but the "
                                   f"model's input {name!r} takes {want}")
            if len(column.shape) != len(dims) and not (len(column.shape) == 0 and list(dims) == [1]):
                raise DatasetError(f"{self.name}: column {name!r} of {self.train.first} holds "
                                   f"{_shape_text(column.shape)} per row, but the model's input {name!r} takes "
                                   f"{_shape_text(dims)} per example")
            for got, need in zip(column.shape, dims):
                if isinstance(got, int) and isinstance(need, int) and got != need:
                    raise DatasetError(f"{self.name}: column {name!r} of {self.train.first} holds "
                                       f"{_shape_text(column.shape)} per row, but the model's input {name!r} takes "
                                       f"{_shape_text(dims)} per example")
            shape = tuple(need if isinstance(need, int) else got for got, need in zip(column.shape, dims)) \
                if column.shape else tuple(d for d in dims if isinstance(d, int))
            bound[name] = Column(name, want, shape)
        self.inputs = bound
        self.label_kind, self.num_classes = label_kind, num_classes
        if label_kind == "classes" and self.label.dtype.kind not in "iub":
            raise DatasetError(f"{self.name}: label column {self.label_column!r} of {self.train.first} is "
                               f"{self.label.dtype}: cross_entropy needs integer class labels")
        self.check()

    def check(self) -> None:
        """Reads the first CHECK_ROWS rows of every file and checks their values (DatasetError naming the file,
        the column, the row and the value)."""
        _, pq = _pyarrow()
        for split in (self.train, self.test):
            for f in split.files:
                try:
                    reader = pq.ParquetFile(f.path)
                    batch = next(reader.iter_batches(batch_size=CHECK_ROWS, columns=self._read_columns()), None)
                except Exception as exc:  # noqa: BLE001 -- pyarrow: a corrupt page
                    raise DatasetError(f"{self.name}: {f.path} cannot be read (corrupt?): {type(exc).__name__}: "
                                       f"{exc}") from exc
                if batch is not None:
                    self._arrays(batch, f.path, 0)

    def _read_columns(self) -> list[str]:
        return [*self.inputs, self.label_column]

    def _arrays(self, table, path: Path, first_row: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A record batch (or table) as the model's inputs and the labels, every value checked."""
        n = table.num_rows
        out = {}
        for name, column in self.inputs.items():
            out[name] = _values(table.column(name), column, n, path, first_row)
        labels = _values(table.column(self.label_column), Column(self.label_column, self.label.dtype, ()), n, path,
                         first_row)
        self._check_labels(labels, path, first_row)
        return out, labels

    def _check_labels(self, labels: np.ndarray, path: Path, first_row: int) -> None:
        kind = self.label_kind
        if kind == "targets":
            bad = ~np.isfinite(labels.astype(np.float64))
        elif kind == "binary":
            bad = (labels != 0) & (labels != 1)
        elif kind == "classes":
            bad = (labels < 0) | (labels >= self.num_classes) | (labels != np.floor(labels))
        else:
            return
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            want = {"binary": "0 or 1 (bce)", "classes": f"a class in 0..{self.num_classes - 1}",
                    "targets": "a finite number"}[kind]
            raise DatasetError(f"{self.name}: file {path}, column {self.label_column!r}, row {first_row + row}: "
                               f"label {labels[row].item()!r} is not {want}")

    # --- the loop's view -------------------------------------------------------------------

    @property
    def num_train(self) -> int:
        return self.train.rows

    @property
    def num_test(self) -> int:
        return self.test.rows

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def is_classification(self) -> bool:
        return self.label_kind in ("classes", "binary")

    def input_specs(self) -> dict[str, tuple[np.dtype, tuple]]:
        return {name: (c.dtype, c.shape) for name, c in self.inputs.items()}

    def describe(self) -> str:
        inputs = ", ".join(f"{name!r} {c.shape} {c.dtype}" for name, c in self.inputs.items())
        return (f"{self.name}: Parquet, train {self.num_train} rows in {len(self.train.files)} file(s), test "
                f"{self.num_test}, label {self.label_column!r}, inputs {inputs}")

    def part(self, index: int, workers: int) -> "ParquetPart":
        """Worker `index` of `workers`'s slice of the training rows (module docstring, "Parts")."""
        if not 0 <= index < workers:
            raise ValueError(f"worker_index {index} is out of range for num_workers {workers}")
        n = self.train.rows
        if workers > n:
            raise DatasetError(f"{self.name}: {workers} workers for {n} training rows: a worker would get none")
        lo, hi = index * n // workers, (index + 1) * n // workers
        return ParquetPart(self, self.train.pieces(lo, hi), hi - lo)

    def test_batches(self, size: int) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
        """The test split in file order, in batches of at most `size` rows: (inputs, labels), every value checked."""
        _, pq = _pyarrow()
        for f in self.test.files:
            row = 0
            for batch in pq.ParquetFile(f.path).iter_batches(batch_size=size, columns=self._read_columns()):
                inputs, labels = self._arrays(batch, f.path, row)
                row += batch.num_rows
                yield inputs, labels

    def read_piece(self, piece: _Piece) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """One piece's rows as arrays (reads its row group, the columns the model needs)."""
        pa, pq = _pyarrow()
        f = self.train.files[piece.file]
        try:
            # Decoded in this thread: pyarrow's default pool (mimalloc) keeps freed pages in the heap of the
            # thread that used them, so with the columns decoded on pyarrow's thread pool what the process kept
            # depended on which threads ran when. Reading 412 MB (tests/integration/test_parquet_memory.py), the
            # peak grew by 23-41 MB from run to run (the most under load); in this thread and with the pages
            # released below, by 14-19 MB.
            table = pq.ParquetFile(f.path).read_row_group(piece.group, columns=self._read_columns(),
                                                          use_threads=False)
        except Exception as exc:  # noqa: BLE001 -- pyarrow: a corrupt page found mid-stream
            raise DatasetError(f"{self.name}: {f.path} row group {piece.group} cannot be read (corrupt?): "
                               f"{type(exc).__name__}: {exc}") from exc
        table = table.slice(piece.start, piece.rows)
        first_row = sum(f.rows[:piece.group]) + piece.start
        arrays = self._arrays(table, f.path, first_row)
        # The column chunks' raw pages are free now; handing them back to the system keeps the process at the
        # data it holds (about 5 ms per 8 MB row group, the pages faulted in again on the next read).
        pa.default_memory_pool().release_unused()
        return arrays


class ParquetPart:
    """One worker's part of a Parquet dataset's training rows, streamed (module docstring: order, resuming)."""

    def __init__(self, dataset: ParquetDataset, pieces: list[_Piece], rows: int) -> None:
        self.dataset = dataset
        self.pieces = pieces
        self.num_rows = rows

    def batches(self, batch_size: int, *, start: int, seed: int
                ) -> Iterator[tuple[int, dict[str, np.ndarray], np.ndarray]]:
        """(epoch, inputs, labels) batches of `batch_size` rows from batch `start` on (start x batch_size rows in)."""
        rows = _Rows(self, seed)
        position = start * batch_size
        while True:
            epoch = position // self.num_rows
            inputs, labels = rows.take(position, batch_size)
            position += batch_size
            yield epoch, inputs, labels


class _Rows:
    """The part's row stream over epochs: blocks of shuffle_rows rows, each shuffled; read piece by piece."""

    def __init__(self, part: ParquetPart, seed: int) -> None:
        self.part = part
        self.seed = seed
        self.block_rows = min(part.dataset.shuffle_rows, part.num_rows)
        self._block_key: tuple[int, int] | None = None
        self._block: tuple[dict[str, np.ndarray], np.ndarray] | None = None

    def take(self, position: int, count: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Rows [position, position + count) of the stream, across blocks and epochs."""
        pieces_in, pieces_y, got = [], [], 0
        while got < count:
            epoch, offset = divmod(position + got, self.part.num_rows)
            block, within = divmod(offset, self.block_rows)
            inputs, labels = self._shuffled(epoch, block)
            n = min(count - got, len(labels) - within)
            pieces_in.append({k: v[within:within + n] for k, v in inputs.items()})
            pieces_y.append(labels[within:within + n])
            got += n
        if len(pieces_y) == 1:
            return pieces_in[0], pieces_y[0]
        return ({k: np.concatenate([p[k] for p in pieces_in]) for k in pieces_in[0]}, np.concatenate(pieces_y))

    def _shuffled(self, epoch: int, block: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Block `block` of epoch `epoch`, read and shuffled by (seed, epoch, block); the last one kept."""
        if self._block_key != (epoch, block):
            inputs, labels = self._read(epoch, block * self.block_rows,
                                        min((block + 1) * self.block_rows, self.part.num_rows))
            order = np.random.default_rng([self.seed, epoch, block]).permutation(len(labels))
            self._block = ({k: v[order] for k, v in inputs.items()}, labels[order])
            self._block_key = (epoch, block)
        return self._block

    def _read(self, epoch: int, lo: int, hi: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Rows [lo, hi) of epoch `epoch`'s piece order, read from their row groups only."""
        pieces = self.part.pieces
        order = np.random.default_rng([self.seed, epoch]).permutation(len(pieces))
        chunks_in, chunks_y, offset = [], [], 0
        for i in order:
            piece = pieces[i]
            start, stop = max(lo, offset), min(hi, offset + piece.rows)
            if start < stop:
                inputs, labels = self._piece(piece)
                a, b = start - offset, stop - offset
                chunks_in.append({k: v[a:b] for k, v in inputs.items()})
                chunks_y.append(labels[a:b])
            offset += piece.rows
            if offset >= hi:
                break
        return ({k: np.concatenate([c[k] for c in chunks_in]) for k in chunks_in[0]}, np.concatenate(chunks_y))

    def _piece(self, piece: _Piece) -> tuple[dict[str, np.ndarray], np.ndarray]:
        # The last piece read is kept: consecutive blocks mostly fall in the same row group.
        if getattr(self, "_piece_key", None) != piece:
            self._piece_value = self._piece_key = None     # the last piece's arrays freed before the next is read
            self._piece_value = self.part.dataset.read_piece(piece)
            self._piece_key = piece
        return self._piece_value


# --- column values ---------------------------------------------------------------------------


def _castable(have: np.dtype, want: np.dtype) -> bool:
    """Whether a column of `have` may feed an input of `want`: floats to floats, integers (and bools) to integers,
    bools to bools; never floats to integer ids, or numbers to bools."""
    if want.kind == "f":
        return have.kind in "fiu"
    if want.kind in "iu":
        return have.kind in "iub"
    if want.kind == "b":
        return have.kind == "b"
    return False


def _shape_text(shape: Sequence) -> str:
    if not shape:
        return "one number"
    return "(" + ", ".join(str(d) if isinstance(d, int) else "?" for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _values(chunked, column: Column, rows: int, path: Path, first_row: int) -> np.ndarray:
    """A column's values as a (rows, *shape) array of the column's dtype: lists checked to be of one length (the
    input's), floats to be finite."""
    pa, _ = _pyarrow()
    array = chunked.combine_chunks() if hasattr(chunked, "combine_chunks") else chunked
    if array.null_count:
        row = int(np.flatnonzero(np.asarray(array.is_null()))[0])
        raise DatasetError(f"{path}, column {column.name!r}, row {first_row + row}: a null value (every row needs a "
                           "value)")
    dims = []
    while pa.types.is_fixed_size_list(array.type) or pa.types.is_list(array.type) or \
            pa.types.is_large_list(array.type):
        if pa.types.is_fixed_size_list(array.type):
            length = array.type.list_size
            values = array.flatten()
        else:
            offsets = np.asarray(array.offsets)
            lengths = np.diff(offsets)
            length = column.shape[len(dims)] if len(dims) < len(column.shape) else None
            expected = length if isinstance(length, int) else (int(lengths[0]) if len(lengths) else 0)
            ragged = np.flatnonzero(lengths != expected)
            if len(ragged):
                row = int(ragged[0])
                raise DatasetError(f"{path}, column {column.name!r}, row {first_row + row}: a list of "
                                   f"{int(lengths[row])} values where every row's holds {expected} (ragged lists)")
            length = expected
            values = array.flatten()
        dims.append(length)
        array = values
        if array.null_count:
            raise DatasetError(f"{path}, column {column.name!r}: a null inside a list")
    flat = array.to_numpy(zero_copy_only=False)
    out = flat.reshape(rows, *dims) if dims else flat.reshape(rows)
    if column.shape and not dims:           # a scalar column feeding an input of shape (1,)
        out = out.reshape(rows, *[d for d in column.shape if isinstance(d, int)])
    if out.dtype.kind == "f":
        finite = np.isfinite(out)
        if not finite.all():
            row, *where = np.argwhere(~finite)[0]
            value = out[(row, *where)]
            raise DatasetError(f"{path}, column {column.name!r}, row {first_row + int(row)}: value {value} is not a "
                               "finite number (NaN or infinity)")
    return out.astype(column.dtype, copy=False)
