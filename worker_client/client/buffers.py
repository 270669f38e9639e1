"""Arrays for the values a pull receives, reused once nobody holds them any more.

A pull of large tensors into fresh arrays costs more than the bytes: numpy asks the kernel for
new pages (transparent huge pages where it can), and where the machine's memory is fragmented
the kernel compacts it first, inside the allocation. Measured with a 100 MB tensor through the
data channel on loopback (30 rounds each, 2 cores): fresh arrays took 112-345 ms a round, one
round in eight or so two to three times the usual 125 ms; reused arrays 113-133 ms, none slow.

`ReceiveBuffers.empty` hands out an array it made before for the same tensor, shape and dtype
when the only references left to it are its own -- the caller dropped the values it returned
(views, memoryviews and anything else holding the array count as holders, so such an array is
never rewritten under them). Otherwise it makes a new one, keeping at most `KEEP` per tensor:
a training loop holding the current values while the next ones arrive needs two.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["KEEP", "MIN_BYTES", "ReceiveBuffers"]

#: Arrays smaller than this are allocated fresh (small allocations come from the allocator's pools).
MIN_BYTES = 1 << 20
#: The most arrays kept per tensor.
KEEP = 2


def _references_when_unheld() -> int:
    """sys.getrefcount of a kept array that nobody else holds, as `ReceiveBuffers.empty` calls it (measured, so
    it holds for this interpreter)."""
    kept = [np.empty(1)]
    return sys.getrefcount(kept[0])


_UNHELD = _references_when_unheld()


class ReceiveBuffers:
    """Reusable receive arrays, per tensor (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple[Hashable, tuple[int, ...], str], list[np.ndarray]] = {}

    def empty(self, tensor: Hashable, shape: Sequence[int], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized array for `tensor`'s values: one kept from an earlier call that nobody holds, or new."""
        dtype = np.dtype(dtype)
        shape = tuple(int(size) for size in shape)
        if math.prod(shape) * dtype.itemsize < MIN_BYTES:
            return np.empty(shape, dtype)
        with self._lock:
            kept = self._kept.setdefault((tensor, shape, dtype.str), [])
            for index in range(len(kept)):
                if sys.getrefcount(kept[index]) == _UNHELD:
                    return kept[index]
            array = np.empty(shape, dtype)
            if len(kept) < KEEP:
                kept.append(array)
            return array

    def clear(self) -> None:
        """Forget every kept array (the memory goes with the last holder)."""
        with self._lock:
            self._kept.clear()
