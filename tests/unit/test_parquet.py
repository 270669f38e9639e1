"""Parquet datasets, streamed (ps_models.parquet): disjoint parts, seeded shuffles, exact resumption, and bad data named
with its file, column, row and value -- before training and mid-stream."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ps_common.errors import DatasetError
from ps_models.datasets import load_dataset
from ps_models.parquet import CHECK_ROWS, ParquetDataset
from tests.helpers import tabular

INPUTS = {"dense": (np.dtype("float32"), (tabular.DENSE,)), "cat": (np.dtype("int64"), (3,))}


def opened(folder: Path, **kwargs) -> ParquetDataset:
    dataset = ParquetDataset(folder, **kwargs)
    dataset.bind(INPUTS, label_kind="binary", num_classes=2)
    return dataset


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tabular.write_parquet(tmp_path / "data", train=3000, test=700, files=3, row_group=256)


def row_keys(inputs: dict[str, np.ndarray]) -> list[tuple]:
    """Each row identified by its dense features (unique with probability 1)."""
    return [tuple(r) for r in inputs["dense"].round(6)]


def test_parts_are_disjoint_cover_the_split_and_differ_by_at_most_one_row(folder):
    dataset = opened(folder)
    seen, sizes = [], []
    for i in range(4):
        part = dataset.part(i, 4)
        sizes.append(part.num_rows)
        batches = part.batches(part.num_rows, start=0, seed=1)   # one batch = the whole part, one epoch
        _, inputs, _ = next(batches)
        seen += row_keys(inputs)
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 3000
    assert len(seen) == len(set(seen)) == 3000


def test_an_epoch_visits_each_row_of_the_part_once_in_an_order_drawn_from_the_seed_and_epoch(folder):
    part = opened(folder, shuffle_rows=500).part(0, 2)
    n = part.num_rows

    def epoch_rows(seed: int, epoch: int) -> list[tuple]:
        _, inputs, _ = next(part.batches(n, start=epoch, seed=seed))
        return row_keys(inputs)

    first, second, other_seed = epoch_rows(0, 0), epoch_rows(0, 1), epoch_rows(1, 0)
    assert sorted(first) == sorted(second) == sorted(other_seed) and len(set(first)) == n
    assert first != second and first != other_seed
    assert epoch_rows(0, 0) == first                     # a function of (seed, epoch)


def test_a_restarted_worker_resumes_exactly_where_its_clock_says(folder):
    part = opened(folder, shuffle_rows=300).part(1, 2)
    stream = part.batches(64, start=0, seed=7)
    reference = [next(stream) for _ in range(60)]          # past the first epoch (1500 rows / 64)
    for start in (0, 5, 23, 24, 41):
        resumed = part.batches(64, start=start, seed=7)
        for want in reference[start:start + 8]:
            got = next(resumed)
            assert got[0] == want[0]
            np.testing.assert_array_equal(got[1]["dense"], want[1]["dense"])
            np.testing.assert_array_equal(got[1]["cat"], want[1]["cat"])
            np.testing.assert_array_equal(got[2], want[2])


def test_a_shuffle_block_moves_a_row_at_most_one_buffer(folder):
    part = opened(folder, shuffle_rows=200).part(0, 1)
    _, inputs, _ = next(part.batches(part.num_rows, start=0, seed=3))
    order = row_keys(inputs)
    _, unshuffled, _ = next(opened(folder, shuffle_rows=1).part(0, 1).batches(part.num_rows, start=0, seed=3))
    position = {key: i for i, key in enumerate(row_keys(unshuffled))}
    # blocks of 200 rows of the epoch's piece order, each permuted: a row stays in its block
    assert all(position[key] // 200 == i // 200 for i, key in enumerate(order))


def test_the_test_split_is_read_whole_in_batches(folder):
    dataset = opened(folder)
    rows = sum(len(labels) for _, labels in dataset.test_batches(128))
    assert rows == dataset.num_test == 700


def _rewrite(path: Path, **columns) -> None:
    table = pq.read_table(path)
    for name, array in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, array)
    pq.write_table(table, path, row_group_size=256)


def _fixed(values: np.ndarray, width: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)


@pytest.mark.parametrize("case, says", [
    ("missing column", ["no column 'cat'"]),
    ("float ids", ["column 'cat'", "float64", "takes int64"]),
    ("wrong width", ["column 'dense'", "(5,) per row", "(4,) per example"]),
    ("ragged lists", ["column 'cat'", "row 17", "ragged"]),
    ("nan", ["column 'dense'", "row 3", "not a finite number"]),
    ("label 2", ["column 'label'", "row 9", "label 2 is not 0 or 1"]),
    ("other schema", ["another schema", "part-1.parquet"]),
    ("corrupt", ["part-2.parquet", "not a readable Parquet file"]),
])
def test_bad_data_is_found_before_training_naming_the_file_the_column_and_the_value(folder, case, says):
    path = folder / "train" / ("part-1.parquet" if case == "other schema" else "part-2.parquet")
    table = pq.read_table(path)
    n = table.num_rows
    if case == "missing column":
        for other in (folder / "train").glob("*.parquet"):
            pq.write_table(pq.read_table(other).drop(["cat"]), other)
        for other in (folder / "test").glob("*.parquet"):
            pq.write_table(pq.read_table(other).drop(["cat"]), other)
    elif case == "float ids":
        for p in [*(folder / "train").glob("*.parquet"), *(folder / "test").glob("*.parquet")]:
            t = pq.read_table(p)
            cat = np.asarray(t.column("cat").combine_chunks().flatten()).astype(np.float64)
            _rewrite(p, cat=_fixed(cat, 3))
    elif case == "wrong width":
        for p in [*(folder / "train").glob("*.parquet"), *(folder / "test").glob("*.parquet")]:
            t = pq.read_table(p)
            _rewrite(p, dense=_fixed(np.zeros((t.num_rows, 5), np.float32), 5))
    elif case == "ragged lists":
        for p in [*(folder / "train").glob("*.parquet"), *(folder / "test").glob("*.parquet")]:
            t = pq.read_table(p)
            rows = [list(r) for r in np.asarray(t.column("cat").combine_chunks().flatten()).reshape(-1, 3)]
            if p == path:
                rows[17] = rows[17][:2]
            _rewrite(p, cat=pa.array(rows, type=pa.list_(pa.int64())))
    elif case == "nan":
        dense = np.asarray(table.column("dense").combine_chunks().flatten()).reshape(n, -1).copy()
        dense[3, 1] = np.nan
        _rewrite(path, dense=_fixed(dense, tabular.DENSE))
    elif case == "label 2":
        label = np.asarray(table.column("label")).copy()
        label[9] = 2
        _rewrite(path, label=pa.array(label))
    elif case == "other schema":
        pq.write_table(table.append_column("extra", pa.array(np.zeros(n))), path)
    elif case == "corrupt":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(DatasetError) as caught:
        opened(folder)
    message = str(caught.value)
    for text in says:
        assert text in message, f"{text!r} not in {message!r}"


def test_bad_values_past_the_checked_rows_stop_the_stream_with_the_same_kind_of_message(tmp_path):
    folder = tabular.write_parquet(tmp_path / "data", train=3 * (CHECK_ROWS + 500), test=300, files=1, row_group=512)
    path = folder / "train" / "part-0.parquet"
    table = pq.read_table(path)
    label = np.asarray(table.column("label")).copy()
    bad_row = CHECK_ROWS + 400
    label[bad_row] = 7
    _rewrite(path, label=pa.array(label))
    dataset = opened(folder)               # the first CHECK_ROWS rows are fine: it opens
    part = dataset.part(0, 1)
    with pytest.raises(DatasetError, match=rf"part-0.parquet, column 'label', row {bad_row}: label 7 is not 0 or 1"):
        for _ in part.batches(256, start=0, seed=0):
            pass


@pytest.mark.parametrize("layout, says", [
    ("no folder", "no folder train/"),
    ("empty", "holds no .parquet file"),
    ("no label", "no label column 'label'"),
])
def test_a_folder_that_is_not_a_dataset_says_what_is_missing(tmp_path, layout, says):
    folder = tmp_path / "data"
    if layout == "no folder":
        folder.mkdir()
    elif layout == "empty":
        (folder / "train").mkdir(parents=True)
        (folder / "test").mkdir()
    else:
        tabular.write_parquet(folder, train=400, test=100, files=1, label="clicked")
    with pytest.raises(DatasetError, match=says):
        ParquetDataset(folder)
    if layout == "no label":
        assert ParquetDataset(folder, label_column="clicked").num_train == 400


def test_one_parquet_file_given_as_the_data_is_refused_pointing_to_its_folder(folder):
    for path in (folder / "train" / "part-0.parquet", folder / "train" / "part-0.bin"):
        if not path.exists():
            path.write_bytes((folder / "train" / "part-0.parquet").read_bytes())
        with pytest.raises(DatasetError) as caught:
            load_dataset(str(path))
        message = str(caught.value)
        for text in (f"{path} is not a .npz (zip) archive (it starts with b'PAR1", f"{path.name} is a Parquet file",
                     "pass the folder holding train/ and test/ (docs/data-format.md)"):
            assert text in message, f"{text!r} not in {message!r}"
        assert "allow_pickle" not in message
