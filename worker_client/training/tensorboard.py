"""TensorBoard scalars of a training run: loss, accuracy, samples/s and stale drops, by global step.

`ScalarWriter` writes one TensorBoard run (an event file in a folder) with tensorboardX, a
small standalone writer (no TensorFlow, no torch); `TensorBoardSink` wraps a worker's event
sink and writes what its "progress" and "eval" events carry. ps-worker uses the sink
(worker 0 by default), ps-launch a writer fed with the whole job's numbers. The tags:

=====================================  ===================================================
``train/loss``                         mean training loss since the previous report
``train/samples_per_second``           throughput (ps-launch: of all workers together)
``train/stale_drops``                  pushes dropped as stale so far (ps-launch: all workers)
``test/accuracy``, ``test/loss``       worker 0's evaluations on the test split
=====================================  ===================================================

`tensorboard --logdir DIR` shows them; the plot (--record) stays for people without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ps_common.errors import JobConfigError

__all__ = ["ScalarWriter", "TensorBoardSink", "require_writer"]

#: What to install when tensorboardX is missing.
INSTALL_HINT = "pip install 'onnx-ps[tensorboard]' (or pip install tensorboardX)"


def require_writer(setting: str = "--tensorboard") -> None:
    """JobConfigError naming the fix when tensorboardX is not installed (checked before a job starts)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError as exc:
        raise JobConfigError(f"{setting} needs the tensorboardX package, which is not installed ({exc}): "
                             f"{INSTALL_HINT}") from None


class ScalarWriter:
    """One TensorBoard run in `directory` (created); `scalars(step, **values)` skips values that are None."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        require_writer()
        from tensorboardX import SummaryWriter

        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JobConfigError(f"--tensorboard {directory}: cannot create the folder: {exc.strerror or exc}") from exc
        self._writer = SummaryWriter(logdir=str(self.directory), flush_secs=5)

    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), global_step=int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def progress_scalars(fields: Mapping[str, Any]) -> dict[str, float | int | None]:
    """The scalars of a "progress" event (one worker's, or the launcher's job-wide numbers)."""
    return {"train/loss": fields.get("loss"), "train/samples_per_second": fields.get("samples_per_second"),
            "train/stale_drops": fields.get("stale_drops")}


def eval_scalars(fields: Mapping[str, Any]) -> dict[str, float | int | None]:
    """The scalars of an "eval" event."""
    return {"test/accuracy": fields.get("test_accuracy"), "test/loss": fields.get("test_loss")}


class TensorBoardSink:
    """An event sink (worker_client.training.EventSink) that writes the scalars, then passes the event on."""

    def __init__(self, directory: str | os.PathLike[str], inner: Any = None) -> None:
        self.writer = ScalarWriter(directory)
        self.inner = inner

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        if event == "progress":
            self.writer.scalars(fields["step"], progress_scalars(fields))
        elif event == "eval":
            self.writer.scalars(fields["step"], eval_scalars(fields))
        elif event == "done":
            self.writer.close()
        if self.inner is not None:
            self.inner(event, fields)

    def close(self) -> None:
        self.writer.close()
