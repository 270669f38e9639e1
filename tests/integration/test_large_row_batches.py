"""Batches whose rows are more than one gRPC message carries, against two in-process shards: a read of 12 MB of
rows is cut into PullRows calls within the shard's 4 MiB answer, a push of 10 MB of row gradients per shard goes on
past its header, and both give what the same rows in small batches give. A shard that predates continued row
gradients gets them all in the header, as before, and refuses what one message cannot carry, applying nothing."""

from __future__ import annotations

import numpy as np
import pytest

import ps_server.service
from ps_common.errors import ServerError
from ps_models.builders import write_model
from ps_models.datasets import load_dataset
from ps_server.config import ServerConfig
from ps_server.server import create_server
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from worker_client.training import Trainer, TrainingPlan

ROWS, WIDTH = 6000, 1024          # 4 KiB rows, 24 MB of table, split over both shards
LR = 0.5


@pytest.fixture
def cluster():
    servers = [create_server(ServerConfig(mode="async", shard_index=i, num_shards=2, partition_min_bytes=4096,
                                          optimizer="sgd", optimizer_params={"lr": LR}))[0] for i in range(2)]
    table = np.random.default_rng(0).standard_normal((ROWS, WIDTH)).astype(np.float32)
    client = PSClient([s.address for s in servers], worker_id="w0", wait_timeout=30)
    try:
        client.initialize({"emb": table, "dense": np.zeros(10, np.float32)})
        client.register(heartbeat=False)
        yield servers, client, table
    finally:
        client.close()
        for server in servers:
            server.stop(0.5)


def ok_calls(servers, rpc: str) -> float:
    return sum(s.metrics.registry.get_sample_value(
        "ps_rpcs_total", {"shard": str(s.config.shard_index), "rpc": rpc, "code": "OK"}) or 0.0 for s in servers)


def test_a_read_of_more_rows_than_one_answer_carries_is_cut_into_calls_and_gives_every_row(cluster):
    servers, client, table = cluster
    ids = np.random.default_rng(1).integers(0, ROWS, 3000)     # 12 MB of rows, repeats and any order
    assert client.shard_map.specs["emb"].row_bytes * len(ids) > 2 * (4 << 20)
    got = client.pull_rows({"emb": ids, "dense": np.array([], np.int64)})
    assert np.array_equal(got["emb"], table[ids]) and got["dense"].shape == (0,)
    assert ok_calls(servers, "PullRows") >= 4                   # at least two calls on each shard
    assert client.steps == [0, 0]


