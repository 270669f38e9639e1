"""PushPull's request and response both ways: the codec's walk (tensor bytes in chunks) and protobuf's parse of a
message without them (a data channel frame's header, a call through shared memory) agree, and each refuses what
the other path carries."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import codec, frames
from ps_common.errors import InvalidRequestError, InvalidTensorError
from ps_proto.v1 import parameter_server_pb2 as pb

HEADER = pb.PushHeader(worker_id="w-1", clock=7, read_step=5,
                       row_gradients=[pb.RowGradient(name="emb", ids=[3, 1], dtype=pb.DTYPE_FLOAT32, data=b"\0" * 16)])
PULL = pb.PullAfterPush(names=["a", "b"], wait_for_step=True, wait_timeout_ms=250, shared_memory=True,
                        rows=[pb.RowIds(name="emb", ids=[4])])
PUSH = pb.PushResponse(outcome=pb.PUSH_ACCEPTED, step=6, clock=8)
ROWS = [pb.RowValues(name="emb", dtype=pb.DTYPE_FLOAT32, shape=[1, 2], data=b"\1" * 8)]


@pytest.mark.parametrize("in_shared_memory", [True, False])
def test_a_request_without_chunks_reads_the_same_by_either_decoder(in_shared_memory: bool) -> None:
    raw = frames.encode_request(HEADER, PULL, gradients_in_shared_memory=in_shared_memory)
    walked, parsed = frames.decode_request(raw), frames.decode_request(raw, chunks=False)
    for frame in (walked, parsed):
        assert frame.header == HEADER and frame.pull == PULL and frame.chunks == []
        assert frame.gradients_in_shared_memory is in_shared_memory


def test_a_request_with_chunks_is_walked_and_refused_where_none_may_come() -> None:
    chunks = list(codec.chunk_fields("a", np.arange(6, dtype=np.float32)))
    raw = frames.encode_request(HEADER, PULL, chunks)
    frame = frames.decode_request(raw)
    assert [c.name for c in frame.chunks] == ["a"] and not frame.gradients_in_shared_memory
    with pytest.raises(InvalidRequestError, match="1 chunks in a request whose gradients travel outside"):
        frames.decode_request(raw, chunks=False)


@pytest.mark.parametrize("raw", [b"", frames.encode_request(pb.PushHeader(), PULL)[2:], b"\x0a\x05ab"],
                         ids=["no header", "cut", "malformed"])
def test_a_request_without_a_header_or_that_does_not_parse_is_invalid_by_either_decoder(raw: bytes) -> None:
    for chunks in (True, False):
        with pytest.raises(InvalidRequestError, match="PushPull|malformed"):
            frames.decode_request(raw, chunks=chunks)


@pytest.mark.parametrize("ready", [True, False])
def test_a_response_without_chunks_reads_the_same_by_either_decoder(ready: bool) -> None:
    raw = frames.encode_response(PUSH, ready=ready, step=6, rows=ROWS)
    for reply in (frames.decode_response(raw, rows_asked=1), frames.decode_response(raw, rows_asked=1, chunks=False)):
        assert reply.push == PUSH and reply.ready is ready and reply.chunks == []
        assert (reply.step, reply.rows) == ((6, ROWS) if ready else (0, []))


def test_a_response_with_chunks_is_refused_where_the_values_travel_elsewhere() -> None:
    chunks = list(codec.chunk_fields("a", np.arange(4, dtype=np.float32)))
    raw = frames.encode_response(PUSH, ready=True, step=6, chunks=chunks)
    assert [c.name for c in frames.decode_response(raw).chunks] == ["a"]
    with pytest.raises(InvalidTensorError, match="shard 3 answered a PushPull whose values travel outside the "
                                                 "message with 1 chunks"):
        frames.decode_response(raw, shard=3, chunks=False)


def test_a_ready_response_without_the_rows_asked_is_refused_by_either_decoder() -> None:
    raw = frames.encode_response(PUSH, ready=True, step=6)
    for chunks in (True, False):
        with pytest.raises(InvalidTensorError, match="answered 0 tables of rows to a PushPull that asked for 2"):
            frames.decode_response(raw, rows_asked=2, chunks=chunks)
