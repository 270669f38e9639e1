"""When a shard's checkpoints are written: the Checkpointer thread (every N steps, every T seconds, on stop)."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from ps_server.checkpoints.directory import CheckpointDirectory
from ps_server.checkpoints.state import ShardState, check_compatible
from ps_server.config import ServerConfig

log = logging.getLogger(__name__)

class CheckpointSource(Protocol):
    """What the Checkpointer needs of a shard: its step, a consistent snapshot, a restore and its events."""

    @property
    def step(self) -> int: ...

    def snapshot(self) -> ShardState: ...

    def restore(self, state: ShardState) -> None: ...

    @property
    def events(self) -> Any: ...   # ps_server.events.Events


class Checkpointer:
    """Restores a shard on start, writes its checkpoints every N steps and/or T seconds, and once more on stop.

    Thread-safe. The writer thread wakes when `checkpoint_every_steps` steps passed since
    the last checkpoint (a shard listener tells it) or `checkpoint_every_seconds` passed,
    and writes only when the state changed. A failed write is logged and retried at the
    next trigger; the shard keeps serving.
    """

    def __init__(self, shard: CheckpointSource, config: ServerConfig) -> None:
        if not config.checkpoint_dir:
            raise ValueError("Checkpointer needs config.checkpoint_dir")
        self.shard = shard
        self.config = config
        self.directory = CheckpointDirectory(config.checkpoint_dir, keep=config.checkpoint_keep)
        self.every_steps = config.checkpoint_every_steps
        self.every_seconds = config.checkpoint_every_seconds
        self.last_path: Path | None = None
        self.last_seconds: float = 0.0
        self._last_step = 0
        self._dirty = False
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        shard.events.subscribe(self._on_event)

    def _on_event(self, event: str, **fields: Any) -> None:
        # Called by the shard, sometimes under its lock: only flags, never I/O (but see "reset").
        if event in ("init", "push", "step", "reset"):
            self._dirty = True
        if event == "step" and self.every_steps and fields.get("step", 0) - self._last_step >= self.every_steps:
            self._wake.set()
        if event == "reset":   # emitted outside the shard's lock, by the rpc thread of Admin.ResetParameters
            self._after_reset()

    def _after_reset(self) -> None:
        """The checkpoints hold parameters that were just dropped: writes the reset state and deletes every other one.

        Otherwise a restart would bring the old parameters back (their checkpoints have
        higher steps than the reset shard's).
        """
        self._last_step = 0
        if self.checkpoint_now(force=True, replace_all=True) is None:
            log.error("shard %d: could not checkpoint the reset; until a checkpoint is written, a restart restores "
                      "the parameters from before the reset", self.config.shard_index)

    def restore(self) -> ShardState | None:
        """Restores the shard from the newest whole checkpoint (before serving); None when there is none.

        Raises CheckpointMismatchError for a checkpoint of another shard or configuration,
        OSError when the directory cannot be created or written.
        """
        self.directory.ensure()
        for stale in self.directory.remove_temporaries():
            log.info("removed %s, left by a checkpoint write that never finished", stale)
        found = self.directory.latest()
        if found is None:
            self.directory.claim(self.config.shard_index, self.config.num_shards)
            log.info("shard %d: no checkpoint in %s; starting fresh", self.config.shard_index, self.directory.path)
            return None
        path, state = found
        check_compatible(state, self.config)
        self.directory.claim(self.config.shard_index, self.config.num_shards)
        self.shard.restore(state)
        self.shard.restored_from = f"{path} (step {state.step})"   # named when a job brings another model
        self._last_step, self._dirty, self.last_path = state.step, False, path
        log.info("shard %d restored from %s: step %d, %d parts, %d workers%s", self.config.shard_index, path, state.step,
                 len(state.parts), len(state.workers),
                 f", {len(state.contributors)} gradients in the sync step" if state.contributors else "")
        return state

    def start(self) -> "Checkpointer":
        if not self.every_steps and not self.every_seconds:
            log.warning("shard %d checkpoints to %s only when it stops: set checkpoint_every_steps or "
                        "checkpoint_every_seconds to survive a crash", self.config.shard_index, self.directory.path)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        next_due = time.monotonic() + self.every_seconds if self.every_seconds else math.inf
        while not self._stopped.is_set():
            self._wake.wait(min(1.0, max(0.0, next_due - time.monotonic())))
            self._wake.clear()
            if self._stopped.is_set():
                return
            step_due = self.every_steps and self.shard.step - self._last_step >= self.every_steps
            time_due = time.monotonic() >= next_due
            if step_due or time_due:
                self.checkpoint_now()
                if self.every_seconds:
                    next_due = time.monotonic() + self.every_seconds

    def checkpoint_now(self, *, force: bool = False, wait: float | None = None, replace_all: bool = False) -> Path | None:
        """Writes a checkpoint of the current state (unless nothing changed since the last, or force).

        Blocks while another write runs (at most `wait` s when given, then logs and gives
        up). Returns the file, or None when nothing was written (no change, or the write
        failed: logged, and the state stays marked as changed). With replace_all, every
        other checkpoint is deleted once this one is written.
        """
        if not self._write_lock.acquire(timeout=-1 if wait is None else max(0.0, wait)):
            log.error("shard %d: a checkpoint write still runs after %.1f s; not writing another",
                      self.config.shard_index, wait)
            return None
        try:
            if not (self._dirty or force):
                return None
            self._dirty = False          # a change from here on marks it again
            started = time.perf_counter()
            state = self.shard.snapshot()
            captured = time.perf_counter()
            try:
                path = self.directory.write(state, replace_all=replace_all)
            except Exception:
                self._dirty = True
                log.exception("shard %d: checkpoint at step %d to %s failed", self.config.shard_index, state.step,
                              self.directory.path)
                return None
            done = time.perf_counter()
            self._last_step, self.last_path, self.last_seconds = state.step, path, done - started
        finally:
            self._write_lock.release()
        log.info("shard %d: checkpoint at step %d written to %s (%.1f MB in %.3f s, %.3f s of it copying under the lock)",
                 self.config.shard_index, state.step, path, state.nbytes / 1e6, done - started, captured - started)
        self.shard.events.emit("checkpoint", step=state.step, seconds=done - started, nbytes=state.nbytes)
        return path

    def stop(self, timeout: float = 60.0) -> Path | None:
        """Stops the writer thread (waits at most timeout s for a write in progress) and writes the final checkpoint.

        Call after the shard stopped taking pushes (Shard.stop), so the final checkpoint
        is its last state.
        """
        deadline = time.monotonic() + timeout
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        return self.checkpoint_now(wait=deadline - time.monotonic())
