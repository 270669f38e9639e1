"""The gRPC boundary of ps.v1.ParameterServer: thin handlers over the Shard.

Every data-plane handler reads the same way (etcd's kvServer.Range): check the request
(decode it with the codec, into the domain's values of ps_server/operations.py), call one
Shard method, and fill the response; typed errors become statuses in one place
(ps_common/boundary.py, `translate_errors`). Only this module (with ps_server/admin.py)
knows the wire types. A push goes: here -> shard.py -> membership.py, consistency.py ->
store.py -> optimizers.py, each returning to its caller; a pull: here -> shard.py ->
consistency.py (the hold) -> store.py (the values) -> back here to encode them. PushPull also
arrives from the data channel (ps_server/data_channel.py): `push_pull_on_channel` makes the same
domain call, with the connection's buffer standing for a shared-memory segment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType

import grpc
import numpy as np

from ps_common import codec, frames
from ps_common import data_channel as dc
from ps_common.boundary import safe_deserializer, translate_errors
from ps_common.data_channel import DataChannelUnavailableError, FrameBuffer, Grant
from ps_common.errors import InvalidRequestError, ResourceExhaustedError, UnknownWorkerError
from ps_common.shard_map import PartKey
from ps_common.shared_memory import Layout, Segment
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.admission import Admission, StreamWatchdog, caller_of
from ps_server.data_channel import DataChannelServer, Violation
from ps_server.membership import PushResult
from ps_server.operations import Push, PushPullResult, Read, StateRead
from ps_server.shared_memory import Segments
from ps_server.shard import Shard, ShardView

log = logging.getLogger(__name__)

#: The ParameterServer rpcs of the data plane: they run on the data-plane pool and take an admission slot
#: (ps_server/admission.py); the others are control rpcs.
DATA_PLANE_RPCS = frozenset({"InitParameters", "Push", "Pull", "PullRows", "PushPull", "Barrier", "ReadState"})
#: The ParameterServer rpcs whose requests are taken as raw bytes and walked by the codec.
RAW_REQUESTS = frozenset({"Push", "InitParameters", "PushPull"})
#: The ParameterServer rpcs whose responses are bytes serialized by the codec.
RAW_RESPONSES = frozenset({"Pull", "PushPull"})


#: PushRequest's field of row gradients continued past the header (parameter_server.proto).
ROW_PIECES_FIELD = 3


class RowPieces:
    """The PushRequest.row_gradients of one Push stream, gathered as its messages are walked: at most `limit`
    bytes of them (ResourceExhaustedError on the message that passes it, before the rest is read)."""

    def __init__(self, rpc: str, limit: Callable[[], int]) -> None:
        self.rpc, self.limit = rpc, limit   # the bound, asked for when the first piece arrives
        self.views: list[memoryview] = []
        self.nbytes = 0
        self._bound: int | None = None

    def add(self, views: list[memoryview]) -> None:
        if not views:
            return
        if self._bound is None:
            self._bound = self.limit()
        self.nbytes += sum(len(v) for v in views)
        if self.nbytes > self._bound:
            raise ResourceExhaustedError(
                f"{self.rpc}: row gradients continued past the header take more than {self._bound} bytes (at least "
                f"{self.nbytes}), more than one push may carry (8 MiB, or the shard's parameter bytes if more)")
        self.views.extend(views)

    def parsed(self) -> list[pb.RowGradient]:
        try:
            return [pb.RowGradient.FromString(bytes(view)) for view in self.views]
        except Exception as exc:  # protobuf's DecodeError
            raise InvalidRequestError(f"{self.rpc}: malformed row gradient piece: {exc}") from exc


def _header_and_chunks(requests: Iterator[bytes], rpc: str, header_type, pieces: RowPieces | None = None):
    """(header, chunks) of a client stream of serialized requests (PushRequest, InitRequest).

    The requests arrive as bytes (see add_to_server) and are walked by
    codec.decode_message, so the tensor bytes are used where they arrived. The first
    message must carry the header; headers in later messages are ignored. With `pieces`
    (a Push), each message's continued row gradients are gathered into it as the chunks are read.
    """
    def decode(raw: bytes) -> tuple[int | memoryview | None, list[codec.ChunkView]]:
        if pieces is None:
            return codec.decode_message(raw)
        first, chunks, extras = codec.decode_with_extras(raw, frozenset({ROW_PIECES_FIELD}))
        pieces.add(extras[ROW_PIECES_FIELD])
        return first, chunks

    first = next(requests, None)
    header, chunks = decode(first) if first is not None else (None, [])
    if not isinstance(header, memoryview):
        raise InvalidRequestError(f"{rpc}: the first message must carry a header")
    try:
        parsed = header_type.FromString(bytes(header))
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequestError(f"{rpc}: malformed header: {exc}") from exc

    def all_chunks() -> Iterator[codec.ChunkView]:
        yield from chunks
        for raw in requests:
            yield from decode(raw)[1]

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
        shard_index=c.shard_index, num_shards=c.num_shards, mode=codec.mode_to_wire(view.policy.mode),
        replicas_to_aggregate=c.replicas_to_aggregate, total_replicas=c.total_replicas,
        staleness=-1 if c.staleness == float("inf") else int(c.staleness), max_staleness=c.max_staleness,
        step=view.step, initialized=view.initialized, optimizer=view.optimizer,
        partition_min_bytes=c.partition_min_bytes, chunk_bytes=c.chunk_bytes, dropped_stale=view.dropped,
        effective_replicas=view.policy.effective_replicas, row_gradients_continue=True,
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




def add_to_server(servicer: object, server: grpc.Server, service_name: str = "ParameterServer",
                  messages: ModuleType = pb) -> None:
    """Registers a ps.v1 service (of the generated module `messages`), as the generated
    add_*Servicer_to_server does, except that:

    - requests are parsed by safe_deserializer (bytes that do not parse get INVALID_ARGUMENT,
      not INTERNAL); a client stream's handler gets the Malformed items in its stream;
    - Push and InitParameters take raw bytes, walked by the codec without copying tensor data;
    - Pull and PushPull answer serialized messages (the codec's, ps_common/frames.py for PushPull).
    """
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    service = messages.DESCRIPTOR.services_by_name[service_name]
    raw = messages is pb and service_name == "ParameterServer"
    handlers = {}
    for method in service.methods:
        request, response = getattr(messages, method.input_type.name), getattr(messages, method.output_type.name)
        serialize = response.SerializeToString
        if raw and method.name in RAW_RESPONSES:
            serialize = _pass_bytes(serialize)
        if raw and method.name in RAW_REQUESTS:
            deserialize = None
        elif raw and method.client_streaming:  # pragma: no cover - every streamed request is in RAW_REQUESTS
            raise NotImplementedError(f"{service.full_name}/{method.name}: a streamed request type needs a decoder here")
        else:
            deserialize = safe_deserializer(request, f"{service_name}.{method.name}")
        handlers[method.name] = kinds[(method.client_streaming, method.server_streaming)](
            getattr(servicer, method.name), request_deserializer=deserialize, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """ps.v1.ParameterServer over one Shard.

    Data-plane rpcs take a slot of `admission` first (RESOURCE_EXHAUSTED when none is free;
    a registered worker's calls have slots of their own); client streams are watched by
    `watchdog`, which cuts a stream that stalls. Control rpcs (registration, heartbeats,
    cluster info) take no slot, so they are answered while the data plane is full.
    """

    def __init__(self, shard: Shard, *, admission: Admission | None = None,
                 watchdog: StreamWatchdog | None = None, segments: Segments | None = None,
                 channel: DataChannelServer | None = None) -> None:
        self.shard = shard
        self.chunk_bytes = shard.config.chunk_bytes
        self.admission = admission or Admission(shard.config.data_plane_limit, shard_index=shard.config.shard_index,
                                                is_live=shard.holds_lease)
        self.watchdog = watchdog
        self.segments = segments or Segments(limit=shard.config.max_registered_workers,
                                             shard_index=shard.config.shard_index)
        #: the shard's data channel (ps_server/data_channel.py); None: it serves none
        self.channel = channel

    def _stream(self, requests: Iterator[bytes], context, rpc: str) -> Iterator[bytes]:
        return requests if self.watchdog is None else self.watchdog.watch(requests, context, rpc)

    # ------------------------------------------------------------------ data plane

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
            pieces = RowPieces("Push", lambda: max(codec.MAX_MESSAGE_BYTES, self.shard.parameter_bytes()))
            header, chunks = _header_and_chunks(self._stream(request_iterator, context, "Push"), "Push",
                                                pb.PushHeader, pieces)
            grads = _assemble(chunks, self.shard.push_layout(), widen=True)   # half-size wire: widened
            result = self.shard.push(self._push(header, grads, codec.join_row_gradients(
                header.row_gradients, pieces.parsed(), "Push")))
        return push_response(result)

    def Pull(self, request, context):
        # A generator handler: errors must be raised before the first yield to abort cleanly.
        yield from self._pull(request, context)

    @translate_errors
    def _pull(self, request: pb.PullRequest, context) -> list[bytes]:
        with self.admission.enter("Pull", caller_of(context)):
            values = self.shard.pull(Read(
                names=list(request.names) or None, min_step=request.min_step, ssp=bool(request.worker_id),
                worker_id=request.worker_id, clock=request.clock, narrow=wire_dtype(request.wire_dtype),
                timeout=self.shard.wait_timeout(request.wait_timeout_ms, context.time_remaining())))
        return codec.encode_pull_messages(values.step, codec.values_chunks(values.parts, chunk_bytes=self.chunk_bytes),
                                          chunk_bytes=self.chunk_bytes)

    @translate_errors
    def PullRows(self, request, context):
        with self.admission.enter("PullRows", caller_of(context)):
            values = self.shard.pull(Read(
                names=(), rows=_row_ids(request.tables), min_step=request.min_step, ssp=bool(request.worker_id),
                worker_id=request.worker_id, clock=request.clock,
                timeout=self.shard.wait_timeout(request.wait_timeout_ms, context.time_remaining())))
        return pb.PullRowsResponse(step=values.step, tables=[row_values(name, rows) for name, rows in values.rows])

    def ReadState(self, request, context):
        # A generator handler, as Pull: errors are raised before the first yield.
        yield from self._read_state(request, context)

    @translate_errors
    def _read_state(self, request: pb.ReadStateRequest, context) -> list[pb.ReadStateResponse]:
        # Not a training path: a reader (export, ps-serve --follow) takes a data-plane slot like a pull.
        with self.admission.enter("ReadState", caller_of(context)):
            if request.since_step < -1:
                raise InvalidRequestError(f"ReadState: since_step must be >= -1 (-1: everything), got "
                                          f"{request.since_step}")
            read = self.shard.read_state(
                request.since_step, whole=list(request.whole), min_step=request.min_step,
                timeout=self.shard.wait_timeout(request.wait_timeout_ms, context.time_remaining()))
        return read_state_messages(read, self.chunk_bytes)

    @translate_errors
    def PushPull(self, request: bytes, context):
        """Push, then the pull the worker needs next, in one message each way (docs/protocol.md, "PushPull")."""
        with self.admission.enter("PushPull", caller_of(context)):
            frame = frames.decode_request(request)
            segment = self._segment(frame)
            push = self._push(frame.header, _gradients_in(segment) if frame.gradients_in_shared_memory else
                              _assemble(frame.chunks, self.shard.push_layout(), widen=True))
            result = self.shard.push_pull(push, self._read_after(frame.pull, segment, context.time_remaining()))
        return push_pull_response(result, self.chunk_bytes)

    def push_pull_on_channel(self, grant: Grant, raw: bytes, memory: FrameBuffer | None,
                             written: Callable[[PartKey, int], None] | None = None) -> tuple[bytes, list | None]:
        """PushPull from a frame of the data channel (ps_server/data_channel.py): the same domain call as the
        rpc, with the connection's buffer standing for a shared-memory segment (the gradients are read from it,
        the values written into it). On a half-size wire (`grant.narrow`) the gradients are widened and the
        values read narrowed, as over gRPC. A connection opened for some tensors (`grant.names`) carries their
        parts only, and its frames name them in pull.names; row gradients and rows read travel in the headers.
        Returns the response header and the answer's body (None: not ready); typed errors are raised for the
        channel to answer. `written(part key, bytes)`, when given, is told as the values land in the buffer
        (Read.written), for the channel to send them while the rest are written. No `memory`: the frame's bytes
        are in the worker's shared-memory segment (SharedMemoryUnavailableError when it has none for the shard's
        parts), read and written there as by the rpc, and the answer has no body."""
        worker_id, layout = grant.worker_id, grant.layout
        with self.admission.enter("PushPull", worker_id):
            frame = frames.decode_request(raw, chunks=False)
            if frame.header.worker_id != worker_id:
                raise Violation(f"a PushPull header for worker {frame.header.worker_id!r} on the data channel of "
                                f"worker {worker_id!r}")
            if not (frame.gradients_in_shared_memory and frame.pull.shared_memory):
                raise InvalidRequestError("PushPull on the data channel: the gradients and the values travel in "
                                          "the frames (set gradients_in_shared_memory and pull.shared_memory)")
            if wire_dtype(frame.pull.wire_dtype) != grant.narrow:
                raise InvalidRequestError(f"PushPull on the data channel: wire_dtype {pb.DType.Name(frame.pull.wire_dtype)} "
                                          f"is not the connection's ({grant.narrow or 'float32'})")
            if (frozenset(frame.pull.names) or None) != grant.names:
                raise InvalidRequestError(
                    f"PushPull on the data channel: pull.names {sorted(frame.pull.names)[:10]} are not the tensors "
                    f"the connection was opened for ({sorted(grant.names)[:10] if grant.names else 'every part'})")
            self.shard.push_layout()   # FAILED_PRECONDITION before init
            if grant.generation != self.shard.generation:
                raise DataChannelUnavailableError(
                    f"worker {worker_id!r}: the data channel's layout no longer fits shard "
                    f"{self.shard.config.shard_index}'s parts (re-initialized?): open it again")
            if memory is None:   # the bytes are in the segment: every part, at full width
                if grant.narrow is not None or grant.names is not None:
                    raise InvalidRequestError(
                        "PushPull on the data channel with its bytes in shared memory: the connection was opened "
                        f"for {'a half-size wire' if grant.narrow is not None else 'some tensors'}; a segment "
                        "holds every part of the shard at full width")
                segment = self.segments.get(worker_id, self.shard.generation)
                push = self._push(frame.header, _gradients_in(segment))
                result = self.shard.push_pull(push, self._read_after(frame.pull, segment, None))
            else:
                grads = _gradients_in((memory, layout))
                if grant.narrow is not None:   # the half-size wire: float32 master values take float32 gradients
                    grads = {key: memory.widened.cast(key, g, np.dtype(np.float32)) if g.dtype == grant.narrow else g
                             for key, g in grads.items()}
                push = self._push(frame.header, grads, finite=memory.finite)
                read = self._read_after(frame.pull, None if grant.narrow else (memory, layout), None, written)
                result = self.shard.push_pull(push, read)
        answer = push_pull_response(result, self.chunk_bytes, values_in_chunks=False)
        if memory is None or result.values is None:
            return answer, None
        if grant.narrow is None:   # the shard wrote the values into the buffer under its lock
            return answer, [memory.buffer[layout.values_offset:layout.size]]
        parts = result.values.parts   # narrowed copies: sent from where they are
        arrays = [parts.get(slot.key, memory.view(slot)) for slot in layout.values]
        return answer, dc.region_views(layout.values, layout.values_offset, layout.size, arrays,
                                       memoryview(bytes(dc.ALIGN)))

    @translate_errors
    def Barrier(self, request, context):
        with self.admission.enter("Barrier", caller_of(context)):
            timeout = self.shard.wait_timeout(request.timeout_ms, context.time_remaining())
            generation, arrived = self.shard.barrier(request.name, request.participant_id, request.participants,
                                                     timeout)
        return pb.BarrierResponse(generation=generation, arrived=arrived)

    # ------------------------------------------------------------------ checks: requests to domain values

    def _push(self, header: pb.PushHeader, grads: Mapping[PartKey, np.ndarray],
              row_gradients: list[pb.RowGradient] | None = None, finite: frozenset[PartKey] = frozenset()) -> Push:
        """The domain's Push of a header and its decoded dense gradients; row gradients (the header's, or
        `row_gradients` where a Push stream continued them) decoded (widened from a half-size wire) against their
        tables' specs; `finite`: the parts whose gradients were found finite as they arrived (Push.finite)."""
        row_grads = []
        for rg in header.row_gradients if row_gradients is None else row_gradients:
            spec = self.shard.table_spec(rg.name, "row gradient")
            ids = np.array(rg.ids, dtype=np.int64)
            row_grads.append((rg.name, ids, codec.rows_from_wire(rg.name, rg.dtype, rg.data, len(ids), spec.row_shape,
                                                                 want=np.dtype(spec.dtype))))
        return Push(header.worker_id, header.clock, header.read_step, grads, row_grads, finite)

    def _read_after(self, pull: pb.PullAfterPush, segment: tuple[Segment | FrameBuffer, Layout] | None,
                    remaining: float | None, written: Callable[[PartKey, int], None] | None = None) -> Read:
        """The domain's Read of a PushPull's pull: into the worker's segment (or data-channel buffer) when it asks
        for shared memory, `written` told as the values land there; `remaining`: the call's time left (None: no
        deadline)."""
        if pull.wait_timeout_ms < 0:
            raise InvalidRequestError(f"PushPull: wait_timeout_ms must be >= 0, got {pull.wait_timeout_ms}")
        timeout = 0.0 if pull.wait_timeout_ms == 0 else self.shard.wait_timeout(pull.wait_timeout_ms, remaining)
        into = None
        if pull.shared_memory and segment is not None:
            memory, layout = segment
            into = memory.views(layout.values)
        return Read(names=list(pull.names) or None, rows=_row_ids(pull.rows), wait_for_step=pull.wait_for_step,
                    ssp=pull.ssp, timeout=timeout, narrow=wire_dtype(pull.wire_dtype), into=into,
                    written=written if into is not None else None)

    def _segment(self, frame: frames.PushPullRequest) -> tuple[Segment, Layout] | None:
        """The worker's shared-memory segment when the frame uses it (SharedMemoryUnavailableError when it has none
        for the shard's current parts)."""
        if not (frame.gradients_in_shared_memory or frame.pull.shared_memory):
            return None
        self.shard.push_layout()   # FAILED_PRECONDITION before init
        return self.segments.get(frame.header.worker_id, self.shard.generation)

    # ------------------------------------------------------------------ control

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
        if self.channel is not None:
            self.channel.close_worker(request.worker_id)
        return pb.DeregisterWorkerResponse()

    @translate_errors
    def GetClusterInfo(self, request, context):
        return cluster_info(self.shard, self.shard.view())

    @translate_errors
    def OpenSharedMemory(self, request, context):
        self.shard.check_id("OpenSharedMemory: worker_id", request.worker_id)
        generation, parts = self.shard.part_layout()
        known = {w.worker_id for w in self.shard.view().workers}
        if request.worker_id not in known:
            raise UnknownWorkerError(f"worker {request.worker_id!r} is not registered on this shard; "
                                     "call RegisterWorker")
        layout = Layout.of(parts)
        door, ticket = self.segments.offer(request.worker_id, layout, generation, known=known)
        return pb.SharedMemoryResponse(size=layout.size, values_offset=layout.values_offset, door=door,
                                       ticket=ticket)

    @translate_errors
    def OpenDataChannel(self, request, context):
        self.shard.check_id("OpenDataChannel: worker_id", request.worker_id)
        if self.channel is None:
            raise DataChannelUnavailableError(f"shard {self.shard.config.shard_index} serves no data channel "
                                              "(--no-data-channel); use gRPC bytes")
        names = frozenset(request.names) or None
        generation, parts = self.shard.part_layout(names)
        known = {w.worker_id for w in self.shard.view().workers}
        if request.worker_id not in known:
            raise UnknownWorkerError(f"worker {request.worker_id!r} is not registered on this shard; "
                                     "call RegisterWorker")
        narrow = wire_dtype(request.wire_dtype)
        layout = dc.wire_layout(parts, narrow)
        ticket = self.channel.offer(request.worker_id, layout, generation, known=known, narrow=narrow, names=names)
        return pb.DataChannelResponse(port=self.channel.port, ticket=ticket, size=layout.size,
                                      values_offset=layout.values_offset, tls=self.channel.tls is not None,
                                      idle_ms=int(self.channel.idle_seconds * 1000))


