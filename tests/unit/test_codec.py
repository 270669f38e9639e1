"""Tensors survive the trip through wire chunks; bad chunks are refused with their values named."""

import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec
from ps_common.errors import InvalidRequestError, InvalidTensorError


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8"])
def test_a_part_round_trips_through_chunks_for_every_dtype(dtype: str) -> None:
    array = (np.arange(1000) % 97).astype(dtype).reshape(250, 4)
    chunks = list(codec.part_chunks("t", array, chunk_bytes=1000))
    assert len(chunks) == -(-array.nbytes // 1000)
    assembler = codec.PartAssembler()
    for chunk in reversed(chunks):  # order on the wire does not matter
        assembler.add(chunk)
    [(key, out)] = assembler.finish().items()
    assert key == ("t", 0)
    np.testing.assert_array_equal(out, array)
    assert out.dtype == array.dtype


def test_a_single_chunk_part_decodes_without_a_copy() -> None:
    array = np.arange(12, dtype=np.float32)
    [chunk] = codec.part_chunks("t", array)
    assembler = codec.PartAssembler()
    assembler.add(chunk)
    out = assembler.finish()[("t", 0)]
    assert not out.flags.writeable  # a view over the message's bytes, not a fresh array
    np.testing.assert_array_equal(out, array)


def test_big_endian_and_non_contiguous_arrays_travel_little_endian() -> None:
    array = np.arange(20, dtype=">f4").reshape(4, 5)[:, ::2]
    [chunk] = codec.part_chunks("t", array)
    assert chunk.dtype == pb.DTYPE_FLOAT32
    assert np.frombuffer(chunk.data, "<f4").tolist() == array.ravel().tolist()


def test_zero_size_and_scalar_parts_round_trip() -> None:
    for array in (np.zeros((0, 3), np.float32), np.float64(2.5).reshape(())):
        assembler = codec.PartAssembler()
        for chunk in codec.part_chunks("z", array):
            assembler.add(chunk)
        out = assembler.finish()[("z", 0)]
        assert out.shape == array.shape
        np.testing.assert_array_equal(out, array)


def test_missing_bytes_are_refused_naming_the_tensor_and_counts() -> None:
    chunks = list(codec.part_chunks("emb", np.zeros(100, np.float32), chunk_bytes=100))
    assembler = codec.PartAssembler()
    for chunk in chunks[:-1]:
        assembler.add(chunk)
    with pytest.raises(InvalidTensorError, match=r"'emb'.*got 300 bytes, expected 400"):
        assembler.finish()


def test_overlapping_chunks_are_refused() -> None:
    chunks = list(codec.part_chunks("w", np.zeros(100, np.float32), chunk_bytes=200))
    assembler = codec.PartAssembler()
    for chunk in chunks + chunks[:1]:
        assembler.add(chunk)
    with pytest.raises(InvalidTensorError, match="overlap"):
        assembler.finish()


def test_a_chunk_outside_the_part_is_refused() -> None:
    chunk = pb.TensorChunk(name="w", dtype=pb.DTYPE_FLOAT32, shape=[2], byte_offset=4, data=b"\0" * 8)
    with pytest.raises(InvalidTensorError, match=r"\[4, 12\) fall outside the part's 8 bytes"):
        codec.PartAssembler().add(chunk)


def test_expected_dtype_and_shape_are_enforced() -> None:
    assembler = codec.PartAssembler(lambda name, row: (np.dtype("float32"), (3,)))
    with pytest.raises(InvalidTensorError, match="dtype float64 does not match the parameter's float32"):
        assembler.add(next(codec.part_chunks("w", np.zeros(3, np.float64))))
    with pytest.raises(InvalidTensorError, match=r"shape \[4\] does not match the part's shape \[3\]"):
        assembler.add(next(codec.part_chunks("w", np.zeros(4, np.float32))))


def test_unknown_wire_dtype_is_refused() -> None:
    chunk = pb.TensorChunk(name="w", dtype=99, shape=[1], data=b"\0\0")
    with pytest.raises(InvalidTensorError, match="'w'.*dtype 99 is not accepted"):
        codec.PartAssembler().add(chunk)
    with pytest.raises(InvalidTensorError, match="complex64 is not supported"):
        codec.dtype_to_wire(np.complex64)


def test_the_pull_response_walker_agrees_with_protobuf_and_copies_no_tensor_bytes() -> None:
    message = pb.PullResponse(step=-3 + 10**12)
    for i, array in enumerate([np.arange(7, dtype=np.float64).reshape(7, 1), np.zeros((0, 4), np.float32),
                               np.float32(1.5).reshape(())]):
        for fields in codec.chunk_fields(f"t{i}", array, row_start=5 * i, chunk_bytes=16):
            message.chunks.add(**fields)
    raw = message.SerializeToString()
    step, views = codec.decode_pull_response(raw)
    assert step == message.step
    assert len(views) == len(message.chunks)
    for view, chunk in zip(views, message.chunks):
        assert (view.name, view.dtype, view.shape, view.row_start, view.byte_offset, bytes(view.data)) == \
            (chunk.name, chunk.dtype, tuple(chunk.shape), chunk.row_start, chunk.byte_offset, chunk.data)
        if len(view.data):
            assert view.data.obj is raw  # a view into the received message, not a copy


def test_the_pull_response_walker_skips_unknown_fields_and_refuses_truncated_messages() -> None:
    chunk = pb.TensorChunk(name="w", dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"\0" * 8)
    unknown = bytes([0x78, 0x05, 0x82, 0x01, 0x02, 0xAA, 0xBB])  # field 15 varint 5; field 16 LEN 2
    raw = pb.PullResponse(step=4, chunks=[chunk]).SerializeToString() + unknown
    step, [view] = codec.decode_pull_response(raw)
    assert (step, view.name, bytes(view.data)) == (4, "w", b"\0" * 8)
    with pytest.raises(InvalidRequestError, match="runs past the end"):
        codec.decode_pull_response(raw[:-len(unknown) - 3])


def test_encoded_requests_are_byte_for_byte_what_protobuf_writes_and_decode_back() -> None:
    header = pb.PushHeader(worker_id="w-1", clock=7, read_step=3)
    arrays = [np.arange(10, dtype=np.float32).reshape(5, 2), np.zeros((0, 3), np.float64), np.float32(2.0).reshape(())]
    fields = [f for i, a in enumerate(arrays)
              for f in codec.chunk_fields(f"p{i}", a, row_start=3 * i, chunk_bytes=12, copy=False)]
    raw = codec.encode_message(header.SerializeToString(), fields)
    expected = pb.PushRequest(header=header)
    for f in fields:
        expected.chunks.add(**{**f, "data": bytes(f["data"])})
    assert raw == expected.SerializeToString()
    got_header, views = codec.decode_message(raw)
    assert pb.PushHeader.FromString(bytes(got_header)) == header
    assert [bytes(v.data) for v in views] == [bytes(f["data"]) for f in fields]


def test_pack_encoded_groups_small_chunks_and_puts_the_header_in_the_first_message_only() -> None:
    small = [c for i in range(10) for c in codec.chunk_fields(f"t{i}", np.zeros(10, np.float32))]
    [message] = [pb.PushRequest.FromString(m) for m in codec.pack_encoded(small, b"", chunk_bytes=1000)]
    assert [c.name for c in message.chunks] == [f"t{i}" for i in range(10)]
    fields = codec.chunk_fields("big", np.zeros(1000, np.float32), chunk_bytes=1000, copy=False)
    messages = [pb.PushRequest.FromString(m) for m in codec.pack_encoded(fields, b"\x0a\x01w", chunk_bytes=1000)]
    assert len(messages) == 4
    assert [m.HasField("header") for m in messages] == [True, False, False, False]
    assert messages[0].header.worker_id == "w"
    assert len(list(codec.pack_encoded([], b""))) == 1


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_float32_part_sent_half_size_is_widened_back_to_float32_when_allowed(wire: str) -> None:
    value = np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3)
    narrow = value.astype(codec.WIRE_DTYPES[wire])
    chunks = list(codec.part_chunks("w", narrow))
    assert chunks[0].dtype == codec.dtype_to_wire(codec.WIRE_DTYPES[wire]) and len(chunks[0].data) == 24
    assembler = codec.PartAssembler(lambda name, row: (np.dtype("float32"), (4, 3)), widen=True)
    for chunk in chunks:
        assembler.add(chunk)
    [(key, got)] = assembler.finish().items()
    assert got.dtype == np.float32 and key == ("w", 0)
    np.testing.assert_array_equal(got, narrow.astype(np.float32))
    strict = codec.PartAssembler(lambda name, row: (np.dtype("float32"), (4, 3)))
    with pytest.raises(InvalidTensorError, match=f"dtype {codec.WIRE_DTYPES[wire].name} does not match"):
        strict.add(chunks[0])


def test_only_float32_parts_may_travel_half_size() -> None:
    assembler = codec.PartAssembler(lambda name, row: (np.dtype("float64"), (3,)), widen=True)
    with pytest.raises(InvalidTensorError, match="dtype float16 does not match the parameter's float64"):
        assembler.add(next(codec.part_chunks("w", np.zeros(3, np.float16))))
