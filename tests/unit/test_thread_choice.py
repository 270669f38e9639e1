"""A graph that loops tries one intra-op thread over its first steps and keeps the faster
(worker_client/engine/thread_choice.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.lstm_fixture import FIXTURES, lstm_batch
from worker_client import GradientEngine
from worker_client.engine import thread_choice
from worker_client.engine.thread_choice import TRIAL_STEPS, ThreadChoice


class _Clock:
    """perf_counter as the fake sessions move it: each run takes its session's time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Session:
    def __init__(self, name: str, seconds: float, clock: _Clock) -> None:
        self.name, self.seconds, self.clock, self.runs = name, seconds, clock, 0

    def run(self) -> str:
        self.runs += 1
        self.clock.now += self.seconds
        return self.name


def _choice(monkeypatch: pytest.MonkeyPatch, wide_s: float, single_s: float, *, threads: int | None = 2,
            trial: bool = True, cores: int = 2) -> tuple[ThreadChoice, _Session, list[_Session]]:
    clock = _Clock()
    monkeypatch.setattr(thread_choice.time, "perf_counter", clock)
    monkeypatch.setattr(thread_choice, "_cores", lambda: cores)
    wide = _Session("wide", wide_s, clock)
    opened: list[_Session] = []

    def open_single() -> _Session:
        opened.append(_Session("single", single_s, clock))
        return opened[-1]

    return ThreadChoice(wide, threads=threads, trial=trial, open_single=open_single), wide, opened  # type: ignore[arg-type]


def _steps(choice: ThreadChoice, count: int) -> list[str]:
    return [choice.run(lambda session: session.run()) for _ in range(count)]


def test_the_first_steps_alternate_and_a_faster_single_thread_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    choice, wide, opened = _choice(monkeypatch, wide_s=0.020, single_s=0.015)
    assert choice.deciding and not opened                 # the one-thread session is opened by the first step
    trial = 2 * (TRIAL_STEPS + 1)
    assert _steps(choice, trial) == ["wide", "single"] * (TRIAL_STEPS + 1)
    assert not choice.deciding and choice.threads == 1
    assert set(_steps(choice, 5)) == {"single"}
    assert wide.runs == TRIAL_STEPS + 1 and len(opened) == 1


@pytest.mark.parametrize("single_s", [0.020, 0.0195, 0.030])
def test_the_threads_asked_for_stay_unless_one_thread_is_clearly_faster(monkeypatch: pytest.MonkeyPatch,
                                                                        single_s: float) -> None:
    """Equal, faster by less than the margin (2.5%), slower: the session as opened stays."""
    choice, _, opened = _choice(monkeypatch, wide_s=0.020, single_s=single_s)
    _steps(choice, 2 * (TRIAL_STEPS + 1))
    assert not choice.deciding and choice.threads == 2
    assert set(_steps(choice, 3)) == {"wide"}
    assert opened[0].runs == TRIAL_STEPS + 1              # released after the trial: no further runs


def test_the_warm_up_steps_are_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow first step of the one-thread session (its arena, its first allocation) does not count."""
    choice, _, opened = _choice(monkeypatch, wide_s=0.020, single_s=0.015)
    choice.run(lambda session: session.run())
    slow_first = []

    def first_run_slow(session: _Session) -> str:
        if session.name == "single" and not slow_first:
            slow_first.append(1)
            session.clock.now += 10.0
        return session.run()

    for _ in range(2 * (TRIAL_STEPS + 1) - 1):
        choice.run(first_run_slow)
    assert slow_first and choice.threads == 1


@pytest.mark.parametrize("threads, trial, cores", [(1, True, 2), (2, False, 2), (None, True, 1)])
def test_no_trial_for_one_thread_a_graph_without_loops_or_a_single_core(
        monkeypatch: pytest.MonkeyPatch, threads: int | None, trial: bool, cores: int) -> None:
    choice, wide, opened = _choice(monkeypatch, wide_s=0.020, single_s=0.001, threads=threads, trial=trial,
                                   cores=cores)
    assert not choice.deciding
    assert set(_steps(choice, 12)) == {"wide"} and not opened and choice.threads == threads


def test_onnxruntimes_default_threads_on_several_cores_are_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    choice, _, _ = _choice(monkeypatch, wide_s=0.020, single_s=0.010, threads=None, cores=4)
    assert choice.deciding
    _steps(choice, 2 * (TRIAL_STEPS + 1))
    assert choice.threads == 1


def test_an_lstms_engine_settles_on_a_thread_count_and_its_gradients_hold_throughout(tmp_path: Path) -> None:
    """The torch LSTM fixture on two threads: the trial runs over the first steps and ends; every step's
    gradients are torch's, whichever session computed them. A graph without loops is never tried."""
    inputs, reference = lstm_batch()
    engine = GradientEngine(FIXTURES / "lstm_reader.onnx", batch_size=len(inputs["labels"]),
                            loss="cross_entropy", intra_op_threads=2, cache_dir=tmp_path)
    assert engine.trying_threads and engine.step_threads == 2
    parameters = engine.parameters()
    for _ in range(2 * (TRIAL_STEPS + 1) + 2):
        _, gradients = engine.gradients(parameters, inputs)
        for name, expected in reference.items():
            np.testing.assert_allclose(gradients[name], expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
    assert not engine.trying_threads and engine.step_threads in (1, 2)

    mlp = np.load(FIXTURES / "mlp.npz")
    plain = GradientEngine(FIXTURES / "mlp.onnx", batch_size=mlp["labels"].shape[0], loss=str(mlp["loss_kind"]),
                           intra_op_threads=2, cache_dir=tmp_path)
    assert not plain.trying_threads and plain.step_threads == 2
    predictor = GradientEngine(FIXTURES / "mlp.onnx", batch_size=1, loss=None, cache_dir=tmp_path)
    assert predictor.step_threads is None and not predictor.trying_threads


def test_the_core_count_falls_back_to_cpu_count_where_affinity_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not on Linux (no sched_getaffinity): os.cpu_count(), and 1 where even that is unknown."""
    monkeypatch.delattr(thread_choice.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(thread_choice.os, "cpu_count", lambda: 6)
    assert thread_choice._cores() == 6
    monkeypatch.setattr(thread_choice.os, "cpu_count", lambda: None)
    assert thread_choice._cores() == 1
