"""A shard's whole state as a backup receives it (ps_server/replication/wire.py): a trained momentum shard's
snapshot, its optimizer's scalar step counters included, arrives as the same state; a tampered one is refused.
The Replication service's bad input: bytes that do not parse and lease requests outside the bounds are
INVALID_ARGUMENT, and change no vote."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.errors import REASON_KEY, CorruptCheckpointError, InvalidRequestError
from ps_proto.v1 import replication_pb2 as rpb
from ps_server.checkpoints import fileformat
from ps_server.config import ServerConfig
from ps_server.replication.replica import WITNESS
from ps_server.replication.service import MAX_ID_CHARS, MAX_ISR
from ps_server.replication.wire import SCALARS_KEY, snapshot_items, snapshot_of
from ps_server.server import create_server
from ps_tools.launch.supervise import free_ports
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


@pytest.fixture
def witness():
    """A witness process's server in this process: the Replication service's voter, no shard of its own."""
    server, port = create_server(ServerConfig(witness=True, voters=("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        channel.close()
        server.stop(0.5)


def _raw(channel: grpc.Channel, rpc: str, body: bytes) -> bytes:
    return channel.unary_unary(f"/ps.v1.Replication/{rpc}")(body, timeout=5)


@pytest.mark.parametrize("rpc", ["Bootstrap", "Renew", "Vote", "SetIsr", "Status"])
def test_replication_bytes_that_do_not_parse_are_invalid_argument(witness, rpc: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _raw(witness, rpc, b"\xff\xff\xff")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert f"Replication.{rpc}" in raised.value.details()


BIG = "r" * (MAX_ID_CHARS + 1)


@pytest.mark.parametrize("rpc, request_, says", [
    ("Vote", rpb.LeaseRequest(shard=-7, epoch=3, replica="s0r1"), "shard -7 is negative"),
    ("Vote", rpb.LeaseRequest(shard=0, epoch=-1, replica="s0r1"), "epoch -1 is negative"),
    ("Vote", rpb.LeaseRequest(shard=0, epoch=3, replica=""), "the replica id has 0 characters"),
    ("Renew", rpb.LeaseRequest(shard=0, epoch=3, replica=BIG), f"the replica id has {MAX_ID_CHARS + 1} characters"),
    ("Bootstrap", rpb.LeaseRequest(shard=0, epoch=1, replica="s0r0", isr=["s0r0"] * (MAX_ISR + 1)),
     f"{MAX_ISR + 1} in-sync replicas named"),
    ("Bootstrap", rpb.LeaseRequest(shard=0, epoch=1, replica="s0r0", isr=["s0r0"], incarnation=BIG),
     "the incarnation has"),
    ("SetIsr", rpb.IsrRequest(shard=0, epoch=3, holder="s0r0", isr=["s0r0", ""]), "an in-sync replica id has 0"),
])
def test_lease_requests_outside_the_bounds_are_refused_and_change_no_vote(witness, rpc, request_, says) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _raw(witness, rpc, request_.SerializeToString())
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in raised.value.details(), \
        raised.value.details()
    # nothing was promised: shard 0's epoch 1 is still free for its replica 0
    granted = rpb.LeaseGrant.FromString(_raw(witness, "Bootstrap", rpb.LeaseRequest(
        shard=0, epoch=1, replica="s0r0", isr=["s0r0"], incarnation="t").SerializeToString()))
    assert granted.granted and granted.epoch == 1 and granted.holder == "s0r0", granted


def test_a_witness_answers_its_status_and_refuses_to_be_followed(witness) -> None:
    status = rpb.ReplicaStatus.FromString(_raw(witness, "Status", rpb.ReplicaStatusRequest().SerializeToString()))
    assert status.role == WITNESS and status.shard == -1
    follow = witness.stream_stream("/ps.v1.Replication/Follow")
    with pytest.raises(grpc.RpcError) as raised:
        list(follow(iter([b"\xff\xfe"]), timeout=5))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_follow_stream_whose_first_acknowledgement_does_not_parse_is_invalid_argument() -> None:
    own = f"127.0.0.1:{free_ports(1)[0]}"
    # a replica whose other voters are not there: it serves Replication while it waits for a lease
    server, _ = create_server(ServerConfig(replicas=(own,), replica_index=0, voters=(own, "127.0.0.1:1", "127.0.0.1:2")))
    channel = grpc.insecure_channel(own)
    try:
        follow = channel.stream_stream("/ps.v1.Replication/Follow")
        with pytest.raises(grpc.RpcError) as raised:
            list(follow(iter([b"\xff\xfe\x00"]), timeout=5))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert "Replication.Follow" in raised.value.details()
        assert dict(raised.value.trailing_metadata() or ())[REASON_KEY] == InvalidRequestError.reason
    finally:
        channel.close()
        server.stop(0.5)
