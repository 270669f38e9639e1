"""Process-wide logging setup: plain text for people, or one JSON object a line for log collectors."""

from __future__ import annotations

import datetime as _dt
import json as _json
import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

#: The plain-text line format (the JSON format carries the same fields).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the record's `extra` fields and the static fields.

    ts is UTC ISO 8601 with milliseconds; an exception adds "exc" (the formatted traceback).
    Values JSON cannot hold are written as their repr().
    """

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
        entry: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(self.fields)
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return _json.dumps(entry, default=repr, ensure_ascii=False)


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"Invalid log level: {level!r} (choose DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return value


def configure_logging(level: str | int = "INFO", json: bool = False, *, stream: TextIO | None = None,
                      fields: Mapping[str, Any] | None = None) -> logging.Handler:
    """Sends every log record at `level` or above to `stream` (default stderr), as JSON lines or text.

    Replaces the root logger's handlers, so calling it again reconfigures instead of
    duplicating lines. `fields` are added to every JSON line (e.g. {"shard": 0}); text
    lines ignore them. Returns the installed handler. Not thread-safe against concurrent
    reconfiguration; call it once at startup.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(fields) if json else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(_level(level))
    return handler
