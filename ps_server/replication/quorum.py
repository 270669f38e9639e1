"""The configuration quorum: every replica process of a job is a voter that grants, per shard, a primacy lease
at an epoch. The rules are pure functions of a voter's state and its own monotonic clock (tested without
sockets); the replication service answers them over gRPC.

Why a quorum of all replica processes (docs/replication.md): with two replicas of a shard and
nothing else, "my primary is dead" and "my primary is cut off from me" look the same, and no
rule can both survive the first and never make two primaries in the second. The job's other
replica processes (and a witness when there are fewer than 3) are the third party.

A voter's record of one shard (`ShardVote`): the highest epoch it promised, the replica it
promised it to (the holder), until when by its clock it will not promise the shard to another
(`lease_until`), and the shard's in-sync replicas (ISR) as the holder last set them.

- `renew(epoch, holder)`: the holder keeps its lease: granted when the voter promised that
  epoch to that holder; the lease runs LEASE seconds from now.
- `vote(epoch, candidate)`: granted when the epoch is above the promised one, the candidate is
  in the ISR, and the lease has run out here (no vote while the holder's lease may be live);
  the voter then promises the epoch to the candidate, with a fresh lease.
- `set_isr(epoch, holder, isr)`: only the holder of that epoch may change the ISR (a backup
  that stopped confirming is taken out, so it can never be elected with missing updates; a
  repaired one is put back); it must stay in its own ISR.

A primary's lease (`Lease`): valid from a renewal round's *sending* time for
LEASE x (1 - DRIFT) once a majority granted that round. Every voter of that majority set its
`lease_until` after the round was sent, so by the time any voter grants a vote for the shard,
the old primary's lease has ended by its own clock (the DRIFT margin covers clock rates);
majorities intersect, so a candidate's majority holds at least one such voter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["DRIFT", "LEASE_SECONDS", "Grant", "Lease", "ShardVote", "Voter", "majority"]

#: How long a granted lease lasts (seconds). A dead primary is replaced after about this long.
LEASE_SECONDS = 1.5
#: The part of a lease a primary does not count on, for clocks that run at slightly different rates.
DRIFT = 0.1


def majority(voters: int) -> int:
    """Grants needed out of `voters`: more than half."""
    return voters // 2 + 1


@dataclass(frozen=True)
class Grant:
    """A voter's answer: granted or not, and what it knows (so a refused caller learns the newer epoch)."""

    granted: bool
    epoch: int
    holder: str
    isr: tuple[str, ...]
    why: str = ""


@dataclass
class ShardVote:
    """One voter's record of one shard."""

    epoch: int = 0
    holder: str = ""
    lease_until: float = float("-inf")
    isr: tuple[str, ...] = ()
    incarnation: str = ""             # the bootstrapping process's token (Voter.bootstrap)

    def answer(self, granted: bool, why: str = "") -> Grant:
        return Grant(granted, self.epoch, self.holder, self.isr, why)


