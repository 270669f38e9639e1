"""Data-plane admission tells callers apart: a registered live worker has slots of its own, anonymous callers share
theirs, and one more call than a class holds is refused at once."""

from __future__ import annotations

import contextlib

import pytest

from ps_common.errors import OverloadedError
from ps_server.admission import Admission


def admitted(admission: Admission, count: int, worker: str = "") -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for _ in range(count):
        stack.enter_context(admission.enter("Pull", worker))
    return stack


def test_anonymous_callers_filling_their_slots_leave_a_live_workers_slots_free():
    admission = Admission(3, is_live=lambda w: w == "w0", worker_calls=2)
    with admitted(admission, 3):
        with pytest.raises(OverloadedError, match="not registered workers"):
            admission.enter("Pull").__enter__()
        with admitted(admission, 2, "w0"):   # the registered worker is still served
            with pytest.raises(OverloadedError, match="worker 'w0' already runs 2"):
                admission.enter("PushPull", "w0").__enter__()


def test_a_name_that_is_not_a_live_worker_takes_an_anonymous_slot():
    admission = Admission(1, is_live=lambda w: w == "w0")
    with admission.enter("Push", "spoofed"):
        with pytest.raises(OverloadedError):
            admission.enter("Push", "someone-else").__enter__()
        with admission.enter("Push", "w0"):
            pass


def test_slots_return_when_calls_end_even_by_an_error():
    admission = Admission(1, is_live=lambda w: True, worker_calls=1)
    for worker in ("", "w0"):
        with pytest.raises(RuntimeError):
            with admission.enter("Pull", worker):
                raise RuntimeError("the handler failed")
        with admission.enter("Pull", worker):
            pass


@pytest.mark.parametrize("limit, per_worker", [(0, 1), (1, 0)])
def test_limits_below_one_are_refused(limit, per_worker):
    with pytest.raises(ValueError, match="Invalid"):
        Admission(limit, worker_calls=per_worker)
