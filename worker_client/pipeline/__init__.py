"""Pipeline (model) parallelism: a model cut into stages, each stage a worker process.

The transport between stages is ``exchange`` (StageServer, StageLink) with ``rendezvous``
(publish, lookup) for local jobs.
"""

from worker_client.pipeline.exchange import Kind, StageLink, StageSecurity, StageServer
from worker_client.pipeline.rendezvous import lookup, publish

__all__ = ["Kind", "StageLink", "StageSecurity", "StageServer", "lookup", "publish"]
