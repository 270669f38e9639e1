"""ps.v1.Replication on a replica process: the voter's rpcs, a backup's Follow (served by the primary), Status."""

from __future__ import annotations

import os

import grpc

from ps_proto.v1 import replication_pb2 as rpb
from ps_proto.v1 import replication_pb2_grpc as rpb_grpc
from ps_server.replication.quorum import Grant, Voter
from ps_server.replication.replica import WITNESS, Replica

__all__ = ["ReplicationServicer"]


def _answer(grant: Grant, voter: str) -> rpb.LeaseGrant:
    return rpb.LeaseGrant(granted=grant.granted, epoch=grant.epoch, holder=grant.holder, isr=list(grant.isr),
                          why=grant.why, voter=voter)


class ReplicationServicer(rpb_grpc.ReplicationServicer):
    """The voter of this process and, unless it is a witness, its replica of a shard."""

    def __init__(self, voter: Voter, replica: Replica | None, address: str) -> None:
        self.voter = voter
        self.replica = replica
        self.address = address

    def Bootstrap(self, request, context):
        return _answer(self.voter.bootstrap(request.shard, request.replica, request.isr,
                                                  request.incarnation), self.address)

    def Renew(self, request, context):
        return _answer(self.voter.renew(request.shard, request.epoch, request.replica, request.isr), self.address)

    def Vote(self, request, context):
        return _answer(self.voter.vote(request.shard, request.epoch, request.replica), self.address)

    def SetIsr(self, request, context):
        return _answer(self.voter.set_isr(request.shard, request.epoch, request.holder, request.isr), self.address)

    def Follow(self, request_iterator, context):
        if self.replica is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"NOT_PRIMARY: {self.address} is a witness (it votes "
                                                               "only)")
        yield from self.replica.serve_follow(request_iterator, context)

    def Status(self, request, context):
        if self.replica is None:
            return rpb.ReplicaStatus(shard=-1, role=WITNESS, pid=os.getpid(), address=self.address)
        return self.replica.status()
