"""End to end: ps-launch trains the factorization machine exported from PyTorch on synthetic clicks, its tables
sparsely and densely, and on hashed int64 ids with its tables held as dynamic tables, to the AUC docs/models.md
states ("Recommendation example")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ps_models.datasets import click_logits, load_dataset
from ps_models.recsys import FM_PATH
from tests.helpers.launch import run_launch
from worker_client.training import binary_auc

pytestmark = pytest.mark.slow

DATA = "synthetic:clicks"
#: The documented recipe: two shards, two sync workers, Adagrad (sparse and dense Adagrad are the same updates).
JOB = ["--model", str(FM_PATH), "--data", DATA, "--shards", "2", "--workers", "2", "--mode", "sync",
       "--steps", "600", "--batch-size", "64", "--optimizer", "adagrad", "--lr", "0.05", "--eval-every", "0",
       "--seed", "0"]
#: The test AUC bar: runs of this recipe end at 0.789 (seed 0) and 0.755..0.789 over seeds 0-2 (their data differ).
AUC_BAR = 0.74
#: The issue's bound on the AUC gap between sparse and dense training of one model.
AUC_GAP = 0.01
#: The issue's bound: bytes per step within 2x of what the batches' unique rows need.
BYTES_FACTOR = 2.0
FIELDS, VOCAB, DIM = 10, 1000, 16
#: Longest run of one launched job, in seconds.
JOB_TIMEOUT = 120


#: The dynamic-table recipe: the same job on hashed ids (any int64), both tables held as dynamic tables.
HASHED = "synthetic:clicks?hashed=1"
DYNAMIC_JOB = [HASHED if arg == DATA else arg for arg in JOB] + ["--dynamic-tables", "factors.weight,linear.weight"]
#: Runs of the dynamic recipe end at 0.791 (seed 0) and 0.755..0.791 over seeds 0-2: the bar of the sparse runs.
DYNAMIC_AUC_BAR = 0.74


def launch(tmp_path: Path, *flags: str, job: list[str] = JOB) -> dict[str, Any]:
    summary, run = run_launch(tmp_path / "record", *job, "--log-level", "WARNING", *flags, timeout=JOB_TIMEOUT)
    summary["settings"] = run["settings"]
    assert summary["steps"] >= 600
    return summary


def test_the_fm_trains_sparsely_to_the_stated_auc_with_bytes_that_follow_its_rows_and_densely_to_the_same_auc(
        tmp_path: Path) -> None:
    sparse = launch(tmp_path / "sparse", "--sparse-min-rows", "1000")
    dense = launch(tmp_path / "dense")
    data = load_dataset(DATA, seed=0)
    bayes = binary_auc(click_logits(DATA, seed=0)[data.num_train:], data.y_test)
    assert sparse["test_auc"] >= AUC_BAR, (sparse["test_auc"], bayes)
    assert sparse["test_auc"] < bayes
    assert abs(sparse["test_auc"] - dense["test_auc"]) <= AUC_GAP, (sparse["test_auc"], dense["test_auc"])

    # each id of a batch is a row of both tables: half the unique rows are factors (16 float32), half linear (1)
    per_table = sparse["unique_rows_per_step"] / 2
    assert 0 < per_table <= 64 * FIELDS
    need = per_table * (DIM * 4 + 8) + per_table * (4 + 8) + 4      # rows, their int64 ids, and the bias
    # the record rounds unique_rows_per_step and the bytes to 0.1: need is known to within this
    rounding = 0.05 * ((DIM * 4 + 8) + (4 + 8)) + 0.05
    for key in ("bytes_pulled_per_step", "bytes_pushed_per_step"):
        assert need - rounding <= sparse[key] <= BYTES_FACTOR * need, (key, sparse[key], need)
        assert dense[key] >= FIELDS * VOCAB * (DIM + 1) * 4          # dense moves both whole tables every step


def test_the_fm_trains_on_hashed_ids_with_dynamic_tables_to_the_stated_auc_with_bytes_that_follow_its_rows(
        tmp_path: Path) -> None:
    """Live rows on the shards: tests/integration/test_dynamic_training.py (ps-launch's record has no shard stats)."""
    dynamic = launch(tmp_path, job=DYNAMIC_JOB)
    assert dynamic["settings"]["worker"]["dynamic_tables"] == ["factors.weight", "linear.weight"]
    data = load_dataset(HASHED, seed=0)
    assert data.x_train.min() < -(1 << 62) and data.x_train.max() > 1 << 62     # no row of a 10,000-row table
    bayes = binary_auc(click_logits(HASHED, seed=0)[data.num_train:], data.y_test)
    assert DYNAMIC_AUC_BAR <= dynamic["test_auc"] < bayes, (dynamic["test_auc"], bayes)

    per_table = dynamic["unique_rows_per_step"] / 2
    assert 0 < per_table <= 64 * FIELDS
    need = per_table * (DIM * 4 + 8) + per_table * (4 + 8) + 4      # rows, their int64 ids, and the bias
    rounding = 0.05 * ((DIM * 4 + 8) + (4 + 8)) + 0.05                # as above
    for key in ("bytes_pulled_per_step", "bytes_pushed_per_step"):
        assert need - rounding <= dynamic[key] <= BYTES_FACTOR * need, (key, dynamic[key], need)