def test_a_push_of_more_row_gradients_than_one_message_carries_applies_whole(cluster):
    servers, client, table = cluster
    ids = np.random.default_rng(2).permutation(ROWS)[:5000]     # 20 MB of row gradients, 10 MB a shard
    grads = np.random.default_rng(3).standard_normal((len(ids), WIDTH)).astype(np.float32)
    report = client.push({"dense": np.ones(10, np.float32)}, row_gradients={"emb": (ids, grads)})
    assert report.accepted and [r.step for r in report.responses] == [1, 1]   # one push: one step on each shard
    want = table.copy()
    want[ids] -= LR * grads
    np.testing.assert_allclose(client.pull(["emb"])["emb"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(client.pull(["dense"])["dense"], -LR * np.ones(10, np.float32))


def test_a_sparse_step_with_rows_beyond_a_frame_pushes_then_reads_its_rows_in_calls(cluster):
    servers, client, table = cluster
    ids = np.arange(0, ROWS, 2)                                 # 12 MB of rows each way
    grads = np.ones((len(ids), WIDTH), np.float32)
    report, values, rows = client.push_pull_rows({"dense": np.ones(10, np.float32)}, {"emb": (ids, grads)},
                                                 names=["dense"], rows={"emb": ids})
    assert report.accepted and values is None and rows is None    # the loop pulls them: pull_rows
    np.testing.assert_allclose(client.pull_rows({"emb": ids})["emb"], table[ids] - LR, rtol=1e-6, atol=1e-6)


def test_a_shard_that_predates_continued_rows_gets_them_in_the_header_and_refuses_too_many(cluster, monkeypatch):
    servers, client, table = cluster
    served = ps_server.service.cluster_info

    asked: list[int] = []

    def old(shard, view):   # what a shard of the version before says: no such field
        info = served(shard, view)
        info.row_gradients_continue = False
        asked.append(id(shard))
        return info

    monkeypatch.setattr(ps_server.service, "cluster_info", old)
    small = np.arange(100)                                      # 400 KB: within the header, taken as before
    assert client.push({"dense": np.ones(10, np.float32)},
                       row_gradients={"emb": (small, np.ones((100, WIDTH), np.float32))}).accepted
    with pytest.raises(ServerError, match=r"Push on shard \d .*RESOURCE_EXHAUSTED: .*larger than max"):
        client.push({"dense": np.ones(10, np.float32)},      # 12 MB a shard, all in one header
                    row_gradients={"emb": (np.arange(ROWS), np.ones((ROWS, WIDTH), np.float32))})
    # asked at most once a shard, and remembered: shard 0's call runs in the pushing thread and always asks;
    # shard 1's, on the client's pool, is cancelled when shard 0's fails before it started (the fan-out fails
    # fast), so it may not have asked, or may still be asking
    assert client._rows_continue.get(0) is False and set(client._rows_continue.values()) == {False}
    assert 1 <= len(asked) == len(set(asked)) <= 2
    assert [client.shard_status(i).step for i in range(2)] == [1, 1]   # only the small push was applied
    after = client.pull(["emb"])["emb"]
    np.testing.assert_allclose(after[:100], table[:100] - LR, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(after[100:], table[100:])


def train_embedding(tmp_path, sparse: bool) -> tuple[dict, dict[str, np.ndarray], dict[str, float]]:
    """4 sync steps of the embedding-bag model on one shard: (the run's result, the values after it, OK rpcs)."""
    # 1024-wide rows (4 KiB), batches of 128 bags of 16 ids out of 3000: about 1,500 rows (6 MB) a step each way,
    # more than one PullRows answer (4 MiB) and than a push's header (2 MiB) carry
    vocab, dim, bag, batch, steps = 3000, 1024, 16, 128, 4
    model = write_model("embedding", tmp_path / "embedding.onnx", vocab_size=vocab, dim=dim, bag_size=bag, seed=0)
    server, _ = create_server(ServerConfig(mode="sync", optimizer="sgd", optimizer_params={"lr": 0.5}))
    client = PSClient([server.address], worker_id="w0", wait_timeout=30)
    try:
        engine = GradientEngine(model, batch_size=batch, intra_op_threads=1, cache_dir=tmp_path / str(sparse),
                                **{"sparse_tables" if sparse else "dense_tables": ["embedding.weight"]})
        plan = TrainingPlan(worker_index=0, num_workers=1, batch_size=batch, steps=steps, eval_every=0,
                            start_timeout=10.0, wait_timeout=30.0)
        data = load_dataset(f"synthetic:ids?n={batch * steps + 256}&vocab={vocab}&bag={bag}&classes=2&signal=0.7",
                            seed=0, model="embedding")
        result = Trainer(client, engine, data, plan=plan).run()
        assert result["steps"] == steps and server.shard.step == steps
        calls = {rpc: ok_calls([server], rpc) for rpc in ("Push", "PushPull", "PullRows")}
        return result, client.pull(), calls
    finally:
        client.close()
        server.stop(0.5)


def test_the_training_loop_trains_a_table_whose_batches_touch_more_rows_than_one_message_carries(tmp_path):
    result, values, calls = train_embedding(tmp_path, sparse=True)
    assert result["unique_rows_per_step"] * 1024 * 4 > 4 << 20, result
    # every batch's rows read in more than one call (the first batch's, the next ones' after each push: too many
    # for the PushPull that would have read them), and the evaluation's; one push or PushPull a step
    assert calls["PullRows"] >= 2 * 4 and calls["Push"] + calls["PushPull"] == 4, calls
    _, dense_values, _ = train_embedding(tmp_path, sparse=False)   # the whole table every step: no rows at all
    for name, value in dense_values.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
