"""Operator tools: clients that start, inspect and probe a job from outside its processes.

`ps-launch` (launch: a whole job of local shard and worker processes), `ps-ctl`
(ctl: the cluster's shards and workers) and `ps-health` (health: one shard's gRPC health
check). They depend on ps_common, ps_server and worker_client; the server depends on none
of them.
"""
