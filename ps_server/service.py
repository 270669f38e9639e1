"""The gRPC boundary of ps.v1.ParameterServer: thin handlers over the Shard.

Each handler reads the same four things in order: check the request (decode it with the
codec), call the domain, translate a typed error into a status, fill the response. Only
this module (with ps_server/admin.py and ps_server/pull_cache.py) knows the wire types.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from ps_common import codec
from ps_common.errors import (REASON_KEY, InvalidRequestError, PSError, ResourceExhaustedError,
                              SharedMemoryUnavailableError, UnknownTensorError, UnknownWorkerError, WaitTimeoutError,
                              shorten)
from ps_common.shared_memory import Layout
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.admission import Admission, StreamWatchdog, caller_of
from ps_server.consistency import Mode, step_after_push
from ps_server.membership import PushResult
from ps_server.pull_cache import PullCache
from ps_server.rows import check_table_name
from ps_server.shared_memory import Segments
from ps_server.shard import Shard, ShardView

log = logging.getLogger(__name__)

#: The domain's modes on the wire.
WIRE_MODE = {Mode.SYNC: pb.MODE_SYNC, Mode.SSP: pb.MODE_SSP, Mode.ASYNC: pb.MODE_ASYNC}


def status_of(exc: PSError) -> grpc.StatusCode:
    """The status code the catalog gives an error (INTERNAL for one that never should cross the wire)."""
    return getattr(grpc.StatusCode, exc.status or "INTERNAL", grpc.StatusCode.INTERNAL)


def abort_with(context: grpc.ServicerContext, exc: PSError) -> None:
    """Ends the rpc with the error's status, its message, and its reason in the trailing metadata."""
    context.set_trailing_metadata(((REASON_KEY, exc.reason),))
    context.abort(status_of(exc), shorten(str(exc)))


@dataclass(frozen=True)
class Malformed:
    """What a request deserializer hands the handler for bytes that do not parse (never raises)."""

    rpc: str
    nbytes: int
    error: str


