"""A worker killed mid-epoch of a Parquet dataset and restarted continues from its position in its part of the data:
the row its clock says, neither skipping nor repeating (ps_models.parquet, "Resuming")."""

from __future__ import annotations

import re
import time

import pytest

from tests.helpers import tabular

BATCH = 32


@pytest.mark.timeout(180)
def test_a_restarted_worker_reads_its_part_of_the_parquet_data_from_where_its_clock_left_it(start_job, tmp_path):
    model = tabular.write_model(tmp_path / "model.onnx")
    data = tabular.write_parquet(tmp_path / "parquet", train=20_000, test=500, files=4, row_group=1000)
    flags = ["--model", str(model), "--data", str(data), "--loss", "bce", "--batch-size", str(BATCH),
             "--shuffle-rows", "700"]
    job = start_job(mode="async", shards=1, workers=2, steps=10**6, worker_flags=flags)
    seen = job.workers[1].wait_for(lambda e: e["event"] == "progress" and e["clock"] >= 40, timeout=90,
                                   what="worker 1 at clock 40")
    job.workers[1].kill()
    last = max(e["clock"] for e in job.workers[1].events if e["event"] == "progress")
    restarted = job.restart_worker(1, *flags)
    start = restarted.wait_for(lambda e: e["event"] == "start", timeout=60, what="the restarted worker's start")
    assert start["resumed"] and start["clock"] >= last >= seen["clock"], (start, last)
    part_rows = 10_000   # 20,000 rows, 2 workers
    deadline = time.monotonic() + 30
    while not re.search(r"from row \d+, epoch", restarted.log_tail()):
        assert time.monotonic() < deadline, restarted.log_tail()
        time.sleep(0.2)
    row = int(re.search(r"\((\d+) rows\) from row (\d+), epoch (\d+)", restarted.log_tail()).group(2))
    assert row == start["clock"] * BATCH, (row, start)
    assert re.search(rf"\({part_rows} rows\) from row {row}, epoch {row // part_rows}", restarted.log_tail())
    restarted.wait_for(lambda e: e["event"] == "progress" and e["clock"] > start["clock"] + 5, timeout=60,
                       what="the restarted worker training on")
