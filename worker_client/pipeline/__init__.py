"""Pipeline (model) parallelism: a model's graph cut into stages, each stage a worker process.

`cut.py` chooses the cuts and writes each stage's model; `stage.py` runs one stage's forward
and backward passes over micro-batches (`LocalPipeline` chains them in one process);
`exchange.py` carries activations and their gradients between stage workers (StageServer,
StageLink), and `rendezvous.py` lets the stage workers of a local job find each other.
"""

from worker_client.pipeline.exchange import Kind, StageLink, StageSecurity, StageServer
from worker_client.pipeline.rendezvous import lookup, publish

__all__ = ["Kind", "StageLink", "StageSecurity", "StageServer", "lookup", "publish"]
