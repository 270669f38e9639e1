"""Deterministic placement of a model's tensors (whole or as row ranges) on N parameter-server shards.

Both the server and the client call build_shard_map with the same parameter list and
shard count and get the same map. The rules:

* Validation comes first: num_shards >= 1, partition_min_bytes >= 1, unique non-empty
  names, non-negative integer dims and known numeric numpy dtype names (bool, int*,
  uint*, float*, complex*); any violation raises ValueError naming the bad value.
* The input order does not matter: specs are sorted by name before anything else.
* A tensor with nbytes <= partition_min_bytes, or with fewer than 2 rows along axis 0,
  is never split. A rank-0 tensor counts as one row: its single Part has row_start=0,
  row_end=1 and shape (). Zero-size tensors are placed like any other (0 bytes).
* Step 1, the unsplittable tensors: largest first (ties by name), each goes whole to the
  least-loaded shard (ties to the lowest index).
* Step 2, the splittable tensors: their bytes are poured over the shards like water,
  raising the least-loaded shards to one common level, so each shard gets a byte
  capacity (0 for a shard already above the level). The splittable tensors, in name
  order, form one byte stream; shard 0 takes the first capacity's worth of it, shard 1
  the next, and so on. Cuts fall on row boundaries (nearest row), and a cut never leaves
  a part of a split tensor smaller than ceil(partition_min_bytes / 2) bytes (at least
  one row): it moves to the nearest row that keeps every part at least that big, or to
  the tensor's start or end. Each cut so lands within about that minimum plus one row
  of its ideal place, and the errors never pile up from shard to shard.
* So every shard holds at most one contiguous row range of each tensor: a tensor has at
  most num_shards parts, and a splittable tensor that lands on one shard stays whole.
  When the splittable bytes can fill the gaps, each shard ends within about
  partition_min_bytes plus two rows of the common level (usually within a row or two);
  with only unsplittable tensors the balance is that of step 1.
* ShardMap.parts is sorted by (name, row_start); a Part's key is the tensor name when
  it is the whole tensor and f"{name}[{row_start}:{row_end}]" for a row range.
* A dynamic table (ParamSpec.dynamic set; its shape is one row's) has no parts: it lives
  on every shard, each holding the ids hashed to it (ps_common/dynamic_ids.py). It is in
  `specs` but takes no place in the split. It must be floating point and not state.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ps_common.dynamic_ids import DynamicTable

DEFAULT_PARTITION_MIN_BYTES: int = 1 << 20

_NUMERIC_KINDS = frozenset("biufc")


def _itemsize(dtype: str) -> int:
    """Bytes per element of a numpy dtype name; ValueError for a name numpy does not know."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc
    if dt.kind not in _NUMERIC_KINDS or dt.itemsize <= 0:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return dt.itemsize


@dataclass(frozen=True)
class ParamSpec:
    """One named tensor of the model: numpy dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    state: bool = False   # model state (running statistics): pushes replace it, no optimizer
    dynamic: DynamicTable | None = None   # a hash-keyed table: `shape` is one row's, rows by int64 id

    def __post_init__(self) -> None:
        shape = tuple(int(d) if isinstance(d, np.integer) else d for d in self.shape)
        object.__setattr__(self, "shape", shape)

    @property
    def rows(self) -> int:
        """Rows along axis 0; a rank-0 tensor counts as one row."""
        return self.shape[0] if self.shape else 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row: shape[1:], or the whole shape of a dynamic table."""
        return self.shape if self.dynamic is not None else self.shape[1:]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along axis 0 (the whole nbytes for a rank-0 tensor; one row of a dynamic table)."""
        return math.prod(self.row_shape) * _itemsize(self.dtype)


#: A part's key everywhere (shard map, store, policies, shared-memory layout, client): (tensor name, first row).
PartKey = tuple[str, int]


@dataclass(frozen=True)
class Part:
    """A row range [row_start, row_end) of one tensor, held by one shard."""

    name: str
    row_start: int
    row_end: int
    shard: int
    shape: tuple[int, ...]
    dtype: str
    whole: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def key(self) -> PartKey:
        """The part's key on both sides: (tensor name, first row it holds)."""
        return (self.name, self.row_start)

    @property
    def label(self) -> str:
        """The part for people: the tensor's name, with its row range when it is split."""
        if self.whole:
            return self.name
        return f"{self.name}[{self.row_start}:{self.row_end}]"


