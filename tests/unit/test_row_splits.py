"""Rows too many for one message, cut and joined again: a read of rows cut into PullRows calls within one answer
(worker_client/client/rows.py split_asked), a push's row gradients continued past its header (ps_common/codec.py
split_row_gradients and join_row_gradients), and a replicated push's rows over several Follow items (ps_server/
replication/wire.py). Every cut joins back to what was cut, in order, within its bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_common import codec
from ps_common.errors import InvalidRequestError
from ps_common.shard_map import ParamSpec, build_shard_map
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_server.operations import Op, Push
from ps_server.replication.wire import CHUNK_BYTES, OpAssembler, op_items
from ps_server.service import RowPieces
from worker_client.client import rows as sparse

WIDTHS = {"wide": 64, "narrow": 1, "mid": 5}
SHARD_MAP = build_shard_map([ParamSpec(name, "float32", (1000, width)) for name, width in WIDTHS.items()], 1)


@st.composite
def asked(draw):
    """route_rows' entries for one shard: each table once, with its positions and ids."""
    entries = []
    for name in draw(st.lists(st.sampled_from(sorted(WIDTHS)), unique=True, max_size=3)):
        count = draw(st.integers(1, 300))
        ids = np.array(draw(st.lists(st.integers(0, 999), min_size=count, max_size=count)), np.int64)
        entries.append((name, np.arange(count, dtype=np.int64) + 1000 * len(entries), ids))
    return entries


@settings(max_examples=150, deadline=None)
@given(asked(), st.integers(4, 2000), st.integers(10, 2000))
def test_a_read_is_cut_into_calls_within_both_bounds_that_join_back_to_it(entries, answer_bytes, request_bytes):
    reads = sparse.split_asked(SHARD_MAP, entries, answer_bytes=answer_bytes, request_bytes=request_bytes)
    for read in reads:
        names = [name for name, _, _ in read]
        assert len(names) == len(set(names)), names              # a table at most once per call
        rows = sum(len(ids) * SHARD_MAP.specs[name].row_bytes for name, _, ids in read)
        count = sum(len(ids) for _, _, ids in read)
        # within both bounds, unless one row alone passes one of them (a call of its own)
        assert (rows <= answer_bytes and count * codec.ID_WIRE_BYTES <= request_bytes) or count == 1, (rows, count)
    for name, pos, ids in entries:   # every table's rows, in order, each once
        got = [(p, i) for read in reads for n, p, i in read if n == name]
        assert np.array_equal(np.concatenate([p for p, _ in got]), pos)
        assert np.array_equal(np.concatenate([i for _, i in got]), ids)
    assert not entries or len(reads) >= 1


def test_a_read_within_one_answer_stays_one_call():
    entries = sparse.route_rows(SHARD_MAP, {"wide": np.arange(100), "narrow": np.arange(50)})[0]
    reads = sparse.split_asked(SHARD_MAP, entries, answer_bytes=codec.CHUNK_BYTES, request_bytes=codec.CHUNK_BYTES)
    assert len(reads) == 1 and [(n, p.tolist(), i.tolist()) for n, p, i in reads[0]] == \
        [(n, p.tolist(), i.tolist()) for n, p, i in entries]


def row_gradients(draw_counts: list[int], dtype=np.float32) -> list[pb.RowGradient]:
    rng = np.random.default_rng(len(draw_counts))
    out = []
    for name, count in zip(sorted(WIDTHS), draw_counts):
        values = rng.standard_normal((count, WIDTHS[name])).astype(dtype)
        wire, data = codec.rows_to_wire(values)
        out.append(pb.RowGradient(name=name, ids=rng.integers(-2**62, 2**62, count), dtype=wire, data=data))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=3), st.integers(0, 5000), st.integers(50, 5000))