class Voter:
    """This process's votes, per shard (thread-safe). `now` is the monotonic clock (injected in tests)."""

    def __init__(self, *, lease: float = LEASE_SECONDS, now: Callable[[], float] = time.monotonic) -> None:
        self.lease = lease
        self.now = now
        #: a voter that (re)started knows no lease promised before: it grants no vote for one lease
        self.started = now()
        self._shards: dict[int, ShardVote] = {}
        self._lock = threading.Lock()

    def record(self, shard: int) -> ShardVote:
        """A copy of the record of `shard` (an empty one before anything was promised)."""
        with self._lock:
            found = self._shards.get(shard, ShardVote())
            return ShardVote(found.epoch, found.holder, found.lease_until, found.isr)

    def bootstrap(self, shard: int, holder: str, isr: Iterable[str], incarnation: str = "") -> Grant:
        """The job's first primary of `shard` (epoch 1), when nothing was promised yet: the replica the job names
        first takes it without an election. Refused once any epoch was promised -- except to the very process
        (`incarnation`, its own random token) it was promised to, asking again because too few voters were up
        the first time; a restarted process has another token and never takes epoch 1 again."""
        with self._lock:
            vote = self._shards.setdefault(shard, ShardVote())
            again = (vote.epoch, vote.holder) == (1, holder) and incarnation and vote.incarnation == incarnation
            if vote.epoch > 0 and not again:
                return vote.answer(False, f"shard {shard} already has epoch {vote.epoch} (holder {vote.holder})")
            vote.epoch, vote.holder, vote.isr, vote.incarnation = 1, holder, tuple(isr), incarnation
            vote.lease_until = self.now() + self.lease
            return vote.answer(True)

    def renew(self, shard: int, epoch: int, holder: str, isr: Iterable[str] = ()) -> Grant:
        """The holder keeps its lease. A voter that missed the round that gave `epoch` (down, or not up yet when
        the job's first primary bootstrapped) learns it here, with the holder's in-sync replicas: a majority
        gave that epoch to this holder alone, and no promise of this voter's is broken by it."""
        with self._lock:
            vote = self._shards.setdefault(shard, ShardVote())
            if epoch > vote.epoch:
                vote.epoch, vote.holder, vote.isr = epoch, holder, tuple(isr)
            if epoch != vote.epoch or holder != vote.holder:
                return vote.answer(False, f"shard {shard}: renewal by {holder!r} at epoch {epoch}, but epoch "
                                          f"{vote.epoch} is promised to {vote.holder!r}")
            vote.lease_until = self.now() + self.lease
            return vote.answer(True)

    def vote(self, shard: int, epoch: int, candidate: str) -> Grant:
        with self._lock:
            vote = self._shards.setdefault(shard, ShardVote())
            now = self.now()
            if epoch <= vote.epoch:
                return vote.answer(False, f"shard {shard}: epoch {epoch} is not above the promised {vote.epoch}")
            if vote.isr and candidate not in vote.isr:
                return vote.answer(False, f"shard {shard}: {candidate!r} is not in sync (ISR {list(vote.isr)})")
            if now < vote.lease_until:
                return vote.answer(False, f"shard {shard}: the lease of {vote.holder!r} at epoch {vote.epoch} runs "
                                          f"{vote.lease_until - now:.2f} s more")
            if now < self.started + self.lease:
                return vote.answer(False, f"shard {shard}: this voter started {now - self.started:.2f} s ago and "
                                          "may not know a lease still running")
            vote.epoch, vote.holder, vote.lease_until = epoch, candidate, now + self.lease
            return vote.answer(True)

    def set_isr(self, shard: int, epoch: int, holder: str, isr: Iterable[str]) -> Grant:
        isr = tuple(isr)
        with self._lock:
            vote = self._shards.setdefault(shard, ShardVote())
            if epoch != vote.epoch or holder != vote.holder:
                return vote.answer(False, f"shard {shard}: only the holder of epoch {vote.epoch} ({vote.holder!r}) "
                                          f"may set the ISR, not {holder!r} at epoch {epoch}")
            if holder not in isr:
                return vote.answer(False, f"shard {shard}: the holder {holder!r} must stay in the ISR {list(isr)}")
            vote.isr = isr
            return vote.answer(True)


@dataclass
class Lease:
    """A primary's view of its own lease: valid until `until` (its monotonic clock), set by renewal rounds."""

    lease: float = LEASE_SECONDS
    drift: float = DRIFT
    until: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def granted(self, sent_at: float) -> None:
        """A majority granted the round sent at `sent_at`: the lease runs from then, less the drift margin."""
        with self._lock:
            self.until = max(self.until, sent_at + self.lease * (1 - self.drift))

    def valid(self, now: float) -> bool:
        with self._lock:
            return now < self.until

    def end(self) -> None:
        """Gives the lease up at once (a newer epoch seen: this replica steps down)."""
        with self._lock:
            self.until = float("-inf")
