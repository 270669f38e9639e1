"""What a job leaves behind: ``--record DIR`` (run.json and plot.png) and ``--tensorboard DIR`` (the job's scalars).

run.json holds the summary, the settings, the processes, the workers' results, the
evaluations and the progress reports; plot.png the loss and the test accuracy (regression:
the test loss) over the global step. The plot needs matplotlib (the ``demo`` extra): without
it the record has no plot, and `write_record` says why. The TensorBoard scalars are the
job's training loss, samples/s and stale drops, and the evaluations' test figures.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ps_common.jobconfig import JobConfig
from ps_tools.launch.children import Child
from ps_tools.launch.display import Progress, format_number
from worker_client.training.tensorboard import ScalarWriter, eval_scalars, progress_scalars, require_writer

#: Shortest time between two writes of the job's TensorBoard scalars, in seconds.
TENSORBOARD_EVERY = 1.0


def run_record(*, summary: dict[str, Any], config: JobConfig, children: list[Child],
               evaluations: list[dict[str, Any]], progress: list[dict[str, Any]]) -> dict[str, Any]:
    """The content of run.json: summary, settings, processes, worker results, evaluations, progress."""
    return {
        "summary": summary,
        "settings": config.as_dict(),
        "processes": [{"name": c.name, "pid": c.pid, "argv": c.argv, "exit_code": c.process.returncode}
                      for c in children],
        "workers": [c.result for c in children if c.role == "worker"],
        "evaluations": evaluations,
        "progress": progress,
    }


def write_record(directory: Path, record: dict[str, Any]) -> str | None:
    """Writes DIR/run.json and DIR/plot.png; returns why there is no plot (matplotlib missing), else None.

    OSError when either cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "run.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    tmp.replace(directory / "run.json")
    try:
        plot_run(record, directory / "plot.png")
    except ImportError as exc:   # matplotlib is an extra: without it the record lacks only its plot
        return f"no plot in {directory} ({exc}): install matplotlib (pip install 'onnx-ps[demo]')"
    return None


def short_name(spec: str | None) -> str:
    """A model's or data set's name for a title: a file's stem, a bundled name, a synthetic kind; not a path."""
    if not spec:
        return "?"
    if spec.startswith("synthetic:"):
        return spec.split("?", 1)[0]
    path = Path(spec)
    return path.stem if path.suffix in (".onnx", ".npz") or "/" in spec or os.sep in spec else spec


def plot_run(record: dict[str, Any], path: Path) -> None:
    """Loss (training and test) and the test accuracy (regression: the test loss) over the global step, as a PNG."""
    import matplotlib.pyplot as plt

    fig = plot_figure(record)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_figure(record: dict[str, Any]) -> Any:
    """The plot of a run record (see plot_run) as a matplotlib figure (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, evals = record["summary"], record["evaluations"]
    fig, (ax_loss, ax_test) = plt.subplots(1, 2, figsize=(11, 4.4))
    workers = sorted({p["worker"] for p in record["progress"]})
    for worker in workers:
        points = [(p["step"], p["loss"]) for p in record["progress"] if p["worker"] == worker and p["loss"] is not None]
        if points:
            ax_loss.plot(*zip(*points), ".", alpha=0.5, label=f"worker {worker}: training loss (mean per report)")
    train = [(e["step"], e["train_loss"]) for e in evals if e.get("train_loss") is not None]
    test = [(e["step"], e["test_loss"]) for e in evals if e.get("test_loss") is not None]
    if train:
        ax_loss.plot(*zip(*train), "-", label="worker 0: training loss (mean since the last evaluation)")
    if test:
        ax_loss.plot(*zip(*test), "-o", markersize=3, label="test loss (whole test split)")
    ax_loss.set_xlabel("global step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    accuracy = [(e["step"], e["test_accuracy"]) for e in evals if e.get("test_accuracy") is not None]
    if accuracy:
        ax_test.plot(*zip(*accuracy), "-o", markersize=3, color="tab:green")
        ax_test.set_ylabel("test accuracy")
        ax_test.set_ylim(0, 1)
        ax_test.set_title(f"final test accuracy {format_number(summary.get('test_accuracy'), '.4f')}", fontsize=10)
    else:   # regression (or a loss of the model's own): the test loss is what there is to watch
        if test:
            ax_test.plot(*zip(*test), "-o", markersize=3, color="tab:red")
            ax_test.set_yscale("log")
        ax_test.set_ylabel("test loss")
        ax_test.set_title(f"final test loss {format_number(summary.get('test_loss'), '.4g')}", fontsize=10)
    ax_test.set_xlabel("global step")
    ax_test.grid(True, alpha=0.3)
    fig.suptitle(f"{short_name(summary['model'])} on {short_name(summary['data'])}", fontsize=13)
    fig.text(0.5, 0.915, f"{summary['mode']}, {summary['workers']} worker(s), {summary['shards']} shard(s), "
                         f"{summary['optimizer']} lr {summary['lr']:g}, batch {summary['batch_size']}, "
                         f"{summary['samples_per_second']:,.0f} samples/s", ha="center", fontsize=9, color="dimgray")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


class JobScalars:
    """The job's TensorBoard scalars in `directory` (``--tensorboard DIR``; the workers' own go in DIR/worker<i>).

    JobConfigError naming the fix when tensorboardX is not installed (checked before a job starts).
    """

    def __init__(self, directory: str) -> None:
        require_writer()
        self._writer = ScalarWriter(directory)
        self._written_at = 0.0
        self._step = -1

    def progress(self, p: Progress | None) -> None:
        """The job's progress at its global step, at most every TENSORBOARD_EVERY s (an epochs job has none)."""
        if p is None or p.unit != "step":
            return
        now = time.monotonic()
        if p.done != self._step and now - self._written_at >= TENSORBOARD_EVERY:
            self._writer.scalars(p.done, progress_scalars(p.fields()))
            self._step, self._written_at = p.done, now

    def final(self, p: Progress | None) -> None:
        """The job's last progress, whenever it comes."""
        if p is not None and p.unit == "step":
            self._writer.scalars(p.done, progress_scalars(p.fields()))

    def evaluation(self, record: dict[str, Any]) -> None:
        """A test evaluation's figures at its step (worker 0's, or the launcher's of a pipeline's whole model)."""
        self._writer.scalars(record["step"], eval_scalars(record))

    def close(self) -> None:
        self._writer.close()
