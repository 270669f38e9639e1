"""Numpy arrays to and from ps.v1 TensorChunk messages: the one place that touches tensor bytes.

A part (a whole tensor, or a row range of one) travels as raw C-order little-endian bytes
cut into chunks of at most ``CHUNK_BYTES``. Encoding copies each chunk once out of the
array (protobuf needs ``bytes``); decoding a part that arrived in one chunk is a zero-copy
read-only view of the received bytes, and a part that arrived in several chunks is copied
once into a fresh array.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


import ml_dtypes
import numpy as np

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common.dynamic_ids import DynamicTable
from ps_common.errors import InvalidRequestError, InvalidTensorError
from ps_common.modes import Mode
from ps_common.shard_map import ParamSpec

#: Largest ``data`` field in one chunk, and the most bytes of chunks packed in one message.
CHUNK_BYTES = 4 << 20

#: gRPC's per-message limit, set on every channel and server: a chunk plus generous headroom
#: for the message's other fields (names, shapes, many small chunks' headers).
MAX_MESSAGE_BYTES = CHUNK_BYTES + (4 << 20)

#: numpy has no bfloat16; ml_dtypes (from the JAX project) adds it as a numpy dtype.
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

_TO_WIRE: dict[np.dtype, int] = {
    np.dtype("<f4"): pb.DTYPE_FLOAT32,
    np.dtype("<f8"): pb.DTYPE_FLOAT64,
    np.dtype("<f2"): pb.DTYPE_FLOAT16,
    np.dtype("<i4"): pb.DTYPE_INT32,
    np.dtype("<i8"): pb.DTYPE_INT64,
    np.dtype("u1"): pb.DTYPE_UINT8,
    BFLOAT16: pb.DTYPE_BFLOAT16,
}

#: Wire dtypes a job may choose for float32 tensors (gradients pushed, parameters pulled):
#: the shards keep float32 master weights and optimizer state, and widen what arrives.
WIRE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": BFLOAT16}
#: The half-size dtypes a float32 part may travel as.
NARROW_FLOAT32 = frozenset({np.dtype("<f2"), BFLOAT16})
_FROM_WIRE: dict[int, np.dtype] = {v: k for k, v in _TO_WIRE.items()}



_SUMMED = (np.dtype(np.float32), np.dtype(np.float64))


def sum_is_finite(values: np.ndarray) -> bool:
    """Whether a float32 or float64 array's elements are all known finite from one reduction: a NaN or an inf
    anywhere makes the sum NaN or inf (inf + finite is inf, inf - inf is NaN, NaN spreads). False says nothing
    (finite values can also overflow the sum; other dtypes are not summed): check otherwise. Empty: True."""
    if values.dtype not in _SUMMED:
        return False
    with np.errstate(over="ignore", invalid="ignore"):   # an overflowing sum is an answer, not a warning
        return bool(np.isfinite(np.add.reduce(values, axis=None)))


def dtype_to_wire(dtype: np.dtype | str) -> int:
    """The ps.v1.DType of a numpy dtype (byte order ignored: the wire is little-endian)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return _TO_WIRE[dt]
    except KeyError:
        supported = ", ".join(sorted(str(d) for d in _TO_WIRE))
        raise InvalidTensorError(f"dtype {np.dtype(dtype)} is not supported on the wire; use one of {supported}") from None


def dtype_from_wire(value: int, *, name: str = "?") -> np.dtype:
    """The numpy dtype of a ps.v1.DType value; InvalidTensorError naming the tensor if unknown."""
    try:
        return _FROM_WIRE[value]
    except KeyError:
        raise InvalidTensorError(f"tensor {name!r}: dtype {pb.DType.Name(value) if value in pb.DType.values() else value} is not accepted") from None


def dtype_name(value: int) -> str:
    """The numpy name (``float32``) of a ps.v1.DType value."""
    return dtype_from_wire(value).name


def as_wire_array(array: np.ndarray) -> np.ndarray:
    """The array as C-contiguous little-endian, copying only when it is not already."""
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.asarray(array, order="C")  # not ascontiguousarray: it turns a 0-d array into 1-d


