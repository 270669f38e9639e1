"""One replica of a replicated shard: its role, and the threads that keep it (docs/replication.md).

A `Replica` sits beside its process's Shard and turns it into a primary or a backup:

- **Primary.** The shard tells every change to `PrimaryLog.record` (under its lock); each
  backup's Follow stream sends the operations in order; `PrimaryLog.wait(seq)` holds the answer
  to a push until every in-sync backup confirmed it (a backup that does not within
  REPLICATION_TIMEOUT is taken out of the ISR through the quorum first), and until then checks
  the lease: a primary whose lease ran out, or that learned a higher epoch, steps down and
  answers NOT_PRIMARY. A renewal round to every voter each LEASE / 6 keeps the lease.
- **Backup.** A follow thread finds the primary among the shard's replicas, takes a snapshot
  (Shard.restore) and then the operations (Shard.replay, in a thread of their own, each
  confirmed on receipt). A backup in the ISR that hears nothing for LEASE runs an election
  (Vote at epoch + 1); with a majority it applies what it received, becomes primary and takes
  the ISR alone; the others follow it.
- **Start.** Replica 0 of a shard asks the voters for epoch 1 (Bootstrap); when an epoch was
  promised already (a restart), it follows like any other: a restarted replica never serves its
  own old state.

`role_check` (the Shard's hook) refuses every call but on a primary holding its lease.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from ps_common.errors import NotPrimaryError, PSError, ReplayMismatchError
from ps_proto.v1 import replication_pb2 as rpb
from ps_proto.v1 import replication_pb2_grpc as rpb_grpc
from ps_server.operations import Op
from ps_server.replication.quorum import LEASE_SECONDS, Grant, Lease, Voter, majority
from ps_server.replication.wire import OpAssembler, op_items, snapshot_items, snapshot_of

log = logging.getLogger(__name__)

__all__ = ["PrimaryLog", "Replica", "ReplicaConfig", "replica_id"]

#: How long a primary waits for an in-sync backup's confirmation before taking it out of the ISR (seconds).
REPLICATION_TIMEOUT = 1.0
#: A primary's stream sends a ping this often when it has nothing else to send (seconds).
PING_SECONDS = 0.2
#: Deadline of one quorum call (seconds).
QUORUM_CALL_SECONDS = 0.5
#: Between two attempts to find and follow the primary (seconds).
FOLLOW_RETRY_SECONDS = 0.2
#: The most operations a primary keeps for its followers; a follower further behind takes a snapshot again.
LOG_LIMIT = 100_000

PRIMARY, BACKUP, JOINING, STALE, WITNESS = "PRIMARY", "BACKUP", "JOINING", "STALE", "WITNESS"


def replica_id(shard: int, replica: int) -> str:
    return f"s{shard}r{replica}"


@dataclass(frozen=True)
class ReplicaConfig:
    """Where this replica sits: its shard and index, its shard's replica addresses (index order), every voter."""

    shard: int
    replica: int
    replicas: tuple[str, ...]
    voters: tuple[str, ...]
    address: str = ""
    lease: float = LEASE_SECONDS
    replication_timeout: float = REPLICATION_TIMEOUT

    @property
    def id(self) -> str:
        return replica_id(self.shard, self.replica)


