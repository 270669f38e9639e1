"""Test helpers shared by the integration, contract and end-to-end tiers."""

from tests.helpers.processes import ShardCluster, ShardProcess, start_shard

__all__ = ["ShardCluster", "ShardProcess", "start_shard"]