def chunk_fields(name: str, part: np.ndarray, *, row_start: int = 0, chunk_bytes: int = CHUNK_BYTES,
                 copy: bool = True) -> Iterator[dict]:
    """Cuts one part (a whole tensor or a row range starting at row_start) into chunks.

    Yields the keyword arguments of each TensorChunk rather than the message, so that
    a message can be built with the chunk in place inside its request (protobuf copies a message
    appended to a repeated field; building it there saves one copy of the bytes). With
    copy=False, data are memoryviews into the array (for `encode_message`, which copies
    them once, straight into the serialized message).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"Invalid chunk size: {chunk_bytes}")
    part = as_wire_array(part)
    wire_dtype = dtype_to_wire(part.dtype)
    shape = part.shape
    # through a uint8 view: bfloat16 arrays do not export a buffer format memoryview can cast
    raw = memoryview(part.reshape(-1).view(np.uint8)) if part.size else memoryview(b"")
    total = raw.nbytes
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        yield {"name": name, "dtype": wire_dtype, "shape": shape, "row_start": row_start,
               "byte_offset": offset, "data": raw[offset:end].tobytes() if copy else raw[offset:end]}
        offset = end
        if offset >= total:
            return


def part_chunks(name: str, part: np.ndarray, *, row_start: int = 0, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """The chunks of one part as TensorChunk messages."""
    for fields in chunk_fields(name, part, row_start=row_start, chunk_bytes=chunk_bytes):
        yield pb.TensorChunk(**fields)


@dataclass
class _PartBuffer:
    """What has arrived for one part: byte ranges, and the bytes themselves (a view or an array)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    ranges: list[tuple[int, int]] = field(default_factory=list)   # (byte offset, length) per chunk
    whole: bytes | memoryview | None = None   # the one chunk that covers the part (zero-copy case)
    array: np.ndarray | None = None     # where chunks are copied as they arrive

    def write(self, start: int, data: bytes) -> None:
        assert self.array is not None
        flat = memoryview(self.array.reshape(-1).view(np.uint8)) if self.array.size else memoryview(bytearray())
        flat[start:start + len(data)] = data


Destination = Callable[[str, int, np.dtype, tuple[int, ...]], "np.ndarray | None"]


