"""Where a local job's stage workers find each other: one small JSON file per (replica, stage) in a shared folder.

A stage worker publishes the address its StageServer bound (port 0 picks one, so nobody
knows it in advance); its neighbours look it up. A restarted worker publishes its new
address over the old one; a StageLink built with ``resolve=lambda: lookup(...)`` finds it.
Writes are atomic (a temporary file, then a rename), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ps_common.errors import StageTimeoutError, StoppedError

#: How often lookup looks at the folder while it waits (seconds).
POLL_SECONDS = 0.1


def path_of(folder: str | os.PathLike[str], replica: int, stage: int) -> Path:
    """The rendezvous file of one stage worker: ``folder/replica{r}-stage{k}.json``."""
    return Path(folder) / f"replica{int(replica)}-stage{int(stage)}.json"


def publish(folder: str | os.PathLike[str], replica: int, stage: int, address: str) -> Path:
    """Writes (or replaces) the address of stage `stage` of replica `replica` atomically; returns the file."""
    target = path_of(folder, replica, stage)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"replica": int(replica), "stage": int(stage), "address": address,
                               "pid": os.getpid(), "time": time.time()}), encoding="utf-8")
    os.replace(tmp, target)
    return target


def read(folder: str | os.PathLike[str], replica: int, stage: int) -> str | None:
    """The published address, or None when there is none yet (or the file does not hold one)."""
    try:
        data = json.loads(path_of(folder, replica, stage).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    address = data.get("address") if isinstance(data, dict) else None
    return address if isinstance(address, str) and address else None


def lookup(folder: str | os.PathLike[str], replica: int, stage: int, *, timeout: float,
           stop: threading.Event | None = None) -> str:
    """The address stage `stage` of replica `replica` published; polls every POLL_SECONDS until it appears.

    Blocks at most `timeout` seconds: then StageTimeoutError naming the file and the seconds
    waited. A set `stop` raises StoppedError within one poll.
    """
    started = time.monotonic()
    stop = stop or threading.Event()
    while True:
        address = read(folder, replica, stage)
        if address is not None:
            return address
        waited = time.monotonic() - started
        if waited >= timeout:
            raise StageTimeoutError(f"no address of stage {stage} of replica {replica} in "
                                    f"{path_of(folder, replica, stage)} after {waited:.1f} s (timeout {timeout:g} s)")
        if stop.wait(min(POLL_SECONDS, timeout - waited)):
            raise StoppedError(f"looking up stage {stage} of replica {replica} in {path_of(folder, replica, stage)}: "
                               f"stopped after {time.monotonic() - started:.1f} s")
