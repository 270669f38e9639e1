"""Dynamic tables' shared rules: the id hash that routes an id to a shard, and the row initializers.

A dynamic table is keyed by any int64 id (docs/protocol.md, "Dynamic tables"). Client and
shards must agree on two things, both defined here and nowhere else:

* routing: id -> shard `splitmix64(id as uint64) % num_shards` (`shard_of_ids`);
* a row's initial value, a pure function of (table name, seed, id): every shard, and a
  shard restarted without a checkpoint, creates the same row for the same id
  (`initial_rows`). The row seed is `splitmix64(table_key ^ splitmix64(id))` with
  `table_key = splitmix64(fnv1a64(name) ^ seed)`; element k of the row draws its uniforms
  from `splitmix64(row_seed + (2k + 1) * GOLDEN)` and `splitmix64(row_seed + (2k + 2) * GOLDEN)`
  (53-bit floats in [0, 1)); "normal:STD" is Box-Muller, "uniform:A" is `A * (2u - 1)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Most ids one table may name in one PullRows or one RowGradient (checked before anything is allocated).
MAX_IDS_PER_REQUEST = 1 << 20

#: The initializers by kind; "normal" and "uniform" take one parameter after a colon.
INITIALIZERS = ("zeros", "normal", "uniform")

GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


@dataclass(frozen=True)
class DynamicTable:
    """How a dynamic table creates and forgets rows (ParamSpec.dynamic; ps.v1.DynamicTable)."""

    initializer: str = "zeros"      # "zeros", "normal:STD" or "uniform:A"
    evict_after_steps: int = 0      # evict a row untouched for this many steps; 0: never
    seed: int = 0                   # mixed with the table name into every row's seed

    def check(self, name: str) -> None:
        """ValueError naming the table and the bad value."""
        parse_initializer(self.initializer, name)
        if not isinstance(self.evict_after_steps, int) or self.evict_after_steps < 0:
            raise ValueError(f"dynamic table {name!r}: evict_after_steps must be an integer >= 0, "
                             f"got {self.evict_after_steps!r}")
        if not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 63):
            raise ValueError(f"dynamic table {name!r}: seed must be an int64, got {self.seed!r}")


def parse_initializer(text: str, name: str = "?") -> tuple[str, float]:
    """(kind, parameter) of an initializer string; ValueError naming the table for a bad one."""
    kind, _, arg = (text or "zeros").strip().partition(":")
    kind = kind.strip().lower()
    if kind == "zeros" and not arg:
        return "zeros", 0.0
    if kind in ("normal", "uniform"):
        try:
            value = float(arg)
        except ValueError:
            value = float("nan")
        if math.isfinite(value) and value > 0:
            return kind, value
    raise ValueError(f"dynamic table {name!r}: invalid initializer {text!r} "
                     "(use 'zeros', 'normal:STD' or 'uniform:A' with STD, A > 0)")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer of each element (uint64 in, uint64 out; wraps modulo 2**64)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


def shard_of_ids(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each id: splitmix64(id viewed as uint64) % num_shards (int64 array)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return (splitmix64(ids.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)


def fnv1a64(text: str) -> int:
    """The 64-bit FNV-1a hash of a name's UTF-8 bytes."""
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8", "surrogatepass"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def table_key(name: str, seed: int) -> int:
    """The 64-bit key of a table: mixes its name and seed."""
    return int(splitmix64(np.array([fnv1a64(name) ^ (seed & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64))[0])


def initial_rows(name: str, table: DynamicTable, ids: np.ndarray, row_shape: tuple[int, ...],
                 dtype: np.dtype | str) -> np.ndarray:
    """The initial rows of `ids` (shape (len(ids), *row_shape)): a pure function of (name, seed, id)."""
    kind, param = parse_initializer(table.initializer, name)
    dtype = np.dtype(dtype)
    shape = (len(ids), *row_shape)
    if kind == "zeros" or not len(ids):
        return np.zeros(shape, dtype)
    elements = math.prod(row_shape)
    ids = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
    row_seed = splitmix64(np.uint64(table_key(name, table.seed)) ^ splitmix64(ids))       # (n,)
    counters = np.arange(1, 2 * elements + 1, dtype=np.uint64) * np.uint64(GOLDEN)        # (2e,)
    with np.errstate(over="ignore"):
        bits = splitmix64(row_seed[:, None] + counters[None, :])                            # (n, 2e)
    u = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))                     # [0, 1)
    u1, u2 = u[:, 0::2], u[:, 1::2]
    if kind == "uniform":
        values = param * (2.0 * u1 - 1.0)
    else:
        values = param * np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
    return values.reshape(shape).astype(dtype)
