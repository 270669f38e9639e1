"""The gRPC boundary: thin ps.v1.ParameterServer handlers over the Shard, errors mapped to status codes.

Each handler does the same four things in order: check the request, call the domain,
translate a typed error into a status, fill the response.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import grpc

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_common import codec
from ps_common.errors import (
    REASON_KEY,
    InitMismatchError,
    InvalidRequestError,
    InvalidTensorError,
    NotInitializedError,
    PermissionDeniedError,
    PSError,
    ShuttingDownError,
    UnknownTensorError,
    UnknownWorkerError,
    WaitTimeoutError,
)
from ps_common.shard_map import ParamSpec
from ps_server.shard import Shard

log = logging.getLogger(__name__)

#: The one catalog from domain errors to gRPC status codes.
STATUS_OF: dict[type[PSError], grpc.StatusCode] = {
    UnknownTensorError: grpc.StatusCode.NOT_FOUND,
    UnknownWorkerError: grpc.StatusCode.NOT_FOUND,
    InvalidTensorError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    NotInitializedError: grpc.StatusCode.FAILED_PRECONDITION,
    InitMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    WaitTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShuttingDownError: grpc.StatusCode.UNAVAILABLE,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(exc: PSError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


def translate_errors(method: Callable) -> Callable:
    """Turns typed domain errors into `context.abort(code, message)`; anything else is INTERNAL."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except PSError as exc:
            context.set_trailing_metadata(((REASON_KEY, exc.reason),))
            context.abort(status_of(exc), str(exc))
        except Exception as exc:  # a bug: log it, keep serving
            log.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {type(exc).__name__}: {exc}")

    return wrapper


def _header_and_chunks(requests: Iterator[bytes], rpc: str, header_type):
    """(header, chunks) of a client stream of serialized requests (PushRequest, InitRequest).

    The requests arrive as bytes (see add_to_server) and are walked by
    codec.decode_message, so the tensor bytes are used where they arrived. The first
    message must carry the header; headers in later messages are ignored.
    """
    first = next(requests, None)
    header, chunks = codec.decode_message(first) if first is not None else (None, [])
    if not isinstance(header, memoryview):
        raise InvalidRequestError(f"{rpc}: the first message must carry a header")
    try:
        parsed = header_type.FromString(bytes(header))
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequestError(f"{rpc}: malformed header: {exc}") from exc

    def all_chunks() -> Iterator[codec.ChunkView]:
        yield from chunks
        for raw in requests:
            yield from codec.decode_message(raw)[1]

    return parsed, all_chunks()


def _pass_bytes(serialize: Callable[[object], bytes]) -> Callable[[object], bytes]:
    """A response serializer that sends already-serialized messages (bytes) as they are."""

    def serializer(message: object) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serializer


def add_to_server(servicer: "ParameterServerServicer", server: grpc.Server) -> None:
    """Registers ps.v1.ParameterServer, as the generated add_ParameterServerServicer_to_server
    does, except that Pull may yield pre-serialized bytes: a part's large chunks are
    serialized once per version (ps_server/store.py), not once per pull."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {}
    for method in service.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        serialize = response.SerializeToString
        deserialize = request.FromString
        if method.name == "Pull":
            serialize = _pass_bytes(serialize)
        if method.name in ("Push", "InitParameters"):
            deserialize = None   # raw bytes: _header_and_chunks walks them without copying tensor data
        handlers[method.name] = kinds[(method.client_streaming, method.server_streaming)](
            getattr(servicer, method.name), request_deserializer=deserialize, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """ps.v1.ParameterServer over one Shard."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    @translate_errors
    def InitParameters(self, request_iterator, context):
        header, chunks = _header_and_chunks(request_iterator, "InitParameters", pb.InitHeader)
        specs = []
        for s in header.parameters:
            specs.append(ParamSpec(name=s.name, dtype=codec.dtype_from_wire(s.dtype, name=s.name).name,
                                   shape=tuple(int(d) for d in s.shape)))
        already, step, nparts = self.shard.initialize(specs, chunks, header.worker_id)
        return pb.InitResponse(already_initialized=already, step=step, num_parts=nparts)

    @translate_errors
    def Push(self, request_iterator, context):
        h, chunks = _header_and_chunks(request_iterator, "Push", pb.PushHeader)
        grads = self.shard.decode(chunks)
        r = self.shard.push(h.worker_id, h.clock, h.read_step, grads)
        return pb.PushResponse(outcome=pb.PUSH_ACCEPTED if r.accepted else pb.PUSH_DROPPED, drop_reason=r.drop_reason,
                               message=r.message, step=r.step, clock=r.clock, duplicate=r.duplicate, aggregated=r.aggregated)

    def Pull(self, request, context):
        # A generator handler: errors must be raised before the first yield to abort cleanly.
        messages = self._pull(request, context)
        yield from messages

    @translate_errors
    def _pull(self, request, context) -> list[pb.PullResponse]:
        timeout = self.shard.wait_timeout(request.wait_timeout_ms, context.time_remaining())
        return self.shard.pull(list(request.names), min_step=request.min_step, worker_id=request.worker_id,
                               clock=request.clock, timeout=timeout)

    @translate_errors
    def Barrier(self, request, context):
        timeout = self.shard.wait_timeout(request.timeout_ms, context.time_remaining())
        generation, arrived = self.shard.barrier(request.name, request.participant_id, request.participants, timeout)
        return pb.BarrierResponse(generation=generation, arrived=arrived)

    @translate_errors
    def RegisterWorker(self, request, context):
        clock, step, lease = self.shard.register(request.worker_id)
        return pb.RegisterWorkerResponse(clock=clock, step=step, lease_ms=int(lease * 1000))

    @translate_errors
    def Heartbeat(self, request, context):
        lease, step = self.shard.heartbeat(request.worker_id)
        return pb.HeartbeatResponse(lease_ms=int(lease * 1000), step=step)

    @translate_errors
    def DeregisterWorker(self, request, context):
        self.shard.deregister(request.worker_id)
        return pb.DeregisterWorkerResponse()

    @translate_errors
    def GetClusterInfo(self, request, context):
        return self.shard.cluster_info()
