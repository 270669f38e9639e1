"""A shard's whole state as a backup receives it (ps_server/replication/wire.py): a trained momentum shard's
snapshot, its optimizer's scalar step counters included, arrives as the same state; a tampered one is refused."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import CorruptCheckpointError, InvalidRequestError
from ps_server.checkpoints import fileformat
from ps_server.config import ServerConfig
from ps_server.replication.wire import SCALARS_KEY, snapshot_items, snapshot_of
from ps_server.server import create_server
from worker_client.client import PSClient


@pytest.fixture
def trained():
    server, _ = create_server(ServerConfig(optimizer="momentum", optimizer_params={"lr": 0.1}))
    try:
        with PSClient([server.address], worker_id="w0", shared_memory=False) as client:
            values = {"w": np.ones((2500, 256), np.float32), "b": np.arange(7, dtype=np.float32)}
            client.initialize(values)
            client.register(heartbeat=False)
            for k in range(3):
                assert client.push({n: np.full_like(v, 0.5 + k) for n, v in values.items()}).accepted
        yield server.shard.snapshot()
    finally:
        server.stop(0.5)


def test_a_trained_state_crosses_as_the_same_state(trained) -> None:
    items = list(snapshot_items(trained, 9, 2, ["s0r0", "s0r1"]))
    assert len(items) > 1 and items[-1].snapshot.last and all(i.seq == 9 and i.epoch == 2 for i in items)
    got = snapshot_of([i.snapshot for i in items], "the test")
    sent, _ = fileformat.encode(trained)
    received, _ = fileformat.encode(got)
    assert sorted(sent) == sorted(received)
    assert any(np.ndim(v) == 0 for v in sent.values())   # the optimizer's step counters are scalars
    for key, value in sent.items():
        assert received[key].shape == value.shape and np.array_equal(received[key], value), key
    assert got.step == trained.step == 3


def test_a_snapshot_whose_bytes_or_scalars_were_changed_is_refused(trained) -> None:
    parts = [i.snapshot for i in snapshot_items(trained, 1, 1, ["s0r0"])]
    parts[-1].tensors[-1].data = bytes(len(parts[-1].tensors[-1].data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        snapshot_of(parts, "the test")
    parts = [i.snapshot for i in snapshot_items(trained, 1, 1, ["s0r0"])]
    parts[0].metadata[SCALARS_KEY] = "not json"
    with pytest.raises(InvalidRequestError, match=SCALARS_KEY):
        snapshot_of(parts, "the test")
