"""Sparse row gradients of one part (embedding tables): the domain value and its arithmetic.

A `RowGrad` is the gradient of some rows of one owned part: `rows` are part-local row
indices (sorted, unique: duplicates are summed when it is built), `values` their gradient
rows. For a dynamic table `rows` are the ids themselves and `part_rows` is None (the
table has no fixed row count; `checked_ids` and `dynamic_gradient` check such ids). The sync policy adds row gradients of several workers (`add`) and scales them
(`scale`) without ever touching the untouched rows, so a step costs what its rows cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ps_common.codec import sum_is_finite
from ps_common.dynamic_ids import MAX_IDS_PER_REQUEST, shard_of_ids
from ps_common.errors import InvalidRequestError, InvalidTensorError, UnknownTensorError
from ps_common.shard_map import ParamSpec, Part, ShardMap


def all_finite(values: np.ndarray) -> bool:
    """Whether every element of a gradient (dense or rows) is finite, in one pass over it when it is.

    A NaN or an inf anywhere makes the float32 or float64 sum non-finite (inf + finite is inf,
    inf - inf is NaN, NaN spreads), so a finite sum proves every element finite: one reduction,
    where min and max take two. Only a non-finite sum, which finite values can also give by
    overflowing, is settled by min and max (they propagate NaN and show inf). Other dtypes take
    min and max at once. Empty: True.
    """
    if not values.size or sum_is_finite(values):
        return True
    return bool(np.isfinite(values.min()) and np.isfinite(values.max()))


@dataclass
class RowGrad:
    """The gradient of rows `rows` (part-local, sorted, unique) of a part with `part_rows` rows
    (of a dynamic table: ids, and part_rows None)."""

    rows: np.ndarray     # int64, shape (k,)
    values: np.ndarray   # shape (k, *row shape)
    part_rows: int | None

    @classmethod
    def summed(cls, rows: np.ndarray, values: np.ndarray, part_rows: int | None) -> "RowGrad":
        """From rows that may repeat: the gradients of a repeated row are summed."""
        unique, inverse = np.unique(rows, return_inverse=True)
        if len(unique) == len(rows):
            order = np.argsort(rows, kind="stable")
            return cls(rows[order].astype(np.int64), np.array(values[order], copy=True), part_rows)
        out = np.zeros((len(unique),) + values.shape[1:], dtype=values.dtype)
        np.add.at(out, inverse.reshape(-1), values)
        return cls(unique.astype(np.int64), out, part_rows)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.rows.nbytes)

    def dense(self) -> np.ndarray:
        """The same gradient as a full array of the part's shape (zeros elsewhere); not for a dynamic table."""
        if self.part_rows is None:
            raise ValueError("a dynamic table's row gradient has no dense form")
        out = np.zeros((self.part_rows,) + self.values.shape[1:], dtype=self.values.dtype)
        out[self.rows] = self.values
        return out


def add(acc: np.ndarray | RowGrad, grad: np.ndarray | RowGrad) -> np.ndarray | RowGrad:
    """acc + grad, either of them dense or rows; returns the sum (acc may be updated in place)."""
    if isinstance(acc, RowGrad) and isinstance(grad, RowGrad):
        return RowGrad.summed(np.concatenate([acc.rows, grad.rows]), np.concatenate([acc.values, grad.values]),
                              acc.part_rows)
    if isinstance(acc, RowGrad):
        acc = acc.dense()
    if isinstance(grad, RowGrad):
        np.add.at(acc, grad.rows, grad.values)
    else:
        np.add(acc, grad, out=acc)
    return acc


def scale(acc: np.ndarray | RowGrad, factor: float) -> None:
    """acc *= factor, in place (only the touched rows of a RowGrad)."""
    target = acc.values if isinstance(acc, RowGrad) else acc
    np.multiply(target, factor, out=target)


def check_table_name(name: str, where: str) -> None:
    """InvalidRequestError for an empty table name (a malformed request, not an unknown tensor)."""
    if not name:
        raise InvalidRequestError(f"{where}: a table's name must not be empty")