class PartAssembler:
    """Collects the chunks of many parts, checks them, and turns them into arrays.

    Checks per chunk: dtype and shape equal the expected ones (when ``expected`` is given),
    the byte range lies inside the part, and, at ``finish``, the chunks of each part cover
    it exactly (no gap, no overlap). Every failure is an InvalidTensorError naming the
    tensor, its row range and the values. Not thread-safe; one per request.

    Copies: a part that arrives as one chunk becomes a read-only view of the chunk's
    bytes (no copy). Otherwise each chunk is copied once, on arrival, into the array that
    ``destination(name, row_start, dtype, shape)`` returns (e.g. a row range of the full
    tensor being reassembled), or into a fresh array when it returns None.
    """

    def __init__(self, expected: Callable[[str, int], tuple[np.dtype, tuple[int, ...]]] | None = None, *,
                 destination: Destination | None = None, widen: bool = False) -> None:
        """``expected(name, row_start) -> (dtype, shape)`` looks a part up (raising for unknown ones).

        With `widen`, a float32 part may arrive as float16 or bfloat16 (a job's half-size
        wire): it is assembled in that dtype and returned widened to float32.
        """
        self._expected = expected
        self._destination = destination
        self._widen = widen
        self._parts: dict[tuple[str, int], _PartBuffer] = {}

    def add(self, chunk: "pb.TensorChunk | ChunkView") -> None:
        """Adds one received chunk: keeps its bytes when it is the whole part, else copies them into place."""
        key = (chunk.name, chunk.row_start)
        buf = self._parts.get(key)
        if buf is None:
            buf = self._parts[key] = self._new_part(chunk)
        elif chunk.dtype != dtype_to_wire(buf.dtype) or tuple(chunk.shape) != buf.shape:
            raise InvalidTensorError(
                f"tensor {chunk.name!r} rows from {chunk.row_start}: chunk says dtype {chunk.dtype} shape {list(chunk.shape)}, "
                f"earlier chunks said {buf.dtype.name} {list(buf.shape)}")
        data = chunk.data
        start, n = chunk.byte_offset, len(data)
        if start < 0 or start + n > buf.nbytes:
            raise InvalidTensorError(
                f"tensor {chunk.name!r} rows from {chunk.row_start}: chunk bytes [{start}, {start + n}) "
                f"fall outside the part's {buf.nbytes} bytes (shape {list(buf.shape)}, {buf.dtype.name})")
        buf.ranges.append((start, n))
        if buf.array is None and not buf.ranges[:-1] and n == buf.nbytes and self._destination is None:
            buf.whole = data
            return
        if buf.array is None:
            buf.array = np.empty(buf.shape, dtype=buf.dtype)
            if buf.whole is not None:
                buf.write(0, buf.whole)
                buf.whole = None
        buf.write(start, data)

    def _new_part(self, chunk: pb.TensorChunk) -> _PartBuffer:
        dtype = dtype_from_wire(chunk.dtype, name=chunk.name)
        shape = tuple(int(d) for d in chunk.shape)
        if any(d < 0 for d in shape):
            raise InvalidTensorError(f"tensor {chunk.name!r}: negative dimension in shape {list(shape)}")
        if self._expected is not None:
            want_dtype, want_shape = self._expected(chunk.name, chunk.row_start)
            narrow = self._widen and want_dtype == np.dtype("<f4") and dtype in NARROW_FLOAT32
            if dtype != want_dtype and not narrow:
                raise InvalidTensorError(
                    f"tensor {chunk.name!r} rows from {chunk.row_start}: dtype {dtype.name} does not match the parameter's {want_dtype.name}")
            if shape != tuple(want_shape):
                raise InvalidTensorError(
                    f"tensor {chunk.name!r} rows from {chunk.row_start}: shape {list(shape)} does not match the part's shape {list(want_shape)}")
        buf = _PartBuffer(dtype=dtype, shape=shape, nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        if self._destination is not None:
            buf.array = self._destination(chunk.name, chunk.row_start, dtype, shape)
        return buf

    def keys(self) -> list[tuple[str, int]]:
        """(name, row_start) of every part seen so far."""
        return list(self._parts)

    def finish(self) -> dict[tuple[str, int], np.ndarray]:
        """Checks coverage and returns each part as an array (read-only when zero-copy)."""
        out: dict[tuple[str, int], np.ndarray] = {}
        for (name, row_start), buf in self._parts.items():
            buf.ranges.sort()
            pos = 0
            for start, n in buf.ranges:
                if start != pos:
                    what = "overlap" if start < pos else "gap"
                    raise InvalidTensorError(
                        f"tensor {name!r} rows from {row_start}: chunks leave a {what} at byte {min(start, pos)} "
                        f"of {buf.nbytes} (shape {list(buf.shape)}, {buf.dtype.name})")
                pos += n
            if pos != buf.nbytes:
                raise InvalidTensorError(
                    f"tensor {name!r} rows from {row_start}: got {pos} bytes, expected {buf.nbytes} "
                    f"(shape {list(buf.shape)}, {buf.dtype.name})")
            if buf.whole is not None:
                value = np.frombuffer(buf.whole, dtype=buf.dtype).reshape(buf.shape)
            elif buf.array is not None:
                value = buf.array
            else:  # a zero-size part
                value = np.empty(buf.shape, dtype=buf.dtype)
            if self._widen and buf.dtype in NARROW_FLOAT32:
                value = value.astype(np.float32)
            out[(name, row_start)] = value
        return out


@dataclass(frozen=True)
class ChunkView:
    """A TensorChunk decoded by `decode_pull_response`: its fields, with `data` a view into the message."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    row_start: int
    byte_offset: int
    data: memoryview


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise InvalidRequestError(f"malformed message: a varint runs past the end at byte {pos} of {len(buf)}")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidRequestError("malformed message: varint longer than 10 bytes")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


#: Bytes of the fixed-width wire types: I64 (1) and I32 (5).
_FIXED_WIDTH = {1: 8, 5: 4}


def _fields(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field in buf[start:end]; LEN values are views."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(buf, pos)
        elif wire_type == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise InvalidRequestError(f"malformed message: field {number} runs past the end ({pos + length} > {end})")
            value, pos = buf[pos:pos + length], pos + length
        elif wire_type in _FIXED_WIDTH:
            width = _FIXED_WIDTH[wire_type]
            if pos + width > end:
                raise InvalidRequestError(f"malformed message: field {number} runs past the end ({pos + width} > {end})")
            value, pos = int.from_bytes(buf[pos:pos + width], "little"), pos + width
        else:
            raise InvalidRequestError(f"malformed message: wire type {wire_type} of field {number} is not supported")
        if number == 0:
            raise InvalidRequestError("malformed message: field number 0")
        yield number, wire_type, value


def decode_message(raw: bytes) -> tuple[int | memoryview | None, list[ChunkView]]:
    """(field 1, chunks) of a serialized PullResponse, PushRequest or InitRequest, copying no tensor bytes.

    The three messages share a shape: field 1 is the step (PullResponse) or the header
    (PushRequest, InitRequest: a view of its bytes, None when absent) and field 2 the
    repeated TensorChunk. protobuf's own parser copies every bytes field when it is read
    (`chunk.data`); walking the wire format instead leaves each chunk's data as a view
    into the received message, so a whole part is used where it arrived. Field numbers
    follow parameter_server.proto; unknown fields are skipped, as protobuf does, so peers
    that add fields still decode. Malformed bytes raise InvalidRequestError.
    """
    buf = memoryview(raw)
    first: int | memoryview | None = None
    chunks: list[ChunkView] = []
    for number, wire_type, value in _fields(buf, 0, len(buf)):
        if number == 1:
            first = _signed(value) if wire_type == 0 else value
        elif number == 2 and wire_type == 2:
            chunks.append(_chunk_view(value))
    return first, chunks


def decode_with_extras(raw: bytes, repeated: frozenset[int] = frozenset()
                       ) -> tuple[int | memoryview | None, list[ChunkView], dict[int, Any]]:
    """decode_message, plus the last value of every other field by number (PushPullRequest, PushPullResponse).

    Fields 1 and 2 are read as decode_message reads them; for the others, a varint field
    gives an int and a length-delimited one a view (a nested message to parse). A field
    number in `repeated` gives the list of all its values, in order ([] when absent).
    """
    buf = memoryview(raw)
    first: int | memoryview | None = None
    chunks: list[ChunkView] = []
    extras: dict[int, Any] = {number: [] for number in repeated}
    for number, wire_type, value in _fields(buf, 0, len(buf)):
        if number == 1:
            first = _signed(value) if wire_type == 0 else value
        elif number == 2 and wire_type == 2:
            chunks.append(_chunk_view(value))
        elif number in repeated:
            extras[number].append(value)
        else:
            extras[number] = value
    return first, chunks, extras


def decode_pull_response(raw: bytes) -> tuple[int, list[ChunkView]]:
    """(step, chunks) of a serialized PullResponse (see decode_message)."""
    step, chunks = decode_message(raw)
    return (step if isinstance(step, int) else 0), chunks


def _varint_bytes(value: int) -> bytes:
    value &= (1 << 64) - 1   # negative int64 as protobuf writes them: 10 bytes, two's complement
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    return _varint_bytes(number << 3 | 2) + _varint_bytes(length)


def _scalar_field(number: int, value: int) -> bytes:
    return _varint_bytes(number << 3) + _varint_bytes(value) if value else b""


def encode_message(header: bytes | None, chunks: Iterable[dict]) -> bytes:
    """A serialized PushRequest or InitRequest: `header` (a serialized header message) and chunks.

    The mirror of decode_message: each chunk's data (bytes or a memoryview into the
    array, see chunk_fields(copy=False)) is copied once, into the result, where building
    protobuf messages would copy it three times (out of the array, into the message, into
    the serialization). The bytes are exactly what protobuf would write for the message.
    """
    pieces: list[bytes | memoryview] = []
    if header is not None:
        pieces += [_len_field(1, len(header)), header]
    for f in chunks:
        name = f["name"].encode("utf-8")
        packed = b"".join(_varint_bytes(int(d)) for d in f["shape"])
        data = f["data"]
        prefix = b"".join([
            _len_field(1, len(name)) + name if name else b"",
            _scalar_field(2, f["dtype"]),
            _len_field(3, len(packed)) + packed if packed else b"",
            _scalar_field(4, f["row_start"]),
            _scalar_field(5, f["byte_offset"]),
            _len_field(6, len(data)) if len(data) else b"",
        ])
        pieces += [_len_field(2, len(prefix) + len(data)), prefix, data]
    return b"".join(pieces)


def scalar_field(number: int, value: int) -> bytes:
    """A varint field as protobuf writes it (nothing for 0, proto3's default)."""
    return _scalar_field(number, int(value))


def message_field(number: int, serialized: bytes) -> bytes:
    """A length-delimited field holding a serialized message (always written, even when empty)."""
    return _len_field(number, len(serialized)) + serialized


def pack_encoded(chunks: Iterable[dict], header: bytes, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Serialized request messages (encode_message) of at most about chunk_bytes of data each.

    Small tensors share a message (one message for a whole small model); a full-size chunk
    travels alone. The header rides in the first message, and there is always one.
    """
    batch: list[dict] = []
    size = 0
    first = True
    for fields in chunks:
        n = len(fields["data"])
        if batch and size + n > chunk_bytes:
            yield encode_message(header if first else None, batch)
            first, batch, size = False, [], 0
        batch.append(fields)
        size += n
    if batch or first:
        yield encode_message(header if first else None, batch)


def encode_pull_messages(step: int, chunks: Iterable[dict], *, chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """A Pull's response stream: serialized PullResponse messages of at most about chunk_bytes of data each,
    every one carrying `step` (the step of the values). Small parts share a message; there is always one."""
    step_field = _scalar_field(1, step)
    messages, batch, size = [], [], 0
    for fields in chunks:
        n = len(fields["data"])
        if batch and size + n > chunk_bytes:
            messages.append(step_field + encode_message(None, batch))
            batch, size = [], 0
        batch.append(fields)
        size += n
    if batch or not messages:
        messages.append(step_field + encode_message(None, batch))
    return messages


def values_chunks(values: Mapping[tuple[str, int], np.ndarray], *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[dict]:
    """The chunk fields of parts {(name, row_start): value}, their data views into the arrays (copied once by
    the encoder)."""
    for (name, row_start), value in values.items():
        yield from chunk_fields(name, value, row_start=row_start, chunk_bytes=chunk_bytes, copy=False)


#: The consistency modes on the wire (ps.v1.ConsistencyMode).
_WIRE_MODES = {Mode.SYNC: pb.MODE_SYNC, Mode.SSP: pb.MODE_SSP, Mode.ASYNC: pb.MODE_ASYNC}


def mode_to_wire(mode: Mode) -> int:
    return _WIRE_MODES[mode]


def mode_from_wire(value: int) -> Mode:
    """The mode a ClusterInfo names; InvalidRequestError for a value this version does not know."""
    for mode, wire in _WIRE_MODES.items():
        if wire == value:
            return mode
    raise InvalidRequestError(f"unknown consistency mode {value} on the wire (a shard of a newer version?)")


def _chunk_view(msg: memoryview) -> ChunkView:
    name, dtype, shape, row_start, byte_offset, data = "", 0, [], 0, 0, memoryview(b"")
    for number, wire_type, value in _fields(msg, 0, len(msg)):
        if number == 1 and wire_type == 2:
            try:
                name = bytes(value).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidRequestError(f"malformed chunk: tensor name is not UTF-8 ({len(value)} bytes, "
                                          f"bad byte at {exc.start})") from None
        elif number == 2 and wire_type == 0:
            dtype = value
        elif number == 3 and wire_type == 2:   # packed repeated int64
            pos = 0
            while pos < len(value):
                dim, pos = _varint(value, pos)
                shape.append(_signed(dim))
        elif number == 3 and wire_type == 0:   # unpacked repeated int64
            shape.append(_signed(value))
        elif number == 4 and wire_type == 0:
            row_start = _signed(value)
        elif number == 5 and wire_type == 0:
            byte_offset = _signed(value)
        elif number == 6 and wire_type == 2:
            data = value
    return ChunkView(name, dtype, tuple(shape), row_start, byte_offset, data)


def spec_to_wire(name: str, dtype: np.dtype | str, shape: Sequence[int], *,
                 state: bool = False, dynamic: DynamicTable | None = None) -> pb.ParameterSpec:
    """A ParameterSpec message (`state`: model state, replaced by pushes, not optimized; `dynamic`: a
    hash-keyed table whose `shape` is one row's)."""
    spec = pb.ParameterSpec(name=name, dtype=dtype_to_wire(dtype), shape=[int(d) for d in shape], state=state)
    if dynamic is not None:
        spec.dynamic.CopyFrom(pb.DynamicTable(initializer=dynamic.initializer,
                                              evict_after_steps=dynamic.evict_after_steps, seed=dynamic.seed))
    return spec


def param_spec_to_wire(spec: ParamSpec) -> pb.ParameterSpec:
    """The ParameterSpec message of a ParamSpec."""
    return spec_to_wire(spec.name, spec.dtype, spec.shape, state=spec.state, dynamic=spec.dynamic)


def spec_from_wire(message: pb.ParameterSpec) -> ParamSpec:
    """The ParamSpec of a ParameterSpec message (InvalidTensorError for an unknown dtype)."""
    dynamic = None
    if message.HasField("dynamic"):
        d = message.dynamic
        dynamic = DynamicTable(initializer=d.initializer or "zeros", evict_after_steps=int(d.evict_after_steps),
                               seed=int(d.seed))
    return ParamSpec(name=message.name, dtype=dtype_from_wire(message.dtype, name=message.name).name,
                     shape=tuple(int(d) for d in message.shape), state=message.state, dynamic=dynamic)


# ---------------------------------------------------------------- sparse rows (RowGradient, RowValues)

def rows_to_wire(array: np.ndarray) -> tuple[int, bytes]:
    """(ps.v1.DType, raw bytes) of a block of rows (RowGradient.data, RowValues.data)."""
    array = as_wire_array(array)
    return dtype_to_wire(array.dtype), array.reshape(-1).view(np.uint8).tobytes() if array.size else b""


def rows_from_wire(name: str, dtype: int, data: bytes, count: int, row_shape: Sequence[int], *,
                   want: np.dtype | None = None) -> np.ndarray:
    """The rows of `name` in `data`: `count` rows of `row_shape`, as an array of shape (count, *row_shape).

    With `want` float32 (a push), float16 or bfloat16 rows are widened to float32 (the
    half-size wire); any other dtype than `want` is InvalidTensorError naming the tensor.
    A byte count other than count * row elements * itemsize is InvalidTensorError too.
    """
    got = dtype_from_wire(dtype, name=name)
    if want is not None and got != want and not (want == np.dtype("<f4") and got in NARROW_FLOAT32):
        raise InvalidTensorError(f"rows of tensor {name!r} arrived as {got.name}, the tensor is {want.name}")
    shape = (count, *(int(d) for d in row_shape))
    need = math.prod(shape) * got.itemsize
    if len(data) != need:
        raise InvalidTensorError(f"rows of tensor {name!r}: {len(data)} bytes for {count} rows of shape "
                                 f"{list(shape[1:])} {got.name}, which need {need}")
    rows = np.frombuffer(data, dtype=got).reshape(shape) if need else np.zeros(shape, got)
    return rows.astype(want) if want is not None and got != want else rows


#: The most bytes one id takes on the wire (a packed int64 varint; a negative dynamic id takes ten).
ID_WIRE_BYTES = 10


def row_gradients_wire_bytes(gradients: Iterable[pb.RowGradient]) -> int:
    """The most bytes row gradients take in a message: their rows, and their ids as packed varints
    (ID_WIRE_BYTES each, what a negative dynamic id takes; a small id takes fewer). The bound every decision of
    what fits a message uses, split_row_gradients' cuts included."""
    return sum(len(g.data) + ID_WIRE_BYTES * len(g.ids) for g in gradients)


def split_row_gradients(gradients: Sequence[pb.RowGradient], *, header_bytes: int, piece_bytes: int
                        ) -> tuple[list[pb.RowGradient], list[list[pb.RowGradient]]]:
    """Row gradients too many for one message, cut for a stream that continues them (PushRequest.row_gradients;
    a replicated push's Follow items): (the first message's, one per table with its first rows, at most
    `header_bytes` in all; the messages after it, lists of pieces of at most `piece_bytes` each, ids counted at
    ID_WIRE_BYTES). Pieces follow the first message's tables in order, so join_row_gradients gives back every
    table's rows as they were."""
    header: list[pb.RowGradient] = []
    pieces: list[pb.RowGradient] = []
    room = header_bytes
    for grad in gradients:
        ids = np.asarray(grad.ids, dtype=np.int64)
        count = len(ids)
        row = len(grad.data) // count if count else 0
        cost = row + ID_WIRE_BYTES
        take = min(count, max(0, room // cost))
        room -= take * cost
        header.append(pb.RowGradient(name=grad.name, dtype=grad.dtype, ids=ids[:take], data=grad.data[:take * row]))
        per = max(1, piece_bytes // cost)
        for start in range(take, count, per):
            end = min(count, start + per)
            pieces.append(pb.RowGradient(name=grad.name, dtype=grad.dtype, ids=ids[start:end],
                                         data=grad.data[start * row:end * row]))
    messages: list[list[pb.RowGradient]] = []
    size = 0
    for piece in pieces:
        cost = row_gradients_wire_bytes([piece])
        if not messages or size + cost > piece_bytes:
            messages.append([])
            size = 0
        messages[-1].append(piece)
        size += cost
    return header, messages


def join_row_gradients(first: Sequence[pb.RowGradient], pieces: Sequence[pb.RowGradient],
                       where: str) -> list[pb.RowGradient]:
    """The row gradients of a stream's first message with the pieces that continue them appended (ids and rows,
    in order): what split_row_gradients cut.

    A piece must name a table the first message has a row gradient for, in that gradient's dtype
    (InvalidRequestError naming `where` otherwise). A table named twice there keeps both, for the shard to refuse."""
    if not pieces:
        return list(first)
    joined = [pb.RowGradient(name=rg.name, dtype=rg.dtype) for rg in first]
    ids: list[list] = [[rg.ids] for rg in first]
    data: list[list[bytes]] = [[rg.data] for rg in first]
    index_of: dict[str, int] = {}
    for index, rg in enumerate(first):
        index_of.setdefault(rg.name, index)
    for piece in pieces:
        index = index_of.get(piece.name)
        if index is None:
            raise InvalidRequestError(f"{where}: a row gradient piece of {piece.name!r} continues no row gradient of "
                                      f"the header (it has {sorted(index_of)[:10]})")
        if piece.dtype != joined[index].dtype:
            raise InvalidRequestError(f"{where}: a row gradient piece of {piece.name!r} is "
                                      f"{dtype_name(piece.dtype)}, its header's is {dtype_name(joined[index].dtype)}")
        ids[index].append(piece.ids)
        data[index].append(piece.data)
    for rg, its_ids, its_data in zip(joined, ids, data):
        for part in its_ids:
            rg.ids.extend(part)
        rg.data = b"".join(its_data)
    return joined