class Peers:
    """gRPC stubs of the other processes (replicas and voters), made once per address."""

    def __init__(self, credentials: grpc.ChannelCredentials | None, metadata: Sequence[tuple[str, str]]) -> None:
        self.credentials = credentials
        self.metadata = tuple(metadata)
        self._stubs: dict[str, rpb_grpc.ReplicationStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def stub(self, address: str) -> rpb_grpc.ReplicationStub:
        with self._lock:
            found = self._stubs.get(address)
            if found is None:
                options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                           ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
                channel = (grpc.insecure_channel(address, options=options) if self.credentials is None
                           else grpc.secure_channel(address, self.credentials, options=options))
                self._channels.append(channel)
                found = self._stubs[address] = rpb_grpc.ReplicationStub(channel)
            return found

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()


def _grant(message: rpb.LeaseGrant) -> Grant:
    return Grant(message.granted, message.epoch, message.holder, tuple(message.isr), message.why)


class Quorum:
    """Asks every voter at once (this process's own voter directly) and counts the grants."""

    def __init__(self, voters: Sequence[str], own: str, voter: Voter, peers: Peers) -> None:
        self.voters = list(voters)
        self.own = own
        self.voter = voter
        self.peers = peers
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.voters)), thread_name_prefix="quorum")

    def ask(self, rpc: str, request) -> list[Grant]:
        """Every voter's answer (a voter that does not answer in QUORUM_CALL_SECONDS counts as a refusal)."""

        def one(address: str) -> Grant:
            if address == self.own:
                return self._local(rpc, request)
            try:
                return _grant(getattr(self.peers.stub(address), rpc)(request, timeout=QUORUM_CALL_SECONDS,
                                                                      metadata=self.peers.metadata))
            except grpc.RpcError as exc:
                return Grant(False, 0, "", (), f"{address}: {exc.code().name}")

        return list(self._pool.map(one, self.voters))

    def _local(self, rpc: str, request) -> Grant:
        if rpc == "SetIsr":
            return self.voter.set_isr(request.shard, request.epoch, request.holder, request.isr)
        method = {"Bootstrap": lambda r: self.voter.bootstrap(r.shard, r.replica, r.isr, r.incarnation),
                  "Renew": lambda r: self.voter.renew(r.shard, r.epoch, r.replica, r.isr),
                  "Vote": lambda r: self.voter.vote(r.shard, r.epoch, r.replica)}[rpc]
        return method(request)

    def granted(self, answers: Sequence[Grant]) -> bool:
        return sum(a.granted for a in answers) >= majority(len(self.voters))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Follower:
    """A backup following this primary: what it confirmed, and whether it is in the ISR."""

    replica: str
    start: int                      # its snapshot holds operations up to here
    confirmed: int = -1
    in_sync: bool = False
    gone: threading.Event = field(default_factory=threading.Event)


class PrimaryLog:
    """The primary's side: the operations in order, the followers' confirmations, the wait before an answer."""

    def __init__(self, replica: "Replica", seq: int) -> None:
        self.replica = replica
        self.seq = seq
        self.ops: collections.deque[tuple[int, Op]] = collections.deque()
        self.followers: dict[str, _Follower] = {}
        #: caught-up backups on their way into the ISR: every answer waits for them as for the ISR's own
        self.joining: set[str] = set()
        self.changed = threading.Condition()

    # -- the shard's side

    def record(self, op: Op) -> int:
        """Under the shard's lock: the next sequence number; the operation queued for every follower."""
        with self.changed:
            self.seq += 1
            self.ops.append((self.seq, op))
            self._trim()
            self.changed.notify_all()
            return self.seq

    def _trim(self) -> None:
        starts = [max(f.confirmed, f.start) for f in self.followers.values() if not f.gone.is_set()]
        keep_from = min(starts) if starts else self.seq
        while self.ops and (self.ops[0][0] <= keep_from or len(self.ops) > LOG_LIMIT):
            self.ops.popleft()

    def wait(self, seq: int) -> None:
        """Until every in-sync backup confirmed `seq` (taking a silent one out of the ISR after the replication
        timeout), and the lease is still ours; NotPrimaryError otherwise."""
        replica = self.replica
        deadline = time.monotonic() + replica.config.replication_timeout
        with self.changed:
            while True:
                missing = [r for r in (*replica.isr, *sorted(self.joining - set(replica.isr)))
                           if r != replica.config.id and
                           (r not in self.followers or self.followers[r].confirmed < seq)]
                if not missing or replica.role != PRIMARY:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    # a joining backup this late does not join (Replica.add_to_isr checks under its lock; if
                    # the quorum already has it, shrink_isr takes it out again before this answer goes)
                    self.joining.difference_update(missing)
                    break
                self.changed.wait(left)
        if replica.role == PRIMARY and missing:
            replica.shrink_isr(missing)
        replica.check_primary()

    def catch_up(self, replica: str, timeout: float) -> bool:
        """Marks a backup as joining the ISR (`wait` holds every answer for it from now on), then waits until it
        confirmed every operation recorded before, which may have been answered without it. False (and not
        joining) when it does not within `timeout`, went away, or is joining or in the ISR already."""
        deadline = time.monotonic() + timeout
        with self.changed:
            if replica in self.joining or replica in self.replica.isr:
                return False
            self.joining.add(replica)
            target = self.seq
            while True:
                follower = self.followers.get(replica)
                if follower is not None and follower.confirmed >= target:
                    return True
                left = deadline - time.monotonic()
                if follower is None or follower.gone.is_set() or left <= 0 or self.replica.role != PRIMARY:
                    self.joining.discard(replica)
                    self.changed.notify_all()
                    return False
                self.changed.wait(left)

    def still_joining(self, replica: str) -> bool:
        with self.changed:
            return replica in self.joining

    def joined(self, replica: str) -> None:
        """The backup is in the ISR, or did not get in: it waits as an ISR member or not at all."""
        with self.changed:
            self.joining.discard(replica)
            self.changed.notify_all()

    # -- the followers' side

    def follow(self, replica: str, snapshot: Callable[[], object]) -> tuple[object, _Follower]:
        """Registers a follower at the current operation, with a snapshot taken at that point (the caller holds the
        shard's lock through `snapshot`, so no operation falls between)."""
        with self.changed:
            old = self.followers.get(replica)
            if old is not None:
                old.gone.set()
            state = snapshot()
            follower = self.followers[replica] = _Follower(replica, start=self.seq)
            self.changed.notify_all()
            return state, follower

    def confirm(self, follower: _Follower, seq: int) -> None:
        with self.changed:
            follower.confirmed = max(follower.confirmed, seq)
            self.changed.notify_all()

    def items(self, follower: _Follower, epoch: int, stop: threading.Event) -> Iterator[rpb.FollowItem]:
        """The operations after the follower's snapshot, in order, and a ping whenever there is nothing to send."""
        sent = follower.start
        while not stop.is_set() and not follower.gone.is_set():
            with self.changed:
                pending = [(s, op) for s, op in self.ops if s > sent]
                if not pending:
                    if self.ops and self.ops[0][0] > sent + 1 and sent < self.seq:
                        raise NotPrimaryError(f"follower {follower.replica} is too far behind: take a snapshot")
                    self.changed.wait(PING_SECONDS)
                    pending = [(s, op) for s, op in self.ops if s > sent]
            if not pending:
                yield rpb.FollowItem(epoch=epoch, seq=sent, isr=list(self.replica.isr))
                continue
            for s, op in pending:
                yield from op_items(op, s, epoch)
                sent = s

    def lags(self) -> list[rpb.FollowerState]:
        with self.changed:
            return [rpb.FollowerState(replica=f.replica, confirmed=f.confirmed,
                                      in_sync=f.replica in self.replica.isr)
                    for f in self.followers.values() if not f.gone.is_set()]


