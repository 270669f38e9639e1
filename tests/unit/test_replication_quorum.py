"""The configuration quorum's rules on a fake clock: a lease blocks votes until it runs out, an epoch is promised
once, only in-sync replicas are elected, only the holder sets the ISR, and a primary's lease ends before any voter
can elect another."""

from __future__ import annotations

import pytest

from ps_server.replication.quorum import DRIFT, LEASE_SECONDS, Lease, Voter, majority


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def voter(clock: Clock) -> Voter:
    v = Voter(now=clock)
    assert v.bootstrap(0, "r0", ["r0", "r1"]).granted
    return v


def test_majority_is_more_than_half() -> None:
    assert [majority(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_bootstrap_gives_epoch_1_once(clock: Clock) -> None:
    v = voter(clock)
    again = v.bootstrap(0, "r1", ["r0", "r1"])
    assert not again.granted and (again.epoch, again.holder) == (1, "r0")


def test_bootstrap_is_granted_again_only_to_the_same_process(clock: Clock) -> None:
    """Too few voters up at the job's start: the process asks again and gets it; a restarted process of the same
    replica (another token) never takes epoch 1 again, nor after an election."""
    v = Voter(lease=LEASE_SECONDS, now=clock)
    assert v.bootstrap(0, "r0", ["r0"], "token-a").granted
    assert v.bootstrap(0, "r0", ["r0"], "token-a").granted              # the same process, again
    restarted = v.bootstrap(0, "r0", ["r0"], "token-b")
    assert not restarted.granted and restarted.epoch == 1
    assert not v.bootstrap(0, "r0", ["r0"], "").granted                 # no token: never again
    clock.t += LEASE_SECONDS + 0.01
    assert v.vote(0, 2, "r0").granted                                   # an election moves on to epoch 2
    assert not v.bootstrap(0, "r0", ["r0"], "token-a").granted


def test_a_voter_that_missed_the_epoch_learns_it_from_the_holders_renewal(clock: Clock) -> None:
    late = Voter(lease=LEASE_SECONDS, now=clock)         # was not up when r0 bootstrapped on the others
    granted = late.renew(0, 1, "r0", ["r0", "r1"])
    assert granted.granted and (granted.epoch, granted.holder, granted.isr) == (1, "r0", ("r0", "r1"))
    assert not late.vote(0, 2, "r1").granted               # the lease it granted runs here now
    clock.t += LEASE_SECONDS + 0.01
    assert late.vote(0, 2, "r1").granted                   # r1 is in the in-sync replicas it learnt
    assert not late.renew(0, 1, "r0", ["r0"]).granted      # an older epoch's holder is refused


def test_no_vote_while_the_holders_lease_runs_and_one_after(clock: Clock) -> None:
    v = voter(clock)
    clock.t += LEASE_SECONDS - 0.01
    refused = v.vote(0, 2, "r1")
    assert not refused.granted and "lease" in refused.why
    assert v.renew(0, 1, "r0").granted          # renewed: another full lease
    clock.t += LEASE_SECONDS - 0.01
    assert not v.vote(0, 2, "r1").granted
    clock.t += 0.02
    granted = v.vote(0, 2, "r1")
    assert granted.granted and (granted.epoch, granted.holder) == (2, "r1")
    stale = v.renew(0, 1, "r0")                  # the old holder learns the newer epoch
    assert not stale.granted and stale.epoch == 2


def test_an_epoch_is_promised_once(clock: Clock) -> None:
    v = voter(clock)
    clock.t += LEASE_SECONDS + 1
    assert v.vote(0, 2, "r1").granted
    clock.t += LEASE_SECONDS + 1
    assert not v.vote(0, 2, "r0").granted       # the same epoch to another: refused
    assert v.vote(0, 3, "r0").granted


def test_only_in_sync_replicas_are_elected_and_only_the_holder_sets_the_isr(clock: Clock) -> None:
    v = voter(clock)
    assert not v.set_isr(0, 1, "r1", ["r1"]).granted       # not the holder
    assert not v.set_isr(0, 1, "r0", ["r1"]).granted       # the holder must stay in
    assert v.set_isr(0, 1, "r0", ["r0"]).granted           # r1 stopped confirming: out
    clock.t += LEASE_SECONDS + 1
    refused = v.vote(0, 2, "r1")
    assert not refused.granted and "not in sync" in refused.why


def test_a_primarys_lease_ends_before_a_voter_of_its_round_can_vote(clock: Clock) -> None:
    v = voter(clock)
    lease = Lease()
    sent = clock.t
    clock.t += 0.2                                # the round arrives later than it was sent
    assert v.renew(0, 1, "r0").granted
    lease.granted(sent)
    assert lease.valid(clock.t)
    # the primary's lease, by its own clock, ends before the voter's promise does, by the drift margin
    assert lease.until <= clock.t + LEASE_SECONDS - DRIFT * LEASE_SECONDS
    clock.t = lease.until
    assert not lease.valid(clock.t) and not v.vote(0, 2, "r1").granted
    lease.granted(clock.t)
    lease.end()
    assert not lease.valid(clock.t)
