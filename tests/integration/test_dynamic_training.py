"""Dynamic tables in the training loop against two real in-process shards: the factorization machine trains on
hashed int64 ids held as dynamic tables, the shards count the live rows the batches created, evict untouched rows
on the worker's schedule, and the bytes per step follow the rows its batches touch."""

from __future__ import annotations

from typing import Any

import numpy as np

from ps_models.datasets import hash_ids, load_dataset
from ps_models.recsys import FM_PATH
from ps_server.config import ServerConfig
from ps_server.server import create_server
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from worker_client.training import Trainer, TrainingPlan

TABLES = ["factors.weight", "linear.weight"]
DATA = "synthetic:clicks?n=6000&hashed=1"
BATCH, STEPS, DIM = 64, 120, 16
#: The issue's bound: bytes per step within 2x of what the batches' unique rows need.
BYTES_FACTOR = 2.0


def train(tmp_path, *, evict_after_steps: int = 0) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """(the worker's result, each shard's ClusterInfo.dynamic_tables after the run, the shard map's specs)."""
    servers = [create_server(ServerConfig(mode="sync", shard_index=i, num_shards=2, optimizer="adagrad",
                                          optimizer_params={"lr": 0.05}))[0] for i in range(2)]
    client = PSClient([s.address for s in servers], worker_id="w0", wait_timeout=30)
    try:
        engine = GradientEngine(FM_PATH, batch_size=BATCH, intra_op_threads=1, cache_dir=tmp_path,
                                dynamic_tables=TABLES)
        plan = TrainingPlan(worker_index=0, num_workers=1, batch_size=BATCH, steps=STEPS, eval_every=0,
                            start_timeout=10.0, wait_timeout=30.0, evict_after_steps=evict_after_steps)
        result = Trainer(client, engine, load_dataset(DATA, seed=0), plan=plan).run()
        infos = [list(client.cluster_info(i).dynamic_tables) for i in range(2)]
        return result, infos, dict(client.fetch_shard_map().specs)
    finally:
        client.close()
        for s in servers:
            s.stop()


def test_hashed_ids_train_as_dynamic_tables_whose_live_rows_the_shards_count(tmp_path):
    result, infos, specs = train(tmp_path)
    assert result["test_auc"] > 0.6, result                 # the clicks' signal was learned from hashed keys
    assert sorted(specs) == ["bias", *TABLES]
    assert [tuple(specs[t].shape) for t in TABLES if specs[t].dynamic is not None] == [(DIM,), (1,)]
    data = load_dataset(DATA, seed=0)
    assert np.abs(data.x_train).max() > 1 << 60              # far beyond the model's 10,000 rows
    seen = len(np.unique(np.concatenate([data.x_train.ravel(), data.x_test.ravel()])))
    for table in TABLES:
        live = [next(d for d in shard if d.name == table) for shard in infos]
        assert all(d.rows > 0 for d in live), live           # both shards hold some of the hashed ids
        assert all(d.evicted == 0 for d in live)
        assert 0 < sum(d.rows for d in live) <= seen         # only ids a batch or the evaluation used
    rows = result["unique_rows_per_step"] / len(TABLES)      # every id is a row of both tables
    need = rows * (DIM * 4 + 8) + rows * (4 + 8) + 4         # the rows, their int64 ids, and the bias
    rounding = 0.05 * ((DIM * 4 + 8) + (4 + 8)) + 0.05       # the result rounds rows and bytes to 0.1
    for key in ("bytes_pulled_per_step", "bytes_pushed_per_step"):
        assert need - rounding <= result[key] <= BYTES_FACTOR * need, (key, result[key], need)


def test_rows_untouched_for_evict_after_steps_are_evicted(tmp_path):
    _, infos, _ = train(tmp_path, evict_after_steps=5)
    for table in TABLES:
        stats = [next(d for d in shard if d.name == table) for shard in infos]
        assert sum(d.evicted for d in stats) > 0, stats
        assert sum(d.rows for d in stats) < sum(d.created for d in stats)


def test_the_hash_is_a_fixed_bijection_spreading_ids_over_int64():
    ids = np.arange(100_000, dtype=np.int64)
    keys = hash_ids(ids)
    assert len(np.unique(keys)) == len(ids)
    assert (keys < 0).mean() > 0.45 and (keys > 1 << 62).any()
    np.testing.assert_array_equal(hash_ids(ids), keys)
