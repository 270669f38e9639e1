"""What a ps-launch user sees on stderr: log lines (text or JSON) and the job's progress (a bar, lines or JSON).

* On a terminal, one live progress bar for the job (percentage, step/total, ETA, then loss,
  samples/s, stale drops and test accuracy; tqdm), with every other line printed above it;
  otherwise the same fields as one line every ``--print-every`` seconds.
* With ``--verbose``, also every process's INFO lines (``[shard0]`` / ``[worker1]`` prefixes).
* With ``--log-json``, only JSON lines: the launcher's and its children's records, each with
  a ``process`` field, and the progress as records with ``"event": "progress"``.

`display_level` picks the lowest level shown; a child's plain lines (`PLAIN`: a traceback, a
final error line) are always shown.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, TextIO

from ps_common.jobconfig import JobConfig

#: The level of every line a child prints that is not a JSON log record (a traceback, a final error line).
PLAIN = "PLAIN"
#: Level numbers by name; PLAIN lines are always shown.
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
          "CRITICAL": logging.CRITICAL, PLAIN: logging.CRITICAL + 1}


def display_level(config: JobConfig) -> str:
    """The lowest level ps-launch shows and its children log: --log-level when given, else WARNING (INFO: --verbose)."""
    if config.source("job.log_level") != "default":
        return config.job.log_level
    return "INFO" if config.launch.verbose else "WARNING"


def now_iso() -> str:
    """The time now, as a JSON record's ``ts`` (UTC, milliseconds)."""
    now = _dt.datetime.now(tz=_dt.timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def format_duration(seconds: float | None) -> str:
    """A duration for people: 42 s, 3 min 05 s, 1 h 02 min; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_number(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`; "n/a" when it is None or NaN."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


@dataclass
class Progress:
    """The job's progress as the bar and the progress lines show it."""

    done: int                        # global steps (or, for an epochs job, pushes of all workers)
    total: int | None
    unit: str                        # "step" | "push"
    loss: float | None
    samples_per_second: float
    stale_drops: int
    test_accuracy: float | None
    test_loss: float | None
    elapsed: float                   # seconds since the workers started training
    eta: float | None                # seconds left, from the rate so far

    @property
    def percent(self) -> float | None:
        return None if not self.total else min(100.0, 100.0 * self.done / self.total)

    def fields(self) -> dict[str, Any]:
        """As JSON fields (the --log-json progress record, the TensorBoard scalars)."""
        return {"step" if self.unit == "step" else "pushes": self.done, "total": self.total,
                "percent": None if self.percent is None else round(self.percent, 1),
                "loss": self.loss, "samples_per_second": round(self.samples_per_second, 1),
                "stale_drops": self.stale_drops, "test_accuracy": self.test_accuracy,
                "elapsed_seconds": round(self.elapsed, 1), "eta_seconds": None if self.eta is None else round(self.eta)}

    def postfix(self) -> str:
        """Loss, samples/s, stale drops and test accuracy, as the bar's and the lines' text."""
        parts = [f"loss {format_number(self.loss, '.4f')}", f"{self.samples_per_second:,.0f} samples/s",
                 f"stale drops {self.stale_drops}"]
        if self.test_accuracy is not None:
            parts.append(f"test acc {self.test_accuracy:.4f}")
        elif self.test_loss is not None:
            parts.append(f"test loss {self.test_loss:.4f}")
        return " | ".join(parts)

    def line(self) -> str:
        """One progress line (no terminal): the same fields as the bar."""
        where = f"{self.unit} {self.done}" + (f"/{self.total}" if self.total else "")
        percent = f"{self.percent:3.0f}% | " if self.percent is not None else ""
        return (f"{percent}{where} | {self.postfix()} | {format_duration(self.elapsed)} elapsed, "
                f"ETA {format_duration(self.eta)}")


class Display:
    """Everything ps-launch writes to stderr: log lines (text or JSON) and the progress (a bar, lines or JSON).

    `threshold` is the lowest level shown (plain lines of a child are always shown). On a
    terminal (and without JSON) the progress is one tqdm bar, redrawn in place, with every
    other line printed above it; otherwise a line (or a JSON record) every `every` s.
    """

    def __init__(self, stream: TextIO, *, tty: bool, json_lines: bool, every: float, threshold: int) -> None:
        self.stream = stream
        self.tty = tty and not json_lines
        self.json = json_lines
        self.every = every
        self.threshold = threshold
        self.bar: Any = None
        self._printed_at = time.monotonic()

    def shows(self, level: str) -> bool:
        return LEVELS.get(level, logging.INFO) >= self.threshold

    def record(self, process_name: str, level: str, msg: str, fields: dict[str, Any] | None = None,
               *, logger: str = "ps_tools.launch", ts: str | None = None, always: bool = False) -> None:
        """One log line of `process_name` ("launch", "shard0", ...), when its level is shown (or `always`)."""
        if not always and not self.shows(level):
            return
        if self.json:
            entry = {"ts": ts or now_iso(), "level": "ERROR" if level == PLAIN else level, "logger": logger,
                     "msg": msg, "process": process_name, **(fields or {})}
            self._write(json.dumps(entry, default=repr, ensure_ascii=False))
            return
        tag = "" if level in ("INFO", "DEBUG", PLAIN) else f"{level}: "
        self._write(f"[{process_name}] {tag}{msg}")

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, p: Progress | None, *, force: bool = False) -> None:
        """Shows the progress: the bar redrawn, or a line / JSON record when `every` s passed (or `force`)."""
        if p is None:
            return
        if self.tty:
            self._draw(p)
            return
        now = time.monotonic()
        if not force and now - self._printed_at < self.every:
            return
        self._printed_at = now
        if self.json:
            self._write(json.dumps({"ts": now_iso(), "level": "INFO", "logger": "ps_tools.launch",
                                    "msg": p.line(), "process": "launch", "event": "progress", **p.fields()}))
        else:
            self._write("[launch] " + p.line())

    def _draw(self, p: Progress) -> None:
        if self.bar is None:
            self.bar = _bar(p, self.stream)
        if p.done > self.bar.n:
            self.bar.update(p.done - self.bar.n)   # tqdm's rate, hence its ETA, follows the updates
        self.bar.stats = p.postfix()
        self.bar.refresh()

    def close(self) -> None:
        """Leaves the bar as it last was (its final state stays on the screen)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _bar(p: Progress, stream: TextIO) -> Any:
    """A tqdm bar for the job: percentage, steps done of the total, the ETA, then the job's numbers (`stats`)."""
    from tqdm import tqdm

    class JobBar(tqdm):  # type: ignore[misc]
        """tqdm's documented way to show fields of one's own: the bar format reads them from format_dict."""

        stats = ""

        @property
        def format_dict(self) -> dict[str, Any]:
            return {**super().format_dict, "stats": self.stats}

    known = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}s | ETA {remaining} | {stats}"
    return JobBar(total=p.total, file=stream, unit=p.unit, dynamic_ncols=True, leave=True, smoothing=0.1,
                  mininterval=0.2, bar_format=known if p.total else "{n_fmt} {unit}s | {elapsed} | {stats}")
