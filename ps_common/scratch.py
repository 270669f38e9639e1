"""Scratch files and folders that go with their process, even one killed with SIGKILL.

A process killed with SIGKILL runs no cleanup, so a temporary folder it made stays in
TMPDIR for good; a long job whose workers restart would fill the disk. Every scratch folder
the project makes is therefore named after its process (its pid and the kernel's start
time of that pid, so a reused pid is told apart) under one folder per user,
`$TMPDIR/onnx-ps-<uid>/` (mode 0700), and every process that makes one first removes those
whose process is gone: nothing a killed process made outlives the start of its successor
or of the next job. Temporary files written beside a final file (`temporary_name`) carry
the same tag, and `sweep_temporaries` removes the dead ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: A scratch entry's name: KIND-PID-START-RANDOM (folders) or .NAME.PID-START.RANDOM.tmp (temporary files).
_FOLDER = re.compile(r"^(?P<kind>[a-z][a-z-]*?)-(?P<pid>\d+)-(?P<start>\d+)-[A-Za-z0-9_]+$")
_TEMPORARY = re.compile(r"^\..+\.(?P<pid>\d+)-(?P<start>\d+)\.[0-9a-f]+\.tmp$")


def _start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks after boot (Linux /proc), 0 where unknown, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        text = ""
    if text:
        fields = text[text.rindex(")") + 2:].split()   # after "pid (comm) ": comm may hold spaces
        return int(fields[19])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def process_tag(pid: int | None = None) -> str:
    """PID-START of a process (this one by default): unique among the processes of one boot."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid) or 0}"


def is_gone(pid: int, start: int) -> bool:
    """Whether the process tagged PID-START no longer runs (its pid is free or now another process's)."""
    now = _start_time(pid)
    return now is None or (now != 0 and start != 0 and now != start)


def scratch_root() -> Path | None:
    """This user's folder of scratch folders (made 0700), or None when it cannot be trusted (not ours, a link)."""
    root = Path(tempfile.gettempdir()) / f"onnx-ps-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        log.warning("not using %s for scratch folders: it is not a private folder of this user", root)
        return None
    return root


def sweep(root: Path) -> list[Path]:
    """Removes the scratch folders under `root` whose process is gone; returns them."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _FOLDER.match(entry.name)
        if match and is_gone(int(match["pid"]), int(match["start"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("removed %d scratch folder(s) of processes that are gone: %s", len(removed),
                 ", ".join(p.name for p in removed[:5]))
    return removed


class ScratchDir:
    """A new empty folder for this process's scratch files, removed by `cleanup` (or on leaving a `with`), and by
    the next process that makes one if this one is killed. `kind` names the process (`ps-worker`, ...)."""

    def __init__(self, kind: str) -> None:
        if not re.fullmatch(r"[a-z][a-z-]*", kind):
            raise ValueError(f"Invalid scratch kind: {kind!r} (lowercase letters and dashes)")
        root = scratch_root()
        if root is not None:
            sweep(root)
            self.path = Path(tempfile.mkdtemp(prefix=f"{kind}-{process_tag()}-", dir=root))
        else:   # no private root: a plain temporary folder (removed on exit, not by a successor)
            self.path = Path(tempfile.mkdtemp(prefix=f"{kind}-"))
        self.name = str(self.path)

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def temporary_name(final: Path) -> Path:
    """Where to write `final` before renaming it into place: beside it, tagged with this process."""
    return final.with_name(f".{final.name}.{process_tag()}.{secrets.token_hex(4)}.tmp")


def sweep_temporaries(folder: Path) -> list[Path]:
    """Removes the temporary files (`temporary_name`) in `folder` whose process is gone; returns them."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match and is_gone(int(match["pid"]), int(match["start"])):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed
