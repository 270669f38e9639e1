"""The contract suite's view of a set of shards: raw ps.v1 stubs, one per shard, and nothing of the client library.

Everything here speaks the wire contract directly (protos/ps/v1/parameter_server.proto),
so the suite can check any server, including one that is not this repository's.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_common import codec
from ps_common.shard_map import ParamSpec, Part, ShardMap, build_shard_map

#: Longest time any single rpc of the suite may take (waits are asked for far shorter).
RPC_TIMEOUT = 30.0
MODE_NAMES = {pb.MODE_SYNC: "sync", pb.MODE_SSP: "ssp", pb.MODE_ASYNC: "async"}


def contract_model() -> dict[str, np.ndarray]:
    """The parameter list the suite initializes: names no real model uses, all floats (sync needs them all)."""
    return {
        "contract.emb": (np.arange(96 * 16, dtype=np.float32).reshape(96, 16) / 100),  # 6 KiB: split at 4 KiB
        "contract.w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4),
        "contract.b": np.array([0.5, -0.5, 0.25, 0.0], np.float32),
        "contract.scale": np.array(2.0, np.float64),
    }


def specs_of(values: Mapping[str, np.ndarray]) -> list[ParamSpec]:
    return [ParamSpec(n, np.asarray(a).dtype.name, tuple(np.shape(a))) for n, a in values.items()]


def new_id(prefix: str = "contract") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    """The RpcError fn raises; fails the test when it returns normally."""
    try:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str, dict)):
            list(result)  # a server stream fails while it is read
    except grpc.RpcError as exc:
        return exc
    pytest.fail("the call succeeded; a status error was expected")


def expect_status(code: grpc.StatusCode, fn: Callable[[], object], *needles: str) -> str:
    """Asserts fn fails with `code` and a message holding every needle; returns the message."""
    exc = rpc_error(fn)
    details = exc.details() or ""
    assert exc.code() == code, f"expected {code.name}, got {exc.code().name}: {details}"
    for needle in needles:
        assert needle in details, f"{needle!r} not in the {code.name} message: {details!r}"
    return details


def _pack(chunks: Sequence[pb.TensorChunk], message_type, limit: int) -> list:
    """Chunks grouped into messages of at most about `limit` data bytes; always at least one message."""
    messages, batch, size = [], [], 0
    for chunk in chunks:
        if batch and size + len(chunk.data) > limit:
            messages.append(message_type(chunks=batch))
            batch, size = [], 0
        batch.append(chunk)
        size += len(chunk.data)
    if batch or not messages:
        messages.append(message_type(chunks=batch))
    return messages


@dataclass
class Pulled:
    """One shard's pull: its step and the parts it sent."""

    step: int
    parts: dict[tuple[str, int], np.ndarray]
    messages: int


