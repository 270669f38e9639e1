"""A backup joins a primary's ISR only holding every operation the primary answered: the answers wait for it from
the moment it starts to join, it confirms what came before it did, and only then are the voters asked (once they
list it, it may be elected). One that falls behind meanwhile does not join, or is taken out before an answer goes
without it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from ps_server.replication.quorum import Grant, Voter
from ps_server.replication.replica import PRIMARY, Peers, PrimaryLog, Replica, ReplicaConfig

OWN, BACKUP = "s0r0", "s0r1"


class HeldQuorum:
    """The voters, answering SetIsr only once `release()` is called (the round trip of the ask); every ISR asked for
    is noted."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.asking = threading.Event()
        self._released = threading.Event()

    def ask(self, rpc: str, request) -> list[Grant]:
        assert rpc == "SetIsr", rpc
        self.asked.append(list(request.isr))
        self.asking.set()
        assert self._released.wait(10), "the test never released the quorum"
        return [Grant(True, request.epoch, request.holder, tuple(request.isr))]

    @staticmethod
    def granted(answers) -> bool:
        return all(a.granted for a in answers)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        pass


def primary(replication_timeout: float = 10.0) -> tuple[Replica, PrimaryLog, HeldQuorum, object]:
    """A primary holding its lease with ISR [itself], and BACKUP following it with everything confirmed."""
    config = ReplicaConfig(shard=0, replica=0, replicas=("a:1", "b:1"), voters=("v:1",), address="a:1",
                           lease=60.0, replication_timeout=replication_timeout)
    replica = Replica(SimpleNamespace(), config, Voter(), Peers(None, ()))
    replica.quorum.close()
    replica.quorum = quorum = HeldQuorum()
    replica.role, replica.epoch, replica.isr = PRIMARY, 1, (OWN,)
    replica.lease.granted(time.monotonic())
    replica.log = log = PrimaryLog(replica, 0)
    _, follower = log.follow(BACKUP, lambda: None)
    log.confirm(follower, 0)
    return replica, log, quorum, follower


def thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_an_answer_given_while_the_voters_are_asked_waits_for_the_joining_backup() -> None:
    replica, log, quorum, follower = primary()
    adding = thread(lambda: replica.add_to_isr(BACKUP))
    assert quorum.asking.wait(10)
    seq = log.record(object())          # a push recorded while the voters decide
    answered = thread(lambda: log.wait(seq))
    answered.join(0.3)
    assert answered.is_alive(), "answered before the backup, which the voters may list already, confirmed it"
    log.confirm(follower, seq)
    answered.join(10)
    assert not answered.is_alive()
    quorum.release()
    adding.join(10)
    assert replica.isr == (OWN, BACKUP) and quorum.asked == [[OWN, BACKUP]] and not log.joining


def test_operations_recorded_before_it_began_to_join_are_confirmed_before_the_voters_are_asked() -> None:
    replica, log, quorum, follower = primary()
    seq = log.record(object())          # recorded after the ack that started the join, maybe answered already
    quorum.release()
    adding = thread(lambda: replica.add_to_isr(BACKUP))
    assert not quorum.asking.wait(0.3), "the voters were asked before the backup held every operation"
    log.confirm(follower, seq)
    adding.join(10)
    assert replica.isr == (OWN, BACKUP) and quorum.asked == [[OWN, BACKUP]]


def test_a_backup_that_does_not_catch_up_in_time_does_not_join() -> None:
    replica, log, quorum, _ = primary(replication_timeout=0.2)
    log.record(object())
    quorum.release()
    replica.add_to_isr(BACKUP)
    assert replica.isr == (OWN,) and quorum.asked == [] and not log.joining
    assert log.wait(log.seq) is None    # and answers no longer wait for it


def test_a_joining_backup_that_misses_an_answers_deadline_is_out_before_that_answer_goes() -> None:
    replica, log, quorum, _ = primary(replication_timeout=0.3)
    adding = thread(lambda: replica.add_to_isr(BACKUP))
    assert quorum.asking.wait(10)
    seq = log.record(object())          # never confirmed by the backup
    isr_when_answered: list[tuple[str, ...]] = []
    answered = thread(lambda: (log.wait(seq), isr_when_answered.append(replica.isr)))
    time.sleep(0.6)                     # past the answer's deadline while the voters still decide
    assert answered.is_alive(), "answered without the backup while the voters may be listing it"
    quorum.release()
    for t in (adding, answered):
        t.join(10)
    assert quorum.asked == [[OWN, BACKUP], [OWN]]     # added, then taken out again before the answer
    assert isr_when_answered == [(OWN,)] and replica.isr == (OWN,) and not log.joining
