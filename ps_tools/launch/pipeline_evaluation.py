"""A pipeline job's evaluations of the whole model, by the launcher: no stage worker holds every parameter.

Every ``eval_every`` global steps (stage 0's, asked of its first shard) while the stages
train, as worker 0 reports them in a data-parallel job, and once at the end on the stages'
final parameters (worker_client.pipeline.evaluate reads them from every stage's shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ps_common.errors import LaunchError, PSError
from ps_common.jobconfig import JobConfig
from ps_common.tls import AUTH_TOKEN_ENV, client_security, token_from
from ps_models.datasets import Dataset
from worker_client.pipeline.evaluate import PipelineEvaluator


class PipelineEvaluations:
    """The whole model's test metrics from the shard groups' addresses (`groups[k]`: stage k's shards)."""

    def __init__(self, config: JobConfig, model_path: Path, dataset: Dataset, groups: list[list[str]]) -> None:
        """Connects to every stage's shards (LaunchError when it cannot)."""
        c = config
        self._every, self._steps = c.worker.eval_every, c.worker.steps
        self._bucket = 0   # the last eval_every bucket evaluated
        credentials, metadata = client_security(c.worker.tls_ca, c.worker.tls_cert, c.worker.tls_key,
                                                token_from(c.job.auth_token_file, env_var=AUTH_TOKEN_ENV))
        try:
            self._evaluator = PipelineEvaluator(model_path, groups, dataset, timeout=c.job.wait_timeout,
                                                channel_credentials=credentials, call_metadata=metadata)
        except (PSError, ValueError) as exc:
            raise LaunchError(f"cannot evaluate the pipeline's whole model {model_path}: {exc}") from exc

    @property
    def periodic(self) -> bool:
        """Whether the job evaluates while it trains (eval_every set)."""
        return bool(self._every)

    def when_due(self) -> dict[str, Any] | None:
        """The evaluation's record when the global step entered a new eval_every bucket, else None; the final
        evaluation covers the last step. PSError or ValueError when a shard could not answer (a shard
        restarting, say: the next one may do)."""
        step = self._evaluator.step()
        if step // self._every <= self._bucket or (self._steps and step >= self._steps):
            return None
        self._bucket = step // self._every
        return self._evaluator.evaluate()

    def final(self) -> dict[str, Any]:
        """The evaluation at the stages' final parameters (LaunchError when it fails); closes the evaluator."""
        try:
            return self._evaluator.evaluate()
        except (PSError, ValueError) as exc:
            raise LaunchError(f"evaluating the pipeline's final parameters failed: {exc}") from exc
        finally:
            self._evaluator.close()

    def close(self) -> None:
        self._evaluator.close()
