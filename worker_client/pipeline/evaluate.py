"""Evaluations of a pipeline job: every stage's parameters pulled, the whole model run once.

No stage worker holds the whole model (that is the point of the stages), so whoever started
the job -- `ps-launch` -- evaluates: it pulls each stage's shard group and runs the model's
inference form on the test split, as worker 0 of a data-parallel job does. `ps-launch` does
it every `eval_every` global steps while the job trains, and once at the end.

During training the stage groups advance independently, so one evaluation may read stage
k's parameters a step or two after stage k+1's: it shows the trend, and the final one, taken
after every stage worker finished, reads one consistent set.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ps_models.datasets import Dataset
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from worker_client.training import metrics_of

__all__ = ["PipelineEvaluator"]


class PipelineEvaluator:
    """The whole model's test metrics at the parameters the stage groups hold now.

    `groups` lists each stage's shard addresses, stage by stage. The inference session and
    one client per stage group are opened once and kept until `close()`, so an evaluation
    costs the pulls and one forward pass over the test split.
    """

    def __init__(self, model_path: str | Path, groups: Sequence[Sequence[str]], dataset: Dataset, *,
                 timeout: float, channel_credentials: grpc.ChannelCredentials | None = None,
                 call_metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.dataset = dataset
        self.timeout = timeout
        self.engine = GradientEngine(model_path, batch_size=1, loss=None)   # inference only: no gradient graph
        self.clients: list[PSClient] = []
        try:
            for addresses in groups:
                self.clients.append(PSClient(list(addresses), worker_id="pipeline-evaluation", rpc_timeout=timeout,
                                             channel_credentials=channel_credentials,
                                             call_metadata=tuple(call_metadata)))
        except BaseException:
            self.close()
            raise

    def step(self) -> int:
        """The global step of stage 0's first shard now (one ClusterInfo call; PSError when unreachable)."""
        return int(self.clients[0].cluster_info(0).step)

    def evaluate(self) -> dict[str, Any]:
        """Test loss, accuracy (and AUC for two classes), and `step`: the global step of stage 0's first shard
        when its parameters were read. PSError when a stage group cannot be pulled."""
        parameters: dict = {}
        for client in self.clients:
            parameters.update(client.pull(timeout=self.timeout))
        outputs, labels = [], []
        for inputs, y in self.dataset.test_batches(4096):
            outputs.append(self.engine.predict(parameters, {n: inputs[n] for n in self.engine.input_names})
                           [self.engine.output_names[0]])
            labels.append(y)
        metrics = metrics_of(np.concatenate(outputs), np.concatenate(labels), self.dataset.num_classes,
                             activation=self.engine.output_activation)
        return {"step": int(self.clients[0].steps[0]), **metrics}

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []

    def __enter__(self) -> "PipelineEvaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