class Replica:
    """One replica process of a shard (module docstring). Thread-safe; `start` runs it, `stop` ends it."""

    def __init__(self, shard, config: ReplicaConfig, voter: Voter, peers: Peers) -> None:
        self.shard = shard
        self.config = config
        self.voter = voter
        self.peers = peers
        self.quorum = Quorum(config.voters, config.address, voter, peers)
        self.role = JOINING
        self.epoch = 0
        self.isr: tuple[str, ...] = ()
        self.lease = Lease(config.lease)
        self.primary_address = ""
        self.failovers = 0
        self.applied = 0                    # a backup: the last operation applied
        self.log: PrimaryLog | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._last_heard = time.monotonic()
        self._threads: list[threading.Thread] = []
        self.incarnation = secrets.token_hex(8)   # this process's token for Bootstrap (Voter.bootstrap)
        self._follow_call = None
        self._apply_queue: collections.deque[tuple[int, Op]] = collections.deque()
        self._apply_ready = threading.Condition()
        self._applying = False
        shard.role_check = self.check_primary

    # ------------------------------------------------------------------ life

    def start(self) -> "Replica":
        if self.config.replica == 0 and self._bootstrap():
            pass
        else:
            self._become_backup(JOINING)
        for target, name in ((self._renew_loop, "renew"), (self._follow_loop, "follow"),
                             (self._apply_loop, "apply"), (self._watch_loop, "watch")):
            thread = threading.Thread(target=target, name=f"replica-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._apply_ready:
            self._apply_ready.notify_all()
        call = self._follow_call
        if call is not None:
            call.cancel()
        for thread in self._threads:
            thread.join(2.0)
        self.quorum.close()

    # ------------------------------------------------------------------ the role check (the shard's hook)

    def check_primary(self) -> None:
        """NotPrimaryError unless this replica is the primary and holds its lease."""
        if self.role != PRIMARY:
            where = f"; the primary is at {self.primary_address}" if self.primary_address else ""
            raise NotPrimaryError(f"shard {self.config.shard}: replica {self.config.replica} "
                                  f"({self.config.address}) is not the primary (role {self.role}, epoch {self.epoch}){where}")
        if not self.lease.valid(time.monotonic()):
            raise NotPrimaryError(f"shard {self.config.shard}: replica {self.config.replica} ({self.config.address}) "
                                  f"has no lease at epoch {self.epoch} (cut off from the quorum?)")

    # ------------------------------------------------------------------ becoming primary

    def _bootstrap(self) -> bool:
        sent = time.monotonic()
        answers = self.quorum.ask("Bootstrap", rpb.LeaseRequest(shard=self.config.shard, epoch=1,
                                                                replica=self.config.id, isr=[self.config.id],
                                                                incarnation=self.incarnation))
        if not self.quorum.granted(answers):
            # Refused by a majority (another holds an epoch: follow it), or too few voters up yet (some granted
            # it to this very process: ask again, the follow loop does while epoch is 0).
            mine = [a for a in answers if a.granted or (a.epoch == 1 and a.holder == self.config.id)]
            known = max((a.epoch for a in answers if a not in mine), default=0)
            log.info("shard %d replica %d: epoch 1 was not granted (%d of %d voters granted it; epoch %d known "
                     "elsewhere)", self.config.shard, self.config.replica, sum(a.granted for a in answers),
                     len(answers), known)
            self.epoch = max(self.epoch, known)
            return False
        self._become_primary(1, sent, isr=(self.config.id,))
        return True

    def _become_primary(self, epoch: int, sent: float, isr: tuple[str, ...]) -> None:
        with self._lock:
            self.epoch = epoch
            self.lease.granted(sent)
            self.isr = isr
            self.log = PrimaryLog(self, self.applied)
            self.shard.following = False
            self.shard.renew_leases()   # the workers' leases ran on the old primary: a fresh one each here
            self.shard.replication = self.log
            self.primary_address = self.config.address
            self.role = PRIMARY
        log.info("shard %d replica %d (%s) is the primary at epoch %d", self.config.shard, self.config.replica,
                 self.config.address, epoch)

    def _election(self) -> None:
        """A backup in the ISR that heard nothing for a lease asks for the next epoch; a majority makes it primary."""
        epoch = self.epoch + 1
        sent = time.monotonic()
        answers = self.quorum.ask("Vote", rpb.LeaseRequest(shard=self.config.shard, epoch=epoch,
                                                           replica=self.config.id))
        if not self.quorum.granted(answers):
            self.epoch = max(self.epoch, *(a.epoch for a in answers))
            log.info("shard %d replica %d: no majority for epoch %d: %s", self.config.shard, self.config.replica,
                     epoch, "; ".join(a.why for a in answers if not a.granted and a.why)[:300])
            return
        self._drain_applies()
        call = self._follow_call
        if call is not None:
            call.cancel()
        self._become_primary(epoch, sent, isr=(self.config.id,))
        self.failovers += 1
        self.shard.events.emit("failover", epoch=epoch)
        answers = self.quorum.ask("SetIsr", rpb.IsrRequest(shard=self.config.shard, epoch=epoch,
                                                           holder=self.config.id, isr=[self.config.id]))
        if not self.quorum.granted(answers):
            self.step_down(f"the ISR of epoch {epoch} was not accepted")

    def step_down(self, why: str) -> None:
        with self._lock:
            if self.role != PRIMARY:
                return
            self.lease.end()
            self.role = STALE
            self.shard.replication = None
            self.shard.following = True
            if self.log is not None:
                with self.log.changed:
                    self.log.changed.notify_all()
        log.warning("shard %d replica %d steps down at epoch %d: %s; it will follow the new primary",
                    self.config.shard, self.config.replica, self.epoch, why)

    def shrink_isr(self, silent: Sequence[str]) -> None:
        """Takes backups that did not confirm in time out of the ISR (through the quorum), or steps down."""
        with self._lock:
            isr = tuple(r for r in self.isr if r not in silent)
            if isr == self.isr:
                return
            answers = self.quorum.ask("SetIsr", rpb.IsrRequest(shard=self.config.shard, epoch=self.epoch,
                                                               holder=self.config.id, isr=list(isr)))
            if self.quorum.granted(answers):
                log.warning("shard %d: replica(s) %s did not confirm within %.1f s: out of the in-sync replicas %s",
                            self.config.shard, ", ".join(silent), self.config.replication_timeout, list(isr))
                self.isr = isr
            else:
                self.step_down(f"the quorum did not accept the in-sync replicas {list(isr)}")

    def add_to_isr(self, replica: str) -> None:
        """A backup that confirmed every operation joins the ISR through the quorum.

        Once the voters list it, it may be elected, so it must hold every operation answered from then on and
        every one answered before: `PrimaryLog.catch_up` makes answers wait for it first, and waits until it
        confirmed what was recorded before that. Only then are the voters asked; a backup that misses an answer's
        deadline meanwhile is no longer joining, and is not added (or is taken out again: PrimaryLog.wait)."""
        log_ = self.log
        if self.role != PRIMARY or log_ is None or not log_.catch_up(replica, self.config.replication_timeout):
            return
        try:
            with self._lock:
                if self.role != PRIMARY or self.log is not log_ or replica in self.isr or \
                        not log_.still_joining(replica):
                    return
                isr = (*self.isr, replica)
                answers = self.quorum.ask("SetIsr", rpb.IsrRequest(shard=self.config.shard, epoch=self.epoch,
                                                                   holder=self.config.id, isr=list(isr)))
                if self.quorum.granted(answers):
                    self.isr = isr
                    log.info("shard %d: replica %s caught up: in-sync replicas %s", self.config.shard, replica,
                             list(isr))
        finally:
            log_.joined(replica)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.config.lease / 6):
            if self.role != PRIMARY:
                continue
            sent = time.monotonic()
            answers = self.quorum.ask("Renew", rpb.LeaseRequest(shard=self.config.shard, epoch=self.epoch,
                                                                replica=self.config.id, isr=list(self.isr)))
            newer = [a for a in answers if a.epoch > self.epoch]
            if newer:
                self.epoch_seen(max(a.epoch for a in newer), newer[0].holder)
                continue
            if self.quorum.granted(answers):
                self.lease.granted(sent)

    def epoch_seen(self, epoch: int, holder: str) -> None:
        if epoch > self.epoch:
            self.step_down(f"epoch {epoch} was promised to {holder}")
            self.epoch = epoch

    # ------------------------------------------------------------------ the primary's Follow

    def serve_follow(self, requests: Iterator[rpb.FollowAck], context) -> Iterator[rpb.FollowItem]:
        """A backup follows this primary: a snapshot, then every operation (FAILED_PRECONDITION when not primary)."""
        first = next(requests, None)
        if first is None:
            return
        log_ = self.log
        if self.role != PRIMARY or log_ is None or first.shard != self.config.shard:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"NOT_PRIMARY: shard {self.config.shard} replica {self.config.replica} is a "
                          f"{self.role.lower()} (the primary is at {self.primary_address or 'unknown'})")
        epoch = self.epoch
        # the shard's lock first, then the log's (the order record() takes them in)
        state, follower = self.shard.atomically(lambda: log_.follow(first.replica, self.shard.snapshot))
        stop = threading.Event()

        def acks() -> None:
            try:
                for ack in requests:
                    log_.confirm(follower, ack.confirmed)
                    if ack.confirmed >= log_.seq and follower.replica not in self.isr and \
                            not log_.still_joining(follower.replica):
                        threading.Thread(target=self.add_to_isr, args=(follower.replica,), daemon=True).start()
            except grpc.RpcError:
                pass
            finally:
                stop.set()
                follower.gone.set()

        threading.Thread(target=acks, name="follow-acks", daemon=True).start()
        log.info("shard %d: replica %s follows from operation %d", self.config.shard, first.replica, follower.start)
        yield from snapshot_items(state, follower.start, epoch, self.isr)
        try:
            for item in log_.items(follower, epoch, stop):
                if self.role != PRIMARY or self.epoch != epoch:
                    break
                yield item
        except NotPrimaryError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"NOT_PRIMARY: {exc}")

    # ------------------------------------------------------------------ the backup's side

    def _become_backup(self, role: str) -> None:
        with self._lock:
            self.role = role
            self.shard.replication = None
            self.shard.following = True
            self._last_heard = time.monotonic()

    def _follow_loop(self) -> None:
        while not self._stop.is_set():
            if self.role == PRIMARY:
                self._stop.wait(FOLLOW_RETRY_SECONDS)
                continue
            if self.config.replica == 0 and self.epoch == 0 and self._bootstrap():
                continue   # the job's start: the voters were not all up at the first try
            if self.role == STALE:
                self._become_backup(JOINING)
            for address in [a for i, a in enumerate(self.config.replicas) if i != self.config.replica]:
                if self._stop.is_set() or self.role == PRIMARY:
                    break
                try:
                    self._follow(address)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        log.debug("shard %d replica %d: following %s: %s", self.config.shard, self.config.replica,
                                  address, exc.details())
                except (PSError, ValueError) as exc:
                    log.warning("shard %d replica %d: following %s failed: %s; taking a snapshot again",
                                self.config.shard, self.config.replica, address, exc)
            self._stop.wait(FOLLOW_RETRY_SECONDS)

    def _follow(self, address: str) -> None:
        acks: collections.deque[rpb.FollowAck] = collections.deque()
        ready = threading.Condition()
        done = threading.Event()

        def requests() -> Iterator[rpb.FollowAck]:
            yield rpb.FollowAck(shard=self.config.shard, replica=self.config.id, confirmed=-1)
            while not done.is_set() and not self._stop.is_set():
                with ready:
                    if not acks:
                        ready.wait(PING_SECONDS)
                    pending = list(acks)
                    acks.clear()
                if pending:
                    yield pending[-1]

        call = self.peers.stub(address).Follow(requests(), metadata=self.peers.metadata)
        self._follow_call = call
        assembler = OpAssembler(lambda name: self.shard.table_spec(name, "replicated row gradient").row_shape)
        parts: list[rpb.SnapshotPart] = []
        try:
            for item in call:
                self._last_heard = time.monotonic()
                if item.epoch > self.epoch:
                    self.epoch = item.epoch
                self.primary_address = address
                if item.HasField("snapshot"):
                    parts.append(item.snapshot)
                    if item.snapshot.last:
                        self._drain_applies()
                        self.shard.restore(snapshot_of(parts, f"snapshot from {address}"))
                        parts = []
                        self.applied = item.seq
                        self.isr = tuple(item.isr)
                        self._become_backup(BACKUP)
                        log.info("shard %d replica %d: took the primary's state at operation %d (epoch %d)",
                                 self.config.shard, self.config.replica, item.seq, item.epoch)
                        self._ack(acks, ready, item.seq)
                    continue
                if item.HasField("op"):
                    got = assembler.add(item)
                    if got is not None:
                        with self._apply_ready:
                            self._apply_queue.append(got)
                            self._apply_ready.notify_all()
                        self._ack(acks, ready, got[0])
                    continue
                self.isr = tuple(item.isr)   # a ping
        finally:
            done.set()
            self._follow_call = None

    @staticmethod
    def _ack(acks, ready, seq: int) -> None:
        with ready:
            acks.append(rpb.FollowAck(confirmed=seq))
            ready.notify_all()

    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            with self._apply_ready:
                while not self._apply_queue and not self._stop.is_set():
                    self._apply_ready.wait(1.0)
                if self._stop.is_set():
                    return
                seq, op = self._apply_queue.popleft()
                self._applying = True
            try:
                self.shard.replay(op)
                self.applied = seq
            except (ReplayMismatchError, PSError, ValueError) as exc:
                log.error("shard %d replica %d: operation %d (%s) did not replay: %s; taking a snapshot again",
                          self.config.shard, self.config.replica, seq, op.kind, exc)
                call = self._follow_call
                if call is not None:
                    call.cancel()
                with self._apply_ready:
                    self._apply_queue.clear()
            finally:
                with self._apply_ready:
                    self._applying = False
                    self._apply_ready.notify_all()

    def _drain_applies(self) -> None:
        """Waits until every received operation is applied (before a snapshot replaces them, or before serving)."""
        with self._apply_ready:
            while (self._apply_queue or self._applying) and not self._stop.is_set():
                self._apply_ready.wait(0.5)

    def _watch_loop(self) -> None:
        """A backup in the ISR that heard nothing from its primary for a lease runs an election."""
        while not self._stop.wait(self.config.lease / 10):
            if self.role != BACKUP or self.config.id not in self.isr:
                continue
            if time.monotonic() - self._last_heard >= self.config.lease:
                self._election()
                self._last_heard = time.monotonic()   # the next try after another lease

    # ------------------------------------------------------------------ status

    def status(self) -> rpb.ReplicaStatus:
        return rpb.ReplicaStatus(
            shard=self.config.shard, replica=self.config.replica, role=self.role, epoch=self.epoch,
            seq=self.log.seq if self.role == PRIMARY and self.log is not None else self.applied,
            step=self.shard.step, primary=self.primary_address, isr=list(self.isr),
            followers=self.log.lags() if self.role == PRIMARY and self.log is not None else [],
            failovers=self.failovers, pid=os.getpid(), address=self.config.address,
            applied_gradients=self.shard.applied_gradients, dropped=self.shard.dropped)
