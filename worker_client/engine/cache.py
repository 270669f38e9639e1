"""Stage "cache": built gradient models on disk, keyed by a hash of the model and options."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import onnx
import onnx_ad

from ps_common.scratch import sweep_temporaries, temporary_name
from worker_client.engine.differentiate import GradientGraph
from worker_client.engine.load import max_ir_version
from worker_client.engine.loss import LossSpec
from worker_client.engine.support import warn_caller

__all__ = ["GRAPH_FORMAT", "cached_or_built", "default_cache_dir", "entry_path"]

#: Bumped whenever the gradient graph built for the same options changes.
GRAPH_FORMAT = 17
#: Hex digits of the SHA-256 content hash kept in an entry's file name.
KEY_DIGITS = 40


def default_cache_dir() -> Path:
    """$ONNX_PS_CACHE, else ~/.cache/onnx-ps/gradients."""
    configured = os.environ.get("ONNX_PS_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "onnx-ps" / "gradients"


def entry_path(cache_dir: Path, lifted: onnx.ModelProto, *, batch_size: int, loss: LossSpec,
               trainable: Sequence[str], inputs: Sequence[str] = (), target: str = "cpu") -> Path:
    """The file holding the gradient model of `lifted` for these options.

    The key covers the lifted model's graph (the trainable values are inputs there, so
    training does not change it), the options that shape the gradient model (`target`: the
    kind of device its rewrites are for, rewrites.TARGETS), and the
    versions of everything that builds it: onnx-ad's and onnx's, and this engine's own
    sources (`code_digest`), so a changed rewrite never meets a graph an older one cached.
    """
    options = {"batch_size": batch_size, "loss": loss.key(), "trainable": list(trainable),
               "input_gradients": list(inputs), "target": target,
               "onnx_ad": onnx_ad.__version__, "onnx": onnx.__version__,
               "ir_version": max_ir_version(), "format": GRAPH_FORMAT, "code": code_digest()}
    return cache_dir / f"{_content_key(lifted, options)}.onnx"


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of the engine's Python sources (this package), read once per process. GRAPH_FORMAT alone relied on
    every change remembering to bump it, and entries cached by an in-between version were served to a later one."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for source in sorted(root.rglob("*.py")):
        digest.update(source.relative_to(root).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def cached_or_built(path: Path, build: Callable[[], GradientGraph]) -> tuple[GradientGraph, bool]:
    """(the gradient model stored at `path`, True), or (`build()`, False) after storing it.

    An unreadable entry is rebuilt and an unwritable cache only costs a rebuild next time;
    both warn.
    """
    if path.is_file():
        try:
            graph = GradientGraph.from_model(onnx.load(path))
        except Exception as exc:  # noqa: BLE001 -- a damaged entry is rebuilt
            warn_caller(f"rebuilding the unreadable cached gradient model {path}: {exc}")
        else:
            return graph, True
    graph = build()
    try:
        _atomic_save(graph.model, path)
    except OSError as exc:  # a read-only or full disk costs a rebuild next time, no more
        warn_caller(f"could not cache the gradient model at {path}: {exc}")
    return graph, False


def _content_key(lifted: onnx.ModelProto, options: Mapping[str, object]) -> str:
    """Hash of the model's graph (trainable values excluded: they are inputs now) and the
    options that change the gradient graph."""
    digest = hashlib.sha256()
    digest.update(lifted.SerializeToString(deterministic=True))
    digest.update(json.dumps(dict(options), sort_keys=True).encode())
    return digest.hexdigest()[:KEY_DIGITS]


def _atomic_save(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to a temporary file beside `path`, then rename it into place, so a
    reader never sees a partial file and concurrent writers race harmlessly. The temporary
    file is named after this process, so one left by a killed writer is removed by the
    next writer (ps_common/scratch.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(path.parent)
    temporary = temporary_name(path)
    try:
        with open(temporary, "xb") as stream:
            stream.write(model.SerializeToString())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
