"""Every push reaching a shard twice (a retry after a lost answer) ends with the parameters of a run without retries.

A ReplayProxy (tests/helpers/replay_proxy.py) stands between a real worker process and each
real shard and sends every Push and PushPull twice, handing the worker the second answer: on
each path training takes (PushPull with shared memory, PushPull over gRPC bytes, and Push and
Pull streams for a model too large for one PushPull message), the shards must acknowledge the
replay as a duplicate and apply nothing, so the parameters equal those of the same job
without the proxy, byte for byte.
"""

from __future__ import annotations

import contextlib
import signal

import numpy as np
import pytest

from tests.faults.conftest import metric
from tests.helpers.processes import ShardCluster
from tests.helpers.replay_proxy import ReplayProxy
from worker_client.client import PSClient, RetryPolicy, ServerError

STEPS = 200
#: the shards offer no data channel: a worker would send its calls over it, around the proxy (with shared memory,
#: the call's header; the channel's own replays: tests/integration/test_data_channel.py)
GRPC_ONLY = ["--no-data-channel"]
PATHS = {
    # path: (shards, shard flags, worker flags)
    "push-pull, shared memory": (2, GRPC_ONLY, ["--shared-memory-min-bytes", "0"]),   # its small shards too
    "push-pull, gRPC bytes": (2, GRPC_ONLY, ["--no-shared-memory"]),
    "push and pull streams": (1, GRPC_ONLY, ["--no-shared-memory", "--model", "deep_mlp"]),   # 369 KB > one message
}


def train_and_pull(start_job, mode: str, path: str, *, replay: bool) -> tuple[dict[str, np.ndarray], list[int],
                                                                           list[float], int]:
    """One worker (so the order of updates is fixed): the final parameters, steps, duplicate counts and replays."""
    shards, shard_flags, flags = PATHS[path]
    job = start_job(mode=mode, shards=shards, workers=1, steps=STEPS, shard_flags=shard_flags, worker_flags=flags,
                    start_workers=False)
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(ReplayProxy(a)) for a in job.cluster.addresses] if replay else []
        servers = ",".join(p.address for p in proxies) if replay else job.cluster.address_option
        job.workers = [job.start_worker(0, "--servers", servers)]
        (result,) = job.finish()
        replayed = sum(p.replayed for p in proxies)
    assert result["iterations"] == STEPS and result["dropped"] == 0, result
    with PSClient(job.cluster.addresses, worker_id="inspector", retry=RetryPolicy(attempts=3)) as client:
        values = {name: np.array(value) for name, value in client.pull().items()}
        steps = list(client.steps)
    return values, steps, [metric(shard, "ps_duplicate_pushes_total") for shard in job.cluster.shards], replayed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_push_replayed_is_applied_once_and_the_parameters_match_a_run_without_retries_bit_for_bit(
        start_job, mode, path):
    shards = PATHS[path][0]
    plain, plain_steps, plain_duplicates, _ = train_and_pull(start_job, mode, path, replay=False)
    replayed, replayed_steps, duplicates, replays = train_and_pull(start_job, mode, path, replay=True)
    assert plain_steps == replayed_steps == [STEPS] * shards
    assert replays == STEPS * shards, "the proxy did not replay every push"
    assert plain_duplicates == [0] * shards and duplicates == [STEPS] * shards
    assert sorted(plain) == sorted(replayed)
    for name in plain:
        assert plain[name].tobytes() == replayed[name].tobytes(), f"{name} differs after replayed pushes"


@pytest.mark.timeout(120)
def test_a_push_that_fails_on_one_shard_after_another_took_it_is_completed_by_sending_it_again_with_its_clock():
    """docs/protocol.md, "Guarantees under faults": a push to several shards is a call per shard, with no transaction
    across them. With shard 1 frozen, a push lands on shard 0 and fails on shard 1 (its deadline). The client keeps
    its clock, so the next push (shard 1 running again) carries the same one: a duplicate where the first landed,
    applied where it did not; each parameter moves by exactly one update, and a third send of that clock by none."""
    start = {"a": np.ones(4096, np.float32), "b": np.ones(4096, np.float32)}
    grads = {"a": np.full(4096, 0.5, np.float32), "b": np.full(4096, 0.5, np.float32)}
    with ShardCluster(2, mode="async") as cluster, \
            PSClient(cluster.addresses, worker_id="w0", rpc_timeout=4.0, retry=RetryPolicy(attempts=1),
                     shared_memory=False, data_channel=False) as client:
        client.initialize(start)
        owners = {name: {p.shard for p in client.shard_map.parts if p.name == name} for name in start}
        assert owners in ({"a": {0}, "b": {1}}, {"a": {1}, "b": {0}}), owners
        frozen = cluster.shards[1]
        frozen.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(ServerError) as failed:
                client.push(grads)
        finally:
            frozen.process.send_signal(signal.SIGCONT)
        assert frozen.address in str(failed.value), failed.value
        report = client.push(grads)
        assert report.clock == 0, "the client moved its clock past a push that failed"
        assert report.responses[0].duplicate, report.responses[0]       # shard 0 took the first send
        again = client.push(grads, clock=0)
        assert [r.duplicate for r in again.responses] == [True, True], again.responses
        with PSClient(cluster.addresses, worker_id="inspector", retry=RetryPolicy(attempts=3)) as inspector:
            values = inspector.pull()
    first = values["a"] if owners["a"] == {0} else values["b"]          # shard 0's parameter: updated, for sure
    assert not np.array_equal(first, start["a"]), "shard 0 applied nothing"
    assert np.array_equal(values["a"], values["b"]), (values["a"][:4], values["b"][:4])   # one update each, no more
