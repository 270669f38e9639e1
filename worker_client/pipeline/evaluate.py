"""The final evaluation of a pipeline job: every stage's parameters pulled, the whole model run once.

No stage worker holds the whole model (that is the point of the stages), so whoever started
the job -- `ps-launch` -- evaluates: it pulls each stage's shard group and runs the model's
inference form on the test split, exactly as worker 0 of a data-parallel job does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from ps_models.datasets import Dataset
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from worker_client.training import evaluate

__all__ = ["evaluate_pipeline"]


def evaluate_pipeline(model_path: str | Path, groups: Sequence[Sequence[str]], dataset: Dataset, *,
                      timeout: float, channel_credentials: grpc.ChannelCredentials | None = None,
                      call_metadata: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Test loss, accuracy (and AUC for two classes) of the whole model at the parameters the
    stage groups hold now; `groups` lists each stage's shard addresses, stage by stage."""
    engine = GradientEngine(model_path, batch_size=1, loss=None)
    parameters: dict = {}
    for addresses in groups:
        client = PSClient(list(addresses), worker_id="pipeline-evaluation", rpc_timeout=timeout,
                          channel_credentials=channel_credentials, call_metadata=tuple(call_metadata))
        try:
            parameters.update(client.pull(timeout=timeout))
        finally:
            client.close()
    inputs = engine.input_names
    input_name = inputs[0] if len(inputs) == 1 else dataset.input_name
    return evaluate(engine, parameters, dataset.x_test, dataset.y_test, input_name=input_name,
                    num_classes=dataset.num_classes)
