"""A worker that sends every push twice (a retry after a lost answer) ends with the parameters of one that does not."""

from __future__ import annotations

import numpy as np
import pytest

from tests.faults.conftest import metric
from worker_client.client import PSClient, RetryPolicy

STEPS = 200


def train_and_pull(start_job, mode: str, *extra: str) -> tuple[dict[str, np.ndarray], list[int], list[float]]:
    """One worker (so the order of updates is fixed), 2 shards: the final parameters, steps and duplicate counts."""
    job = start_job(mode=mode, shards=2, workers=1, steps=STEPS, worker_flags=list(extra))
    (result,) = job.finish()
    assert result["iterations"] == STEPS and result["dropped"] == 0, result
    with PSClient(job.cluster.addresses, worker_id="inspector", retry=RetryPolicy(attempts=3)) as client:
        values = {name: np.array(value) for name, value in client.pull().items()}
        steps = list(client.steps)
    return values, steps, [metric(shard, "ps_duplicate_pushes_total") for shard in job.cluster.shards]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_push_sent_twice_is_applied_once_and_the_parameters_match_a_run_without_retries_bit_for_bit(
        start_job, mode):
    plain, plain_steps, plain_duplicates = train_and_pull(start_job, mode)
    retried, retried_steps, duplicates = train_and_pull(start_job, mode, "--duplicate-pushes")
    assert plain_steps == retried_steps == [STEPS, STEPS]
    assert plain_duplicates == [0, 0] and duplicates == [STEPS, STEPS]
    assert sorted(plain) == sorted(retried)
    for name in plain:
        assert plain[name].tobytes() == retried[name].tobytes(), f"{name} differs after retried pushes"
