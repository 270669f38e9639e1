"""Driving a ps_server.shard.Shard directly, without sockets: chunks are built and decoded with the codec
as a client and the service boundary would."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ps_common import codec
from ps_common.shard_map import ParamSpec, build_shard_map
from ps_server.config import ServerConfig
from ps_server.membership import PushResult
from ps_server.operations import Push, Read
from ps_server.shard import Shard

#: The SGD learning rate of every test shard: a power of two, so expected values are exact.
LR = 0.5


class FakeClock:
    """A monotonic clock that moves only when told to (drives leases)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make_shard(mode: str = "async", *, now: FakeClock | None = None, **overrides) -> Shard:
    """A shard with SGD(lr=LR), a 10 s lease and a fake clock, unless overridden."""
    settings = dict(mode=mode, optimizer="sgd", optimizer_params={"lr": LR}, lease_seconds=10.0,
                    wait_timeout_seconds=30.0)
    settings.update(overrides)
    return Shard(ServerConfig(**settings), now=now if now is not None else FakeClock())


def specs_of(values: Mapping[str, np.ndarray]) -> list[ParamSpec]:
    return [ParamSpec(name, np.asarray(a).dtype.name, tuple(np.shape(a))) for name, a in values.items()]


def own_chunks(shard: Shard, arrays: Mapping[str, np.ndarray], *, specs: list[ParamSpec] | None = None,
               chunk_bytes: int = codec.CHUNK_BYTES):
    """The chunks of the parts `shard` owns, cut from full-size arrays (as the client cuts them)."""
    shard_map = build_shard_map(specs if specs is not None else specs_of(arrays), shard.config.num_shards,
                                partition_min_bytes=shard.config.partition_min_bytes)
    chunks = []
    for part in shard_map.parts_on(shard.config.shard_index):
        if part.name not in arrays:
            continue
        array = np.asarray(arrays[part.name])
        piece = array if part.whole else array[part.row_start:part.row_end]
        chunks.extend(codec.part_chunks(part.name, piece, row_start=part.row_start, chunk_bytes=chunk_bytes))
    return chunks


def decode(chunks, layout) -> dict[tuple[str, int], np.ndarray]:
    """The chunks assembled into parts and checked against a layout, as the service does."""
    assembler = codec.PartAssembler(layout)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def init_shard(shard: Shard, values: Mapping[str, np.ndarray]) -> tuple[bool, int, int]:
    """InitParameters: the full parameter list, and the chunks of this shard's parts."""
    specs = specs_of(values)
    return shard.initialize(specs, decode(own_chunks(shard, values, specs=specs), shard.init_layout(specs)))


def push(shard: Shard, worker_id: str, clock: int, read_step: int, grads: Mapping[str, np.ndarray]) -> PushResult:
    """Push: decode and check the chunks, then hand them to the shard, as the service does."""
    specs = [ParamSpec(s.name, s.dtype, s.shape) for s in shard.store.shard_map.specs.values()] \
        if shard.store.shard_map is not None else specs_of(grads)
    return shard.push(Push(worker_id, clock, read_step, decode(own_chunks(shard, grads, specs=specs),
                                                               shard.push_layout())))


def pull_values(shard: Shard, names=(), *, min_step: int = 0, worker_id: str = "", clock: int = 0,
                timeout: float = 5.0) -> tuple[int, dict[str, np.ndarray]]:
    """Pull: (step, {name: part value}) for a shard that holds whole tensors (names empty: every tensor)."""
    got = shard.pull(Read(names=list(names) or None, min_step=min_step, ssp=bool(worker_id), worker_id=worker_id,
                          clock=clock, timeout=timeout))
    return got.step, {name: value for (name, _), value in got.parts.items()}


def pull_rows(shard: Shard, tables, *, min_step: int = 0, worker_id: str = "", clock: int = 0,
              timeout: float = 5.0) -> tuple[int, list[tuple[str, np.ndarray]]]:
    """PullRows: (step, [(name, rows)]) of the tables' ids, as the service asks the shard."""
    got = shard.pull(Read(names=(), rows=list(tables), min_step=min_step, ssp=bool(worker_id), worker_id=worker_id,
                          clock=clock, timeout=timeout))
    return got.step, got.rows


def values(shard: Shard) -> dict[tuple[str, int], np.ndarray]:
    """A copy of every part's current value, straight from the store."""
    return {key: state.value.copy() for key, state in shard.store.parts.items()}


def clocks(shard: Shard) -> dict[str, int]:
    return {w: r.clock for w, r in shard.membership.workers.items()}


def initialize(shard: Shard, specs: list[ParamSpec], chunks) -> tuple[bool, int, int]:
    """InitParameters from already-made chunks: decoded against the shard's init layout, as the service does."""
    return shard.initialize(specs, decode(chunks, shard.init_layout(specs)))


def cluster_info(shard: Shard):
    """GetClusterInfo's response, built by the service boundary from the shard's view."""
    from ps_server.service import cluster_info as build

    return build(shard, shard.view())
