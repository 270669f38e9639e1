"""The PushPull rpc: a push and the pull after it in one round trip, against any ps.v1 server.

Its push is exactly Push (outcome, clock, at-most-once); its values are exactly what Pull
returns at the step it reports; a wait that runs out answers ready = false and keeps the push.
"""

from __future__ import annotations

import grpc
import numpy as np

from ps_common import codec
from ps_proto.v1 import parameter_server_pb2 as pb
from tests.contract.wire import RPC_TIMEOUT, Target, Workers, expect_status


def push_pull(target: Target, shard: int, worker: str, clock: int, read_step: int, *, scale: float = 1.0,
              pull: pb.PullAfterPush | None = None) -> tuple[pb.PushPullResponse, dict]:
    grads = target.grads(scale)
    request = pb.PushPullRequest(header=pb.PushHeader(worker_id=worker, clock=clock, read_step=read_step),
                                 chunks=list(target.chunks_for(shard, grads)),
                                 pull=pull or pb.PullAfterPush(wait_timeout_ms=1000))
    response = target.stubs[shard].PushPull(request, timeout=RPC_TIMEOUT)
    assembler = codec.PartAssembler()
    for chunk in response.chunks:
        assembler.add(chunk)
    return response, {key: np.array(v) for key, v in assembler.finish().items()}


def test_a_push_pull_applies_the_push_once_and_returns_what_a_pull_then_returns(ready: Target,
                                                                                 workers: Workers) -> None:
    worker = workers.new()
    workers.new()   # sync: a second live worker, so one push does not complete the step
    mode = ready.mode
    for shard in ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        step = ready.info(shard).step
        response, values = push_pull(ready, shard, worker, clock, step)
        assert response.push.outcome == pb.PUSH_ACCEPTED and response.push.clock == clock + 1
        assert response.ready
        pulled = ready.pull(shard)
        assert response.step == pulled.step
        assert sorted(values) == sorted(pulled.parts)
        for key, value in values.items():
            np.testing.assert_array_equal(value, pulled.parts[key])
        retry, _ = push_pull(ready, shard, worker, clock, step)
        assert retry.push.duplicate and retry.push.outcome == response.push.outcome
        if mode != "sync":
            assert retry.step == response.step   # not applied again


def test_a_push_pull_whose_wait_runs_out_says_not_ready_and_keeps_the_push(ready: Target, workers: Workers) -> None:
    if ready.mode != "sync":
        return   # only a sync step (or an SSP bound) makes a pull wait; sync is the one every server has
    worker = workers.new()
    workers.new()   # the step waits for a second gradient that does not come
    for shard in ready.shards_with_parts():
        clock = workers.start_clocks[worker][shard]
        step = ready.info(shard).step
        response, values = push_pull(ready, shard, worker, clock, step,
                                     pull=pb.PullAfterPush(wait_for_step=True, wait_timeout_ms=300))
        assert response.push.outcome == pb.PUSH_ACCEPTED
        assert not response.ready and values == {}
        assert ready.worker(ready.info(shard), worker).clock == clock + 1


def test_a_push_pull_with_a_malformed_push_is_refused_and_changes_nothing(ready: Target, workers: Workers) -> None:
    worker = workers.new()
    shard = ready.shards_with_parts()[0]
    before = ready.snapshot(shard, [worker])
    bad = pb.PushPullRequest(header=pb.PushHeader(worker_id=worker, clock=workers.start_clocks[worker][shard]),
                             chunks=[pb.TensorChunk(name="nope", dtype=pb.DTYPE_FLOAT32, shape=[1], data=b"\0" * 4)])
    expect_status(grpc.StatusCode.NOT_FOUND, lambda: ready.stubs[shard].PushPull(bad, timeout=RPC_TIMEOUT), "nope")
    assert ready.snapshot(shard, [worker]) == before
