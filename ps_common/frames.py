"""The PushPull frame, both ways and for both sides: one encoder and one decoder per message.

PushPullRequest and PushPullResponse travel as raw bytes, walked by the codec so tensor
bytes are used where they arrived and copied once when sent (ps_common/codec.py). This
module is the only code that knows their layout; the field numbers come from the
generated descriptors, never written by hand, so a renumbered proto cannot drift from it.

A message without tensor bytes -- the header of a data channel's frame and its answer, a call whose
bytes are in shared memory -- is built and parsed whole by protobuf's C library instead: no bytes to
spare a copy of, and one call where the codec's walk is some thirty Python calls (a frame's header both
ways: 8 -> 4 us to encode, 9 -> 2 to decode on these machines). The bytes are the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ps_common import codec
from ps_common.errors import InvalidRequestError, InvalidTensorError
from ps_proto.v1 import parameter_server_pb2 as pb

__all__ = ["PushPullReply", "PushPullRequest", "decode_request", "decode_response", "encode_request",
           "encode_response"]


def _number(message: type, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


# Fields 1 and 2 of both messages are read as codec.decode_message reads them (header or step, chunks).
_REQ_HEADER, _REQ_CHUNKS = _number(pb.PushPullRequest, "header"), _number(pb.PushPullRequest, "chunks")
_REQ_PULL = _number(pb.PushPullRequest, "pull")
_REQ_SHARED = _number(pb.PushPullRequest, "gradients_in_shared_memory")
_RES_STEP, _RES_CHUNKS = _number(pb.PushPullResponse, "step"), _number(pb.PushPullResponse, "chunks")
_RES_PUSH = _number(pb.PushPullResponse, "push")
_RES_READY = _number(pb.PushPullResponse, "ready")
_RES_ROWS = _number(pb.PushPullResponse, "rows")
assert (_REQ_HEADER, _REQ_CHUNKS, _RES_STEP, _RES_CHUNKS) == (1, 2, 1, 2), "the codec reads fields 1 and 2"


def _parse(message_type, raw, what: str):
    try:
        return message_type.FromString(bytes(raw))
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequestError(f"{what}: malformed ({exc})") from exc


@dataclass
class PushPullRequest:
    """A decoded PushPullRequest: the push's header and gradient chunks (views), the pull, the shared-memory flag."""

    header: pb.PushHeader
    chunks: list[codec.ChunkView]
    pull: pb.PullAfterPush
    gradients_in_shared_memory: bool


def encode_request(header: pb.PushHeader, pull: pb.PullAfterPush, chunks: Iterable[dict] | None = None, *,
                   gradients_in_shared_memory: bool = False) -> bytes:
    """A serialized PushPullRequest; `chunks` are codec.chunk_fields dicts (their data copied once, here), None
    when the gradients travel elsewhere."""
    if chunks is None:
        return pb.PushPullRequest(header=header, pull=pull,
                                  gradients_in_shared_memory=gradients_in_shared_memory).SerializeToString()
    return b"".join([codec.encode_message(header.SerializeToString(), chunks),
                     codec.message_field(_REQ_PULL, pull.SerializeToString()),
                     codec.scalar_field(_REQ_SHARED, gradients_in_shared_memory)])


def decode_request(raw: bytes, *, chunks: bool = True) -> PushPullRequest:
    """The request's parts; InvalidRequestError for bytes that do not parse or a missing header. `chunks=False`:
    a request whose gradients travel elsewhere (a data channel frame's header), parsed whole; one with chunks
    is then refused (InvalidRequestError)."""
    if not chunks:
        message = _parse(pb.PushPullRequest, raw, "PushPull request")
        if not message.HasField("header"):
            raise InvalidRequestError(f"PushPull: the request must carry a header (field {_REQ_HEADER})")
        if message.chunks:
            raise InvalidRequestError(f"PushPull: {len(message.chunks)} chunks in a request whose gradients travel "
                                      "outside the message (a data channel frame's header, or shared memory)")
        return PushPullRequest(message.header, [], message.pull, message.gradients_in_shared_memory)
    header, chunks_, extras = codec.decode_with_extras(raw)
    if not isinstance(header, memoryview):
        raise InvalidRequestError(f"PushPull: the request must carry a header (field {_REQ_HEADER})")
    in_shared_memory = bool(extras.get(_REQ_SHARED, 0))
    if in_shared_memory and chunks_:
        raise InvalidRequestError("PushPull: gradients in shared memory and in chunks at once")
    return PushPullRequest(_parse(pb.PushHeader, header, "PushPull header"), chunks_,
                           _parse(pb.PullAfterPush, extras.get(_REQ_PULL, b""), "PushPull pull"), in_shared_memory)


@dataclass
class PushPullReply:
    """A PushPullResponse: the push's outcome, whether the pull was answered, its step, values and rows."""

    push: pb.PushResponse
    ready: bool
    step: int = 0
    chunks: list[codec.ChunkView] = field(default_factory=list)   # decoded: views into the message
    rows: list[pb.RowValues] = field(default_factory=list)


def encode_response(push: pb.PushResponse, *, ready: bool, step: int = 0, chunks: Iterable[dict] | None = None,
                    rows: Sequence[pb.RowValues] = ()) -> bytes:
    """A serialized PushPullResponse; `chunks` are codec.chunk_fields dicts of the values (copied once, here), None
    when the values travel elsewhere (or there are none)."""
    if chunks is None:
        return pb.PushPullResponse(step=step if ready else 0, push=push, ready=ready,
                                   rows=rows if ready else ()).SerializeToString()
    values = codec.encode_message(None, chunks) if ready else b""
    return b"".join([codec.scalar_field(_RES_STEP, step if ready else 0), values,
                     codec.message_field(_RES_PUSH, push.SerializeToString()),
                     codec.scalar_field(_RES_READY, ready),
                     *(codec.message_field(_RES_ROWS, r.SerializeToString()) for r in (rows if ready else ()))])


def decode_response(raw: bytes, *, rows_asked: int = 0, shard: int = 0, chunks: bool = True) -> PushPullReply:
    """The response's parts; InvalidTensorError when a ready answer lacks the rows asked for. `chunks=False`: an
    answer whose values travel elsewhere (a data channel's reply header, shared memory), parsed whole; one with
    chunks is then refused (InvalidTensorError)."""
    if not chunks:
        message = _parse(pb.PushPullResponse, raw, "PushPull response")
        if message.chunks:
            raise InvalidTensorError(f"shard {shard} answered a PushPull whose values travel outside the message "
                                     f"with {len(message.chunks)} chunks in it")
        reply = PushPullReply(message.push, message.ready, message.step, [], list(message.rows))
    else:
        step, chunks_, extras = codec.decode_with_extras(raw, repeated=frozenset({_RES_ROWS}))
        reply = PushPullReply(_parse(pb.PushResponse, extras.get(_RES_PUSH, b""), "PushPull response"),
                              bool(extras.get(_RES_READY, 0)), int(step or 0), chunks_,
                              [pb.RowValues.FromString(bytes(v)) for v in extras[_RES_ROWS]])
    if reply.ready and rows_asked and len(reply.rows) != rows_asked:
        raise InvalidTensorError(f"shard {shard} answered {len(reply.rows)} tables of rows to a PushPull that asked "
                                 f"for {rows_asked}: a server without PullAfterPush.rows?")
    return reply
