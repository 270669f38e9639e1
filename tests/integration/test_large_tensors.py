"""Tensors far above gRPC's message limit stream through the shards intact (chunked both ways).

Sizes: a single 1 GiB float32 tensor through one shard, and a multi-tensor model of
PS_BIG_MODEL_GB GiB (default 2.5) over two shards. On a 2-core machine the 2.5 GiB model
took about 45 s idle and up to 100 s under heavy load; set PS_BIG_MODEL_GB lower on a
smaller machine. Both are marked slow; each frees its arrays before returning.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from worker_client.client import PSClient, RetryPolicy

GIB = 1 << 30
LR = 0.5
FLAGS = ["--optimizer", "sgd", "--lr", str(LR)]
BIG_MODEL_GB = float(os.environ.get("PS_BIG_MODEL_GB", "2.5"))


def _check_all_equal(array: np.ndarray, value: float) -> None:
    """Every element equals value (checked a block at a time: no full-size temporaries)."""
    flat = array.reshape(-1)
    block = 16 << 20
    for start in range(0, flat.size, block):
        piece = flat[start:start + block]
        if not (piece == value).all():
            bad = start + int(np.argmax(piece != value))
            raise AssertionError(f"element {bad} is {flat[bad]}, expected {value}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_single_1_gib_tensor_is_pushed_and_pulled_through_one_shard(start_cluster) -> None:
    cluster = start_cluster(1, mode="async", flags=FLAGS)
    with PSClient(cluster.addresses, worker_id="big", rpc_timeout=120, retry=RetryPolicy(attempts=2)) as worker:
        worker.wait_ready(30)
        ones = np.ones(GIB // 4, np.float32)
        assert ones.nbytes == GIB
        worker.initialize({"big": ones})
        worker.register(heartbeat=False)
        report = worker.push({"big": ones})      # the gradient: 1 everywhere
        assert report.accepted and report.steps == [1]
        del ones
        gc.collect()
        pulled = worker.pull()["big"]
        assert pulled.shape == (GIB // 4,) and pulled.dtype == np.float32
        _check_all_equal(pulled, 1.0 - LR)
        del pulled
        gc.collect()


def big_model(total_bytes: int) -> dict[str, np.ndarray]:
    """An embedding (about half the bytes, split over the shards), two dense layers and small tensors."""
    width = 1024
    emb_rows = max(2, (total_bytes // 2) // (width * 4))
    dense_rows = max(2, (total_bytes // 4) // (width * 4))
    return {
        "embedding": np.full((emb_rows, width), 1.0, np.float32),
        "dense1.weight": np.full((dense_rows, width), 2.0, np.float32),
        "dense2.weight": np.full((dense_rows, width), 3.0, np.float32),
        "dense1.bias": np.full(width, 4.0, np.float32),
        "head.bias": np.full(10, 5.0, np.float64),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_of_several_gib_is_pushed_and_pulled_over_two_shards(start_cluster) -> None:
    cluster = start_cluster(2, mode="async", flags=FLAGS)
    model = big_model(int(BIG_MODEL_GB * GIB))
    total = sum(a.nbytes for a in model.values())
    initial = {name: float(a.reshape(-1)[0]) for name, a in model.items()}
    with PSClient(cluster.addresses, worker_id="big", rpc_timeout=240, retry=RetryPolicy(attempts=2)) as worker:
        worker.wait_ready(30)
        worker.initialize(model)
        per_shard = worker.shard_map.bytes_per_shard()
        assert min(per_shard) > 0.4 * total, f"unbalanced: {per_shard}"
        worker.register(heartbeat=False)
        for array in model.values():
            array.fill(2.0)                    # reuse the buffers as the gradient: 2 everywhere
        report = worker.push(model)
        assert report.accepted and report.steps == [1, 1]
        del model, array
        gc.collect()
        pulled = worker.pull()
        assert sum(a.nbytes for a in pulled.values()) == total
        for name, value in pulled.items():
            _check_all_equal(value, initial[name] - LR * 2.0)
        del pulled
        gc.collect()
