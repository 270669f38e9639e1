"""ps-launch's display without processes: progress lines, levels, JSON records, the plot's texts, TensorBoard sinks."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from ps_common import jobconfig
from ps_tools import launch
from ps_tools.launch import Display, Progress
from tests.helpers.tensorboard import read_scalars
from worker_client.training.tensorboard import TensorBoardSink


def progress(**overrides) -> Progress:
    fields = dict(done=225, total=500, unit="step", loss=0.21042, samples_per_second=1542.4, stale_drops=3,
                  test_accuracy=0.9721, test_loss=0.09, elapsed=9.2, eta=11.4)
    return Progress(**{**fields, **overrides})


def test_a_progress_line_has_the_percentage_the_step_the_numbers_and_the_eta() -> None:
    line = progress().line()
    assert line.startswith(" 45% | step 225/500 | loss 0.2104 | 1,542 samples/s | stale drops 3 | test acc 0.9721")
    assert line.endswith("| 9 s elapsed, ETA 11 s")
    assert progress(eta=None, elapsed=125).line().endswith("| 2 min 05 s elapsed, ETA ?")
    assert "test loss 0.0900" in progress(test_accuracy=None).line()   # regression: its test loss


def test_without_a_terminal_progress_lines_come_every_print_every_seconds_and_on_force() -> None:
    out = io.StringIO()
    display = Display(out, tty=False, json_lines=False, every=3600, threshold=logging.WARNING)
    display.progress(progress())                 # too soon after the start
    display.progress(progress(done=300), force=True)
    assert out.getvalue().splitlines() == ["[launch] " + progress(done=300).line()]


def test_lines_below_the_threshold_are_hidden_plain_lines_and_always_lines_are_not() -> None:
    out = io.StringIO()
    display = Display(out, tty=False, json_lines=False, every=10, threshold=logging.WARNING)
    display.record("shard0", "INFO", "shard 0 security: plaintext; ...")
    display.record("shard0", "WARNING", "replicas capped")
    display.record("worker1", launch.PLAIN, "ps-worker: ValueError: ...")
    display.record("launch", "INFO", "done: test accuracy 0.97", always=True)
    assert out.getvalue().splitlines() == ["[shard0] WARNING: replicas capped", "[worker1] ps-worker: ValueError: ...",
                                           "[launch] done: test accuracy 0.97"]


def test_json_records_keep_their_fields_and_name_the_process() -> None:
    out = io.StringIO()
    display = Display(out, tty=True, json_lines=True, every=0.0, threshold=logging.INFO)
    display.record("worker0", "INFO", "worker 0 step 25: ...", {"event": "eval", "step": 25, "test_accuracy": 0.9})
    display.progress(progress())
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["process"] == "worker0" and first["step"] == 25 and first["event"] == "eval"
    assert second["event"] == "progress" and second["percent"] == 45.0 and second["eta_seconds"] == 11
    assert display.bar is None   # JSON lines, even on a terminal: no bar


def config(*flags: str) -> jobconfig.JobConfig:
    return jobconfig.load_config(launch.build_parser().parse_args(list(flags)), scope="launch")


def test_the_launcher_shows_warnings_by_default_info_with_verbose_and_any_level_asked_for() -> None:
    assert launch.display_level(config()) == "WARNING"
    assert launch.display_level(config("--verbose")) == "INFO"
    assert launch.display_level(config("--log-level", "DEBUG")) == "DEBUG"
    assert launch.display_level(config("--log-level", "ERROR", "--verbose")) == "ERROR"


@pytest.mark.parametrize(("spec", "name"), [("runs/demo/mlp.onnx", "mlp"), ("/data/my data.npz", "my data"),
                                           ("digits", "digits"), ("mlp", "mlp"),
                                           ("synthetic:regression?n=100&features=3", "synthetic:regression")])
def test_titles_name_models_and_data_not_paths(spec: str, name: str) -> None:
    assert launch.short_name(spec) == name


def record(*, regression: bool) -> dict:
    evals = [{"worker": 0, "step": s, "train_loss": 1.0 / (s + 1), "test_loss": 1.5 / (s + 1),
              "test_accuracy": None if regression else 0.5 + s / 1000} for s in (0, 25, 50)]
    summary = {"model": "/home/me/models/very/long/path/regressor.onnx", "data": "/home/me/data/houses.npz",
               "mode": "sync", "workers": 2, "shards": 2, "optimizer": "adam", "lr": 0.001, "batch_size": 32,
               "samples_per_second": 1234.0, "test_accuracy": evals[-1]["test_accuracy"],
               "test_loss": evals[-1]["test_loss"]}
    progress = [{"worker": w, "step": s, "loss": 0.5} for w in (0, 1) for s in (10, 20)]
    return {"summary": summary, "evaluations": evals, "progress": progress}


def test_a_regression_plot_shows_the_test_loss_and_a_short_title() -> None:
    fig = launch.plot_figure(record(regression=True))
    ax_loss, ax_test = fig.axes
    assert fig._suptitle.get_text() == "regressor on houses"
    assert ax_test.get_ylabel() == "test loss" and ax_test.get_title() == "final test loss 0.02941"
    assert len(ax_test.lines) == 1 and list(ax_test.lines[0].get_xdata()) == [0, 25, 50]
    legend = [t.get_text() for t in ax_loss.get_legend().get_texts()]
    assert legend == ["worker 0: training loss (mean per report)", "worker 1: training loss (mean per report)",
                      "worker 0: training loss (mean since the last evaluation)", "test loss (whole test split)"]


def test_a_classification_plot_shows_the_test_accuracy(tmp_path: Path) -> None:
    fig = launch.plot_figure(record(regression=False))
    assert fig.axes[1].get_ylabel() == "test accuracy" and fig.axes[1].get_title() == "final test accuracy 0.5500"
    launch.plot_run(record(regression=False), tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_worker_tensorboard_sink_writes_what_its_events_carry_and_passes_them_on(tmp_path: Path) -> None:
    seen = []
    sink = TensorBoardSink(tmp_path, inner=lambda event, fields: seen.append(event))
    sink("start", {"worker": 0})
    sink("progress", {"step": 10, "loss": 0.5, "samples_per_second": 100.0, "stale_drops": 1})
    sink("eval", {"step": 10, "test_accuracy": 0.75, "test_loss": None})
    sink("done", {"worker": 0})
    assert seen == ["start", "progress", "eval", "done"]
    scalars = read_scalars(tmp_path)
    assert scalars == {"train/loss": [(10, 0.5)], "train/samples_per_second": [(10, 100.0)],
                       "train/stale_drops": [(10, 1.0)], "test/accuracy": [(10, 0.75)]}


def test_the_launcher_starts_every_process_through_the_name_the_refusal_tests_replace(monkeypatch) -> None:
    # tests/integration/test_user_mistakes.py proves a refused job starts nothing by replacing
    # supervise.ChildProcess: that must be the name the launcher calls.
    from ps_tools.launch import supervise

    started = []
    monkeypatch.setattr(supervise, "ChildProcess", lambda name, argv, **kwargs: started.append(name) or "fake")
    launcher = launch.Launcher(config())
    try:
        child = launcher._start("shard0", "shard", 0, ["true"])
    finally:
        launcher.close()
    assert started == ["shard0"] and child.process == "fake" and launcher.children == [child]
