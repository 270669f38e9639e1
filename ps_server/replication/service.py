"""ps.v1.Replication on a replica process: the voter's rpcs, a backup's Follow (served by the primary), Status.

Requests come through the product's error boundary as every other service's do (ps_common/boundary.py):
bytes that do not parse are INVALID_ARGUMENT, and a lease or ISR request outside the bounds below is
refused (INVALID_ARGUMENT) before any voter state is read or changed. The bounds are far above what a job
sends (a replica id such as "s0r1", a handful of in-sync replicas).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import grpc

from ps_common.boundary import Malformed, abort_with, translate_errors
from ps_common.errors import InvalidRequestError
from ps_proto.v1 import replication_pb2 as rpb
from ps_proto.v1 import replication_pb2_grpc as rpb_grpc
from ps_server.replication.quorum import Grant, Voter
from ps_server.replication.replica import WITNESS, Replica

__all__ = ["MAX_ID_CHARS", "MAX_ISR", "ReplicationServicer"]

log = logging.getLogger(__name__)

#: The longest replica id, holder or process token a lease or ISR request may carry.
MAX_ID_CHARS = 256
#: The most in-sync replicas a lease or ISR request may name.
MAX_ISR = 64


def _answer(grant: Grant, voter: str) -> rpb.LeaseGrant:
    return rpb.LeaseGrant(granted=grant.granted, epoch=grant.epoch, holder=grant.holder, isr=list(grant.isr),
                          why=grant.why, voter=voter)


def _check_id(rpc: str, what: str, value: str) -> None:
    if not value or len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(f"Replication.{rpc}: {what} has {len(value)} characters; it needs 1 to "
                                  f"{MAX_ID_CHARS}")


def _check(rpc: str, shard: int, epoch: int, replica: str, isr, incarnation: str = "") -> None:
    """InvalidRequestError naming the field and its value when a request is outside the documented bounds."""
    if shard < 0:
        raise InvalidRequestError(f"Replication.{rpc}: shard {shard} is negative")
    if epoch < 0:
        raise InvalidRequestError(f"Replication.{rpc}: epoch {epoch} is negative")
    _check_id(rpc, "the replica id", replica)
    if len(isr) > MAX_ISR:
        raise InvalidRequestError(f"Replication.{rpc}: {len(isr)} in-sync replicas named; at most {MAX_ISR}")
    for member in isr:
        _check_id(rpc, "an in-sync replica id", member)
    if len(incarnation) > MAX_ID_CHARS:
        raise InvalidRequestError(f"Replication.{rpc}: the incarnation has {len(incarnation)} characters; at most "
                                  f"{MAX_ID_CHARS}")


def _well_formed(requests: Iterator, context) -> Iterator[rpb.FollowAck]:
    """A Follow stream's acknowledgements that parsed. A malformed first one ends the call with INVALID_ARGUMENT;
    a malformed later one (read by the primary's acknowledgement thread) ends the stream, and the backup follows
    again from a fresh snapshot."""
    for index, request in enumerate(requests):
        if isinstance(request, Malformed):
            if index == 0:
                abort_with(context, request.refusal())
            log.warning("%s: acknowledgement %d of %d bytes does not parse (%s); ending the stream", request.rpc,
                        index, request.nbytes, request.error)
            return
        yield request


class ReplicationServicer(rpb_grpc.ReplicationServicer):
    """The voter of this process and, unless it is a witness, its replica of a shard."""

    def __init__(self, voter: Voter, replica: Replica | None, address: str) -> None:
        self.voter = voter
        self.replica = replica
        self.address = address

    @translate_errors
    def Bootstrap(self, request, context):
        _check("Bootstrap", request.shard, request.epoch, request.replica, request.isr, request.incarnation)
        return _answer(self.voter.bootstrap(request.shard, request.replica, request.isr,
                                                  request.incarnation), self.address)

    @translate_errors
    def Renew(self, request, context):
        _check("Renew", request.shard, request.epoch, request.replica, request.isr, request.incarnation)
        return _answer(self.voter.renew(request.shard, request.epoch, request.replica, request.isr), self.address)

    @translate_errors
    def Vote(self, request, context):
        _check("Vote", request.shard, request.epoch, request.replica, request.isr, request.incarnation)
        return _answer(self.voter.vote(request.shard, request.epoch, request.replica), self.address)

    @translate_errors
    def SetIsr(self, request, context):
        _check("SetIsr", request.shard, request.epoch, request.holder, request.isr)
        return _answer(self.voter.set_isr(request.shard, request.epoch, request.holder, request.isr), self.address)

    def Follow(self, request_iterator, context):
        if self.replica is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"NOT_PRIMARY: {self.address} is a witness (it votes "
                                                               "only)")
        yield from self.replica.serve_follow(_well_formed(request_iterator, context), context)

    @translate_errors
    def Status(self, request, context):
        if self.replica is None:
            return rpb.ReplicaStatus(shard=-1, role=WITNESS, pid=os.getpid(), address=self.address)
        return self.replica.status()