class Target:
    """The shards under test (in shard order), over raw stubs."""

    def __init__(self, label: str, addresses: Sequence[str]) -> None:
        self.label = label
        self.addresses = list(addresses)
        options = [("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES)]
        self.channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        self.stubs = [pb_grpc.ParameterServerStub(c) for c in self.channels]
        self.model = contract_model()
        self.init_skip_reason: str | None = None
        self.initialized_here = False
        self._init_lock = threading.Lock()

    # ------------------------------------------------------------------ info

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def info(self, shard: int = 0) -> pb.ClusterInfo:
        return self.stubs[shard].GetClusterInfo(pb.ClusterInfoRequest(), timeout=RPC_TIMEOUT)

    @property
    def mode(self) -> str:
        return MODE_NAMES.get(self.info(0).mode, "unknown")

    def wait_ready(self, timeout: float = 30.0) -> None:
        for i, channel in enumerate(self.channels):
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"shard {i} at {self.addresses[i]} not reachable within {timeout} s") from None

    def shard_map(self) -> ShardMap:
        info = self.info(0)
        return build_shard_map(specs_of(self.model), self.num_shards, partition_min_bytes=info.partition_min_bytes)

    def parts_on(self, shard: int) -> list[Part]:
        return self.shard_map().parts_on(shard)

    def shards_with_parts(self) -> list[int]:
        shard_map = self.shard_map()
        return [i for i in range(self.num_shards) if shard_map.parts_on(i)]

    # ------------------------------------------------------------------ init

    def init_messages(self, shard: int, values: Mapping[str, np.ndarray] | None = None, *,
                      specs: Sequence[pb.ParameterSpec] | None = None, chunk_bytes: int = codec.CHUNK_BYTES,
                      skip: Iterable[str] = ()) -> list[pb.InitRequest]:
        values = self.model if values is None else values
        if specs is None:
            specs = [codec.spec_to_wire(s.name, s.dtype, s.shape) for s in specs_of(values)]
        chunks = list(self.chunks_for(shard, values, chunk_bytes=chunk_bytes, skip=skip))
        messages = _pack(chunks, pb.InitRequest, chunk_bytes)
        messages[0].header.CopyFrom(pb.InitHeader(parameters=specs, worker_id="contract-suite"))
        return messages

    def init(self, shard: int, messages: Sequence[pb.InitRequest]) -> pb.InitResponse:
        return self.stubs[shard].InitParameters(iter(messages), timeout=RPC_TIMEOUT)

    def ensure_initialized(self) -> None:
        """InitParameters with the contract model on every shard, once; skips when another list is in place."""
        with self._init_lock:
            if self.init_skip_reason is None and not self.initialized_here:
                try:
                    responses = [self.init(i, self.init_messages(i)) for i in range(self.num_shards)]
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    self.init_skip_reason = (f"the server at {self.addresses} is initialized with a different "
                                             f"parameter list than the contract suite's: {exc.details()}")
                else:
                    self.initialized_here = True
                    self.fresh_init = not any(r.already_initialized for r in responses)
            if self.init_skip_reason is not None:
                pytest.skip(self.init_skip_reason)

    # ------------------------------------------------------------------ tensors

    def chunks_for(self, shard: int, arrays: Mapping[str, np.ndarray], *, chunk_bytes: int = codec.CHUNK_BYTES,
                   skip: Iterable[str] = ()) -> Iterable[pb.TensorChunk]:
        """The chunks of shard's parts of the given full-size arrays."""
        skipped = set(skip)
        for part in self.parts_on(shard):
            if part.name not in arrays or part.name in skipped:
                continue
            array = np.asarray(arrays[part.name])
            piece = array if part.whole else array[part.row_start:part.row_end]
            yield from codec.part_chunks(part.name, piece, row_start=part.row_start, chunk_bytes=chunk_bytes)

    def grads(self, scale: float = 1.0) -> dict[str, np.ndarray]:
        """A gradient for every tensor of the contract model, `scale` everywhere."""
        return {n: np.full(np.shape(a), scale, dtype=np.asarray(a).dtype) for n, a in self.model.items()}

    # ------------------------------------------------------------------ push

    def push_messages(self, worker_id: str, clock: int, read_step: int,
                      chunks: Iterable[pb.TensorChunk], *, per_message: int | None = None) -> list[pb.PushRequest]:
        chunks = list(chunks)
        if per_message is None:
            messages = _pack(chunks, pb.PushRequest, codec.CHUNK_BYTES)
        else:
            messages = [pb.PushRequest(chunks=chunks[i:i + per_message]) for i in range(0, len(chunks), per_message)] \
                or [pb.PushRequest()]
        messages[0].header.CopyFrom(pb.PushHeader(worker_id=worker_id, clock=clock, read_step=read_step))
        return messages

    def push_raw(self, shard: int, messages: Sequence[pb.PushRequest]) -> pb.PushResponse:
        return self.stubs[shard].Push(iter(messages), timeout=RPC_TIMEOUT)

    def push(self, shard: int, worker_id: str, clock: int, read_step: int,
             grads: Mapping[str, np.ndarray] | None = None) -> pb.PushResponse:
        """A well-formed push of shard's parts of grads (default: all ones)."""
        grads = self.grads(1.0) if grads is None else grads
        return self.push_raw(shard, self.push_messages(worker_id, clock, read_step, self.chunks_for(shard, grads)))

    # ------------------------------------------------------------------ pull

    def pull_stream(self, shard: int, names: Sequence[str] = (), *, min_step: int = 0, worker_id: str = "",
                    clock: int = 0, wait_timeout_ms: int = 0, timeout: float = RPC_TIMEOUT):
        request = pb.PullRequest(names=list(names), min_step=min_step, worker_id=worker_id, clock=clock,
                                 wait_timeout_ms=wait_timeout_ms)
        return self.stubs[shard].Pull(request, timeout=timeout)

    def pull(self, shard: int, names: Sequence[str] = (), **kwargs) -> Pulled:
        step, count = None, 0
        assembler = codec.PartAssembler()
        for message in self.pull_stream(shard, names, **kwargs):
            if step is None:
                step = message.step
            count += 1
            for chunk in message.chunks:
                assembler.add(chunk)
        parts = {key: np.array(value) for key, value in assembler.finish().items()}
        return Pulled(step=step if step is not None else -1, parts=parts, messages=count)

    def snapshot(self, shard: int, worker_ids: Sequence[str] = ()) -> tuple:
        """What a rejected request must leave unchanged: step, drops, the workers' clocks, and the values."""
        info = self.info(shard)
        clocks = {w.worker_id: w.clock for w in info.workers if w.worker_id in set(worker_ids)}
        pulled = self.pull(shard)
        values = {key: (value.dtype.str, value.shape, value.tobytes()) for key, value in pulled.parts.items()}
        return info.step, info.dropped_stale, info.initialized, clocks, pulled.step, values

    # ------------------------------------------------------------------ membership

    def register(self, worker_id: str) -> list[pb.RegisterWorkerResponse]:
        return [s.RegisterWorker(pb.RegisterWorkerRequest(worker_id=worker_id), timeout=RPC_TIMEOUT) for s in self.stubs]

    def deregister(self, worker_id: str) -> None:
        for stub in self.stubs:
            stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=worker_id), timeout=RPC_TIMEOUT)

    def worker(self, info: pb.ClusterInfo, worker_id: str) -> pb.WorkerInfo | None:
        for w in info.workers:
            if w.worker_id == worker_id:
                return w
        return None

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def __repr__(self) -> str:
        return f"Target({self.label!r}, {self.addresses})"


class Workers:
    """Registers worker ids for one test on every shard, and deregisters them all at its end."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.ids: list[str] = []
        self.start_clocks: dict[str, list[int]] = {}

    def new(self, prefix: str = "w") -> str:
        worker_id = new_id(f"contract-{prefix}")
        self.ids.append(worker_id)
        self.start_clocks[worker_id] = [r.clock for r in self.target.register(worker_id)]
        return worker_id

    def cleanup(self) -> None:
        for worker_id in self.ids:
            try:
                self.target.deregister(worker_id)
            except grpc.RpcError:
                pass