def test_row_gradients_continued_past_the_header_join_back_on_the_shard(counts, header_bytes, piece_bytes):
    grads = row_gradients(counts)
    header, messages = codec.split_row_gradients(grads, header_bytes=header_bytes, piece_bytes=piece_bytes)
    assert [g.name for g in header] == [g.name for g in grads]       # the header names every table
    assert sum(len(g.data) + codec.ID_WIRE_BYTES * len(g.ids) for g in header) <= header_bytes
    for message in messages:
        size = sum(len(p.data) + codec.ID_WIRE_BYTES * len(p.ids) for p in message)
        assert size <= piece_bytes or sum(len(p.ids) for p in message) == 1, size
    # what the shard receives: the header, then each message's pieces, serialized and parsed again
    pieces = [pb.RowGradient.FromString(p.SerializeToString()) for message in messages for p in message]
    joined = codec.join_row_gradients(header, pieces, "Push")
    assert [(g.name, list(g.ids), g.dtype, g.data) for g in joined] == \
        [(g.name, list(g.ids), g.dtype, g.data) for g in grads]


def test_row_gradients_within_the_header_are_left_as_they_are():
    grads = row_gradients([3, 4])
    assert codec.join_row_gradients(grads, [], "Push") == grads


def test_a_piece_of_a_table_the_header_lacks_or_in_another_dtype_is_refused_naming_both():
    header = row_gradients([2, 2])   # "mid" and "narrow"
    with pytest.raises(InvalidRequestError, match=r"'wide' continues no row gradient of the header .*'mid', 'narrow'"):
        codec.join_row_gradients(header, row_gradients([0, 0, 1])[2:], "Push")
    half = row_gradients([1], dtype=np.float16)
    with pytest.raises(InvalidRequestError, match="'mid' is float16, its header's is float32"):
        codec.join_row_gradients(header, half, "Push")


def test_pieces_past_their_bound_are_refused_when_they_arrive_and_the_bound_is_asked_for_once():
    asked = []
    pieces = RowPieces("Push", lambda: asked.append(1) or 100)
    pieces.add([])
    assert asked == []                                  # no piece, no bound asked for
    pieces.add([memoryview(bytes(60))])
    with pytest.raises(Exception, match=r"Push: row gradients continued past the header take more than 100 bytes "
                                        r"\(at least 120\)") as caught:
        pieces.add([memoryview(bytes(60))])
    assert type(caught.value).__name__ == "ResourceExhaustedError" and asked == [1]
    broken = RowPieces("Push", lambda: 100)
    broken.add([memoryview(b"\xff\xff")])
    with pytest.raises(InvalidRequestError, match="Push: malformed row gradient piece"):
        broken.parsed()


@pytest.mark.parametrize("count", [0, 3, 9000])
def test_a_replicated_push_with_rows_over_several_items_arrives_whole(count):
    rng = np.random.default_rng(count)
    rows = [("wide", rng.integers(0, 1000, count), rng.standard_normal((count, 512)).astype(np.float32)),
            ("narrow", np.array([5, 6], np.int64), np.ones((2, 1), np.float32))]
    push = Push("w0", 4, 2, {("b", 0): np.arange(3, dtype=np.float32)}, rows)
    items = list(op_items(Op("push", push=push, live_count=1, result=(True, 3, 5)), 7, 1))
    if count == 9000:   # 18 MB of rows: several items, none much over CHUNK_BYTES
        assert len(items) > 4
        assert all(item.ByteSize() < CHUNK_BYTES + (64 << 10) for item in items), [i.ByteSize() for i in items]
    assembler = OpAssembler(lambda name: (512,) if name == "wide" else (1,))
    done = [assembler.add(item) for item in items]
    assert done[:-1] == [None] * (len(items) - 1)
    seq, op = done[-1]
    assert seq == 7 and op.result == (True, 3, 5) and op.push.clock == 4
    assert np.array_equal(op.push.grads[("b", 0)], push.grads[("b", 0)])
    assert [name for name, _, _ in op.push.row_grads] == ["wide", "narrow"]
    for (name, ids, values), (_, got_ids, got_values) in zip(rows, op.push.row_grads):
        assert np.array_equal(got_ids, ids) and np.array_equal(got_values, values), name
