"""Where a worker's events go: JSON lines for launchers, text for people, and the numbers they carry."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

import numpy as np

__all__ = ["EventSink", "JsonLinesSink", "TextSink", "format_event", "peak_rss_mb"]


class EventSink(Protocol):
    """Where a trainer reports events: "start", "progress", "eval", "done"."""

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None: ...


class JsonLinesSink:
    """One JSON object a line, {"event": ..., "time": unix seconds, ...fields}, flushed at once (for ps-launch)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        self.stream.write(json.dumps(record, default=_jsonable) + "\n")
        self.stream.flush()


class TextSink:
    """One human-readable line per event (`format_event`)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        self.stream.write(format_event(event, fields) + "\n")
        self.stream.flush()


def format_event(event: str, fields: Mapping[str, Any]) -> str:
    """An event as one line of text for people."""
    f = fields
    who = f"worker {f.get('worker')}"
    if event == "start":
        how = "rejoined" if f["resumed"] else "started"
        return (f"{who} ({f['worker_id']}) {how}: {f['mode']} on {f['shards']} shard(s), {f['workers']} "
                f"worker(s); {f['train_examples']} training examples, batch {f['batch_size']}; "
                f"at step {f['step']}, clock {f['clock']}")
    if event == "progress":
        return (f"{who} step {f['step']}: loss {_num(f['loss'])}, {f['samples_per_second']:.0f} samples/s, "
                f"{f['stale_drops']} stale drop(s)")
    if event == "eval":
        final = " (final)" if f.get("final") else ""
        return (f"{who} step {f['step']}{final}: test accuracy {_num(f['test_accuracy'])}, "
                f"test loss {_num(f['test_loss'])}")
    if event == "done":
        text = (f"{who} done at step {f['steps']}: {f['iterations']} pushes in {f['seconds']:.1f} s "
                f"({f['samples_per_second']:.0f} samples/s), {f['dropped']} dropped")
        if f.get("test_accuracy") is not None:
            text += f"; test accuracy {_num(f['test_accuracy'])}, test loss {_num(f['test_loss'])}"
        return text
    return f"{who} {event}: {json.dumps(dict(f), default=_jsonable)}"


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB.

    Linux: VmHWM of /proc/self/status, the high-water mark of this program's own memory.
    Not getrusage's ru_maxrss: Linux carries that over fork and exec, so a worker started by
    a launcher holding a whole model would report the launcher's peak as its own. Elsewhere
    ru_maxrss (KiB; bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _jsonable(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)
