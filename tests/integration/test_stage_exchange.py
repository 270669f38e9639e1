"""The stage exchange over real gRPC on 127.0.0.1 port 0: round trips, the inbox's rules, auth, retries."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from ps_common.errors import (REASON_KEY, InvalidRequestError, ServerError, StageTimeoutError, StoppedError,
                              UnauthenticatedError)
from ps_proto.v1 import stage_exchange_pb2 as spb
from worker_client.pipeline import Kind, StageLink, StageSecurity, StageServer, lookup, publish
from worker_client.pipeline.exchange import SEND_METHOD

TOKEN = "stage-token-0123456789abcdef"
A, C = Kind.ACTIVATIONS, Kind.COTANGENTS


@pytest.fixture
def server():
    """Stage 1 of replica 0, plaintext, no token."""
    srv = StageServer(replica=0, stage=1)
    yield srv
    srv.close(0)


@pytest.fixture
def link(server):
    """Stage 0 -> stage 1 of replica 0."""
    with StageLink(server.address, replica=0, from_stage=0, to_stage=1, rpc_timeout=10) as lnk:
        yield lnk


def test_float32_int64_bfloat16_and_a_multi_chunk_tensor_arrive_exactly(server, link):
    rng = np.random.default_rng(0)
    tensors = {
        "x": rng.standard_normal((4, 8)).astype(np.float32),
        "ids": np.arange(12, dtype=np.int64).reshape(3, 4),
        "half": rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16),
        "big": rng.standard_normal((3, 1024, 1024)).astype(np.float32),   # 12 MiB: three chunks, over 8 MiB
        "scalar": np.float32(2.5) * np.ones((), np.float32),
    }
    ack = link.send(A, 3, 0, 2, tensors, timeout=30)
    assert not ack.duplicate and not ack.stale
    got = server.take(A, 3, 0, timeout=10)
    assert set(got) == set(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == np.asarray(value).tobytes(), name


def test_take_finds_each_micro_batch_whatever_the_order_of_arrival(server, link):
    link.send(A, 0, 1, 2, {"x": np.full(3, 1.0, np.float32)}, timeout=10)
    link.send(A, 0, 0, 2, {"x": np.full(3, 0.0, np.float32)}, timeout=10)
    assert server.take(A, 0, 0, timeout=5)["x"][0] == 0.0
    assert server.take(A, 0, 1, timeout=5)["x"][0] == 1.0


def test_activations_and_cotangents_of_the_same_micro_batch_are_kept_apart():
    with StageServer(replica=2, stage=1) as mid, \
            StageLink(mid.address, replica=2, from_stage=0, to_stage=1) as up, \
            StageLink(mid.address, replica=2, from_stage=2, to_stage=1) as down:
        up.send(A, 5, 0, 1, {"t": np.zeros(2, np.float32)}, timeout=10)
        down.send(C, 5, 0, 1, {"t": np.ones(2, np.float32)}, timeout=10)
        assert mid.take(C, 5, 0, timeout=5)["t"].tolist() == [1.0, 1.0]
        assert mid.take(A, 5, 0, timeout=5)["t"].tolist() == [0.0, 0.0]


def test_a_take_that_runs_out_names_the_kind_step_micro_batch_replica_peer_and_seconds(server):
    started = time.monotonic()
    with pytest.raises(StageTimeoutError) as err:
        server.take(C, 7, 3, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2
    message = str(err.value)
    for part in ("COTANGENTS", "step 7", "micro-batch 3", "replica 0", "from stage 2", "0.3 s"):
        assert part in message, (part, message)


def test_a_set_stop_event_ends_a_take_within_a_second(server):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(StoppedError):
        server.take(A, 0, 0, timeout=60, stop=stop)
    assert time.monotonic() - started < 1.0


def test_discard_through_drops_held_messages_and_refuses_late_ones(server, link):
    link.send(A, 1, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=10)
    link.send(A, 2, 0, 1, {"x": np.ones(1, np.float32)}, timeout=10)
    assert server.discard_through(1) == 1
    late = link.send(A, 1, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=10)
    assert late.stale and late.discarded_through == 1
    with pytest.raises(ValueError, match="discarded"):
        server.take(A, 1, 0, timeout=0.2)
    assert server.take(A, 2, 0, timeout=5)["x"][0] == 1.0
    assert server.inbox.stats().held == 0


def test_a_duplicate_send_is_acknowledged_and_never_taken_twice(server, link):
    first = link.send(A, 4, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=10)
    again = link.send(A, 4, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=10)
    assert not first.duplicate and again.duplicate
    server.take(A, 4, 0, timeout=5)
    after_take = link.send(A, 4, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=10)
    assert after_take.duplicate
    with pytest.raises(ValueError, match="already taken"):
        server.take(A, 4, 0, timeout=0.2)


def _raw_send(address: str, messages: list[bytes], metadata=()):
    with grpc.insecure_channel(address) as channel:
        send = channel.stream_unary(SEND_METHOD, request_serializer=lambda b: b,
                                    response_deserializer=spb.StageAck.FromString)
        return send(iter(messages), timeout=10, metadata=metadata)


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    reason = dict(exc.trailing_metadata() or ()).get(REASON_KEY, "")
    return exc.code(), reason


def _header(**fields) -> bytes:
    base = dict(replica=0, from_stage=0, to_stage=1, kind=spb.ACTIVATIONS, step=0, micro_batch=0, micro_batches=1)
    base.update(fields)
    return spb.StageMessage(header=spb.StageHeader(**base)).SerializeToString()


@pytest.mark.parametrize("messages", [
    [b"\xff\xff\xff\xff garbage"],
    [spb.StageMessage().SerializeToString()],                       # no header
    [_header(kind=7)],                                              # unknown kind
    [_header(to_stage=2, from_stage=1)],                            # another stage's message
    [_header(replica=1)],                                           # another replica's message
    [_header(from_stage=2)],                                        # activations from the wrong neighbour
    [_header(micro_batch=2, micro_batches=2)],                      # micro-batch out of range
], ids=["bad-bytes", "no-header", "unknown-kind", "wrong-stage", "wrong-replica", "wrong-sender", "micro-range"])
def test_bad_input_is_invalid_argument_never_internal(server, messages):
    with pytest.raises(grpc.RpcError) as err:
        _raw_send(server.address, messages)
    assert _status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError.reason)
    assert server.inbox.stats().held == 0


def test_a_chunk_that_does_not_fit_its_tensor_is_invalid_argument(server):
    chunk = spb.StageMessage(chunks=[{"name": "x", "dtype": 1, "shape": [4], "byte_offset": 8, "data": b"\0" * 16}])
    with pytest.raises(grpc.RpcError) as err:
        _raw_send(server.address, [_header(), chunk.SerializeToString()])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside" in err.value.details()


def test_a_full_inbox_refuses_with_resource_exhausted_until_the_stage_takes():
    with StageServer(replica=0, stage=1, max_held_messages=2) as srv, \
            StageLink(srv.address, replica=0, from_stage=0, to_stage=1) as lnk:
        for micro in range(2):
            lnk.send(A, 0, micro, 3, {"x": np.zeros(1, np.float32)}, timeout=10)
        with pytest.raises(ServerError) as err:
            lnk.send(A, 0, 2, 3, {"x": np.zeros(1, np.float32)}, timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "inbox full" in str(err.value)
        srv.take(A, 0, 0, timeout=5)
        lnk.send(A, 0, 2, 3, {"x": np.zeros(1, np.float32)}, timeout=10)


def test_a_worker_token_on_the_server_refuses_a_link_without_it_and_accepts_one_with_it():
    with StageServer(replica=0, stage=1, security=StageSecurity(token=TOKEN)) as srv:
        with StageLink(srv.address, replica=0, from_stage=0, to_stage=1) as bare:
            with pytest.raises(UnauthenticatedError) as err:
                bare.send(A, 0, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=5)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with StageLink(srv.address, replica=0, from_stage=0, to_stage=1,
                       security=StageSecurity(token="wrong-token-0123456789")) as wrong:
            with pytest.raises(UnauthenticatedError):
                wrong.send(A, 0, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=5)
        with StageLink(srv.address, replica=0, from_stage=0, to_stage=1, security=StageSecurity(token=TOKEN)) as ok:
            ok.send(A, 0, 0, 1, {"x": np.ones(1, np.float32)}, timeout=5)
        assert srv.take(A, 0, 0, timeout=5)["x"][0] == 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_send_before_the_peer_is_up_is_retried_until_it_starts():
    port = _free_port()
    started: list[StageServer] = []
    timer = threading.Timer(1.0, lambda: started.append(StageServer(f"127.0.0.1:{port}", replica=0, stage=1)))
    timer.start()
    try:
        with StageLink(f"127.0.0.1:{port}", replica=0, from_stage=0, to_stage=1) as lnk:
            ack = lnk.send(A, 0, 0, 1, {"x": np.ones(2, np.float32)}, timeout=15)
        assert not ack.duplicate
        timer.join()
        assert started[0].take(A, 0, 0, timeout=5)["x"].tolist() == [1.0, 1.0]
    finally:
        timer.join()
        for srv in started:
            srv.close(0)


def test_a_send_to_a_peer_that_never_comes_names_the_address_and_status_after_its_timeout():
    address = f"127.0.0.1:{_free_port()}"
    with StageLink(address, replica=0, from_stage=0, to_stage=1) as lnk:
        begun = time.monotonic()
        with pytest.raises(ServerError) as err:
            lnk.send(A, 0, 0, 1, {"x": np.ones(1, np.float32)}, timeout=1.0)
    assert time.monotonic() - begun < 4
    assert address in str(err.value) and "UNAVAILABLE" in str(err.value)


def test_a_stop_event_ends_a_send_that_is_retrying():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with StageLink(f"127.0.0.1:{_free_port()}", replica=0, from_stage=0, to_stage=1) as lnk:
        begun = time.monotonic()
        with pytest.raises(StoppedError):
            lnk.send(A, 0, 0, 1, {"x": np.ones(1, np.float32)}, timeout=30, stop=stop)
    assert time.monotonic() - begun < 1.5


def test_a_restarted_peer_on_a_new_port_is_found_through_the_rendezvous(tmp_path):
    first = StageServer(replica=0, stage=1)
    publish(tmp_path, 0, 1, first.address)
    link = StageLink(lookup(tmp_path, 0, 1, timeout=5), replica=0, from_stage=0, to_stage=1,
                     resolve=lambda: lookup(tmp_path, 0, 1, timeout=1), resolve_after=0.3)
    try:
        link.send(A, 0, 0, 1, {"x": np.zeros(1, np.float32)}, timeout=10)
        first.close(0)
        second = StageServer(replica=0, stage=1)   # a new port
        publish(tmp_path, 0, 1, second.address)
        try:
            link.send(A, 1, 0, 1, {"x": np.ones(1, np.float32)}, timeout=15)
            assert link.address == second.address
            assert second.take(A, 1, 0, timeout=5)["x"][0] == 1.0
        finally:
            second.close(0)
    finally:
        link.close()


def test_under_mutual_tls_a_link_with_the_jobs_client_certificate_sends_and_one_without_is_refused(tmp_path):
    from ps_tools.certs import make_files, write_files

    write_files(tmp_path, make_files(), force=False)
    d = {name: str(tmp_path / name) for name in ("ca.crt", "server.crt", "server.key", "worker.crt", "worker.key")}
    serving = StageSecurity(server_cert=d["server.crt"], server_key=d["server.key"], client_ca=d["ca.crt"])
    with StageServer("127.0.0.1:0", replica=0, stage=1, security=serving) as srv:
        mutual = StageSecurity(ca=d["ca.crt"], cert=d["worker.crt"], key=d["worker.key"])
        with StageLink(srv.address, replica=0, from_stage=0, to_stage=1, security=mutual) as lnk:
            lnk.send(A, 0, 0, 1, {"x": np.ones(1, np.float32)}, timeout=10)
        assert srv.take(A, 0, 0, timeout=5)["x"][0] == 1.0
        with StageLink(srv.address, replica=0, from_stage=0, to_stage=1,
                       security=StageSecurity(ca=d["ca.crt"])) as no_cert:
            with pytest.raises(ServerError) as err:
                no_cert.send(A, 0, 1, 2, {"x": np.ones(1, np.float32)}, timeout=1)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert srv.inbox.stats().held == 0


def test_plaintext_off_loopback_is_refused_unless_the_job_is_insecure():
    with pytest.raises(ValueError, match="plaintext stage exchange on 0.0.0.0"):
        StageServer("0.0.0.0:0", replica=0, stage=0)


def test_a_tf_config_stage_worker_serves_plaintext_on_all_interfaces_only_with_its_insecure_setting(caplog):
    import argparse
    import json

    from ps_common import jobconfig
    from worker_client.pipeline.worker import stage_security

    tf = json.dumps({"cluster": {"ps": ["ps-0.job:2222", "ps-1.job:2222"],
                                 "worker": ["w-0.job:2222", "w-1.job:2222"]},
                     "task": {"type": "worker", "index": 0, "stage": 1}})

    def job(*argv: str) -> jobconfig.JobConfig:
        parser = argparse.ArgumentParser()
        jobconfig.add_arguments(parser, scope="worker")
        return jobconfig.load_config(parser.parse_args(["--stages", "2", *argv]), scope="worker",
                                     env={"TF_CONFIG": tf})

    plain = job()
    assert plain.worker.stage_listen.startswith("0.0.0.0:") and not plain.worker.insecure
    with pytest.raises(ValueError, match=r"plaintext stage exchange on 0\.0\.0\.0.*--insecure"):
        StageServer("0.0.0.0:0", replica=0, stage=1, security=stage_security(plain))
    with caplog.at_level("WARNING", logger="worker_client.pipeline.exchange"):
        with StageServer("0.0.0.0:0", replica=0, stage=1, security=stage_security(job("--insecure"))) as srv:
            assert srv.address.startswith("0.0.0.0:")
    assert "PLAINTEXT" in caplog.text and "non-loopback" in caplog.text
