"""A model's GradientEngine built as the engine builds it and built again with one rewrite doing nothing: what the
rewrite tests compare (the same loss and gradients, fewer or other nodes)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from worker_client import GradientEngine


def with_and_without(path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType,
                     rewrite: str, *, nothing: object = 0, **options: object) -> tuple[GradientEngine, GradientEngine]:
    """(the engine of the model at `path` as built, the engine built with `module.<rewrite>` returning `nothing`
    and doing nothing), each with `options` and a cache folder of its own under `cache_root`."""
    engine = GradientEngine(path, cache_dir=cache_root / "with", **options)
    with monkeypatch.context() as patched:
        patched.setattr(module, rewrite, lambda *args, **kwargs: nothing)
        plain = GradientEngine(path, cache_dir=cache_root / "without", **options)
    return engine, plain
