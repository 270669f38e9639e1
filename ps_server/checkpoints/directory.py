"""The checkpoint directory protocol of one shard: atomic write, ownership claim, pruning, and
quarantine of files that do not read back whole."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from safetensors import safe_open
from safetensors.numpy import save_file

from ps_common.errors import CheckpointMismatchError, CorruptCheckpointError
from ps_server.checkpoints.fileformat import decode, encode
from ps_server.checkpoints.state import ShardState

log = logging.getLogger(__name__)

_FINAL = re.compile(r"^ckpt-(\d{12})\.safetensors$")
_TEMPORARY = re.compile(r"^\.ckpt-\d{12}\.safetensors\.tmp-\d+-\d+$")
_CORRUPT_SUFFIX = ".corrupt"
#: The file that ties a directory to one shard of one job, so two shards never share one by mistake.
OWNER_FILE = "SHARD.json"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:012d}.safetensors"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step in a checkpoint's file name; ValueError for a name that is not a checkpoint's."""
    m = _FINAL.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt-<step>.safetensors)")
    return int(m.group(1))


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDirectory:
    """The checkpoints of one shard in one directory. Not thread-safe: the Checkpointer serializes calls."""

    def __init__(self, path: str | os.PathLike, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"Invalid checkpoint keep: {keep} (must be >= 1)")
        self.path = Path(path)
        self.keep = keep
        self._counter = 0

    def ensure(self) -> None:
        """Creates the directory if needed; OSError naming it when it cannot be written."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise OSError(f"checkpoint directory {self.path} is not writable")

    def owner(self) -> dict | None:
        """What the directory's SHARD.json says ({"shard_index", "num_shards"}), or None when it has none
        (an unreadable one is logged and counts as none: `claim` rewrites it)."""
        owner_file = self.path / OWNER_FILE
        try:
            owner = json.loads(owner_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("rewriting unreadable %s: %s", owner_file, exc)
            return None
        return owner if isinstance(owner, dict) else None

    def mismatch(self, shard_index: int, num_shards: int) -> str | None:
        """Why shard_index of num_shards may not use the directory (it belongs to another shard), or None.
        Reads only: the launcher asks before it starts any shard, and `claim` asks again."""
        owner = self.owner()
        if owner is None or (owner.get("shard_index"), owner.get("num_shards")) == (shard_index, num_shards):
            return None
        return (f"checkpoint directory {self.path} belongs to shard_index={owner.get('shard_index')} of "
                f"num_shards={owner.get('num_shards')}; this shard is shard_index={shard_index} of "
                f"num_shards={num_shards}")

    def claim(self, shard_index: int, num_shards: int) -> None:
        """Marks the directory as shard_index's of num_shards; CheckpointMismatchError when another shard's it is."""
        self.ensure()
        owner_file = self.path / OWNER_FILE
        want = {"shard_index": shard_index, "num_shards": num_shards}
        if self.owner() is None:
            tmp = self.path / f".{OWNER_FILE}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(want))
            _fsync_path(tmp)
            try:
                if owner_file.exists():           # unreadable (owner() logged it): rewritten
                    os.replace(tmp, owner_file)
                else:
                    os.link(tmp, owner_file)      # fails when another shard claimed it first
            except FileExistsError:
                pass                              # theirs: checked below
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_path(self.path, directory=True)
        why = self.mismatch(shard_index, num_shards)
        if why is not None:
            raise CheckpointMismatchError(f"{why}: give every shard a directory of its own")

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete-named checkpoint, newest first."""
        if not self.path.is_dir():
            return []
        found = []
        for entry in self.path.iterdir():
            m = _FINAL.match(entry.name)
            if m and entry.is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found, reverse=True)

    def write(self, state: ShardState, *, replace_all: bool = False) -> Path:
        """Writes `state` atomically (temporary file, fsync, rename, directory fsync), then prunes to `keep`.

        With replace_all, every other checkpoint is deleted instead (after a reset).
        """
        self.ensure()
        tensors, metadata = encode(state)
        final = self.path / checkpoint_name(state.step)
        self._counter += 1
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}-{self._counter}"
        try:
            save_file(tensors, tmp, metadata=metadata)
            _fsync_path(tmp)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_path(self.path, directory=True)
        self.prune(keep_also=final, keep=1 if replace_all else self.keep)
        return final

    def prune(self, *, keep_also: Path | None = None, keep: int | None = None) -> list[Path]:
        """Keeps `keep` checkpoints (keep_also, the one just written, and the newest others), deletes the rest."""
        keep = self.keep if keep is None else keep
        removed = []
        others = [path for _, path in self.checkpoints() if path != keep_also]
        for path in others[keep - (keep_also is not None):]:
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    def remove_temporaries(self) -> list[Path]:
        """Deletes temporary files left by a write that never finished (call before writing starts)."""
        removed = []
        if self.path.is_dir():
            for entry in self.path.iterdir():
                if _TEMPORARY.match(entry.name):
                    entry.unlink(missing_ok=True)
                    removed.append(entry)
        return removed

    def read(self, path: Path) -> ShardState:
        """The state in one file; CorruptCheckpointError naming the file and the reason when it is not whole."""
        try:
            with safe_open(str(path), framework="np") as f:
                metadata = f.metadata() or {}
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except OSError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError (an Exception) for a bad or short file
            raise CorruptCheckpointError(f"{path}: unreadable: {exc}") from exc
        return decode(tensors, metadata, source=str(path))

    def latest(self) -> tuple[Path, ShardState] | None:
        """The newest checkpoint that reads back whole; a corrupt one is skipped (warning) and renamed *.corrupt."""
        for _, path in self.checkpoints():
            try:
                return path, self.read(path)
            except CorruptCheckpointError as exc:
                aside = path.with_name(path.name + _CORRUPT_SUFFIX)
                log.warning("skipping checkpoint %s: %s; moved aside to %s, trying the previous one", path, exc, aside.name)
                try:
                    os.replace(path, aside)
                except OSError as move:
                    log.warning("could not move %s aside: %s", path, move)
            except OSError as exc:
                log.warning("skipping checkpoint %s: cannot read it: %s; trying the previous one", path, exc)
        return None


def iter_checkpoints(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of the complete-named checkpoints in a directory, newest first (for tools and Admin)."""
    return CheckpointDirectory(path).checkpoints()