class ShardMap:
    """Which shard holds which tensor or row range; build it with build_shard_map."""

    num_shards: int
    partition_min_bytes: int
    specs: dict[str, ParamSpec]
    parts: tuple[Part, ...]

    def __init__(
        self,
        num_shards: int,
        partition_min_bytes: int,
        specs: dict[str, ParamSpec],
        parts: Iterable[Part],
    ) -> None:
        self.num_shards = num_shards
        self.partition_min_bytes = partition_min_bytes
        self.specs = dict(specs)
        self.parts = tuple(sorted(parts, key=lambda p: p.key))
        self._by_name: dict[str, list[Part]] = {name: [] for name in self.specs}
        self._by_shard: list[list[Part]] = [[] for _ in range(num_shards)]
        self._by_key: dict[tuple[str, int], Part] = {}
        self._bytes_per_shard = [0] * num_shards
        for p in self.parts:
            self._by_name[p.name].append(p)
            self._by_shard[p.shard].append(p)
            self._by_key[p.key] = p
            self._bytes_per_shard[p.shard] += p.nbytes

    def parts_on(self, shard: int) -> list[Part]:
        """The parts shard holds, sorted by (name, row_start); ValueError for a shard out of range."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} out of range [0, {self.num_shards})")
        return list(self._by_shard[shard])

    def parts_of(self, name: str) -> list[Part]:
        """The parts of one tensor sorted by row_start; KeyError(name) for an unknown tensor."""
        try:
            return list(self._by_name[name])
        except KeyError:
            raise KeyError(name) from None

    def part(self, name: str, row_start: int) -> Part:
        """The part of tensor name that starts at row_start; KeyError naming both if none does."""
        try:
            return self._by_key[(name, row_start)]
        except KeyError:
            raise KeyError(f"no part of tensor {name!r} starts at row {row_start}") from None

    def bytes_per_shard(self) -> list[int]:
        """The bytes of the parts each shard holds, in shard order (summed once, when the map is made)."""
        return list(self._bytes_per_shard)

    def shard_bytes(self, shard: int) -> int:
        """The bytes of the parts `shard` holds (a client asks it every step)."""
        return self._bytes_per_shard[shard]

    def imbalance(self) -> float:
        """max/mean - 1 of bytes_per_shard; 0.0 for a perfect balance or an empty model."""
        totals = self.bytes_per_shard()
        total = sum(totals)
        if total == 0:
            return 0.0
        return max(totals) * self.num_shards / total - 1.0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardMap):
            return NotImplemented
        return (
            self.num_shards == other.num_shards
            and self.partition_min_bytes == other.partition_min_bytes
            and self.specs == other.specs
            and self.parts == other.parts
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"ShardMap(num_shards={self.num_shards}, partition_min_bytes={self.partition_min_bytes}, "
            f"tensors={len(self.specs)}, parts={len(self.parts)})"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _validate(specs: list[ParamSpec], num_shards: int, partition_min_bytes: int) -> None:
    if not _is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
    if not _is_int(partition_min_bytes) or partition_min_bytes < 1:
        raise ValueError(f"partition_min_bytes must be an integer >= 1, got {partition_min_bytes!r}")
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise ValueError(f"expected a ParamSpec, got {spec!r}")
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"tensor name must be a non-empty string, got {spec.name!r}")
        if spec.name in seen:
            raise ValueError(f"duplicate tensor name {spec.name!r}")
        seen.add(spec.name)
        for dim in spec.shape:
            if not _is_int(dim) or dim < 0:
                raise ValueError(f"tensor {spec.name!r} has a bad dimension {dim!r} in shape {spec.shape!r}")
        if not isinstance(spec.dtype, str):
            raise ValueError(f"tensor {spec.name!r} has a dtype that is not a name: {spec.dtype!r}")
        try:
            _itemsize(spec.dtype)
        except ValueError as exc:
            raise ValueError(f"tensor {spec.name!r}: {exc}") from None
        if spec.dynamic is not None:
            if not isinstance(spec.dynamic, DynamicTable):
                raise ValueError(f"tensor {spec.name!r}: dynamic must be a DynamicTable, got {spec.dynamic!r}")
            if np.dtype(spec.dtype).kind != "f" or spec.state:
                raise ValueError(f"dynamic table {spec.name!r} is {spec.dtype}{' state' if spec.state else ''}: "
                                 "a dynamic table trains, so it must be floating point and not state")
            spec.dynamic.check(spec.name)


def _water_level_capacities(loads: list[int], amount: int) -> list[Fraction]:
    """Bytes to add to each shard so the least-loaded ones rise to one level, amount in all."""
    if amount == 0:
        return [Fraction(0)] * len(loads)
    ordered = sorted(loads)
    level = Fraction(0)
    running = 0
    for j, load in enumerate(ordered, start=1):
        running += load
        level = Fraction(amount + running, j)
        if j == len(ordered) or level <= ordered[j]:
            break
    return [max(Fraction(0), level - load) for load in loads]


def _snap_row(ideal: Fraction, lo: int, rows: int, min_rows: int) -> int:
    """The allowed cut row nearest ideal: lo, rows, or one leaving >= min_rows on both sides."""
    target = math.floor(ideal + Fraction(1, 2))
    target = min(max(target, lo), rows)
    candidates = [lo, rows]
    inner_lo, inner_hi = lo + min_rows, rows - min_rows
    if inner_lo <= inner_hi:
        candidates.append(min(max(target, inner_lo), inner_hi))
    # nearest to the ideal; ties go to the lower row
    return min(candidates, key=lambda k: (abs(ideal - k), k))


def build_shard_map(
    specs: Iterable[ParamSpec],
    num_shards: int,
    *,
    partition_min_bytes: int = DEFAULT_PARTITION_MIN_BYTES,
) -> ShardMap:
    """Place every tensor (whole or as row ranges) on one of num_shards shards; see the module docstring."""
    spec_list = list(specs)
    _validate(spec_list, num_shards, partition_min_bytes)
    spec_list.sort(key=lambda s: s.name)
    by_name = {s.name: s for s in spec_list}

    placed = [s for s in spec_list if s.dynamic is None]   # dynamic tables live on every shard, by id hash
    splittable = [s for s in placed if s.nbytes > partition_min_bytes and s.rows >= 2]
    split_names = {s.name for s in splittable}
    fixed = [s for s in placed if s.name not in split_names]

    parts: list[Part] = []
    loads = [0] * num_shards

    # Step 1: unsplittable tensors, largest first, to the least-loaded shard (lowest index on ties).
    for spec in sorted(fixed, key=lambda s: (-s.nbytes, s.name)):
        shard = min(range(num_shards), key=lambda i: (loads[i], i))
        loads[shard] += spec.nbytes
        parts.append(Part(spec.name, 0, spec.rows, shard, spec.shape, spec.dtype, True))

    # Step 2: the splittable tensors as one byte stream, cut at the water-level capacities.
    if splittable:
        starts: list[int] = []
        offset = 0
        for spec in splittable:
            starts.append(offset)
            offset += spec.nbytes
        stream_bytes = offset
        capacities = _water_level_capacities(loads, stream_bytes)
        min_piece_bytes = (partition_min_bytes + 1) // 2

        cuts: list[int] = [0]  # byte positions in the stream; shard i takes [cuts[i], cuts[i+1])
        ideal_end = Fraction(0)
        for shard in range(num_shards - 1):
            ideal_end += capacities[shard]
            x = max(Fraction(cuts[-1]), ideal_end)
            if x >= stream_bytes:
                cuts.append(stream_bytes)
                continue
            t = bisect.bisect_right(starts, math.floor(x)) - 1  # the tensor the ideal cut falls in
            spec = splittable[t]
            start, row_bytes = starts[t], spec.row_bytes
            lo_row = max(0, cuts[-1] - start) // row_bytes  # rows of it already taken by earlier shards
            min_rows = max(1, -(-min_piece_bytes // row_bytes))
            row = _snap_row((x - start) / row_bytes, lo_row, spec.rows, min_rows)
            cuts.append(start + row * row_bytes)
        cuts.append(stream_bytes)

        for spec, start in zip(splittable, starts):
            end, row_bytes = start + spec.nbytes, spec.row_bytes
            pieces: list[tuple[int, int, int]] = []
            for shard in range(num_shards):
                lo, hi = max(cuts[shard], start), min(cuts[shard + 1], end)
                if lo < hi:
                    pieces.append((shard, (lo - start) // row_bytes, (hi - start) // row_bytes))
            whole = len(pieces) == 1
            for shard, r0, r1 in pieces:
                shape = spec.shape if whole else (r1 - r0, *spec.shape[1:])
                parts.append(Part(spec.name, r0, r1, shard, shape, spec.dtype, whole))

    return ShardMap(num_shards, partition_min_bytes, by_name, parts)
