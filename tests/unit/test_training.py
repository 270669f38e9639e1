"""The training loop's pure parts: what a sync worker waits for, plan validation, event wording."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ps_proto.v1 import parameter_server_pb2 as pb
from worker_client.client import PushReport
from worker_client.training import TrainingPlan, format_event
from worker_client.training.loop import Trainer


def _report(*responses: tuple[int, int, int], read_steps: list[int] | None = None) -> PushReport:
    return PushReport([pb.PushResponse(outcome=o, drop_reason=r, step=t) for o, r, t in responses], clock=0,
                      read_steps=read_steps or [])


def test_a_sync_worker_waits_for_the_next_step_only_where_its_gradient_was_taken() -> None:
    accepted, dropped = pb.PUSH_ACCEPTED, pb.PUSH_DROPPED
    report = _report((accepted, pb.DROP_REASON_UNSPECIFIED, 5), (dropped, pb.DROP_STALE, 9),
                     (dropped, pb.DROP_ALREADY_CONTRIBUTED, 7), (dropped, pb.DROP_STEP_AHEAD, 2),
                     read_steps=[5, 8, 7, 4])
    assert report.wait_steps == [6, 0, 8, 0]


@pytest.mark.parametrize("options, fragment", [
    ({"worker_index": 2, "num_workers": 2, "steps": 1}, "Invalid worker_index: 2 (must be in [0, 2))"),
    ({"batch_size": 0, "steps": 1}, "Invalid batch_size: 0"),
    ({}, "set steps or epochs"),
    ({"epochs": 0}, "Invalid epochs: 0"),
    ({"steps": 5, "wait_timeout": 0}, "Invalid wait_timeout: 0"),
])
def test_a_bad_plan_names_the_option_and_value(options: dict, fragment: str) -> None:
    base = {"worker_index": 0, "num_workers": 1, "batch_size": 8}
    with pytest.raises(ValueError) as info:
        TrainingPlan(**{**base, **options})
    assert fragment in str(info.value)


def test_events_read_as_one_line_of_text() -> None:
    line = format_event("eval", {"worker": 0, "step": 40, "test_accuracy": 0.97123, "test_loss": 0.1, "final": True})
    assert line == "worker 0 step 40 (final): test accuracy 0.9712, test loss 0.1000"
    line = format_event("progress", {"worker": 1, "step": 3, "loss": None, "samples_per_second": 12.3,
                                     "stale_drops": 2})
    assert line == "worker 1 step 3: loss n/a, 12 samples/s, 2 stale drop(s)"


def test_a_retry_window_keeps_retrying_past_the_attempts_and_its_last_sleep_ends_at_the_window() -> None:
    from worker_client.client import RetryPolicy

    policy = RetryPolicy(attempts=3, initial_backoff=1.0, max_backoff=2.0, window=10.0)
    assert 0.5 <= policy.pause(1, 0.0, 1.0) <= 1.0          # within the attempts: backoff with jitter
    assert policy.pause(5, 9.8, 2.0) == pytest.approx(0.2)  # past them: only until the window ends
    assert policy.pause(6, 10.0, 2.0) is None
    assert RetryPolicy(attempts=2).pause(2, 0.0, 0.2) is None   # no window: the attempts alone
    with pytest.raises(ValueError, match="Invalid retry window: -1"):
        RetryPolicy(window=-1)


def test_a_dropped_push_is_logged_with_its_clock_shards_and_reasons_as_fields(caplog) -> None:
    import json

    from ps_common.logs import JsonFormatter
    from ps_proto.v1 import parameter_server_pb2 as pb
    from worker_client.training.loop import _Tally

    caplog.set_level("DEBUG", logger="worker_client.training")
    report = PushReport([pb.PushResponse(outcome=pb.PUSH_ACCEPTED),
                         pb.PushResponse(outcome=pb.PUSH_DROPPED, drop_reason=pb.DROP_STALE, message="stale")], clock=7)
    _Tally(start_clock=0).count(report)
    record = next(r for r in caplog.records if "dropped" in r.getMessage())
    entry = json.loads(JsonFormatter({"worker": 1}).format(record))
    assert (entry["clock"], entry["dropped_by"], entry["reason"], entry["worker"]) == (7, [1], ["STALE"], 1)


@pytest.mark.parametrize("mode, steps, last, declared", [
    ("sync", [300, 299], 300, [299, 299]),   # the shard at the last step gets a gradient it drops as stale
    ("sync", [301, 300], 300, [300, 299]),
    ("sync", [299, 299], 300, None),         # no shard there yet: the client's own read steps
    ("sync", [300, 299], None, None),        # a job of epochs has no last step
    ("async", [300, 299], 300, None),        # only sync steps wait for a quorum
    ("ssp", [300, 299], 300, None),
])
def test_a_sync_push_never_begins_a_step_past_the_jobs_last(mode, steps, last, declared) -> None:
    trainer = SimpleNamespace(mode=mode, client=SimpleNamespace(steps=steps), plan=SimpleNamespace(steps=last))
    assert Trainer._declared_read_steps(trainer) == declared
    if declared is not None:   # what the shard then decides: the step the report waits for is the one it has
        report = _report(*((pb.PUSH_DROPPED, pb.DROP_STALE, s) if d < s else (pb.PUSH_ACCEPTED, 0, s)
                           for s, d in zip(steps, declared)), read_steps=declared)
        assert report.wait_steps[0] == 0 and report.stale
