"""The gradient session's intra-op threads: for a graph that loops, one thread where that is faster.

onnxruntime runs a Scan's (or Loop's) body node by node once per time step, and a recurrent layer's body
is dozens of elementwise ops on a [batch, hidden] tensor each. With more than one intra-op thread every
such op that onnxruntime's cost model splits pays the thread pool's hand-off, every step: on a 2-core
machine ps_bench's 2-layer LSTM once ran its gradient step in 14.5 ms on two threads and 13.6 on one,
and minutes later in 8.2 on two; its GRU ran 12.0 against 10.5 at one moment and faster on two at another.
Which wins depends on the model and the machine, so it is measured: for a CPU session of a graph with a
Scan or Loop given more than one intra-op thread (explicitly, or by onnxruntime's default of one per
core), the first steps alternate between that session and one of the same graph on one thread -- each
warmed by one step, then TRIAL_STEPS timed steps each -- and the session whose median step is faster by
at least MARGIN is kept; the other is released. Every step of the trial returns its own correct result
(the same graph; only the order of a parallel reduction's terms can differ between the two). A graph
without loops, a single thread, or a CUDA session: no trial.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import onnx
import onnxruntime as ort

__all__ = ["MARGIN", "TRIAL_STEPS", "ThreadChoice", "loops"]

_log = logging.getLogger(__name__)

#: Timed steps per session in the trial (after one warm-up step each).
TRIAL_STEPS = 4
#: One thread is kept only when its median step is at least this much faster (noise is not a reason).
MARGIN = 0.05

_Result = TypeVar("_Result")


def loops(model: onnx.ModelProto) -> bool:
    """Whether the main graph runs a Scan or Loop body."""
    return any(node.op_type in ("Scan", "Loop") for node in model.graph.node)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        return os.cpu_count() or 1


class ThreadChoice:
    """The session `step` runs on: `session` as opened, or, after a trial (module docstring), the faster of
    it and `open_single()`'s one-thread session. `threads` is the intra-op thread count asked for (None:
    onnxruntime's default); `trial` says whether the graph and placement call for a trial at all."""

    def __init__(self, session: ort.InferenceSession, *, threads: int | None, trial: bool,
                 open_single: Callable[[], ort.InferenceSession]) -> None:
        self.session = session
        self.threads = threads
        wide = threads is None and _cores() > 1 or threads is not None and threads > 1
        self._trial: list[tuple[ort.InferenceSession, list[float]]] | None = None
        self._pending = trial and wide
        # held only until the trial opens its session (it holds the graph)
        self._open_single: Callable[[], ort.InferenceSession] | None = open_single if self._pending else None
        self._turn = 0

    @property
    def deciding(self) -> bool:
        """Whether steps still alternate between the two sessions."""
        return self._pending or self._trial is not None

    def run(self, call: Callable[[ort.InferenceSession], _Result]) -> _Result:
        """`call` on the session this step runs on, timed while the trial lasts."""
        if self._pending:
            assert self._open_single is not None
            self._pending, opener, self._open_single = False, self._open_single, None
            self._trial = [(self.session, []), (opener(), [])]
        if self._trial is None:
            return call(self.session)
        session, times = self._trial[self._turn % 2]
        started = time.perf_counter()
        result = call(session)
        if self._turn >= 2:                   # the first step of each warms it
            times.append(time.perf_counter() - started)
        self._turn += 1
        if all(len(t) >= TRIAL_STEPS for _, t in self._trial):
            self._settle()
        return result

    def _settle(self) -> None:
        assert self._trial is not None
        (wide, wide_times), (single, single_times) = self._trial
        wide_ms, single_ms = (1e3 * statistics.median(t) for t in (wide_times, single_times))
        keep_single = single_ms < (1 - MARGIN) * wide_ms
        _log.info("gradient step on %s intra-op threads: median %.2f ms; on one: %.2f ms; keeping %s",
                  self.threads or "onnxruntime's default", wide_ms, single_ms,
                  "one thread" if keep_single else "the threads asked for")
        if keep_single:
            self.session, self.threads = single, 1
        self._trial = None
