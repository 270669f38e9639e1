"""Operations and snapshots on the Follow stream (protos/ps/v1/replication.proto), both ways.

An operation (ps_server.operations.Op) becomes one or more FollowItems: its fields and its
tensors as TensorChunks of at most CHUNK_BYTES, several items when they are many (`more` on
all but the last); a push's row gradients too (codec.split_row_gradients: at most about
CHUNK_BYTES of them an item, joined by the follower with codec.join_row_gradients). A
snapshot (the shard's whole state, ps_server.checkpoints' ShardState) travels in the checkpoint format: its metadata in the first part, its tensors as chunks keyed
by their checkpoint keys, `last` on the final part. Both decoders check every chunk against
what they declare (codec.PartAssembler), so a malformed stream is an error, never a wrong state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from ps_common import codec
from ps_common.errors import InvalidRequestError
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import replication_pb2 as rpb
from ps_server.checkpoints import fileformat
from ps_server.checkpoints.state import ShardState
from ps_server.operations import Op, Push

__all__ = ["OpAssembler", "op_items", "snapshot_items", "snapshot_of"]

#: Tensor bytes in one item, at most.
CHUNK_BYTES = codec.CHUNK_BYTES
#: The snapshot metadata key that lists its rank-0 tensors.
SCALARS_KEY = "replication.scalars"


def _chunks(arrays: Iterable[tuple[str, int, np.ndarray]]) -> Iterator[pb.TensorChunk]:
    for name, row_start, value in arrays:
        yield from codec.part_chunks(name, np.ascontiguousarray(value), row_start=row_start, chunk_bytes=CHUNK_BYTES)


def _batched(chunks: Iterable[pb.TensorChunk]) -> Iterator[list[pb.TensorChunk]]:
    """Chunks grouped into items of at most about CHUNK_BYTES of data; always at least one (maybe empty) group."""
    group: list[pb.TensorChunk] = []
    size = 0
    sent = False
    for chunk in chunks:
        if group and size + len(chunk.data) > CHUNK_BYTES:
            yield group
            sent, group, size = True, [], 0
        group.append(chunk)
        size += len(chunk.data)
    if group or not sent:
        yield group


def op_items(op: Op, seq: int, epoch: int) -> Iterator[rpb.FollowItem]:
    """The items of one operation (its tensors spread over several when they are many)."""
    message = rpb.ReplicaOp(kind=op.kind, worker_id=op.worker_id, clock=op.clock, live_count=op.live_count)
    arrays: list[tuple[str, int, np.ndarray]] = []
    continued: list[list[pb.RowGradient]] = []   # row gradients of the items after the first
    if op.push is not None:
        push = op.push
        message.push.CopyFrom(pb.PushHeader(worker_id=push.worker_id, clock=push.clock, read_step=push.read_step))
        rows = []
        for name, ids, values in push.row_grads:
            dtype, data = codec.rows_to_wire(np.asarray(values))
            rows.append(pb.RowGradient(name=name, ids=np.asarray(ids, np.int64), dtype=dtype, data=data))
        if codec.row_gradients_wire_bytes(rows) > CHUNK_BYTES:
            rows, continued = codec.split_row_gradients(rows, header_bytes=CHUNK_BYTES, piece_bytes=CHUNK_BYTES)
        message.push.row_gradients.extend(rows)
        arrays = [(name, row_start, value) for (name, row_start), value in push.grads.items()]
    if op.result is not None:
        message.accepted, message.step_after, message.clock_after = op.result
    if op.kind == "init":
        message.specs.extend(codec.param_spec_to_wire(s) for s in op.specs)
        arrays = [(name, row_start, value) for (name, row_start), value in (op.values or {}).items()]
    groups = list(_batched(_chunks(arrays)))
    count = max(len(groups), 1 + len(continued))
    for i in range(count):
        item = rpb.FollowItem(epoch=epoch, seq=seq, more=i < count - 1)
        item.op.CopyFrom(message if i == 0 else rpb.ReplicaOp(kind=op.kind))
        if i < len(groups):
            item.op.chunks.extend(groups[i])
        if 0 < i <= len(continued):
            item.op.push.row_gradients.extend(continued[i - 1])
        yield item


class OpAssembler:
    """Puts an operation back together from its items (`add` returns the Op once the last one arrived).

    `row_shape(name)` gives a table's row shape (the shard's spec), for row gradients."""

    def __init__(self, row_shape: Callable[[str], tuple[int, ...]]) -> None:
        self._row_shape = row_shape
        self._first: rpb.ReplicaOp | None = None
        self._seq = 0
        self._chunks: list[pb.TensorChunk] = []
        self._rows: list[pb.RowGradient] = []

    def add(self, item: rpb.FollowItem) -> tuple[int, Op] | None:
        if self._first is None:
            self._first, self._seq = item.op, item.seq
        elif item.seq != self._seq:
            raise InvalidRequestError(f"operation {self._seq} is cut: an item of operation {item.seq} came before "
                                      "its last part")
        else:   # the first item's row gradients are the push's own; later items' continue them
            self._rows.extend(item.op.push.row_gradients)
        self._chunks.extend(item.op.chunks)
        if item.more:
            return None
        first, chunks, rows, seq = self._first, self._chunks, self._rows, self._seq
        self._first, self._chunks, self._rows = None, [], []
        return seq, _op_of(first, chunks, rows, self._row_shape)


def _values(chunks: Sequence[pb.TensorChunk]) -> dict[tuple[str, int], np.ndarray]:
    assembler = codec.PartAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return {key: np.array(value) for key, value in assembler.finish().items()}   # own, writable copies


def _op_of(message: rpb.ReplicaOp, chunks: Sequence[pb.TensorChunk], row_pieces: Sequence[pb.RowGradient],
           row_shape: Callable[[str], tuple[int, ...]]) -> Op:
    kind = message.kind
    if kind == "push":
        header = message.push
        rows = [(rg.name, np.array(rg.ids, np.int64),
                 np.array(codec.rows_from_wire(rg.name, rg.dtype, rg.data, len(rg.ids), row_shape(rg.name))))
                for rg in codec.join_row_gradients(header.row_gradients, row_pieces, "replicated push")]
        push = Push(header.worker_id, header.clock, header.read_step, _values(chunks), rows)
        return Op("push", push=push, live_count=message.live_count,
                  result=(message.accepted, message.step_after, message.clock_after))
    if kind == "init":
        return Op("init", specs=tuple(codec.spec_from_wire(s) for s in message.specs), values=_values(chunks))
    if kind in ("register", "deregister", "membership", "reset"):
        return Op(kind, worker_id=message.worker_id, clock=message.clock, live_count=message.live_count)
    raise InvalidRequestError(f"unknown replicated operation {kind!r}")


def snapshot_items(state: ShardState, seq: int, epoch: int, isr: Sequence[str]) -> Iterator[rpb.FollowItem]:
    """A shard's whole state as items (the checkpoint format), holding operations up to `seq`."""
    tensors, metadata = fileformat.encode(state)
    # a chunk has no shape of rank 0 (it arrives as (1,)): the scalars' keys ride in the metadata
    scalars = sorted(key for key, value in tensors.items() if np.ndim(value) == 0)
    groups = list(_batched(_chunks((key, 0, value) for key, value in tensors.items())))
    for i, group in enumerate(groups):
        part = rpb.SnapshotPart(tensors=group, last=i == len(groups) - 1)
        if i == 0:
            part.metadata.update(metadata)
            part.metadata[SCALARS_KEY] = json.dumps(scalars)
        yield rpb.FollowItem(epoch=epoch, seq=seq, snapshot=part, isr=list(isr))


def snapshot_of(parts: Sequence[rpb.SnapshotPart], source: str) -> ShardState:
    """The state in a snapshot's parts (CorruptCheckpointError when it does not check out)."""
    metadata = dict(parts[0].metadata) if parts else {}
    try:
        scalars = set(json.loads(metadata.pop(SCALARS_KEY, "[]")))
    except (TypeError, ValueError):
        raise InvalidRequestError(f"snapshot from {source}: its {SCALARS_KEY} is not a JSON list") from None
    tensors = {key: value for (key, _), value in _values([chunk for part in parts for chunk in part.tensors]).items()}
    for key in scalars & set(tensors):
        if tensors[key].size != 1:
            raise InvalidRequestError(f"snapshot from {source}: scalar {key!r} arrived with shape "
                                      f"{tensors[key].shape}")
        tensors[key] = tensors[key].reshape(())
    return fileformat.decode(tensors, metadata, source=source)