# ---------------------------------------------------------------------- filling responses


def push_pull_response(result: PushPullResult, chunk_bytes: int, *, values_in_chunks: bool = True) -> bytes:
    """The PushPullResponse of a push and its read: the values read as copies in its chunks (values in shared
    memory leave none), or none when they travel elsewhere (`values_in_chunks=False`: a data channel's answer,
    whose body carries them)."""
    values = result.values
    if values is None:
        return frames.encode_response(push_response(result.push), ready=False)
    return frames.encode_response(push_response(result.push), ready=True, step=values.step,
                                  chunks=codec.values_chunks(values.parts, chunk_bytes=chunk_bytes)
                                  if values.parts and values_in_chunks else None,
                                  rows=[row_values(name, rows) for name, rows in values.rows])


def read_state_messages(read: StateRead, chunk_bytes: int) -> list[pb.ReadStateResponse]:
    """ReadState's stream: messages of at most about chunk_bytes of data each, every one with the step and the
    state id; the first with the dynamic tables' live rows. A table's rows are cut by whole rows."""
    messages: list[pb.ReadStateResponse] = []
    size = 0

    def message_for(nbytes: int) -> pb.ReadStateResponse:
        nonlocal size
        if not messages or (size and size + nbytes > chunk_bytes):
            messages.append(pb.ReadStateResponse(step=read.step, state_id=read.state_id))
            size = 0
        size += nbytes
        return messages[-1]

    message_for(0).dynamic_tables.extend(pb.DynamicTableInfo(name=n, rows=r) for n, r in read.live_rows.items())
    for (name, row_start), value in read.parts.items():
        for chunk in codec.part_chunks(name, value, row_start=row_start, chunk_bytes=chunk_bytes):
            message_for(len(chunk.data)).chunks.append(chunk)
    for name, ids, rows in read.rows:
        row_bytes = max(1, rows[:1].nbytes)
        per_message = max(1, chunk_bytes // row_bytes)
        for start in range(0, max(len(ids), 1), per_message):   # a table with no changed rows still says so
            cut = rows[start:start + per_message]
            message_for(cut.nbytes).rows.append(row_values(name, cut, ids[start:start + per_message]))
    return messages


def row_values(name: str, values: np.ndarray, ids: np.ndarray | None = None) -> pb.RowValues:
    """The rows of one table, as PullRows and PushPull answer them (with their ids, as ReadState does)."""
    dtype, data = codec.rows_to_wire(values)
    return pb.RowValues(name=name, dtype=dtype, shape=values.shape, data=data, ids=() if ids is None else ids)


def wire_dtype(value: int) -> np.dtype | None:
    """The half-size dtype a pull asks float32 parts in (None: as stored); INVALID_ARGUMENT for another."""
    if value in (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32):
        return None
    dtype = codec.dtype_from_wire(value, name="(wire_dtype)")
    if dtype not in codec.NARROW_FLOAT32:
        raise InvalidRequestError(f"wire_dtype {pb.DType.Name(value)}: a pull may ask for float32, float16 or "
                                  "bfloat16 only")
    return dtype


def _row_ids(tables) -> list[tuple[str, np.ndarray]]:
    return [(t.name, np.array(t.ids, dtype=np.int64)) for t in tables]


def _gradients_in(segment: tuple[Segment | FrameBuffer, Layout]) -> dict[PartKey, np.ndarray]:
    """The gradients a worker wrote into its segment (or sent in a data-channel frame), as views (read by the shard
    inside the call)."""
    memory, layout = segment
    return memory.views(layout.gradients)
