"""Replicated shards: a primary and backups per shard, a primacy lease granted by a quorum of the job's replica
processes, operations replicated before a push is acknowledged (docs/replication.md).

| module | what it holds |
| --- | --- |
| `quorum.py` | the voters' rules (bootstrap, renew, vote, set the in-sync replicas) and a primary's lease |
| `replica.py` | one replica process: its role, the primary's log of operations and its followers, a backup's follow-and-replay loop, elections |
| `wire.py` | operations and snapshots as ps.v1.Replication messages, and back |
| `service.py` | ps.v1.Replication: the voter's rpcs, Follow (served by a primary), Status |
"""