def owned_parts(shard_map: ShardMap, shard_index: int, name: str, ids: np.ndarray, where: str) -> list[tuple[Part, np.ndarray]]:
    """This shard's parts of tensor `name`, each with the positions in `ids` that fall in it.

    Every id must lie in [0, rows) and in a row range this shard owns: else
    InvalidTensorError naming the tensor, the id and the shard that owns it.
    UnknownTensorError for a tensor the model lacks; InvalidTensorError for a scalar.
    """
    spec = shard_map.specs.get(name)
    if spec is None:
        raise UnknownTensorError(f"{where}: tensor {name!r} is not a parameter of this model")
    if not spec.shape:
        raise InvalidTensorError(f"{where}: tensor {name!r} is a scalar: it has no rows")
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise InvalidTensorError(f"{where}: row ids of {name!r} must be a 1-d int64 array, got {ids.dtype}{list(ids.shape)}")
    rows = spec.shape[0]
    if len(ids) and (ids.min() < 0 or ids.max() >= rows):
        bad = int(ids[(ids < 0) | (ids >= rows)][0])
        raise InvalidTensorError(f"{where}: row id {bad} of tensor {name!r} is outside [0, {rows})")
    found: list[tuple[Part, np.ndarray]] = []
    covered = np.zeros(len(ids), dtype=bool)
    for part in shard_map.parts_of(name):
        inside = (ids >= part.row_start) & (ids < part.row_end)
        if part.shard == shard_index:
            found.append((part, np.flatnonzero(inside)))
            covered |= inside
    if not covered.all():
        bad = int(ids[~covered][0])
        owner = next(p.shard for p in shard_map.parts_of(name) if p.row_start <= bad < p.row_end)
        raise InvalidTensorError(f"{where}: row {bad} of tensor {name!r} belongs to shard {owner}, not shard {shard_index}")
    return found


def split_gradient(shard_map: ShardMap, shard_index: int, name: str, ids: np.ndarray, values: np.ndarray,
                   where: str) -> dict[tuple[str, int], RowGrad]:
    """A checked row gradient of `name` cut into one RowGrad per owned part (every owned part, also an empty one).

    Checks: a trainable tensor (floating point, not state), values of shape (len(ids), *row
    shape) in the tensor's dtype, finite values, ids as owned_parts checks them.
    """
    found = owned_parts(shard_map, shard_index, name, ids, where)
    spec = shard_map.specs[name]
    if np.dtype(spec.dtype).kind != "f" or spec.state:
        raise InvalidTensorError(f"{where}: tensor {name!r} ({spec.dtype}{', state' if spec.state else ''}) does "
                                 "not train: push no row gradient for it")
    want = (len(ids), *spec.shape[1:])
    if values.dtype != np.dtype(spec.dtype) or tuple(values.shape) != tuple(want):
        raise InvalidTensorError(f"{where}: row gradient of {name!r} is {values.dtype}{list(values.shape)}, "
                                 f"expected {spec.dtype}{list(want)}")
    if not all_finite(values):
        raise InvalidTensorError(f"{where}: row gradient of {name!r} holds NaN or inf")
    return {part.key: RowGrad.summed(ids[pos] - part.row_start, values[pos], part.row_end - part.row_start)
            for part, pos in found}


def checked_ids(spec: ParamSpec, ids: np.ndarray, shard_index: int, num_shards: int, where: str) -> None:
    """Ids of dynamic table `spec` for this shard: a 1-d int64 array of at most MAX_IDS_PER_REQUEST ids,
    each hashed to this shard (ps_common/dynamic_ids.py); else InvalidTensorError naming the id and its shard."""
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise InvalidTensorError(f"{where}: ids of dynamic table {spec.name!r} must be a 1-d int64 array, "
                                 f"got {ids.dtype}{list(ids.shape)}")
    if len(ids) > MAX_IDS_PER_REQUEST:
        raise InvalidTensorError(f"{where}: {len(ids)} ids of dynamic table {spec.name!r}, over the limit of "
                                 f"{MAX_IDS_PER_REQUEST} per table and request")
    if len(ids) and num_shards > 1:
        owner = shard_of_ids(ids, num_shards)
        wrong = np.flatnonzero(owner != shard_index)
        if len(wrong):
            bad = int(ids[wrong[0]])
            raise InvalidTensorError(f"{where}: id {bad} of dynamic table {spec.name!r} hashes to shard "
                                     f"{int(owner[wrong[0]])}, not shard {shard_index} (splitmix64(id) % {num_shards})")


def dynamic_gradient(spec: ParamSpec, ids: np.ndarray, values: np.ndarray, shard_index: int, num_shards: int,
                     where: str) -> RowGrad:
    """A checked row gradient of dynamic table `spec`, by id, repeated ids summed.

    Checks: ids as checked_ids, values of shape (len(ids), *row shape) in the table's dtype, finite.
    """
    checked_ids(spec, ids, shard_index, num_shards, where)
    want = (len(ids), *spec.row_shape)
    if values.dtype != np.dtype(spec.dtype) or tuple(values.shape) != want:
        raise InvalidTensorError(f"{where}: row gradient of dynamic table {spec.name!r} is "
                                 f"{values.dtype}{list(values.shape)}, expected {spec.dtype}{list(want)}")
    if not all_finite(values):
        raise InvalidTensorError(f"{where}: row gradient of dynamic table {spec.name!r} holds NaN or inf")
    return RowGrad.summed(ids, values, None)
