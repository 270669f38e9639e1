"""Contract: what a shard says before InitParameters, and how the first initialization installs the values."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common import codec
from tests.contract.wire import Target, expect_status, new_id

pytestmark = pytest.mark.before_init


def test_cluster_info_before_init_says_not_initialized_with_no_parameters_or_parts(uninitialized: Target) -> None:
    for shard in range(uninitialized.num_shards):
        info = uninitialized.info(shard)
        assert not info.initialized
        assert list(info.parameters) == [] and list(info.parts) == []
        assert info.step == 0


def test_push_before_init_is_failed_precondition(uninitialized: Target) -> None:
    worker = new_id("contract-early")
    uninitialized.register(worker)    # membership works before the parameters exist
    try:
        chunk = next(codec.part_chunks("contract.b", uninitialized.model["contract.b"]))
        messages = uninitialized.push_messages(worker, 0, 0, [chunk])
        for shard in range(uninitialized.num_shards):
            expect_status(grpc.StatusCode.FAILED_PRECONDITION, lambda: uninitialized.push_raw(shard, messages),
                          "InitParameters")
            assert uninitialized.info(shard).step == 0
    finally:
        uninitialized.deregister(worker)


def test_pull_before_init_is_failed_precondition(uninitialized: Target) -> None:
    for shard in range(uninitialized.num_shards):
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, lambda: uninitialized.pull(shard), "InitParameters")
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, lambda: uninitialized.pull(shard, ["contract.w"]))


def test_init_whose_chunks_leave_out_a_part_is_invalid_and_leaves_the_shard_uninitialized(uninitialized: Target) -> None:
    shard = uninitialized.shards_with_parts()[0]
    missing = uninitialized.parts_on(shard)[0]
    messages = uninitialized.init_messages(shard, skip=[missing.name])
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: uninitialized.init(shard, messages), repr(missing.name))
    assert not uninitialized.info(shard).initialized


def test_init_with_a_wrong_dtype_shape_or_byte_count_is_invalid_and_installs_nothing(uninitialized: Target) -> None:
    shard = uninitialized.shards_with_parts()[0]
    part = uninitialized.parts_on(shard)[0]
    good = uninitialized.init_messages(shard)

    def with_bad_chunk(mutate) -> list[pb.InitRequest]:
        messages = [pb.InitRequest() for _ in good]
        for copy, original in zip(messages, good):
            copy.CopyFrom(original)
        for message in messages:
            for chunk in message.chunks:
                if chunk.name == part.name and chunk.row_start == part.row_start:
                    mutate(chunk)
                    return messages
        raise AssertionError(f"no chunk of {part.name!r} in the init stream")

    def wrong_dtype(chunk: pb.TensorChunk) -> None:
        chunk.dtype = pb.DTYPE_FLOAT16 if chunk.dtype != pb.DTYPE_FLOAT16 else pb.DTYPE_FLOAT32

    def wrong_shape(chunk: pb.TensorChunk) -> None:
        chunk.shape.append(1)

    def short_bytes(chunk: pb.TensorChunk) -> None:
        chunk.data = chunk.data[:-1]

    for mutate in (wrong_dtype, wrong_shape, short_bytes):
        expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: uninitialized.init(shard, with_bad_chunk(mutate)),
                      repr(part.name))
        assert not uninitialized.info(shard).initialized, mutate.__name__


def test_init_with_an_unspecified_dtype_in_the_header_is_invalid(uninitialized: Target) -> None:
    specs = [pb.ParameterSpec(name="contract.bad", dtype=pb.DTYPE_UNSPECIFIED, shape=[2])]
    messages = uninitialized.init_messages(0, specs=specs, values={})
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, lambda: uninitialized.init(0, messages), "'contract.bad'")
    assert not uninitialized.info(0).initialized


def test_init_installs_exactly_the_values_sent_and_every_shard_serves_its_parts(uninitialized: Target) -> None:
    target = uninitialized
    responses = [target.init(i, target.init_messages(i, chunk_bytes=1024)) for i in range(target.num_shards)]
    target.initialized_here = True
    target.fresh_init = True
    shard_map = target.shard_map()
    for shard, response in enumerate(responses):
        assert not response.already_initialized
        assert response.step == 0
        assert response.num_parts == len(shard_map.parts_on(shard))
        pulled = target.pull(shard)
        assert pulled.step == 0
        assert sorted(pulled.parts) == sorted((p.name, p.row_start) for p in shard_map.parts_on(shard))
        for part in shard_map.parts_on(shard):
            value = target.model[part.name]
            expected = value if part.whole else value[part.row_start:part.row_end]
            got = pulled.parts[(part.name, part.row_start)]
            assert got.dtype == expected.dtype and got.shape == expected.shape
            np.testing.assert_array_equal(got, expected)