def safe_deserializer(message_type, rpc: str) -> Callable[[bytes], object]:
    """`message_type.FromString` that returns Malformed instead of raising.

    gRPC answers a deserializer's exception with INTERNAL ("Exception deserializing
    request!"), but bytes that do not parse are the caller's error: translate_errors turns
    Malformed into INVALID_ARGUMENT naming the rpc and the parser's complaint.
    """

    def deserialize(raw: bytes) -> object:
        try:
            return message_type.FromString(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything the parser raises on garbage
            return Malformed(rpc, len(raw), f"{type(exc).__name__}: {exc}")

    return deserialize


def translate_errors(method: Callable) -> Callable:
    """Turns typed domain errors into their status (abort_with); anything else is a bug: INTERNAL.

    A request that did not parse (Malformed) is INVALID_ARGUMENT. A client stream that ends
    under the handler (the client cancelled, or the watchdog cut it) is CANCELLED, logged
    at debug level: it is the client's doing, not the shard's.
    """

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise InvalidRequestError(f"{request.rpc}: the request's {request.nbytes} bytes do not parse as "
                                          f"its message ({request.error})")
            return method(self, request, context)
        except PSError as exc:
            abort_with(context, exc)
        except grpc.RpcError as exc:   # raised by a client stream's request iterator when the call ends
            log.debug("%s: the client stream ended under the handler: %s", method.__name__, exc)
            context.abort(grpc.StatusCode.CANCELLED, f"{method.__name__}: the request stream was cancelled")
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


def _assemble(chunks: Iterator[codec.ChunkView], layout, *, widen: bool = False) -> dict:
    assembler = codec.PartAssembler(layout, widen=widen)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def _pass_bytes(serialize: Callable[[object], bytes]) -> Callable[[object], bytes]:
    """A response serializer that sends already-serialized messages (bytes) as they are."""

    def serializer(message: object) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serializer


def push_response(result: PushResult) -> pb.PushResponse:
    return pb.PushResponse(outcome=pb.PUSH_ACCEPTED if result.accepted else pb.PUSH_DROPPED,
                           drop_reason=int(result.drop_reason), message=result.message, step=result.step,
                           clock=result.clock, duplicate=result.duplicate, aggregated=result.aggregated)


def cluster_info(shard: Shard, view: ShardView) -> pb.ClusterInfo:
    """ClusterInfo from the shard's configuration and a view of its state."""
    c = shard.config
    info = pb.ClusterInfo(
        shard_index=c.shard_index, num_shards=c.num_shards, mode=WIRE_MODE[view.policy.mode],
        replicas_to_aggregate=c.replicas_to_aggregate, total_replicas=c.total_replicas,
        staleness=-1 if c.staleness == float("inf") else int(c.staleness), max_staleness=c.max_staleness,
        step=view.step, initialized=view.initialized, optimizer=view.optimizer,
        partition_min_bytes=c.partition_min_bytes, chunk_bytes=c.chunk_bytes, dropped_stale=view.dropped,
        effective_replicas=view.policy.effective_replicas,
    )
    if view.shard_map is not None:
        for spec in sorted(view.shard_map.specs.values(), key=lambda s: s.name):
            info.parameters.append(codec.param_spec_to_wire(spec))
        for part in view.shard_map.parts:
            info.parts.add(name=part.name, row_start=part.row_start, row_end=part.row_end, shard=part.shard)
    for d in view.dynamic:
        info.dynamic_tables.add(name=d.name, rows=d.rows, created=d.created, evicted=d.evicted)
    for w in view.workers:
        info.workers.add(worker_id=w.worker_id, clock=w.clock, live=w.live,
                         lease_remaining_ms=int(w.lease_remaining * 1000))
    return info


#: The ParameterServer rpcs of the data plane: they run on the data-plane pool and take an admission slot
#: (ps_server/admission.py); the others are control rpcs.
DATA_PLANE_RPCS = frozenset({"InitParameters", "Push", "Pull", "PullRows", "PushPull", "Barrier"})
#: The ParameterServer rpcs whose requests are taken as raw bytes and walked by the codec.
RAW_REQUESTS = frozenset({"Push", "InitParameters", "PushPull"})
#: The ParameterServer rpcs whose responses may be bytes serialized ahead (ps_server/pull_cache.py).
RAW_RESPONSES = frozenset({"Pull", "PushPull"})


def add_to_server(servicer: object, server: grpc.Server, service_name: str = "ParameterServer") -> None:
    """Registers a ps.v1 service, as the generated add_*Servicer_to_server does, except that:

    - unary requests are parsed by safe_deserializer (bytes that do not parse get
      INVALID_ARGUMENT, not INTERNAL);
    - Push and InitParameters take raw bytes, walked by the codec without copying tensor data;
    - Pull may yield pre-serialized bytes (ps_server/pull_cache.py).
    """
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    service = pb.DESCRIPTOR.services_by_name[service_name]
    raw = service_name == "ParameterServer"
    handlers = {}
    for method in service.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        serialize = response.SerializeToString
        if raw and method.name in RAW_RESPONSES:
            serialize = _pass_bytes(serialize)
        if raw and method.name in RAW_REQUESTS:
            deserialize = None
        elif method.client_streaming:  # pragma: no cover - every streamed request is in RAW_REQUESTS
            raise NotImplementedError(f"{service.full_name}/{method.name}: a streamed request type needs a decoder here")
        else:
            deserialize = safe_deserializer(request, f"{service_name}.{method.name}")
        handlers[method.name] = kinds[(method.client_streaming, method.server_streaming)](
            getattr(servicer, method.name), request_deserializer=deserialize, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """ps.v1.ParameterServer over one Shard.

    Data-plane rpcs (InitParameters, Push, Pull, Barrier) take a slot of `admission` first
    (RESOURCE_EXHAUSTED when none is free); client streams are watched by `watchdog`, which
    cuts a stream that stalls. Control rpcs (registration, heartbeats, cluster info) take no
    slot, so they are answered while the data plane is full.
    """

    def __init__(self, shard: Shard, *, admission: Admission | None = None,
                 watchdog: StreamWatchdog | None = None, segments: Segments | None = None) -> None:
        self.shard = shard
        self.pull_cache = PullCache(shard.config.chunk_bytes)
        self.admission = admission or Admission(shard.config.data_plane_limit, shard_index=shard.config.shard_index,
                                                is_live=shard.holds_lease)
        self.watchdog = watchdog
        self.segments = segments or Segments(limit=shard.config.max_registered_workers,
                                             shard_index=shard.config.shard_index)

    def _stream(self, requests: Iterator[bytes], context, rpc: str) -> Iterator[bytes]:
        return requests if self.watchdog is None else self.watchdog.watch(requests, context, rpc)

    @translate_errors
    def InitParameters(self, request_iterator, context):
        with self.admission.enter("InitParameters", caller_of(context)):
            header, chunks = _header_and_chunks(self._stream(request_iterator, context, "InitParameters"),
                                                "InitParameters", pb.InitHeader)
            specs = [codec.spec_from_wire(s) for s in header.parameters]
            values = _assemble(chunks, self.shard.init_layout(specs))
            already, step, nparts = self.shard.initialize(specs, values, header.worker_id)
        return pb.InitResponse(already_initialized=already, step=step, num_parts=nparts)

    @translate_errors
    def Push(self, request_iterator, context):
        with self.admission.enter("Push", caller_of(context)):
            header, chunks = _header_and_chunks(self._stream(request_iterator, context, "Push"), "Push",
                                                pb.PushHeader)
            grads = _assemble(chunks, self.shard.push_layout(), widen=True)   # half-size wire: widened
            result = self.shard.push(header.worker_id, header.clock, header.read_step, grads,
                                     self._row_grads(header))
        return push_response(result)

    def Pull(self, request, context):
        # A generator handler: errors must be raised before the first yield to abort cleanly.
        yield from self._pull(request, context)

    @translate_errors
    def _pull(self, request, context) -> list[pb.PullResponse | bytes]:
        with self.admission.enter("Pull", caller_of(context)):
            timeout = self.shard.wait_timeout(request.wait_timeout_ms, context.time_remaining())
            wire = wire_dtype(request.wire_dtype)
            return self.shard.pull(list(request.names), min_step=request.min_step, worker_id=request.worker_id,
                                   clock=request.clock, timeout=timeout,
                                   read=lambda step, parts: self.pull_cache.messages(step, parts, wire))

    def _row_grads(self, header: pb.PushHeader) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The header's RowGradients as (name, ids, rows) arrays (widened from a half-size wire)."""
        if not header.row_gradients:
            return []
        self.shard.push_layout()   # FAILED_PRECONDITION before InitParameters
        specs = self.shard.store.shard_map.specs
        out = []
        for rg in header.row_gradients:
            check_table_name(rg.name, "row gradient")
            spec = specs.get(rg.name)
            if spec is None:
                raise UnknownTensorError(f"row gradient: tensor {rg.name!r} is not a parameter of this model")
            ids = np.array(rg.ids, dtype=np.int64)
            out.append((rg.name, ids, codec.rows_from_wire(rg.name, rg.dtype, rg.data, len(ids), spec.row_shape,
                                                           want=np.dtype(spec.dtype))))
        return out

    @translate_errors
    def PullRows(self, request, context):
        with self.admission.enter("PullRows", caller_of(context)):
            timeout = self.shard.wait_timeout(request.wait_timeout_ms, context.time_remaining())
            tables = [(t.name, np.array(t.ids, dtype=np.int64)) for t in request.tables]
            step, rows = self.shard.pull_rows(tables, min_step=request.min_step, worker_id=request.worker_id,
                                              clock=request.clock, timeout=timeout)
        return pb.PullRowsResponse(step=step, tables=[row_values(name, values) for name, values in rows])

    @translate_errors
    def Barrier(self, request, context):
        with self.admission.enter("Barrier", caller_of(context)):
            timeout = self.shard.wait_timeout(request.timeout_ms, context.time_remaining())
            generation, arrived = self.shard.barrier(request.name, request.participant_id, request.participants,
                                                     timeout)
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
        self.segments.close(request.worker_id)
        return pb.DeregisterWorkerResponse()

    @translate_errors
    def GetClusterInfo(self, request, context):
        return cluster_info(self.shard, self.shard.view())

    @translate_errors
    def PushPull(self, request: bytes, context):
        """Push, then the pull the worker needs next, in one message each way (docs/protocol.md, "PushPull")."""
        with self.admission.enter("PushPull", caller_of(context)):
            header_view, chunks, extras = codec.decode_with_extras(request)
            if not isinstance(header_view, memoryview):
                raise InvalidRequestError("PushPull: the request must carry a header (field 1)")
            header = _parse(pb.PushHeader, header_view, "PushPull header")
            pull = _parse(pb.PullAfterPush, extras.get(3, b""), "PushPull pull")
            # the rows to read after the push are checked before it, so a bad request changes nothing
            read_rows, rows_bytes = self.shard.rows_reader(
                [(t.name, np.array(t.ids, dtype=np.int64)) for t in pull.rows],
                f"PushPull rows by {header.worker_id!r}") if pull.rows else (None, 0)
            segment = None
            if extras.get(4) or pull.shared_memory:
                segment = self._segment_of(header.worker_id)
            if extras.get(4):
                if chunks:
                    raise InvalidRequestError("PushPull: gradients in shared memory and in chunks at once")
                self.shard.push_layout()   # FAILED_PRECONDITION before init
                current = Layout.of((key, state.value.dtype, state.value.shape) for key, state in self.shard.store_parts())
                if segment[1] != current:
                    self.segments.close(header.worker_id)
                    raise SharedMemoryUnavailableError(
                        f"worker {header.worker_id!r}: the shared-memory layout no longer fits shard "
                        f"{self.shard.config.shard_index}'s parts (re-initialized?): open it again")
                grads = {slot.key: segment[0].view(slot) for slot in segment[1].gradients}
            else:
                grads = _assemble(chunks, self.shard.push_layout(), widen=True)
            result = self.shard.push(header.worker_id, header.clock, header.read_step, grads,
                                     self._row_grads(header))
            min_step = step_after_push(result.accepted, result.drop_reason, header.read_step, result.step) \
                if pull.wait_for_step else 0
            wire = wire_dtype(pull.wire_dtype)
            read = (lambda step, parts: self.pull_cache.body(step, parts, wire)) \
                if segment is None or not pull.shared_memory else _write_values(segment)
            if read_rows is not None:   # the rows under the same lock, at the values' step
                read = _and_rows(read, read_rows)
            rows: list[tuple[str, np.ndarray]] = []
            try:
                step, body = self.shard.pull(list(pull.names), min_step=min_step,
                                             worker_id=header.worker_id if pull.ssp else "",
                                             clock=result.clock, timeout=self._push_pull_wait(pull, context),
                                             read=read, nbytes=None if read_rows is None else rows_bytes)
                if read_rows is not None:
                    body, rows = body
                ready = True
            except WaitTimeoutError:
                step, body, ready = 0, b"", False
            except ResourceExhaustedError as exc:
                if read_rows is None:
                    raise
                # new dynamic rows would pass max_shard_bytes: the push stands, the rows are not read
                log.warning("PushPull by %r: its rows were not read: %s", header.worker_id, exc)
                step, body, ready = 0, b"", False
        return b"".join([codec.scalar_field(1, step), body,
                         codec.message_field(3, push_response(result).SerializeToString()),
                         codec.scalar_field(4, ready), *(codec.message_field(5, row_values(name, values).SerializeToString())
                                                         for name, values in rows)])

    def _push_pull_wait(self, pull: pb.PullAfterPush, context) -> float:
        if pull.wait_timeout_ms < 0:
            raise InvalidRequestError(f"PushPull: wait_timeout_ms must be >= 0, got {pull.wait_timeout_ms}")
        if pull.wait_timeout_ms == 0:
            return 0.0
        return self.shard.wait_timeout(pull.wait_timeout_ms, context.time_remaining())

    def _segment_of(self, worker_id: str):
        found = self.segments.get(worker_id)
        if found is None:
            raise SharedMemoryUnavailableError(f"worker {worker_id!r} has no shared-memory segment on shard "
                                               f"{self.shard.config.shard_index}: call OpenSharedMemory first")
        return found

    @translate_errors
    def OpenSharedMemory(self, request, context):
        self.shard.check_id("OpenSharedMemory: worker_id", request.worker_id)
        view = self.shard.view()
        known = {w.worker_id for w in view.workers}
        if request.worker_id not in known:
            raise UnknownWorkerError(f"worker {request.worker_id!r} is not registered on this shard; "
                                     "call RegisterWorker")
        layout = Layout.of((key, state.value.dtype, state.value.shape)
                           for key, state in self.shard.store_parts())
        door, ticket = self.segments.offer(request.worker_id, layout, known=known)
        return pb.SharedMemoryResponse(size=layout.size, values_offset=layout.values_offset, door=door,
                                       ticket=ticket)


def row_values(name: str, values: np.ndarray) -> pb.RowValues:
    """The rows of one table, as PullRows and PushPull answer them."""
    dtype, data = codec.rows_to_wire(values)
    return pb.RowValues(name=name, dtype=dtype, shape=values.shape, data=data)


def _and_rows(read: Callable, read_rows: Callable[[int], list]) -> Callable:
    """A Shard.pull read callback: `read`'s (step, body), with the rows read at the same step: (step, (body, rows))."""

    def both(step: int, parts) -> tuple[int, tuple[bytes, list]]:
        step, body = read(step, parts)
        return step, (body, read_rows(step))

    return both


def wire_dtype(value: int) -> np.dtype | None:
    """The half-size dtype a pull asks float32 parts in (None: as stored); INVALID_ARGUMENT for another."""
    if value in (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32):
        return None
    dtype = codec.dtype_from_wire(value, name="(wire_dtype)")
    if dtype not in codec.NARROW_FLOAT32:
        raise InvalidRequestError(f"wire_dtype {pb.DType.Name(value)}: a pull may ask for float32, float16 or "
                                  "bfloat16 only")
    return dtype


def _parse(message_type, raw, what: str):
    try:
        return message_type.FromString(bytes(raw))
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequestError(f"{what}: malformed ({exc})") from exc


def _write_values(segment):
    """A Shard.pull read callback that copies the values into the worker's segment (under the shard's lock)."""
    memory, layout = segment
    slots = {slot.key: slot for slot in layout.values}

    def read(step: int, parts) -> tuple[int, bytes]:
        for state in parts:
            slot = slots.get((state.part.name, state.part.row_start))
            if slot is None:
                raise InvalidRequestError(f"part {state.part.name!r} rows from {state.part.row_start} is not in the "
                                          "worker's shared-memory layout: open it again (OpenSharedMemory)")
            np.copyto(memory.view(slot), state.value, casting="no")
        return step, b""

    return read
