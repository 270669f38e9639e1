"""A worker's memory for a Parquet dataset does not grow with the dataset: reading a 10x larger dataset than the
reader's bound, a process's peak memory grows by less than that bound (docs/data-format.md, "Memory")."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ps_common.process import child_env

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                                            reason="peak memory is read from Linux's /proc")]
SHUFFLE_ROWS = 8192
ROW_GROUP = 65536
ROW_BYTES = 16 * 4 + 8 * 8 + 1
#: The reader's bound for this data, as docs/data-format.md ("Memory") states it: 3 x one row group's decoded
#: bytes (the columns as Arrow reads them, the arrays made of them, the piece kept) + 2 x the shuffle buffer + 8 MB.
BOUND_MB = (3 * ROW_GROUP * ROW_BYTES + 2 * SHUFFLE_ROWS * ROW_BYTES) / 1e6 + 8

READ = textwrap.dedent("""
    import json, sys
    from ps_models.parquet import ParquetDataset
    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    dataset = ParquetDataset(sys.argv[1], shuffle_rows=int(sys.argv[2]))
    dataset.bind({"x": ("float32", (16,)), "ids": ("int64", (8,))}, label_kind="binary", num_classes=2)
    part = dataset.part(0, 1)
    batches = part.batches(1024, start=0, seed=0)
    next(batches)
    before = peak()
    rows = 1024
    for _, inputs, labels in batches:
        rows += len(labels)
        if rows >= part.num_rows:
            break
    print(json.dumps({"before_mb": before, "after_mb": peak(), "rows": rows}))
""")


def write(folder: Path, rows: int) -> int:
    """rows of x (16 float32) and ids (8 int64) with labels, in files of 1M rows; the bytes written."""
    rng = np.random.default_rng(0)
    (folder / "train").mkdir(parents=True)
    (folder / "test").mkdir()
    for i, start in enumerate(range(0, rows, 1 << 20)):
        n = min(1 << 20, rows - start)
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 16, np.float32)), 16),
                          "ids": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 2**40, n * 8)), 8),
                          "label": pa.array(rng.integers(0, 2, n).astype(np.int8))})
        pq.write_table(table, folder / "train" / f"part-{i}.parquet", row_group_size=ROW_GROUP, compression="none")
        if i == 0:
            pq.write_table(table.slice(0, 1000), folder / "test" / "part-0.parquet")
    return sum(p.stat().st_size for p in folder.rglob("*.parquet"))


def test_reading_ten_times_the_bound_of_parquet_data_grows_a_process_by_less_than_the_bound(tmp_path):
    size = write(tmp_path / "data", rows=2_800_000)
    assert size >= 10 * BOUND_MB * 1e6, f"the data ({size / 1e6:.0f} MB) should be at least ten times the bound"
    done = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "data"), str(SHUFFLE_ROWS)], capture_output=True,
                          text=True, env=child_env(), timeout=200)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["rows"] >= 2_800_000
    grown = result["after_mb"] - result["before_mb"]
    print(f"{size / 1e6:.0f} MB of Parquet read; peak {result['before_mb']:.0f} MB -> {result['after_mb']:.0f} MB")
    assert grown < BOUND_MB, result
