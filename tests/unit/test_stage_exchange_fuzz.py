"""The stage exchange's receiving side under arbitrary bytes, without sockets: a catalog error or an ack, never a bug.

Every `StageExchange.Send` stream is decoded by `StageExchangeServicer._send`; whatever it
raises besides a catalog error (`PSError`: INVALID_ARGUMENT, RESOURCE_EXHAUSTED) would be
answered INTERNAL. Random bytes, valid messages with bytes flipped or cut, and headers with
random field values must never get there, and a refused message must leave nothing held.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_common import codec
from ps_common.errors import PSError
from ps_proto.v1 import stage_exchange_pb2 as spb
from worker_client.pipeline.exchange import Inbox, Kind, StageExchangeServicer

REPLICA, STAGE = 0, 1


def _servicer() -> tuple[Inbox, StageExchangeServicer]:
    inbox = Inbox(replica=REPLICA, stage=STAGE, max_held_messages=8, max_held_bytes=1 << 20)
    return inbox, StageExchangeServicer(inbox, max_message_bytes=1 << 20, max_tensors=8)


def _valid_stream(step: int = 5) -> list[bytes]:
    header = spb.StageHeader(replica=REPLICA, from_stage=STAGE - 1, to_stage=STAGE, kind=spb.ACTIVATIONS,
                             step=step, micro_batch=0, micro_batches=2)
    tensors = {"h": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.arange(3, dtype=np.int64)}
    chunks = (f for name, value in tensors.items() for f in codec.chunk_fields(name, value, chunk_bytes=16))
    return list(codec.pack_encoded(chunks, header.SerializeToString(), chunk_bytes=16))


def _outcome(servicer: StageExchangeServicer, messages: list[bytes]) -> str:
    try:
        ack = servicer._send(iter(messages))
    except PSError as exc:
        return exc.reason
    return "stale" if ack.stale else "duplicate" if ack.duplicate else "held"


def test_a_valid_stream_is_held_and_taken_whole() -> None:
    inbox, servicer = _servicer()
    assert _outcome(servicer, _valid_stream()) == "held"
    taken = inbox.take(Kind.ACTIVATIONS, 5, 0, timeout=1.0)
    assert taken["h"].tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    assert taken["ids"].tolist() == [0, 1, 2]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_bytes_are_refused_as_bad_input(messages: list[bytes]) -> None:
    inbox, servicer = _servicer()
    outcome = _outcome(servicer, messages)
    assert outcome in ("INVALID_REQUEST", "INVALID_TENSOR", "held"), outcome
    if outcome != "held":
        assert inbox.stats().held == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_valid_stream_with_bytes_flipped_or_cut_never_reaches_a_bug(data: st.DataObject) -> None:
    messages = _valid_stream()
    index = data.draw(st.integers(0, len(messages) - 1))
    raw = bytearray(messages[index])
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    messages[index] = bytes(raw)
    inbox, servicer = _servicer()
    outcome = _outcome(servicer, messages)
    assert outcome in ("INVALID_REQUEST", "INVALID_TENSOR", "RESOURCE_EXHAUSTED", "held"), outcome


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replica=st.integers(0, 2**32 - 1), from_stage=st.integers(0, 2**32 - 1), to_stage=st.integers(0, 2**32 - 1),
       kind=st.integers(0, 2**31 - 1), step=st.integers(0, 2**64 - 1), micro=st.integers(0, 2**32 - 1),
       micros=st.integers(0, 2**32 - 1))
def test_headers_with_any_field_values_are_checked_not_trusted(replica, from_stage, to_stage, kind, step, micro,
                                                                micros) -> None:
    header = spb.StageHeader(replica=replica, from_stage=from_stage, to_stage=to_stage, kind=kind, step=step,
                             micro_batch=micro, micro_batches=micros)
    messages = list(codec.pack_encoded(iter(()), header.SerializeToString(), chunk_bytes=16))
    inbox, servicer = _servicer()
    outcome = _outcome(servicer, messages)
    fits = (replica == REPLICA and to_stage == STAGE and kind in {k.value for k in Kind}
            and from_stage == Kind(kind).sender(STAGE) and step < 2**62 and micro < micros)
    assert outcome == ("held" if fits else "INVALID_REQUEST"), (outcome, header)
