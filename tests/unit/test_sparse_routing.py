"""Client-side routing of sparse rows (worker_client/client/rows.py): ids to the shards whose row ranges hold them."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import codec
from ps_common.errors import InvalidTensorError
from ps_common.shard_map import ParamSpec, build_shard_map
from worker_client.client import rows as sparse

ROWS, DIM = 100, 8
SHARD_MAP = build_shard_map([ParamSpec("emb", "float32", (ROWS, DIM)), ParamSpec("b", "float32", (4,))], 2,
                            partition_min_bytes=64)


def boundary() -> int:
    """The first row of the table's part on the second shard."""
    parts = SHARD_MAP.parts_of("emb")
    assert len(parts) == 2, "the table must be split over both shards"
    return parts[1].row_start


def test_ids_go_to_the_shard_whose_range_holds_them_keeping_their_positions():
    cut = boundary()
    ids = np.array([cut, 0, cut - 1, ROWS - 1], np.int64)
    plan = sparse.route_rows(SHARD_MAP, {"emb": ids})
    first, second = (SHARD_MAP.parts_of("emb")[i].shard for i in (0, 1))
    assert plan[first][0][1].tolist() == [1, 2] and plan[first][0][2].tolist() == [0, cut - 1]
    assert plan[second][0][1].tolist() == [0, 3] and plan[second][0][2].tolist() == [cut, ROWS - 1]


def test_every_shard_holding_a_part_gets_a_row_gradient_even_an_empty_one():
    ids = np.array([0, 1, 1], np.int64)
    grads = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
    by_shard = sparse.row_gradients_by_shard(SHARD_MAP, {"emb": (ids, grads)}, np.dtype("<f4"))
    assert sorted(by_shard) == [0, 1]
    owner = SHARD_MAP.parts_of("emb")[0].shard
    (full,), (empty,) = by_shard[owner], by_shard[1 - owner]
    assert list(full.ids) == [0, 1, 1] and list(empty.ids) == [] and empty.data == b""
    np.testing.assert_array_equal(codec.rows_from_wire("emb", full.dtype, full.data, 3, (DIM,)), grads)


@pytest.mark.parametrize("ids,match", [([ROWS], r"id 100 is outside \[0, 100\)"), ([-1], "id -1"),
                                       ([[1]], "1-d integer array")])
def test_ids_out_of_range_or_of_the_wrong_shape_are_refused_naming_them(ids, match):
    with pytest.raises(InvalidTensorError, match=match):
        sparse.route_rows(SHARD_MAP, {"emb": np.array(ids, np.int64)})


def test_a_row_gradient_of_the_wrong_shape_is_refused_before_anything_is_sent():
    with pytest.raises(InvalidTensorError, match=r"2 rows of float32\[100, 8\] need \[2, 8\]"):
        sparse.row_gradients_by_shard(SHARD_MAP, {"emb": (np.array([0, 1]), np.zeros((2, DIM + 1), np.float32))},
                                      np.dtype("<f4"))


def test_a_sparse_step_takes_a_data_channel_frame_only_when_its_rows_fit_the_headers(monkeypatch):
    from ps_common import data_channel as dc
    from worker_client.client import ps_client

    fits = ps_client.PSClient._rows_fit_a_frame
    row_bytes = SHARD_MAP.specs["emb"].row_bytes
    ids = np.arange(10, dtype=np.int64)
    grads = sparse.row_gradients_by_shard(SHARD_MAP, {"emb": (ids, np.ones((10, DIM), np.float32))},
                                          np.dtype("<f4"))[SHARD_MAP.parts_of("emb")[0].shard]
    asked = [("emb", np.arange(10), ids)]
    assert fits(SHARD_MAP, grads, asked)
    # the request header: row gradients and asked ids together, within the bound less the room kept
    request = codec.row_gradients_wire_bytes(grads) + codec.ID_WIRE_BYTES * len(ids)
    monkeypatch.setattr(dc, "MAX_HEADER_BYTES", ps_client.FRAME_HEADER_ROOM + request)
    assert fits(SHARD_MAP, grads, asked)
    monkeypatch.setattr(dc, "MAX_HEADER_BYTES", ps_client.FRAME_HEADER_ROOM + request - 1)
    assert not fits(SHARD_MAP, grads, asked)
    monkeypatch.undo()
    # the answer's rows: within one answer (the shard's bound on rows read at once)
    many = np.zeros(codec.CHUNK_BYTES // row_bytes, np.int64)
    assert fits(SHARD_MAP, [], [("emb", np.arange(len(many)), many)])
    more = np.zeros(len(many) + 1, np.int64)
    assert not fits(SHARD_MAP, [], [("emb", np.arange(len(more)), more)])


@pytest.mark.parametrize("ids", [np.arange(1000), np.full(1000, -1), np.full(1000, -(2 ** 62)), np.full(1000, 2 ** 62)],
                         ids=["small", "minus-one", "large-negative", "large-positive"])
def test_wire_bytes_bounds_what_row_gradients_take_in_a_message_whatever_their_ids(ids):
    from ps_proto.v1 import parameter_server_pb2 as pb

    data = np.zeros((len(ids), DIM), np.float32).tobytes()
    grad = pb.RowGradient(name="emb", ids=ids, dtype=pb.DTYPE_FLOAT32, data=data)
    framing = len(pb.RowGradient(name="emb", dtype=pb.DTYPE_FLOAT32).SerializeToString()) + 2 * 6  # two length prefixes
    assert grad.ByteSize() <= codec.row_gradients_wire_bytes([grad]) + framing
    # the counters add what the tensors hold, ids as int64
    assert sparse.payload_bytes([grad]) == len(data) + 8 * len(ids)
