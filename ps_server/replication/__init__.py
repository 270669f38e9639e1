"""Replicated shards: a primary and backups per shard, a primacy lease granted by a quorum of the job's replica
processes, operations replicated before a push is acknowledged (docs/replication.md).

| module | what it holds |
| --- | --- |
| `quorum.py` | the voters' rules (renew, vote, set the in-sync replicas) and a primary's lease |
"""
